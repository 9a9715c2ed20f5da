"""Numbers and tensors the step logs into the user's lists: `losses.append(loss.item())`,
`norms.append(total_norm.detach())`, a forward hook keeping a layer's statistics.

While the step is traced, each list of plain numbers or tensors held in the user's
globals, closure variables, objects or modules (python_state's slots; not a library
object's fields) is swapped for a recording list. After the trace the user's list is put back untouched,
and what the step appended (traced stand-ins of `loss.item()`, a learning rate, tensors it
computed) become outputs of the graph, computed at every call; after each run they are
appended to the list the slot holds then (a new list per epoch is the one appended to),
as eager appends them; a scheduler's rate (`scheduler.get_last_lr()[0]`), as the scheduler
gives it once the call's scheduler steps are made. A tensor is appended detached: the step's autograd graph is freed
by then, as eager's is once its backward has run.

What a trace cannot repeat is refused: reading a list the step also logs to (its length,
its last values: read once, at capture), appending anything else (a Python value, a
tensor the step did not compute: a parameter, the batch), or changing the list otherwise.
A list the step only reads is watched as a value (python_state), like any other; one it
does not touch at all is left out of the step's cache key, so that the loop may log into
it between steps.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import CaptureError
from remat.capture.state.slots import NUMBERS, TRACED_NUMBERS, Slot
from remat.capture.state.scheduler_calls import SchedulerRead

_READS = (
    "__getitem__", "__len__", "__iter__", "__contains__", "__reversed__", "__eq__", "__ne__", "__lt__", "__le__",
    "__gt__", "__ge__", "__add__", "__mul__", "__repr__", "__str__", "__format__", "index", "count", "copy",
)  # fmt: skip
_CHANGES = ("extend", "insert", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__", "__iadd__", "__imul__")


class _Recording(list):  # type: ignore[type-arg]
    """The user's list while the step is traced: what the step appends is recorded, and
    held while the step runs, so that a pop of the last of it (a forward hook pushing an
    activation that a backward hook pops, as opacus' do) takes it off again, leaving the list
    as it came in."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.appended: list[Any] = []
        self.read: str | None = None
        self.changed: str | None = None

    def append(self, value: Any) -> None:
        self.appended.append(value)
        list.append(self, value)

    def pop(self, index: int = -1) -> Any:
        if self.appended and index in (-1, len(self) - 1):
            list.pop(self)
            return self.appended.pop()
        self.changed = self.changed or "pop"
        return list.pop(self, index)


def record_calls(
    cls: type, base: type, reads: tuple[str, ...], changes: tuple[str, ...], on: Callable[[Any], Any] = lambda c: c,
    made: Callable[[Any], Any] | None = None,
) -> None:
    """Give a recording container's class methods that note the first of `reads` called
    (`read`) and the first of `changes` (`changed`) by name, then do what `base`'s do, on
    the container itself or on what `on` gives for it. `made`: a plain container of its
    contents (`base` of them, but where it keeps more: a deque's `maxlen`)."""

    def reading(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.read = self.read or name
            return getattr(base, name)(on(self), *args, **kwargs)

        return method

    def changing(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.changed = self.changed or name
            result = getattr(base, name)(on(self), *args, **kwargs)
            return self if name.startswith("__i") else result

        return method

    for name in reads:
        setattr(cls, name, reading(name))
    for name in changes:
        setattr(cls, name, changing(name))

    # copy.copy, copy.deepcopy and pickle read it whole, and make a plain container (the
    # default copy of a subclass would share the recording).
    def plain(self: Any) -> Any:
        self.read = self.read or "copy"
        return (made or base)(on(self))

    cls.__copy__ = plain
    cls.__deepcopy__ = lambda self, memo: copy.deepcopy(plain(self), memo)
    cls.__reduce_ex__ = lambda self, protocol: (copy.copy, (plain(self),))  # unpickled: the plain container


class _RecordingDeque(collections.deque):  # type: ignore[type-arg]
    """The user's deque (a window of the last losses, `deque(maxlen=100)`) while the step is
    traced, recorded as a list is; its `maxlen` kept, so that what the step reads of it is eager's."""

    def __init__(self, items: collections.deque[Any]) -> None:
        super().__init__(items, items.maxlen)
        self.appended: list[Any] = []
        self.read: str | None = None
        self.changed: str | None = None

    def append(self, value: Any) -> None:
        self.appended.append(value)
        collections.deque.append(self, value)

    def pop(self) -> Any:  # the last appended taken off again, as a list's
        if self.appended:
            collections.deque.pop(self)
            return self.appended.pop()
        self.changed = self.changed or "pop"
        return collections.deque.pop(self)


record_calls(_Recording, list, _READS, _CHANGES)
record_calls(
    _RecordingDeque, collections.deque, (*_READS[:-1], "copy"), (*_CHANGES, "appendleft", "extendleft", "popleft", "rotate"),
    made=lambda d: collections.deque(d, d.maxlen),
)
# A list to torch's pytree functions, read through its own methods: a plain list comes back.
pytree.register_pytree_node(_Recording, lambda items: (list(items), None), lambda values, _: list(values))


@dataclass(frozen=True)
class LoggedList:
    """A list the step appends `count` traced numbers or tensors to, at each call, and the
    scheduler's rates among them (`rates`: position among the leaves of what it appends,
    SchedulerRead), read once the call's scheduler steps are made. `shapes`: for each value
    appended, None for a number or tensor, or the pytree spec of a dict, tuple or list of them
    (`history.append({"loss": loss.item(), "acc": acc})`), made again from its leaves."""

    slot: Slot
    count: int
    rates: tuple[tuple[int, SchedulerRead], ...] = ()
    shapes: tuple[Any, ...] = ()
    keyed = False  # not part of the step's cache key: it grows at every call, and the graph never reads it

    def where(self) -> str:
        return f"into {self.slot.name}"

    def replay(self, values: list[Any]) -> None:
        target = self.slot.get()
        if not isinstance(target, (list, collections.deque)):
            raise CaptureError(
                f"{self.slot.name}, the list train_step logs numbers to, is now a {type(target).__name__}; the step "
                f"appended its {self.count} numbers to a list when it was compiled. Hold a list there, or compile a new step."
            )
        rates, graph = dict(self.rates), iter(values)
        leaves = iter([rates[i].read() if i in rates else next(graph) for i in range(self.count + len(rates))])
        shapes = self.shapes or (None,) * (self.count + len(rates))
        target.extend(next(leaves) if spec is None else pytree.tree_unflatten([next(leaves) for _ in range(spec.num_leaves)], spec) for spec in shapes)


def candidates(slots: list[tuple[Slot, Any]]) -> list[tuple[Slot, list[Any]]]:
    """The lists (and deques) of plain numbers or tensors (or empty) the step could log to: held by the
    user's globals, closures and objects, or a module's attributes (not a library object's)."""
    return [
        (slot, value)
        for slot, value in slots
        if type(value) in (list, collections.deque) and not slot.library and all(type(v) in NUMBERS or isinstance(v, torch.Tensor) for v in value)
    ]


@contextlib.contextmanager
def recording(lists: list[tuple[Slot, list[Any]]]) -> Iterator[list[tuple[Slot, _Recording]]]:
    """While the block runs, each list swapped for a recording copy (one per list, in every
    slot that holds it: what the step appends through one is read through the others);
    the user's own put back after."""
    copies: dict[int, _Recording] = {}
    for _, original in lists:
        if id(original) not in copies:
            copies[id(original)] = _Recording(original) if type(original) is list else _RecordingDeque(original)
    swapped = [(slot, original, copies[id(original)]) for slot, original in lists]
    try:
        for slot, _, recorder in swapped:
            slot.set(recorder)
        yield [(slot, recorder) for slot, _, recorder in swapped]
    finally:
        for slot, original, recorder in swapped:
            if slot.get() is recorder:
                slot.set(original)


def unread(recorders: list[tuple[Slot, _Recording]]) -> frozenset[str]:
    """The lists the traced step neither read, appended to nor changed: the graph does not
    depend on what they hold, so they are left out of the step's cache key (a list the loop
    logs into beside the step's own, in the same dict). Not a module's: a library's code
    may read one in C (a list of dimensions given to an op), which the recording does not see."""
    return frozenset(
        slot.name for slot, r in recorders
        if not r.appended and r.read is None and r.changed is None and not isinstance(slot.owner, torch.nn.Module)
    )


def logged(recorders: list[tuple[Slot, _Recording]], inputs: set[int]) -> tuple[list[LoggedList], list[list[Any]]]:
    """The lists the traced step logged numbers or tensors to, and the traced values, per
    list; or a CaptureError for what a trace cannot repeat. `inputs`: the graph's inputs,
    by id (a tensor the step did not compute)."""
    lists: list[LoggedList] = []
    values: list[list[Any]] = []
    for slot, recorder in {id(r): (slot, r) for slot, r in reversed(recorders)}.values():  # each list once, by its first slot
        if recorder.changed is not None:
            raise CaptureError(
                f"train_step changed {slot.name} while it was traced (list.{recorder.changed}): its Python code runs "
                "once, at capture, so the graph would not repeat it. Change such lists outside train_step; to log a "
                "value, append it (losses.append(loss.item())) or return it from train_step."
            )
        if not recorder.appended:
            continue
        shapes = tuple(_shape(v) for v in recorder.appended)
        leaves = [leaf for v, spec in zip(recorder.appended, shapes) for leaf in ([v] if spec is None else pytree.tree_leaves(v))]
        rates = tuple((i, v) for i, v in enumerate(leaves) if isinstance(v, SchedulerRead))
        traced = [v for v in leaves if not isinstance(v, SchedulerRead)]
        plain = [v for v in traced if not isinstance(v, TRACED_NUMBERS) and not _computed(v, inputs)]
        if plain:
            what = "a tensor the step did not compute (a parameter, the batch)" if isinstance(plain[0], torch.Tensor) else f"the Python value {plain[0]!r}"
            raise CaptureError(
                f"train_step appends {what} to {slot.name}, which no step but the traced one would append: a list the "
                "step logs to can take numbers computed from tensors (loss.item()), optimizer settings and tensors the "
                "step computes. Return a tensor from train_step instead, or append other values outside train_step."
            )
        if recorder.read is not None:
            raise CaptureError(
                f"train_step reads {slot.name} (list.{recorder.read}), a list it also logs numbers to: what it reads is "
                "read once, at capture, and would be the same at every step. Read the list outside train_step."
            )
        lists.append(LoggedList(slot, len(traced), rates, shapes if any(s is not None for s in shapes) else ()))
        values.append(traced)
    return lists, values


def _shape(value: Any) -> Any:
    """None for a value appended as it is, or the pytree spec of a dict, tuple or list of values (a record of the step's numbers)."""
    if type(value) in (dict, tuple, list) or (isinstance(value, tuple) and hasattr(type(value), "_fields")):
        return pytree.tree_flatten(value)[1]
    return None


def _computed(value: Any, inputs: set[int]) -> bool:
    """A tensor the trace computed (a placeholder of the graph's inputs is not)."""
    return isinstance(value, FakeTensor) and id(value) not in inputs
