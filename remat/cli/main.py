"""The `remat` command line.

Each subcommand is a pair of functions, `configure(parser)` to add its arguments and
`run(args) -> exit code`, listed once in `COMMANDS`. A new subcommand (`plan`, `run`,
`bench`) is two functions and one line there. Problems a user can fix (unknown model,
missing device, a graph that cannot be captured) are printed as `remat: error: ...`
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from remat.cli.common import Command, _Parser
from remat.cli.demo import cmd_demo, configure_demo
from remat.cli.profile import cmd_profile, configure_profile
from remat.errors import RematError, UsageError


def _lazy(module: str, configure: str, run: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """configure/run of a subcommand that lives in its own module, imported only when used."""
    import importlib

    return (
        lambda p: getattr(importlib.import_module(module), configure)(p),
        lambda args: getattr(importlib.import_module(module), run)(args),
    )


COMMANDS: list[Command] = [
    Command("profile", "capture one training iteration, profile it and show where the memory goes", configure_profile, cmd_profile),
    Command("plan", "choose what to recompute under a memory budget and predict the cost", *_lazy("remat.cli.plan", "configure", "run")),
    Command("run", "train with the rewritten graph; check it against eager and measure it", *_lazy("remat.cli.run", "configure_run", "cmd_run")),
    Command("bench", "eager, remat and the usual checkpointing baselines side by side over batch sizes", *_lazy("remat.cli.bench", "configure_bench", "cmd_bench")),
    Command("maxbatch", "the largest batch that fits a memory cap, with and without remat", *_lazy("remat.cli.bench", "configure_maxbatch", "cmd_maxbatch")),
    Command("frontier", "plan (and run) every budget with every planner: overhead against peak memory", *_lazy("remat.cli.frontier", "configure_frontier", "cmd_frontier")),
    Command("demo", "profile two small models quickly and show the outputs", configure_demo, cmd_demo),
]


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
        for note in getattr(e, "__notes__", []):
            print(note, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
