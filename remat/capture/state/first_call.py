"""What a step's code sets up on its first run only, as eager's first step does.

A step may change Python state on its first run and never again: a warn-once flag
(`if not self._warned: warnings.warn(...); self._warned = True`), a config made lazily
(`if self._plan is None: self._plan = {...}`), a library's table filled at its first call
(einops' backends, when the library is not among the installed packages). Eager's later
steps take the other branch and change nothing, and so does the graph, traced as they run.

The first trace shows the change. A trace from the state it left that changes none of
those slots again tells it from a counter (changed at every step: kept_numbers) or a
toggle: it is a set-up, and that second trace is the graph. Compiling changes nothing in
the user's objects, so the watch puts the state back; the change is made when the step
first runs (`make`, before its key is read), and the key it is cached under is read with
the change made (`applied`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from remat.capture.state.python_state import NOT_PLAIN, StateWatch, copied, frozen, holds_traced_value
from remat.capture.state.slots import Slot
from remat.ops.op_facts import is_random

_MOST_ITEMS = 1024
_COUNTS = (int, float)  # a number that changes by counting is kept_numbers', not a set-up


@dataclass
class SetUp:
    """A value the step's first run leaves in a slot, to be left there when the graph first runs."""

    slot: Slot
    value: Any  # containers copied: the watch puts the slot's own container back as it was


def traced_as_set_up(watch: StateWatch, retrace: Callable[[], Any], first: Any) -> tuple[Any, list[SetUp]]:
    """After the first trace (`first`, its graph): (a trace from the state it left, the
    set-ups) where the watched slots it changed (but for counted numbers) are all left as
    they are by that trace, or (None, []) where none changed, or one changed again (the
    slots then as the first trace left them), or one holds a traced value, or the first
    trace drew random numbers the second does not (a set-up that draws them: the graph
    could not draw them at the first run)."""
    changed = [w for w in watch.before.values() if _fingerprint(w.slot.get()) != _fingerprint(w.content) and not _counted(w)]
    if not changed or any(_traced(w.slot.get()) for w in changed):
        return None, []
    left = [copied(w.slot.get()) for w in changed]
    after_first = [_fingerprint(w.slot.get()) for w in changed]
    gm = retrace()
    if [_fingerprint(w.slot.get()) for w in changed] != after_first or _draws(gm) != _draws(first):
        for w, value in zip(changed, left):  # as the first trace left them: the checks after it judge that change
            _put(w.slot, value)
        return None, []
    watch.set_up |= {w.slot.name for w in changed}
    return gm, [SetUp(w.slot, copied(w.slot.get())) for w in changed]


def _draws(gm: Any) -> int:
    return sum(1 for n in gm.graph.nodes if is_random(n))


def make(set_ups: list[SetUp]) -> None:
    """Leave each slot holding its set-up value (a container the slot holds is refilled in place)."""
    for s in set_ups:
        _put(s.slot, copied(s.value))


@contextlib.contextmanager
def applied(set_ups: list[SetUp]) -> Iterator[None]:
    """The set-ups made while the block runs, the slots put back after."""
    held = [(s.slot, copied(s.slot.get())) for s in set_ups]
    make(set_ups)
    try:
        yield
    finally:
        for slot, value in reversed(held):
            _put(slot, value)


def _put(slot: Slot, value: Any) -> None:
    now = slot.get()
    if type(now) is type(value) and isinstance(now, (list, dict, set)):
        now.clear()
        now.extend(value) if isinstance(now, list) else now.update(value)
    else:
        slot.set(value)


def _traced(value: Any, depth: int = 0) -> bool:
    """Whether a value made while tracing holds a traced tensor or number, in a container or
    in an object's fields (a cache object made at the first call): never left in the user's state."""
    if holds_traced_value(value, True):
        return True
    fields = getattr(value, "__dict__", None) if not isinstance(value, type) else None
    if depth < 3 and isinstance(fields, dict) and len(fields) <= _MOST_ITEMS:
        return any(_traced(v, depth + 1) for v in fields.values())
    if depth < 3 and isinstance(value, (list, tuple, dict)) and len(value) <= _MOST_ITEMS:
        return any(_traced(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def _counted(w: Any) -> bool:
    now = w.slot.get()
    return type(w.content) in _COUNTS and type(now) in _COUNTS


def _fingerprint(value: Any, depth: int = 0) -> Any:
    """What tells two states of a slot apart: its frozen copy, or for a container of other
    objects, its items by identity; any other object by identity."""
    f = frozen(value)
    if f is not NOT_PLAIN:
        return f
    if depth < 3 and isinstance(value, dict) and len(value) <= _MOST_ITEMS:
        return (dict, tuple((_fingerprint(k, depth + 1), _fingerprint(v, depth + 1)) for k, v in value.items()))
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= _MOST_ITEMS:
        return (type(value), tuple(_fingerprint(v, depth + 1) for v in value))
    return ("object", id(value))
