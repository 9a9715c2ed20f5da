"""A multi-tensor optimizer's update moved into the backward pass in buckets: the aten ops
one step dispatches, the peaks and the time, against eager's multi-tensor step.

For each model, torch's AdamW with `foreach=True` (its updates in buckets) and with
`foreach=False` (one update per parameter, what remat moved before buckets), the usual
loop (gradients cleared after the step), compiled at `--budget`: 3 steps checked bitwise
against eager with the same optimizer, the aten ops one call dispatches (counted by a
TorchDispatchMode) beside eager's, the predicted and measured peaks, and the time against
eager's (alternating pairs in this process). Writes `update_buckets.json` under --out.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/update_buckets.py --models bert-tiny --batch-size 1 --budget 0.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.measurement.check import check_against_eager, time_alternating, twin
from remat.models import build_model, make_train_step


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(run: Any) -> int:
    with _CountOps() as count:
        run()
    return count.ops


def measure(name: str, batch_size: int, budget: float, pairs: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "batch_size": batch_size, "budget": budget}
    for variant, foreach in (("foreach", True), ("per_parameter", False)):
        spec = build_model(name, batch_size)
        opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, foreach=foreach)
        step_fn = make_train_step(spec.loss_fn)
        eager_model, eager_opt = twin(spec.model, opt)
        check_model, check_opt = twin(spec.model, opt)
        step = remat.compile(step_fn, spec.model, opt, spec.batch, memory_budget=budget, profile_runs=1)
        result = check_against_eager(step_fn, check_model, check_opt, spec.model, opt, step, spec.batch, steps=3)
        step_fn(eager_model, eager_opt, spec.batch)  # the optimizer's state made, as remat's steps have made it
        eager_ops = _ops(lambda: step_fn(eager_model, eager_opt, spec.batch))
        ops = _ops(lambda: step(spec.batch))
        timing = time_alternating(lambda: step_fn(eager_model, eager_opt, spec.batch), lambda: step(spec.batch), pairs=pairs)
        plan = step.report.plan
        row[variant] = {
            "optimizer": f"AdamW(foreach={foreach})", "updates_note": plan.updates_note, "bitwise": result.match,
            "recomputed": plan.num_recomputed, "eager_ops": eager_ops, "ops": ops, "ops_over_eager": round(ops / eager_ops, 3),
            "predicted_peak_bytes": step.report.predicted_peak_bytes, "measured_peak_bytes": step.report.measured_peak_bytes,
            "time_over_eager": round(timing.ratio, 3), "time_spread": [round(r, 3) for r in timing.ratio_spread],
            "eager_seconds": round(timing.a_seconds, 5), "remat_seconds": round(timing.b_seconds, 5),
        }  # fmt: skip
        print(name, variant, json.dumps(row[variant]), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert-tiny")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.6)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--out", default="docs/update-buckets")
    args = parser.parse_args()
    rows = [measure(name, args.batch_size, args.budget, args.pairs) for name in args.models.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "update_buckets.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out / 'update_buckets.json'}")


if __name__ == "__main__":
    main()
