"""`remat bench` and `remat maxbatch` (the sweep logic lives in remat/measurement/sweep.py and maxbatch.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remat.defaults import DEFAULT_PLANNER


def _ints(text: str, what: str) -> list[int]:
    from remat.cli.common import UsageError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise UsageError(f"{what} must be positive integers, got {text!r}")
    return out


def _fractions(text: str) -> list[float | str]:
    from remat.cli.common import UsageError

    if text.strip().lower() in ("", "none"):
        return []
    try:
        out = [x.strip() if x.strip() == "min" or x.strip().startswith("=") else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--budgets must be comma-separated fractions such as 0.5,0.3 (or min), got {text!r}") from None
    if any(not isinstance(x, str) and not (0 < x <= 1) for x in out):
        raise UsageError(f"--budgets must be fractions in (0, 1], got {text!r}")
    return out


def configure_bench(p: argparse.ArgumentParser) -> None:
    from remat.measurement.baselines import BASELINES
    from remat.cli.common import MODEL_HELP
    from remat.models import OPTIMIZER_NAMES

    p.add_argument("--model", metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-sizes", default="2,4,8", metavar="B,B,...", help="batch sizes to sweep (default: 2,4,8)")
    p.add_argument("--budgets", default="0.5", metavar="X,X,...", help="remat budgets: fractions of the activation peak, min (the smallest peak the planner reaches), or =BASELINE (that baseline's measured peak at the same batch size, already in the results: --resume) (default: 0.5)")
    p.add_argument(
        "--baselines",
        default="hf,sequential",
        metavar="NAME,...",
        help=f"from: {', '.join(BASELINES)}, or none (default: hf,sequential; compile and remat-inductor run at each budget; "
        "compile at budget 1 is torch.compile without checkpointing)",
    )
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"remat planner (default: {DEFAULT_PLANNER})")
    p.add_argument("--pairs", type=int, default=3, metavar="K", help="timing rounds, each eager + every method (default: 3)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/bench-<model>)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in DIR/results.json and do only the rest")
    p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed runs again (not those that failed to fit their budget)")
    p.add_argument("--replot", metavar="DIR", default=None, help="only redraw tables and plots from DIR/results.json")
    p.add_argument("--json", action="store_true", help="print the output files as one JSON object on stdout")


def cmd_bench(args: argparse.Namespace) -> int:
    from remat.measurement.baselines import BASELINES
    from remat.measurement.sweep import bench, replot
    from remat.cli.common import UsageError, _check_device, _positive
    from remat.measurement.report import console_for
    from remat.workloads import check_names

    if args.replot:
        files = replot(args.replot)
    else:
        if not args.model:
            raise UsageError("--model is required (or --replot DIR)")
        check_names(args.model, args.optimizer)
        _positive(args.pairs, "--pairs")
        _check_device(args.device)
        baselines = [] if args.baselines.strip().lower() in ("", "none") else [b.strip() for b in args.baselines.split(",") if b.strip()]
        unknown = [b for b in baselines if b not in BASELINES]
        if unknown:
            raise UsageError(f"unknown baseline {unknown[0]!r}; available baselines: {', '.join(BASELINES)}")
        budgets = _fractions(args.budgets)
        for at_budgets in ("compile", "remat-inductor"):
            if at_budgets in baselines and not [b for b in budgets if not isinstance(b, str)]:
                raise UsageError(f"{at_budgets} runs at remat's budgets: give --budgets with fractions")
        out = Path(args.out) if args.out else Path("runs") / f"bench-{args.model}"
        files = bench(
            args.model,
            _ints(args.batch_sizes, "--batch-sizes"),
            budgets,
            baselines,
            out,
            optimizer=args.optimizer,
            device=args.device,
            planner=args.planner,
            pairs=args.pairs,
            seed=args.seed,
            resume=args.resume,
            retry_failed=args.retry_failed,
        )
    if args.json:
        print(json.dumps({k: str(v) for k, v in files.items()}))
    else:
        console = console_for(sys.stdout)
        console.print(f"tables: {files['tables']}\nplots: {files['peak_plot']}, {files['latency_plot']}, {files['tradeoff_plot']}\nraw: {files['results']}, {files['results_csv']}")
    return 0


def configure_maxbatch(p: argparse.ArgumentParser) -> None:
    from remat.cli.common import MODEL_HELP
    from remat.models import OPTIMIZER_NAMES

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--cap", required=True, metavar="SIZE", help='memory cap on the whole peak, e.g. "8GiB"')
    p.add_argument("--budget", type=float, default=None, metavar="X", help="plan remat at this fraction instead of at the cap itself")
    p.add_argument("--max-batch", type=int, default=256, metavar="N", help="largest batch size to try (default: 256)")
    p.add_argument("--start", type=int, default=1, metavar="B", help="first batch size tried; node costs are profiled there (default: 1)")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-confirm", action="store_true", help="simulator only: skip the measured runs")
    p.add_argument("--out", default=None, metavar="DIR", help="write maxbatch-<cap>MiB.json here (default: runs/maxbatch-<model>)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; progress goes to stderr")


def cmd_maxbatch(args: argparse.Namespace) -> int:
    from remat.measurement.maxbatch import maxbatch
    from remat.cli.common import UsageError, _check_device, _positive
    from remat.workloads import check_names

    check_names(args.model, args.optimizer)
    _positive(args.max_batch, "--max-batch")
    _positive(args.start, "--start")
    _check_device(args.device)
    if args.budget is not None and not (0 < args.budget <= 1):
        raise UsageError(f"--budget must be a fraction in (0, 1], got {args.budget}")
    out = Path(args.out) if args.out else Path("runs") / f"maxbatch-{args.model}"
    result = maxbatch(
        args.model,
        args.cap,
        budget=args.budget,
        max_batch=args.max_batch,
        start=args.start,
        optimizer=args.optimizer,
        device=args.device,
        seed=args.seed,
        confirm=not args.no_confirm,
        out_dir=out,
        say=lambda s: print(s, file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(result["summary"])
    return 0
