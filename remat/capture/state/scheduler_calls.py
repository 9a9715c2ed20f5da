"""A learning-rate scheduler stepped inside train_step, stepped again at every call.

`optimizer.step(); scheduler.step()` at the end of train_step is a common loop. A
scheduler's step is Python (it sets `param_groups[i]["lr"]` from its own counters), so no
graph can hold it; but the graph reads every hyperparameter from param_groups at each
call. So while the step is traced, each `scheduler.step()` is recorded instead of run, and
the runtime steps the real scheduler at every call: before the graph runs where the step
stepped it before `optimizer.step()` (the update then uses the new rate, as in eager), and
after the graph otherwise. Refused: a step with an argument (`ReduceLROnPlateau.step(loss)`:
the metric is a value of the step) and a scheduler made inside train_step (each trace
would make another).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch.fx
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from remat.errors import CaptureError
from remat.capture.train_graph import InputKind, TrainGraph


@dataclass(frozen=True)
class SchedulerCall:
    scheduler: Any  # the user's scheduler object
    before_update: bool  # stepped before optimizer.step() in train_step


def checked(tg: TrainGraph, calls: list[SchedulerCall]) -> tuple[SchedulerCall, ...]:
    """The calls, once sure the step returns no number computed from a hyperparameter while
    a scheduler steps after the update: in eager that number may be read after the
    scheduler's step (the next rate), but the graph computes it from this step's rate."""
    if any(not c.before_update for c in calls) and tg.call.output_numbers:
        placeholders = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
        hyper = {n for n, i in zip(placeholders, tg.inputs) if i.kind is InputKind.HYPERPARAMETER}
        outputs = list(tg.gm.graph.output_node().args[0][0])
        # The numbers of the step's updates of Python state are the last outputs, update by update.
        logged = [update.where() for update in tg.call.state_updates for _ in range(update.count)]
        first_logged = len(outputs) - len(logged)
        for position in tg.call.output_numbers:
            if hyper & _ancestors(outputs[position]):
                what = (
                    f"logs a number computed from an optimizer setting ({logged[position - first_logged]})"
                    if position >= first_logged else f"returns a number computed from an optimizer setting (output {position})"
                )
                raise CaptureError(
                    f"train_step {what} and steps a "
                    "learning-rate scheduler after the update: remat steps the scheduler after the graph, so the number "
                    "would be this step's rate, where eager may read the next one. Read it from optimizer.param_groups "
                    "(or scheduler.get_last_lr()) after train_step returns."
                )
    return tuple(calls)


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def make_calls(calls: tuple[SchedulerCall, ...], before_update: bool) -> None:
    """Step the schedulers train_step stepped, those before its update or those after."""
    for call in calls:
        if call.before_update == before_update:
            call.scheduler.step()


@contextlib.contextmanager
def recorded_scheduler_calls(calls: list[SchedulerCall], updating: Callable[[], bool]) -> Iterator[None]:
    """While train_step is traced: record its scheduler.step() calls instead of running them
    (`updating()`: whether optimizer.step() has begun)."""
    calls.clear()

    def step(self: Any, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise CaptureError(
                f"train_step steps a learning-rate scheduler with an argument ({type(self).__name__}.step(...)), a value "
                "of the step that no graph can hand to Python code: step it between steps, outside train_step."
            )
        calls.append(SchedulerCall(self, before_update=not updating()))

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise CaptureError(
            f"train_step makes a learning-rate scheduler ({type(self).__name__}): make it once, before the loop (a "
            "scheduler stepped inside train_step is stepped at every call)."
        )

    # Every subclass's own step; the two base classes' __init__, which every scheduler runs.
    replaced = [(cls, "step", step) for cls in _scheduler_classes() if "step" in vars(cls)]
    replaced += [(cls, "__init__", init) for cls in (LRScheduler, ReduceLROnPlateau)]
    saved = [(cls, name, vars(cls)[name]) for cls, name, _ in replaced]
    try:
        for cls, name, method in replaced:
            setattr(cls, name, method)
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def _scheduler_classes() -> list[type]:
    """Every scheduler class defined now: torch's and the user's subclasses."""
    out: list[type] = []
    todo: list[type] = [LRScheduler, ReduceLROnPlateau]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return out
