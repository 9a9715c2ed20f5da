"""μ-TWO against Chen's √n segments on the same graphs, budgets and profiles.

    .venv/bin/python benchmarks/planners.py --out docs/planners

For each model and batch size, the training step is captured and profiled once (or the
saved profile.json is read back: `--profiles DIR` looks for DIR/<model>-b<B>/profile.json,
and a fresh profile is saved there), then each planner plans for each budget. Writes
planners.csv and planners.md (the table in docs/RESULTS.md) to the output folder.
Planning time is each make_plan call's wall time, on this machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MiB = 2**20
COLUMNS = [
    "model", "batch_size", "budget", "planner", "status", "budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes",
    "predicted_step_peak_bytes", "fits", "predicted_overhead_seconds", "overhead_fraction", "baseline_iteration_seconds",
    "num_recomputed", "planning_seconds", "simulations", "smallest_reachable_peak_bytes", "note",
]


def _graph(model: str, batch: int, optimizer: str, profiles: Path, runs: int):
    from remat import build as pipeline
    from remat.capture.capture import capture
    from remat.profile.profiles import Profile
    from remat.workloads import load

    spec = load(model, batch, optimizer)
    tg = capture(spec.train_step, spec.model, spec.optimizer, spec.batch)
    path = profiles / f"{model}-b{batch}" / "profile.json"
    saved = None
    if path.is_file():
        saved = Profile.from_json(path)
        saved.check_graph(tg)
        print(f"{model} b{batch}: profile read from {path}", file=sys.stderr)
    else:
        print(f"{model} b{batch}: profiling ({len(tg.op_nodes())} nodes)…", file=sys.stderr)
    built = pipeline.build_on(tg, spec.model, spec.optimizer, spec.batch, runs=runs, saved_profile=saved)
    if saved is None:
        built.profile.model, built.profile.batch_size, built.profile.optimizer = model, batch, optimizer
        built.profile.to_json(path)
    return built.index, built.profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert:8,resnet152:4", help="model:batch,... (default: bert:8,resnet152:4)")
    p.add_argument("--budgets", default="0.8,0.6,0.4,0.2", help="budgets, comma-separated (default: 0.8,0.6,0.4,0.2)")
    p.add_argument("--planners", default="mutwo,chen")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--profiles", default=None, metavar="DIR", help="where profiles are read from and saved (default: OUT/profiles)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per node when profiling")
    p.add_argument("--out", default="runs/planners", metavar="DIR")
    args = p.parse_args(argv)

    from remat.budget import format_bytes, parse_budget
    from remat.errors import BudgetError
    from remat.planners.evaluate import evaluate
    from remat.planners import make_plan

    out = Path(args.out)
    profiles = Path(args.profiles) if args.profiles else out / "profiles"
    rows: list[dict] = []
    for item in args.models.split(","):
        model, batch = item.split(":")
        index, prof = _graph(model, int(batch), args.optimizer, profiles, args.runs)
        ns = prof.seconds_by_node()
        base = evaluate(index, set(), ns).timeline
        for budget in args.budgets.split(","):
            budget_bytes = parse_budget(budget).to_bytes(base.persistent_bytes, base.step_peak_bytes)
            for planner in args.planners.split(","):
                row = {c: "" for c in COLUMNS}
                row.update(model=model, batch_size=int(batch), budget=budget, planner=planner, budget_bytes=budget_bytes,
                           baseline_peak_bytes=base.peak_bytes, baseline_iteration_seconds=prof.iteration_seconds)
                t0 = time.perf_counter()
                try:
                    plan = make_plan(planner, index, ns, budget_bytes, fingerprint=prof.fingerprint, model=model,
                                     batch_size=int(batch), baseline_iteration_seconds=prof.iteration_seconds)
                except BudgetError as e:
                    row.update(status="no plan", planning_seconds=time.perf_counter() - t0, note=str(e))
                    msg = str(e)
                    i = msg.find("reach is ")
                    if i >= 0:
                        j = msg.find(" bytes)", i)
                        row["smallest_reachable_peak_bytes"] = int(msg[msg.find("(", i) + 1 : j])
                else:
                    row.update(
                        status="plan",
                        planning_seconds=time.perf_counter() - t0,
                        predicted_peak_bytes=plan.predicted_peak_bytes,
                        predicted_step_peak_bytes=plan.predicted_step_peak_bytes,
                        fits=plan.predicted_peak_bytes <= budget_bytes,
                        predicted_overhead_seconds=plan.predicted_overhead_seconds,
                        overhead_fraction=plan.predicted_overhead_fraction,
                        num_recomputed=plan.num_recomputed,
                        simulations=plan.meta.get("simulations", ""),
                        note=", ".join(f"{k}={plan.meta[k]}" for k in ("segments", "schedule") if k in plan.meta),
                    )
                rows.append(row)
                done = row["status"] == "plan"
                print(
                    f"{model} b{batch} {budget:>4} {planner:>5}: "
                    + (f"peak {format_bytes(row['predicted_peak_bytes'])} ≤ {format_bytes(budget_bytes)}, "
                       f"+{row['predicted_overhead_seconds'] * 1e3:.0f} ms, {row['num_recomputed']} recomputed"
                       if done else f"no plan (reach {format_bytes(row['smallest_reachable_peak_bytes'] or 0)})")
                    + f", {row['planning_seconds']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    out.mkdir(parents=True, exist_ok=True)
    with (out / "planners.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "planners.md").write_text(markdown(rows))
    print(f"wrote {out / 'planners.csv'}, {out / 'planners.md'}", file=sys.stderr)
    return 0


def markdown(rows: list[dict]) -> str:
    """One table: a row per model and budget, μ-TWO and Chen side by side."""
    planners = list(dict.fromkeys(r["planner"] for r in rows))
    head = ["model", "budget (cap)"]
    for p in planners:
        head += [f"{p}: predicted peak", f"{p}: overhead", f"{p}: recomputed", f"{p}: planning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["batch_size"], r["budget"]), {})[r["planner"]] = r
    for (model, batch, budget), by in keyed.items():
        any_row = next(iter(by.values()))
        cells = [f"{model} b{batch}", f"{budget} ({any_row['budget_bytes'] / MiB:,.1f} MiB)"]
        for p in planners:
            r = by.get(p)
            if r is None:
                cells += ["", "", "", ""]
            elif r["status"] == "plan":
                it = r["baseline_iteration_seconds"]
                cells += [
                    f"{r['predicted_peak_bytes'] / MiB:,.1f} MiB",
                    f"{r['predicted_overhead_seconds'] * 1e3:,.0f} ms ({r['predicted_overhead_seconds'] / it:.1%})",
                    str(r["num_recomputed"]),
                    f"{r['planning_seconds']:.2f} s",
                ]
            else:
                reach = r["smallest_reachable_peak_bytes"]
                cells += [f"no plan (reaches {reach / MiB:,.1f} MiB)" if reach else "no plan", "–", "–", f"{r['planning_seconds']:.2f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
