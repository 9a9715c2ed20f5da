"""Every optimizer a library offers, trained through remat beside eager: bitwise, refused by
name, or neither (a bug). For each of pytorch_optimizer's optimizers (its
`get_supported_optimizers()`, built with `lr=1e-3` and its defaults), an MLP trained for
`--steps` steps by the same loop on both sides (no recomputation, so that the capture of the
optimizer is what is judged), compared after every step: loss, gradients, parameters and
optimizer state. `--eager-first` runs one eager step on each side before compiling, as a
refusal that says so advises. Each optimizer has `--timeout` seconds. Writes
`library_optimizers.json` (one row per optimizer) and `library_optimizers.md` under --out.

pytorch_optimizer is not a dependency of remat; install it on its own:

    .venv/bin/pip install --no-deps pytorch-optimizer==4.1.0
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/library_optimizers.py --skip kron --out docs/library-optimizers
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import signal
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import remat
from remat.errors import RematError
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model, make_train_step


class _OutOfTime(Exception):
    pass


def _out_of_time(*_: Any) -> None:
    raise _OutOfTime()


def check_one(name: str, make: Any, steps: int, eager_first: bool, timeout: int) -> dict[str, Any]:
    """One optimizer: its outcome ("bitwise", "refused", "not bitwise", "failed", "out of time", "not built") and what was said."""
    spec = build_model("mlp-deep", 16)
    step_fn = make_train_step(spec.loss_fn)
    # Each side builds its own optimizer, as a user would.
    eager_model, model = twin(spec.model, None)[0], twin(spec.model, None)[0]
    try:
        eager_opt, opt = make(eager_model.parameters(), lr=1e-3), make(model.parameters(), lr=1e-3)
    except Exception as e:  # noqa: BLE001 - an optimizer that needs more arguments than a learning rate
        return {"name": name, "outcome": "not built", "said": f"{type(e).__name__}: {e}"[:300]}
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(timeout)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if eager_first:
                for m, o in ((eager_model, eager_opt), (model, opt)):
                    torch.manual_seed(99)
                    step_fn(m, o, spec.batch)
            step = remat.compile(step_fn, model, opt, spec.batch, memory_budget=None, profile_runs=1, measure=False)
            result = check_against_eager(step_fn, eager_model, eager_opt, model, opt, step, spec.batch, steps=steps)
        said = [str(w.message) for w in caught if str(w.message).startswith("remat")]
        return {"name": name, "outcome": "bitwise" if result.match else "not bitwise", "graphs": len(step._graphs),
                "said": result.summary() if not result.match else (said[0] if said else "")}  # fmt: skip
    except RematError as e:
        return {"name": name, "outcome": "refused", "said": str(e).splitlines()[0]}
    except _OutOfTime:
        return {"name": name, "outcome": "out of time", "said": f"over {timeout} s"}
    except Exception as e:  # noqa: BLE001 - a failure remat did not name: recorded as one
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"name": name, "outcome": "failed", "said": f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})"[:400]}
    finally:
        signal.alarm(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="these optimizers (default: all the library offers)")
    parser.add_argument("--skip", nargs="*", default=[], help="optimizers left out (Kron runs out of memory in eager on a CPU)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eager-first", action="store_true", help="one eager step on each side before compiling")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per optimizer")
    parser.add_argument("--out", type=Path, default=Path("library-optimizers"))
    args = parser.parse_args()
    try:
        import pytorch_optimizer
    except ImportError:
        parser.error("pytorch_optimizer is not installed: .venv/bin/pip install --no-deps pytorch-optimizer==4.1.0")
    names = [n for n in (args.only or pytorch_optimizer.get_supported_optimizers()) if n not in set(args.skip)]
    rows = []
    for i, name in enumerate(names, 1):
        rows.append(check_one(name, pytorch_optimizer.load_optimizer(name), args.steps, args.eager_first, args.timeout))
        print(f"[{i}/{len(names)}] {name}: {rows[-1]['outcome']} {rows[-1]['said'][:160]}", flush=True)
    counts = Counter(r["outcome"] for r in rows)
    version = importlib.metadata.version("pytorch-optimizer")
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-eager-first" if args.eager_first else ""
    summary = {"library": f"pytorch_optimizer {version}", "torch": torch.__version__, "steps": args.steps,
               "eager_first": args.eager_first, "skipped": args.skip, "counts": dict(counts), "rows": rows}  # fmt: skip
    (args.out / f"library_optimizers{suffix}.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# pytorch_optimizer {version} through remat{' (one eager step first)' if args.eager_first else ''}", "",
             ", ".join(f"{n} {k}" for k, n in counts.most_common()), "", "| optimizer | outcome | graphs | what was said |", "|---|---|---:|---|"]  # fmt: skip
    lines += [f"| {r['name']} | {r['outcome']} | {r.get('graphs', '')} | {r['said'][:200].replace('|', '/')} |" for r in rows]
    (args.out / f"library_optimizers{suffix}.md").write_text("\n".join(lines) + "\n")
    print(dict(counts))


if __name__ == "__main__":
    main()
