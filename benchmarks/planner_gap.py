"""Each planner's predicted overhead and planning time at each budget, on one profile.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_gap.py --model bert-tiny --batch-size 16 \
        --budgets 0.4,0.5,0.6,0.7,0.8 --profile docs/plan_regression/bert-tiny-b16.json --out docs/planners/gap-bert-tiny-b16.md

The same profile (node times) for every planner, so that the costs compare: a saved one
(`--profile`, written there first if the file does not exist), or one measured now.
Overheads are the schedule's predicted rebuild time as a share of the iteration; the
exact planner (`milp`) stops at `--milp-seconds` and says whether it proved its plan
optimal. Writes a markdown table (`--out`) and prints it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable


from remat.errors import RematError
from remat import build as pipeline
from remat.capture.capture import capture
from remat.profile.profiles import Profile
from remat.memory.simulator import simulate
from remat.planners import make_plan
from remat.workloads import load


def built_on_profile(model: str, batch_size: int, profile: str | None) -> tuple[Any, Callable[[], Any]]:
    """The model's SGD step captured and built on a saved profile (written there first if
    the file does not exist, or measured now without one), and a function that builds it
    again (a freshly derived index) on the same node times."""
    spec = load(model, batch_size, "sgd")
    tg = capture(spec.train_step, spec.model, spec.optimizer, spec.batch)
    path = Path(profile) if profile else None
    saved = Profile.from_json(path) if path is not None and path.exists() else None
    built = pipeline.build_on(tg, spec.model, spec.optimizer, spec.batch, runs=1, saved_profile=saved)
    if path is not None and saved is None:
        built.profile.to_json(path)
        saved = built.profile
    return built, lambda: pipeline.build_on(tg, spec.model, spec.optimizer, spec.batch, runs=1, saved_profile=saved)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--budgets", required=True, help="comma list of fractions of the activation peak")
    p.add_argument("--planners", default="mutwo,refined,milp")
    p.add_argument("--milp-seconds", type=float, default=30.0)
    p.add_argument("--profile", default=None, help="saved profile to use (written there first if missing)")
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args()
    built, _ = built_on_profile(args.model, args.batch_size, args.profile)
    base = simulate(built.analysis, scratch=built.index.scratch)
    iteration = sum(built.node_seconds().values())
    planners = args.planners.split(",")
    lines = [
        f"{args.model} batch {args.batch_size}: predicted overhead (% of the iteration) and planning seconds",
        "",
        "| budget | " + " | ".join(planners) + " |",
        "|---|" + "---:|" * len(planners),
    ]
    print("\n".join(lines), flush=True)
    for fraction in (float(b) for b in args.budgets.split(",")):
        budget = int(base.persistent_bytes + fraction * base.step_peak_bytes)
        cells = []
        for planner in planners:
            options = {"time_limit": args.milp_seconds} if planner == "milp" else {}
            t0 = time.perf_counter()
            try:
                plan = make_plan(planner, built.index, built.node_seconds(), budget, **options)
            except RematError:
                cells.append(f"refused ({time.perf_counter() - t0:.1f} s)")
                continue
            status = f", {plan.meta.get('milp_status')}" if planner == "milp" else ""
            cells.append(f"{100 * plan.predicted_overhead_seconds / iteration:.2f}% ({time.perf_counter() - t0:.1f} s{status})")
        line = f"| {fraction:g} | " + " | ".join(cells) + " |"
        lines.append(line)
        print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
