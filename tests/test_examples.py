"""Every script in examples/ (but the CLI factory) runs as a new user runs it, with
`python examples/<name>.py` from the repository root, and ends with remat's report:
its measured peak equal to its predicted one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "tiny_factory.py")


def test_the_examples_are_found():
    assert {"hf_trainer.py", "accelerate_loop.py", "lightning_module.py", "fp16_grad_scaler.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_as_a_script(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, f"examples/{script}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if script == "fp16_grad_scaler.py":
        scales = [float(s) for s in re.findall(r"scale (\d+)", done.stdout)]
        assert len(scales) == 6 and scales[2] < scales[1]  # step 2 overflowed: the scale backed off
    peaks = re.search(r"peak predicted ([\d,]+) B, measured ([\d,]+) B", done.stdout)
    assert peaks, done.stdout[-2000:]
    assert peaks.group(1) == peaks.group(2)
