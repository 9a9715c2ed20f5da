"""Gradient accumulation against one large batch, with and without remat.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accumulation.py --model bert --batch-size 32 --micro 4 --budget 0.5 --out docs/accumulation

The same samples train the same update either way: one batch of B, or k micro-batches of
B/k, each with its own backward(), then one optimizer step: inside one step, or (a
configuration ending in ":calls") across k calls of a step that runs one micro-batch's
forward and backward, the loop stepping the optimizer after the k-th. Each is run in
eager PyTorch and under remat at the budget; across calls, the prediction is the larger
of the step's two graphs (none set, all set), and the update (eager, outside the
step) is not in it. Peaks are the allocator's (persistent state included),
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


def micro_step(loss_fn: Callable[[Any, Any], torch.Tensor], k: int):
    def step(model, optimizer, batch):
        loss = loss_fn(model, batch) / k
        loss.backward()
        return loss.detach()

    return step


def across_calls(call: Callable[[Any], Any], optimizer: Any, batch: dict[str, torch.Tensor], k: int) -> Callable[[], Any]:
    """One update as k calls of the micro-step, then the optimizer's step and zero_grad()."""
    n = next(iter(batch.values())).shape[0]
    parts = [{key: v[i * n // k : (i + 1) * n // k] for key, v in batch.items()} for i in range(k)]

    def update() -> Any:
        total = sum(call(part) for part in parts)
        optimizer.step()
        optimizer.zero_grad()
        return total

    return update


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--configs", default=None, metavar="K:BUDGET,...",
                   help="micro-batches:budget pairs to run, budget 'none' for eager, ':calls' after one for micro-batches "
                   "across calls (default: 1:none,K:none,1:B,K:B); the first is the reference")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="runs/accumulation")
    args = p.parse_args()
    spec = build_model(args.model, args.batch_size)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.01, momentum=0.9)
    k, b = args.micro, args.batch_size
    pairs = args.configs or f"1:none,{k}:none,1:{args.budget:g},{k}:{args.budget:g}"
    configs = []
    for item in pairs.split(","):
        micro, budget_text, *calls = item.split(":")
        budget = None if budget_text == "none" else float(budget_text)
        where = " across calls" if calls == ["calls"] else ""
        configs.append((f"{'eager' if budget is None else f'remat@{budget:g}'}, {micro} × {b // int(micro)}{where}", int(micro), budget, bool(where)))
    runs: list[dict[str, Any]] = []
    for name, micro, budget, apart in configs:
        model, o = twin(spec.model, opt)
        step_fn = micro_step(spec.loss_fn, micro) if apart else accumulating_step(spec.loss_fn, micro)
        example = {key: v[: b // micro] for key, v in spec.batch.items()} if apart else spec.batch
        rec: dict[str, Any] = {"method": name, "micro_batches": micro, "budget": budget, "across_calls": apart}
        t0 = time.perf_counter()
        step: Any = (lambda f, m, oo: lambda batch: f(m, oo, batch))(step_fn, model, o)
        if budget is not None:
            try:
                step = remat.compile(step_fn, model, o, example, memory_budget=budget, progress=True)
            except BudgetError as e:  # the micro-batched graph's floor (all gradients alive) is above the fraction
                if e.reach is None:
                    raise
                rec["note"] = f"budget {budget:g} out of reach; planned at the smallest reachable peak"
                step = remat.compile(step_fn, model, o, example, memory_budget=e.reach.best, progress=True)
        fn = across_calls(step, o, spec.batch, micro) if apart else (lambda s: lambda: s(spec.batch))(step)
        fn()  # optimizer state made, first-step work done (across calls: both graphs compiled)
        if budget is not None:
            reports = [g.report for g in step._graphs.values()]
            rec.update(predicted_peak_bytes=max(r.predicted_peak_bytes for r in reports), num_recomputed=[r.num_recomputed for r in reports],
                       compile_seconds=time.perf_counter() - t0, baseline_peak_bytes=max(r.baseline_peak_bytes for r in reports))
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
