"""The `remat` command line.

Each subcommand is a pair of functions, `configure(parser)` to add its arguments and
`run(args) -> exit code`, listed once in `COMMANDS`. A new subcommand (`plan`, `run`,
`bench`) is two functions and one line there. Problems a user can fix (unknown model,
missing device, a graph that cannot be captured) are printed as `remat: error: ...`
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from remat.errors import RematError, UsageError


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _stderr_console() -> Any:
    from remat.report import console_for

    return console_for(sys.stderr)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- shared steps


# Argument checks live with the workloads (the library uses them too); imported on use,
# so that `remat --help` does not load torch.
def check_model_args(model: str, batch_size: int, optimizer: str, device: str) -> None:
    from remat.workloads import check_arguments

    check_arguments(model, batch_size, optimizer, device)


def _check_device(device: str) -> str:
    from remat.workloads import check_device

    return check_device(device)


def _positive(value: int, what: str) -> int:
    from remat.workloads import check_positive

    return check_positive(value, what)


MODEL_HELP = (
    "a built-in model (mlp, mlp-deep, bert, bert-tiny, resnet152, resnet-tiny), hf:<model_type> "
    "(any transformers architecture with random weights, e.g. hf:gpt2; config fields may follow: "
    "hf:llama:num_hidden_layers=2,hidden_size=256), or package.module:function (your factory returning "
    "model, optimizer, batch, train_step)"
)


def add_model_arguments(p: argparse.ArgumentParser, budget_help: str) -> None:
    """--model, --batch-size, --budget, --planner and --optimizer, as `plan` and `run` take them."""
    from remat.models import OPTIMIZER_NAMES
    from remat.planners import PLANNERS

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, required=True, metavar="B")
    p.add_argument("--budget", required=True, metavar="X", help=budget_help)
    p.add_argument("--planner", default="mutwo", metavar="NAME", help=f"one of: {', '.join(PLANNERS)} (default: mutwo)")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")


def build_and_capture(model: str, batch_size: int, optimizer: str, device: str, seed: int) -> tuple[Any, Any, Any, Any]:
    """(spec, optimizer, train graph, seconds it took): the start of every pipeline command."""
    from remat.capture import capture

    spec = load_workload(model, batch_size, optimizer, device, seed)
    t0 = time.perf_counter()
    tg = capture(spec.train_step, spec.model, spec.optimizer, spec.batch)
    return spec, spec.optimizer, tg, time.perf_counter() - t0


def load_workload(model: str, batch_size: int, optimizer: str, device: str, seed: int, zero_grad_first: bool = False) -> Any:
    """The `remat.workloads.Workload` of --model, with its errors as usage errors."""
    from remat.workloads import load

    check_model_args(model, batch_size, optimizer, device)
    try:
        return load(model, batch_size, optimizer, seed=seed, device=device, zero_grad_first=zero_grad_first)
    except ValueError as e:  # unknown names, bad sizes, a broken factory: the message says which
        raise UsageError(str(e)) from None


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
) -> tuple[Any, Path, dict[str, Path]]:
    """Build, capture, profile and write the report files; (profile, out dir, files)."""
    from remat.profiler import profile
    from remat.report import write_report

    _positive(runs, "--runs")
    spec, opt, tg, capture_s = build_and_capture(model, batch_size, optimizer, device, seed)
    if progress:
        _say(f"captured {model} (batch {batch_size}, {optimizer}): {len(tg.op_nodes())} nodes in {capture_s:.1f} s")
    prof = profile(tg, spec.model, opt, spec.batch, warmup=warmup, runs=runs, device=device, progress=progress)
    prof.model, prof.batch_size, prof.optimizer = model, batch_size, optimizer
    prof.meta["seed"] = seed
    prof.meta["capture_seconds"] = capture_s
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"profile-{model}-b{batch_size}"
    files = write_report(prof, out, plot_x=plot_x)
    return prof, out, files


# ---------------------------------------------------------------------- profile


def configure_profile(p: argparse.ArgumentParser) -> None:
    from remat.models import OPTIMIZER_NAMES

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, required=True, metavar="B")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/profile-<model>-b<B>)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; tables go to stderr")
    p.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs per node, after one warm-up (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and batch (default: 0)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="largest activations to list (default: 10)")
    p.add_argument(
        "--plot-x", choices=("rank", "time"), default="rank", help="x axis of the plot: node rank or cumulative time (default: rank)"
    )


def cmd_profile(args: argparse.Namespace) -> int:
    from remat.report import console_for, print_summary

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


# ---------------------------------------------------------------------- demo


DEMO_MODELS: tuple[tuple[str, int], ...] = (("bert-tiny", 2), ("resnet-tiny", 2))


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output folder (default: runs/demo)")
    p.add_argument("--profile-only", action="store_true", help="only the two small profiles (seconds), not the BERT bench (minutes)")


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on a small default: profile two small models, then BERT-base's bench
    (eager vs remat vs HF checkpointing at two batch sizes), and say where everything is."""
    from remat.report import breakdown_table, console_for, phase_table

    console = console_for(sys.stdout)
    written = []
    for model, batch in DEMO_MODELS:
        prof, out, files = run_profile(model, batch, out_dir=Path(args.out) / f"profile-{model}-b{batch}")
        console.print(phase_table(prof))
        console.print(breakdown_table(prof.peak_breakdown, prof.simulated_peak_bytes, title=f"{model}: memory at the peak"))
        console.print(
            f"simulated peak {prof.simulated_peak_bytes / 2**20:.2f} MiB, measured {prof.measured_peak_bytes / 2**20:.2f} MiB\n"
        )
        written.append((model, out, files))
    console.print("[bold]profile outputs[/bold]")
    for model, out, files in written:
        console.print(f"  {model}: {out}/ ({', '.join(p.name for p in files.values())})")
    if not args.profile_only:
        from remat.bench import demo

        demo(Path(args.out))
    return 0


# ---------------------------------------------------------------------- registry and main


def _lazy(module: str, configure: str, run: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """configure/run of a subcommand that lives in its own module, imported only when used."""
    import importlib

    return (
        lambda p: getattr(importlib.import_module(module), configure)(p),
        lambda args: getattr(importlib.import_module(module), run)(args),
    )


COMMANDS: list[Command] = [
    Command("profile", "capture one training iteration, profile it and show where the memory goes", configure_profile, cmd_profile),
    Command("plan", "choose what to recompute under a memory budget and predict the cost", *_lazy("remat.cli_plan", "configure", "run")),
    Command("run", "train with the rewritten graph; check it against eager and measure it", *_lazy("remat.cli_run", "configure_run", "cmd_run")),
    Command("bench", "eager, remat and the usual checkpointing baselines side by side over batch sizes", *_lazy("remat.cli_bench", "configure_bench", "cmd_bench")),
    Command("maxbatch", "the largest batch that fits a memory cap, with and without remat", *_lazy("remat.cli_bench", "configure_maxbatch", "cmd_maxbatch")),
    Command("frontier", "plan (and run) every budget with every planner: overhead against peak memory", *_lazy("remat.cli_frontier", "configure_frontier", "cmd_frontier")),
    Command("demo", "profile two small models quickly and show the outputs", configure_demo, cmd_demo),
]


class _Parser(argparse.ArgumentParser):
    """argparse that reports as `remat: error: ...` like every other error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"remat: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from remat import __version__

    parser = _Parser(prog="remat", description="Automatic activation checkpointing for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `remat` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args._run(args)
    except (UsageError, RematError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
