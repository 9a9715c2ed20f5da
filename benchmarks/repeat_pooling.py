"""Does pricing a node with its counterparts in the other repeats give better plans?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/repeat_pooling.py --out docs/repeat-pooling

The profiler times every node over a few runs and, by default, takes each node's median
over its own samples and those of the same node in the other repeats of its block
(profile.repeats). This benchmark times `--runs` whole iterations node by node once, then
in each of `--trials` trials takes `--estimate-runs` of them as the profile (as
`remat.compile` does with its 3) and the others as the held-out truth (each node's own
median over them). For both estimates (own samples; pooled over repeats) it reports:
- the error of the node times against the truth: median over nodes of |estimate - truth|
  / truth, for nodes the truth puts at 2 µs or more;
- per budget, the default planner's plan: its predicted overhead (from the estimate) and
  its overhead priced with the held-out times, as % of the held-out iteration, each node
  at its own held-out median and at the median pooled over repeats.
Writes repeat_pooling.csv and repeat_pooling.md to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

COLUMNS = ["model", "trial", "times", "budget", "node_time_error", "predicted_percent", "held_out_percent", "held_out_pooled_percent"]


def samples_of(model: str, batch: int, optimizer: str, runs: int):  # type: ignore[no-untyped-def]
    """The pipeline of `model` and `runs` timed iterations (runs x nodes seconds), after one warm-up."""
    import torch

    from remat import build as pipeline
    from remat.profile import profiler
    from remat.profile.node_runner import NodeRunner, time_run_cpu
    from remat.workloads import load

    spec = load(model, batch, optimizer)
    pl = pipeline.build(spec.train_step, spec.model, spec.optimizer, spec.batch, runs=1)
    runner = NodeRunner(pl.tg.gm)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        inputs = profiler._profiling_inputs(pl.tg, spec.model, spec.optimizer, spec.batch)
        time_run_cpu(runner, inputs)
        samples = np.stack([time_run_cpu(runner, inputs) for _ in range(runs)])
    return pl, samples


def measure(model: str, batch: int, optimizer: str, budgets: list[float], runs: int, estimate_runs: int, trials: int) -> list[dict]:
    from remat.defaults import DEFAULT_PLANNER
    from remat.profile.repeats import find_repeats, pooled_medians
    from remat.memory.schedule import recompute_seconds
    from remat.planners import make_plan

    pl, samples = samples_of(model, batch, optimizer, runs)
    repeats = find_repeats(pl.tg)
    names = [n.name for n in pl.tg.op_nodes()]
    persistent, peak = pl.profile.persistent_bytes, pl.profile.simulated_peak_bytes
    rng = np.random.default_rng(0)
    rows = []
    for trial in range(trials):
        picked = rng.permutation(runs)
        est, held = samples[picked[:estimate_runs]], samples[picked[estimate_runs:]]
        truth, pooled_truth = np.median(held, axis=0), pooled_medians(held, repeats)
        truth_seconds, pooled_truth_seconds = dict(zip(names, truth.tolist())), dict(zip(names, pooled_truth.tolist()))
        timed = truth >= 2e-6
        for label, estimate in (("own samples", np.median(est, axis=0)), ("pooled over repeats", pooled_medians(est, repeats))):
            error = float(np.median(np.abs(estimate[timed] - truth[timed]) / truth[timed]))
            seconds = dict(zip(names, estimate.tolist()))
            for b in budgets:
                budget = int(persistent + b * (peak - persistent))
                plan = make_plan(DEFAULT_PLANNER, pl.index, seconds, budget)
                schedule = plan.schedule(pl.index)
                held_out = recompute_seconds(schedule, truth_seconds)
                held_out_pooled = recompute_seconds(schedule, pooled_truth_seconds)
                rows.append(dict(
                    model=model, trial=trial, times=label, budget=b, node_time_error=round(error, 4),
                    predicted_percent=round(100 * plan.predicted_overhead_seconds / float(estimate.sum()), 2),
                    held_out_percent=round(100 * held_out / float(truth.sum()), 2),
                    held_out_pooled_percent=round(100 * held_out_pooled / float(pooled_truth.sum()), 2),
                ))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "repeat_pooling.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = [
        "| model | times | node time error (median) | budget | predicted overhead % (mean) | held-out overhead % (mean, min–max) | held-out, pooled % (mean) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["model"], r["times"], r["budget"]) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    for model, times, budget in keys:
        sel = [r for r in rows if (r["model"], r["times"], r["budget"]) == (model, times, budget)]
        held = [r["held_out_percent"] for r in sel]
        lines.append(
            f"| {model} | {times} | {np.median([r['node_time_error'] for r in sel]):.1%} | {budget} | "
            f"{np.mean([r['predicted_percent'] for r in sel]):.2f} | {np.mean(held):.2f} ({min(held):.2f}–{max(held):.2f}) | "
            f"{np.mean([r['held_out_pooled_percent'] for r in sel]):.2f} |"
        )
    (out / "repeat_pooling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt-narrow-20:2:adamw,bert-tiny:8:adamw", help="MODEL:BATCH:OPTIMIZER,...")
    p.add_argument("--budgets", default="0.4,0.6,0.8")
    p.add_argument("--runs", type=int, default=12, help="timed iterations in all")
    p.add_argument("--estimate-runs", type=int, default=3, help="of them, taken as the profile in each trial")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("runs/repeat-pooling"))
    args = p.parse_args()
    if not 1 <= args.estimate_runs < args.runs:
        p.error("--estimate-runs must be at least 1 and below --runs")
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = []
    for item in args.models.split(","):
        model, batch, optimizer = item.split(":")
        rows += measure(model, int(batch), optimizer, budgets, args.runs, args.estimate_runs, args.trials)
    write(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
