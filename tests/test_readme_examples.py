"""Every Python example in the README, run as a new user runs it: written to a file of its
own and run with `python example.py` (or `torchrun`, where it says so) in a subprocess,
its code at module level as written. Each must run, train bitwise like the same script
with the step run eagerly (remat.compile swapped for a plain call, before the script runs),
and compile once per batch shape (a script's globals are not watched unless the step
reads them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)

# Run before the example: the same seed on both sides; for the eager side, remat.compile
# replaced by a step that calls train_step itself.
_PROLOGUE = """
import torch
torch.manual_seed(0)
if {eager}:
    import types, remat
    class _EagerStep:
        def __init__(self, train_step, model, optimizer, batch, **options):
            self._call = lambda b: train_step(model, optimizer, b)
            self.report = types.SimpleNamespace(predicted_peak_bytes=0, measured_peak_bytes=0, predicted_time=types.SimpleNamespace(seconds=0.0))
        def __call__(self, batch):
            return self._call(batch)
    remat.compile = _EagerStep
"""

# Run after it: a digest of every model's and optimizer's state the script holds, and how
# many graphs each compiled step holds, in a file per rank.
_EPILOGUE = """
import hashlib as _hashlib, json as _json, os as _os
_digest = _hashlib.sha256()
def _add(t):
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard
    _digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
for _v in list(globals().values()):
    if isinstance(_v, torch.nn.Module):
        [_add(_t) for _t in _v.state_dict().values()]
    if isinstance(_v, torch.optim.Optimizer):
        [_add(_t) for _st in _v.state.values() for _t in _st.values() if isinstance(_t, torch.Tensor)]
_graphs = [len(_v._graphs) for _v in list(globals().values()) if type(_v).__name__ == "RematStep"]
with open(f"result-{_os.environ.get('RANK', '0')}.json", "w") as _f:
    _json.dump({"digest": _digest.hexdigest(), "graphs": _graphs}, _f)
"""


def _run(code: str, tmp_path: Path, eager: bool) -> list[dict]:
    tmp_path = tmp_path / ("eager" if eager else "remat")
    tmp_path.mkdir()
    script = tmp_path / "example.py"
    script.write_text(_PROLOGUE.format(eager=eager) + code + _EPILOGUE)
    launcher = code.splitlines()[0]
    command = [sys.executable, str(script)]
    if "torchrun" in launcher:  # "# name.py: torchrun --nproc_per_node N name.py"
        nproc = re.search(r"--nproc_per_node (\d+)", launcher).group(1)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc, str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, f"the example failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "remat:" not in done.stderr, f"remat warned:\n{done.stderr[-3000:]}"  # a new user's run says nothing it need not
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert results, done.stdout[-2000:]
    return results


def test_the_readme_has_python_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_a_readme_example_runs_as_a_script_bitwise_like_eager_and_compiles_once(index: int, tmp_path: Path) -> None:
    code = EXAMPLES[index]
    with_remat = _run(code, tmp_path, eager=False)
    eager = _run(code, tmp_path, eager=True)
    for rank, (r, e) in enumerate(zip(with_remat, eager)):
        assert r["graphs"] and all(n == 1 for n in r["graphs"]), f"rank {rank}: compiled {r['graphs']} times for one batch shape"
        assert r["digest"] == e["digest"], f"rank {rank}: the model or optimizer state differs from the eager run's"
