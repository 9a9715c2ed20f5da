"""Gradient accumulation inside one step against one large batch, with and without remat.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accumulation.py --model bert --batch-size 32 --micro 4 --budget 0.5 --out docs/accumulation

The same samples train the same update either way: one batch of B, or k micro-batches of
B/k, each with its own backward(), then one optimizer step. Each is run in eager PyTorch
and under remat at the budget. Peaks are the allocator's (persistent state included),
beside the simulator's prediction; times are medians of round-robin rounds in this one
process, as ratios to the first configuration (eager with one batch of B). Writes accumulation.json and
accumulation.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


import remat
from remat.measurement.check import twin
from remat.errors import BudgetError
from remat.profile.allocator import persistent_bytes
from remat.profile.allocator import measure_step_peak
from remat.models import build_model

MiB = 2**20


def accumulating_step(loss_fn: Callable[[Any, Any], torch.Tensor], k: int):
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        n = next(iter(batch.values())).shape[0]
        total = 0.0
        for i in range(k):
            loss = loss_fn(model, {key: v[i * n // k : (i + 1) * n // k] for key, v in batch.items()}) / k
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--configs", default=None, metavar="K:BUDGET,...",
                   help="micro-batches:budget pairs to run, budget 'none' for eager (default: 1:none,K:none,1:B,K:B); the first is the reference")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="runs/accumulation")
    args = p.parse_args()
    spec = build_model(args.model, args.batch_size)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.01, momentum=0.9)
    k, b = args.micro, args.batch_size
    pairs = args.configs or f"1:none,{k}:none,1:{args.budget:g},{k}:{args.budget:g}"
    configs = []
    for item in pairs.split(","):
        micro, budget_text = item.split(":")
        budget = None if budget_text == "none" else float(budget_text)
        configs.append((f"{'eager' if budget is None else f'remat@{budget:g}'}, {micro} × {b // int(micro)}", int(micro), budget))
    runs: list[dict[str, Any]] = []
    for name, micro, budget in configs:
        model, o = twin(spec.model, opt)
        step_fn = accumulating_step(spec.loss_fn, micro)
        rec: dict[str, Any] = {"method": name, "micro_batches": micro, "budget": budget}
        t0 = time.perf_counter()
        if budget is None:
            fn = (lambda f, m, oo: lambda: f(m, oo, spec.batch))(step_fn, model, o)
        else:
            try:
                step = remat.compile(step_fn, model, o, spec.batch, memory_budget=budget, progress=True)
            except BudgetError as e:  # the micro-batched graph's floor (all gradients alive) is above the fraction
                if e.reach is None:
                    raise
                rec["note"] = f"budget {budget:g} out of reach; planned at the smallest reachable peak"
                step = remat.compile(step_fn, model, o, spec.batch, memory_budget=e.reach.best, progress=True)
            rec.update(predicted_peak_bytes=step.report.predicted_peak_bytes, num_recomputed=step.report.num_recomputed,
                       compile_seconds=time.perf_counter() - t0, baseline_peak_bytes=step.report.baseline_peak_bytes)
            fn = (lambda s: lambda: s(spec.batch))(step)
        fn()  # optimizer state made, first-step work done
        rec["peak_bytes"] = persistent_bytes(model, o, spec.batch) + measure_step_peak(fn, "cpu", model).peak_bytes
        rec["fn"] = fn
        runs.append(rec)
        print(f"{name}: peak {rec['peak_bytes'] / MiB:,.1f} MiB", file=sys.stderr, flush=True)
    times: list[list[float]] = [[] for _ in runs]
    for r in range(args.rounds):
        order = list(range(len(runs)))[r % len(runs):] + list(range(len(runs)))[: r % len(runs)]
        for i in order:
            t = time.perf_counter()
            runs[i]["fn"]()
            times[i].append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for rec, ts in zip(runs, times):
        del rec["fn"]
        rec["seconds"] = statistics.median(ts)
        ratios = [t / e for t, e in zip(ts, times[0])]
        rec["ratio_to_eager"] = statistics.median(ratios)
        rec["ratio_spread"] = [min(ratios), max(ratios)]
    eager_peak = runs[0]["peak_bytes"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "batch_size": b, "micro": k, "budget": args.budget, "rounds": args.rounds,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    (out / "accumulation.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    ref = runs[0]["method"]
    lines = [f"| method | peak MiB (measured) | predicted | peak / {ref} | time / {ref} (median, min–max) |", "|---|---:|---:|---:|---:|"]
    for rec in runs:
        pred = f"{rec['predicted_peak_bytes'] / MiB:,.1f}" if "predicted_peak_bytes" in rec else "–"
        lines.append(f"| {rec['method']}{' (' + rec['note'] + ')' if rec.get('note') else ''} | {rec['peak_bytes'] / MiB:,.1f} | {pred} | {rec['peak_bytes'] / eager_peak:.2f} | "
                     f"{rec['ratio_to_eager']:.2f} ({rec['ratio_spread'][0]:.2f}–{rec['ratio_spread'][1]:.2f}) |")
    (out / "accumulation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
