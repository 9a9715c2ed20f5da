"""`remat profile`: capture one training iteration, profile it and show where the memory goes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from remat.cli.common import MODEL_HELP, _positive, _say, _stderr_console, build_and_capture


def profile_summary(prof: Any, out_dir: Path, files: dict[str, Path]) -> dict[str, Any]:
    """The one JSON object `remat profile --json` prints."""
    return {
        "model": prof.model,
        "batch_size": prof.batch_size,
        "optimizer": prof.optimizer,
        "device": prof.device,
        "num_nodes": prof.num_nodes,
        "nodes_per_phase": prof.nodes_per_phase,
        "num_activations": prof.num_activations,
        "activation_bytes": sum(t.nbytes for t in prof.activations()),
        "persistent_bytes": prof.persistent_bytes,
        "peak_bytes_simulated": prof.simulated_peak_bytes,
        "peak_bytes_measured": prof.measured_peak_bytes,
        "step_peak_bytes_simulated": prof.simulated_step_peak_bytes,
        "step_peak_bytes_measured": prof.measured_step_peak_bytes,
        "peak_rank": prof.peak_rank,
        "peak_breakdown": prof.peak_breakdown,
        "phase_seconds": prof.phase_seconds,
        "iteration_seconds": prof.iteration_seconds,
        "fingerprint": prof.fingerprint,
        "repeated_blocks": prof.meta.get("repeats", []),
        "out_dir": str(out_dir),
        "files": {k: str(v) for k, v in files.items()},
    }


def run_profile(
    model: str,
    batch_size: int,
    *,
    optimizer: str = "sgd",
    device: str = "cpu",
    out_dir: str | Path | None = None,
    runs: int = 3,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
    plot_x: str = "rank",
    pool_repeats: bool = False,
) -> tuple[Any, Path, dict[str, Path]]:
    """Build, capture, profile and write the report files; (profile, out dir, files)."""
    from remat.profile.profiler import profile
    from remat.measurement.report import write_report

    _positive(runs, "--runs")
    spec, opt, tg, capture_s = build_and_capture(model, batch_size, optimizer, device, seed)
    if progress:
        _say(f"captured {model} (batch {batch_size}, {optimizer}): {len(tg.op_nodes())} nodes in {capture_s:.1f} s")
    prof = profile(tg, spec.model, opt, spec.batch, warmup=warmup, runs=runs, device=device, progress=progress, pool_repeats=pool_repeats)
    prof.model, prof.batch_size, prof.optimizer = model, batch_size, optimizer
    prof.meta["seed"] = seed
    prof.meta["capture_seconds"] = capture_s
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"profile-{model}-b{batch_size}"
    files = write_report(prof, out, plot_x=plot_x)
    return prof, out, files


def configure_profile(p: argparse.ArgumentParser) -> None:
    from remat.models import OPTIMIZER_NAMES

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, required=True, metavar="B")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/profile-<model>-b<B>)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; tables go to stderr")
    p.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs per node, after one warm-up (default: 3)")
    p.add_argument(
        "--pool-repeats", action="store_true",
        help="each node's time pooled with its counterparts' in the other repeats of a repeated block (default: its own samples)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and batch (default: 0)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="largest activations to list (default: 10)")
    p.add_argument(
        "--plot-x", choices=("rank", "time"), default="rank", help="x axis of the plot: node rank or cumulative time (default: rank)"
    )


def cmd_profile(args: argparse.Namespace) -> int:
    from remat.measurement.report import console_for, print_summary

    t0 = time.perf_counter()
    prof, out, files = run_profile(
        args.model,
        args.batch_size,
        optimizer=args.optimizer,
        device=args.device,
        out_dir=args.out,
        runs=args.runs,
        seed=args.seed,
        plot_x=args.plot_x,
        pool_repeats=args.pool_repeats,
    )
    wall = time.perf_counter() - t0
    console = _stderr_console() if args.json else console_for(sys.stdout)
    print_summary(prof, console, top_k=args.top)
    console.print(f"wrote {', '.join(str(p) for p in files.values())} ({wall:.1f} s)")
    if args.json:
        summary = profile_summary(prof, out, files)
        summary["wall_seconds"] = wall
        print(json.dumps(summary))
    return 0
