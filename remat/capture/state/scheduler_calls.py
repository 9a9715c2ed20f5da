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

The rates a scheduler gives (`scheduler.get_last_lr()`) and the counts it keeps
(`last_epoch`, `_step_count`) are not yet known while the step is traced where it steps
after the update, nor are they the traced ones where the loop steps it between calls. So
to the step's code (the user's, or a library's passing it on: Accelerate's scheduler) a
scheduler gives `SchedulerRead`s instead: one returned from train_step, or passed to a
print, a logger or a recorded logging method, or appended to a list, is read from the real
scheduler once this call's scheduler steps are made, as eager would read it then. Any
other use of it (arithmetic, a comparison, text formatted from it) is refused, naming it;
so is a read between two steps of the same scheduler in one step.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from remat.errors import CaptureError
from remat.capture.train_graph import InputKind, TrainGraph
from remat.capture.trace_checks import wrapped_methods


@dataclass(frozen=True)
class SchedulerCall:
    scheduler: Any  # the user's scheduler object
    before_update: bool  # stepped before optimizer.step() in train_step


# Code whose reads of a scheduler get its real values: torch's own (a scheduler reading
# another's) and remat's (walking the user's state); a library's code may pass a read on.
_REAL_READERS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
_COUNTS = ("last_epoch", "_step_count")  # the ints every scheduler's step moves


@dataclass(frozen=True)
class SchedulerRead:
    """A number train_step read from a scheduler after `steps_before` of the step's own
    calls of `scheduler.step()`: a rate (`get_last_lr()[what]`, an index) or a count it keeps
    (`what`: the field's name); read from the scheduler once the call's steps are made."""

    scheduler: Any
    what: int | str
    steps_before: int

    def read(self) -> float | int:
        return self.scheduler.get_last_lr()[self.what] if isinstance(self.what, int) else getattr(self.scheduler, self.what)

    def __repr__(self) -> str:
        name = type(self.scheduler).__name__
        return f"{name}.get_last_lr()[{self.what}]" if isinstance(self.what, int) else f"{name}.{self.what}"


def _rate_used(op: str) -> Callable[..., Any]:
    def method(self: SchedulerRead, *args: Any) -> Any:
        raise CaptureError(
            f"train_step uses {self!r} ({op}): what a scheduler holds is known only once the call's scheduler steps "
            "are made, after the graph, so the step may return it, append it to a list, or pass it to print, a logger "
            "or a logging method (print('lr', scheduler.get_last_lr()[0])), and nothing else. Compute with "
            "optimizer.param_groups[i]['lr'] read before the scheduler's step, or with a count the step keeps itself "
            "(self.step += 1), instead; or use the scheduler's values after train_step returns."
        )

    return method


def _read_by_real_code() -> bool:
    """Whether the scheduler's value being read is for torch's or remat's code (past remat's
    own wrappers: library_objects' attribute lookups)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_REAL_READERS[1]):
        frame = frame.f_back
    return frame is None or frame.f_code.co_filename.startswith(_REAL_READERS[0])


for _op in (
    "__bool__", "__int__", "__float__", "__index__", "__complex__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__neg__", "__pos__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
    "__pow__", "__rpow__", "__str__", "__format__",
):  # fmt: skip
    setattr(SchedulerRead, _op, _rate_used(_op.strip("_")))


def checked(tg: TrainGraph, calls: list[SchedulerCall], reads: list[SchedulerRead] = ()) -> tuple[SchedulerCall, ...]:
    """The calls, once sure the step returns no number computed from a hyperparameter while
    a scheduler steps after the update: in eager that number may be read after the
    scheduler's step (the next rate), but the graph computes it from this step's rate; and
    that each rate the step read comes after all of its scheduler's steps in the step."""
    for rate in reads:
        steps = _steps_of(rate.scheduler, calls)
        if steps != rate.steps_before:
            raise CaptureError(
                f"train_step reads {rate!r} after {rate.steps_before} of its {steps} scheduler.step() calls: remat "
                "makes a step's scheduler steps before or after the graph, so it can give only the rate after all of "
                "them. Read the rate after the last step of that scheduler in train_step, or outside it."
            )
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
                    "would be this step's rate, where eager may read the next one. Use scheduler.get_last_lr()[i] instead "
                    "(remat reads it once the scheduler has stepped), or read optimizer.param_groups after train_step returns."
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
def recorded_scheduler_calls(calls: list[SchedulerCall], updating: Callable[[], bool], reads: list[SchedulerRead]) -> Iterator[None]:
    """While train_step is traced: record its scheduler.step() calls instead of running them
    (`updating()`: whether optimizer.step() has begun), and give the step's code SchedulerReads
    for the rates and counts it reads (`reads`: those given)."""
    calls.clear()
    reads.clear()

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

    def last_rates(real: Callable[..., Any]) -> Callable[..., Any]:
        def get_last_lr(self: Any) -> Any:
            rates = real(self)
            if _read_by_real_code():
                return rates
            steps = _steps_of(self, calls)
            given = [SchedulerRead(self, i, steps) if type(rate) is float else rate for i, rate in enumerate(rates)]
            reads.extend(r for r in given if isinstance(r, SchedulerRead))
            return given

        return get_last_lr

    def counts(real: Callable[..., Any]) -> Callable[..., Any]:
        def getattribute(self: Any, name: str) -> Any:
            value = real(self, name)
            if name not in _COUNTS or type(value) is not int or _read_by_real_code():
                return value
            read = SchedulerRead(self, name, _steps_of(self, calls))
            reads.append(read)
            return read

        return getattribute

    # Every subclass's own step and get_last_lr; the two base classes' __init__, which every
    # scheduler runs; the base class's attribute lookup, every scheduler's counts.
    classes = _scheduler_classes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(wrapped_methods(tuple(c for c in classes if "step" in vars(c)), ("step",), lambda _: step))
        stack.enter_context(wrapped_methods(tuple(c for c in classes if "get_last_lr" in vars(c)), ("get_last_lr",), last_rates))
        stack.enter_context(wrapped_methods((LRScheduler, ReduceLROnPlateau), ("__init__",), lambda _: init))
        stack.enter_context(wrapped_methods((LRScheduler,), ("__getattribute__",), counts))
        yield


def _steps_of(scheduler: Any, calls: list[SchedulerCall]) -> int:
    """How many of the step's scheduler.step() calls so far are `scheduler`'s."""
    return sum(c.scheduler is scheduler for c in calls)


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
