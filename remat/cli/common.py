"""What every `remat` subcommand shares: the command record, the parser, the model arguments
and the first step of every pipeline command (load the workload, capture it)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from remat.errors import UsageError

__all__ = ["UsageError"]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _stderr_console() -> Any:
    from remat.measurement.report import console_for

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
    "a built-in model (mlp, mlp-deep, bert, bert-tiny, resnet152, resnet-tiny, gpt-narrow-6, gpt-narrow-20, "
    "gpt-narrow-60), hf:<model_type> "
    "(any transformers architecture with random weights, e.g. hf:gpt2; config fields may follow: "
    "hf:llama:num_hidden_layers=2,hidden_size=256, lists in brackets: hf:convnext:depths=[1,1]), or package.module:function (your factory returning "
    "model, optimizer, batch, train_step)"
)


def add_model_arguments(p: argparse.ArgumentParser, budget_help: str) -> None:
    """--model, --batch-size, --budget, --planner, --optimizer and --no-lean-ops, as `plan` and `run` take them."""
    from remat.models import OPTIMIZER_NAMES
    from remat.defaults import DEFAULT_PLANNER
    from remat.planners import PLANNERS

    p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, required=True, metavar="B")
    p.add_argument("--budget", required=True, metavar="X", help=budget_help)
    p.add_argument("--planner", default=DEFAULT_PLANNER, metavar="NAME", help=f"one of: {', '.join(PLANNERS)} (default: {DEFAULT_PLANNER})")
    p.add_argument("--optimizer", default="sgd", metavar="NAME", help=f"one of: {', '.join(OPTIMIZER_NAMES)} (default: sgd)")
    p.add_argument(
        "--no-lean-ops",
        action="store_true",
        help="plan without lean operator variants (backward ops writing their result into an input that dies there)",
    )


def build_and_capture(model: str, batch_size: int, optimizer: str, device: str, seed: int) -> tuple[Any, Any, Any, Any]:
    """(spec, optimizer, train graph, seconds it took): the start of every pipeline command."""
    from remat.capture.capture import capture

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


class _Parser(argparse.ArgumentParser):
    """argparse that reports as `remat: error: ...` like every other error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"remat: error: {message}\n")
