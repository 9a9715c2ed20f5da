"""What the step prints or logs: `print("loss", loss.item())`, `log.info("loss %.4f", loss.item())`.

The step's Python code runs once, at capture: a print inside it would print traced
placeholders once, and nothing at the steps. While the step is traced, the user's code's
`print` and `Logger` calls (`log.info(...)`, `logging.info(...)`) are recorded instead of
made. The numbers and tensors among
their arguments that the step computes become outputs of the graph, and after each run
the call is made again with their values (before the numbers the step keeps are updated,
in the order the step made the calls; a logger's level is checked then). A number the
step counts up (kept_numbers) prints as it was when printed: the slot's number before
the step plus the additions made by then; a scheduler's rate (scheduler_calls.SchedulerRead), as
the scheduler gives it once the call's scheduler steps are made. Text
formatted before the call (an f-string of `loss.item()`) cannot be: the trace stops
there, and the error says to pass the number as an argument (trace_checks). A library's
print or log call is recorded too where its arguments hold a number or tensor the step
computes (`accelerator.print("loss", loss.item())`); its other messages are made once, at
capture. A library's
logging method (Lightning's `self.log`) is recorded the same way once its integration
registers it (`record_calls_of`), and so are a tqdm progress bar's `update`, `set_postfix`
and `set_description` where tqdm is loaded, and a TensorBoard `SummaryWriter`'s
`add_scalar` and `add_scalars` where it is.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from remat.capture.state import user_code
from remat.capture.state.kept_numbers import Term, counted
from remat.capture.state.slots import TRACED_NUMBERS, Slot
from remat.capture.state.scheduler_calls import SchedulerRead

_TRACED = (*TRACED_NUMBERS, torch.Tensor)


@dataclass(frozen=True)
class CountedValue:
    """A number the step counts up, as printed: the number `slot` holds before the step,
    plus `addends` (constants, or Term.GRAPH: the graph's next outputs)."""

    slot: Slot
    addends: tuple[Any, ...]


@dataclass(frozen=True)
class PrintCall:
    """A call of `function(*args, **kwargs)` made again after each run; the leaves of
    (args, kwargs) that are Term.GRAPH take the graph's next outputs."""

    function: Callable[..., Any]
    leaves: tuple[Any, ...]
    spec: Any  # pytree spec of (args, kwargs)
    keyed = True  # it holds no slot of the user's state

    @property
    def count(self) -> int:
        return sum(a is Term.GRAPH for leaf in self.leaves for a in (leaf.addends if isinstance(leaf, CountedValue) else (leaf,)))

    def where(self) -> str:
        return "printed"

    def replay(self, values: list[Any]) -> None:
        numbers = iter(values)

        def value(leaf: Any) -> Any:
            if leaf is Term.GRAPH:
                return next(numbers)
            if isinstance(leaf, SchedulerRead):  # read once the call's scheduler steps are made
                return leaf.read()
            if isinstance(leaf, CountedValue):
                total = leaf.slot.get()
                for addend in leaf.addends:
                    total = total + value(addend)
                return total
            return leaf

        args, kwargs = pytree.tree_unflatten([value(leaf) for leaf in self.leaves], self.spec)
        self.function(*args, **kwargs)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL, "exception": logging.ERROR}
_LOGGING_DIR = os.path.dirname(logging.__file__)


_OWN_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _from_user_code(printed: tuple[Any, ...] = ()) -> bool:
    """Whether the call being recorded comes from the user's code, past the logging
    module's own frames; or from a library's (not torch's or remat's) with a number or
    tensor the step computes among `printed`, which printed now would show the trace's
    stand-in, once (Accelerate's `accelerator.print("loss", loss.item())`). A library's
    other messages are made once, at capture, as before."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_LOGGING_DIR):
        frame = frame.f_back
    if frame is None:
        return False
    where = frame.f_code.co_filename
    if user_code.is_user_file(where):
        return True
    return not where.startswith(_OWN_DIRS) and any(isinstance(v, (*TRACED_NUMBERS, FakeTensor, SchedulerRead)) for v in pytree.tree_leaves(printed))


@dataclass(frozen=True)
class RecordedMethod:
    """A library's method whose calls from the user's code are recorded like a print and
    made again after each run (Lightning's `LightningModule.log`): `again(real, obj, *args,
    **kwargs)` makes the call then; `check(args, kwargs)` refuses arguments it cannot make
    again (raises)."""

    cls: type
    name: str
    again: Callable[..., None]
    check: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None


_RECORDED_METHODS: dict[tuple[type, str], RecordedMethod] = {}


def record_calls_of(method: RecordedMethod) -> None:
    """Record, in every step traced from now on, the user's calls of `method` (an integration registers its library's)."""
    _RECORDED_METHODS[(method.cls, method.name)] = method


# A progress bar's methods a step calls to show its progress (`pbar.set_postfix(loss=loss.item())`,
# `pbar.update(1)`): recorded like prints where tqdm is loaded. Traced, set_postfix would
# format the trace's stand-in for the number into the bar's text.
_TQDM_METHODS = ("update", "set_postfix", "set_postfix_str", "set_description", "set_description_str")


def _call_again(real: Callable[..., Any], obj: Any, *args: Any, **kwargs: Any) -> None:
    real(obj, *args, **kwargs)


# TensorBoard's scalars a step writes (`writer.add_scalar("loss", loss.item(), step)`):
# traced, the writer would be given the trace's stand-in once, and nothing at the steps.
_TENSORBOARD_METHODS = ("add_scalar", "add_scalars")


def _loaded_library_methods() -> list[RecordedMethod]:
    """The registered methods, and those of libraries the process has loaded (tqdm, TensorBoard's writer)."""
    known = []
    for module, cls, names in (("tqdm.std", "tqdm", _TQDM_METHODS), ("torch.utils.tensorboard.writer", "SummaryWriter", _TENSORBOARD_METHODS)):
        kind = getattr(sys.modules.get(module), cls, None)
        known += [RecordedMethod(kind, name, _call_again) for name in names] if isinstance(kind, type) else []
    return [*known, *_RECORDED_METHODS.values()]


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]]:
    """While the block runs, the user's code's `print(...)` and logger calls recorded, not
    made (whatever the logger's level: it is checked when the call is made again)."""
    calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
    real_print = builtins.print
    real_methods = {name: getattr(logging.Logger, name) for name in [*_LEVELS, "log"]}

    def recorded_print(*args: Any, **kwargs: Any) -> None:
        if not _from_user_code((args, kwargs)):
            return real_print(*args, **kwargs)
        calls.append((real_print, args, kwargs))

    def recording_method(name: str) -> Callable[..., None]:
        def method(logger: logging.Logger, *args: Any, **kwargs: Any) -> None:
            if not _from_user_code((args, kwargs)):
                # one frame more: the record names the library's line, not this wrapper's
                return real_methods[name](logger, *args, **{**kwargs, "stacklevel": kwargs.get("stacklevel", 1) + 1})
            kwargs.pop("stacklevel", None)  # the call is made again from the runtime: its caller is not the step's line
            if name == "exception":
                kwargs.setdefault("exc_info", True)
            calls.append((functools.partial(real_methods["log"], logger), args if name == "log" else (_LEVELS[name], *args), kwargs))

        return method

    def recording_library_method(method: RecordedMethod, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_method(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if not _from_user_code():
                return real(obj, *args, **kwargs)
            if method.check is not None:
                method.check(args, kwargs)
            calls.append((functools.partial(method.again, real, obj), args, kwargs))

        return recorded_method

    builtins.print = recorded_print
    for name in real_methods:
        setattr(logging.Logger, name, recording_method(name))
    library = {(m.cls, m.name): (m, getattr(m.cls, m.name), m.name in vars(m.cls)) for m in _loaded_library_methods()}
    for (cls, name), (method, real, _) in library.items():
        setattr(cls, name, recording_library_method(method, real))
    try:
        yield calls
    finally:
        builtins.print = real_print
        for name, real in real_methods.items():
            setattr(logging.Logger, name, real)
        for (cls, name), (_, real, own) in library.items():
            setattr(cls, name, real) if own else delattr(cls, name)


def recorded(calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]) -> tuple[list[PrintCall], list[list[Any]]]:
    """The calls as PrintCalls, with the traced values each takes from the graph, in order."""
    out: list[PrintCall] = []
    values: list[list[Any]] = []
    for function, args, kwargs in calls:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        traced: list[Any] = []

        def marked(v: Any) -> Any:
            if isinstance(v, _TRACED):
                traced.append(v)
                return Term.GRAPH
            count = counted(v)
            return v if count is None else CountedValue(count[0], tuple(marked(a) for a in count[1]))

        out.append(PrintCall(function, tuple(marked(v) for v in leaves), spec))
        values.append(traced)
    return out, values
