"""`remat frontier`: every planner at every budget, on one profile; CSV/JSON, a table and a plot.

Writes to the output folder: frontier.json (everything), frontier.csv (one row per planner
and budget), frontier.md (per budget: overheads, μ-TWO's gap to the exact planner, solver
times), frontier.png (overhead against peak memory, one curve per planner) and
profile.json (pass it back with --profile to skip profiling). The files are rewritten
after every point; --resume keeps the points already there and does only the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "plan every budget with every planner and plot overhead against peak memory"


def configure_frontier(p: argparse.ArgumentParser) -> None:
    from remat.cli.common import MODEL_HELP
    from remat.models import OPTIMIZER_NAMES
    from remat.planners import PLANNERS

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, required=True, metavar="B")
    p.add_argument("--planners", default="mutwo,chen,milp", metavar="LIST", help=f"comma list of: {', '.join(PLANNERS)} (default: mutwo,chen,milp)")
    p.add_argument(
        "--budgets",
        default="0.1:1.0:0.1",
        metavar="RANGE",
        help='fractions start:stop:step (stop included), or a comma list of budgets such as "0.5,0.8,6GiB" (default: 0.1:1.0:0.1)',
    )
    p.add_argument("--measure", action="store_true", help="also run each plan: 3 steps bitwise against eager, and the measured peak")
    p.add_argument("--pairs", type=int, default=0, metavar="K", help="with --measure, also time eager vs remat in K alternating pairs (default: 0, no timing)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="seconds for the exact planner per budget (default: 60)")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument("--profile", default=None, metavar="FILE", help="a profile.json of this model and batch size (skips profiling)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/frontier-<model>-b<B>)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the points already in DIR/frontier.json (same model, batch size, optimizer and device) and do only the rest, "
        "on the node times of DIR/profile.json",
    )
    p.add_argument(
        "--no-lean-ops",
        action="store_true",
        help="plan without lean operator variants (backward ops writing their result into a dying input), "
        "to compare the frontier with and without them",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs per node when profiling (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and batch (default: 0)")
    p.add_argument("--json", action="store_true", help="print the frontier as one JSON object on stdout")


def cmd_frontier(args: argparse.Namespace) -> int:
    from pathlib import Path

    from remat.measurement.frontier import parse_budgets, run_frontier
    from remat.measurement.frontier_files import markdown_table

    t0 = time.perf_counter()
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    budgets = parse_budgets(args.budgets)
    out = Path(args.out) if args.out else Path("runs") / f"frontier-{args.model}-b{args.batch_size}"
    try:
        fr = run_frontier(
            args.model,
            args.batch_size,
            planners,
            budgets,
            optimizer=args.optimizer,
            measure=args.measure,
            out_dir=out,
            time_limit=args.time_limit,
            device=args.device,
            seed=args.seed,
            runs=args.runs,
            pairs=args.pairs if args.measure else 0,
            profile_path=args.profile,
            progress=True,
            resume=args.resume,
            lean_ops=not args.no_lean_ops,
        )
    except KeyboardInterrupt:
        print(f"interrupted: every point finished so far is in {out}/frontier.json; rerun with --resume to do only the rest", file=sys.stderr)
        raise
    stream = sys.stderr if args.json else sys.stdout
    print(markdown_table(fr), file=stream)
    print(f"wrote {out}/frontier.json, frontier.csv, frontier.md, frontier.png ({time.perf_counter() - t0:.1f} s)", file=stream)
    if args.json:
        print(json.dumps(fr.to_dict()))
    bad = [p for p in fr.points if p.grads_match is False]
    return 1 if bad else 0
