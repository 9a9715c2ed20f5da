"""Host time remat adds to each call of a compiled step, apart from the graph's own time.

For each model: the step compiled without recomputation (memory_budget=None), then, over
many calls, the median time of each part of a call (measurement.call_time): finding the
compiled graph (checking the watched Python state), gathering the graph's inputs, and the
whole call but the graph (host); and, alternating, the whole call beside eager's whole
step. Writes `call_overhead.json` under --out.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/call_overhead.py --models bert-tiny,bert --batch-size 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import remat
from remat.measurement.call_time import measure_call_time
from remat.measurement.check import time_alternating, twin
from remat.workloads import load


def measure(model_name: str, batch_size: int, calls: int) -> dict[str, object]:
    work = load(model_name, batch_size=batch_size, optimizer="adamw", zero_grad_first=True)
    eager_model, eager_opt = twin(work.model, work.optimizer)
    step = remat.compile(work.train_step, work.model, work.optimizer, work.batch, memory_budget=None, profile_runs=1)
    for _ in range(3):  # warm-up
        step(work.batch)
        work.train_step(eager_model, eager_opt, work.batch)
    call = measure_call_time(step, work.batch, calls, steps=calls)
    timing = time_alternating(lambda: work.train_step(eager_model, eager_opt, work.batch), lambda: step(work.batch), pairs=calls)
    return {
        "model": model_name, "batch_size": batch_size, "calls": calls,
        "guards_ms": round(call.guards_seconds * 1e3, 3), "gather_inputs_ms": round(call.inputs_seconds * 1e3, 3),
        "host_ms": round(call.host_seconds * 1e3, 3), "host_warm_ms": round(call.warm_host_seconds * 1e3, 3),
        "remat_call_ms": round(timing.b_seconds * 1e3, 3), "eager_step_ms": round(timing.a_seconds * 1e3, 3),
        "remat_over_eager": round(timing.ratio, 3), "remat_over_eager_spread": [round(r, 3) for r in timing.ratio_spread],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert-tiny,bert")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", default="docs/call-overhead")
    args = parser.parse_args()
    rows = [measure(name, args.batch_size, args.calls) for name in args.models.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "call_overhead.json").write_text(json.dumps(rows, indent=2) + "\n")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
