"""What a step's code sets up that remat makes ahead of it: what its first run sets once,
as eager's first step does, and the keys it makes in a defaultdict at every run.

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

Keys a step makes in a `defaultdict` by reading them (`history["loss"].append(loss.item())`,
`totals["loss"] += loss.item()`) are made at its every run, not its first only: eager's
step makes the key (an empty list, a zero), then logs or counts into it. A trace that
makes one would leave a placeholder there, so a capture whose first trace made keys in
the user's defaultdicts is refused (`MadeKeys`) and made again with those keys made first
(`with_keys_made`): the dict is then split by key as a plain one is (python_state), each
list a logged one, each number a counted one. The keys made for the capture are taken
out after it (`keys_made`); before each call's key is read, the runtime makes them where
missing, as the step's read would (`make_keys`): a dict emptied, or made anew, for an
epoch finds the graph compiled for the first.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from remat.capture.state.python_state import TEXT, StateWatch, copied, holds_traced_value
from remat.capture.state.slots import MISSING, NOT_PLAIN, Slot, frozen, item_name
from remat.errors import CaptureError
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
    changed = [w for w in watch.before.values() if _fingerprint(w.slot.get()) != _fingerprint(w.content) and not _kept(w)]
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


def _kept(w: Any) -> bool:
    """A number changed by counting, or a text the user's code sets (set again after each
    run whatever the slot held: `self.mode = "eval"`): kept_numbers', not a set-up."""
    now = w.slot.get()
    return (type(w.content) in _COUNTS and type(now) in _COUNTS) or (type(now) in TEXT and not w.slot.library)


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


class MadeKeys(CaptureError):
    """The first trace made keys in the user's defaultdicts (`keys`: a slot each, its owner
    the slot holding the dict). Its message is the refusal, where a capture made them first."""

    def __init__(self, message: str, keys: list[Slot]) -> None:
        super().__init__(message)
        self.keys = keys


def refuse_made_keys(watch: StateWatch) -> None:
    """After the first trace: MadeKeys for the keys it made in the user's defaultdicts,
    watched whole or split by key."""
    parents = [(w.slot, set(w.content)) for w in watch.before.values() if isinstance(w.content, dict)] + list(watch.split.values())
    made = [key for parent, before in parents for key in _new_keys(parent, before)]
    if made:
        raise MadeKeys(
            f"train_step made keys in a defaultdict as it read them ({', '.join(key.name for key in made[:5])}) while it "
            "was traced, and others when traced again with those made: remat makes the keys a step reads before each "
            "call, so they must be the same at every step. Log into a plain dict whose lists you make before compiling "
            "(history = {'loss': []}, then history['loss'].append(loss.item())).",
            made,
        )


def _new_keys(parent: Slot, before: set[Any]) -> list[Slot]:
    """The str keys the dict `parent` holds now and did not hold (`before`), where it is a defaultdict."""
    held = parent.get()
    if not isinstance(held, collections.defaultdict) or held.default_factory is None:
        return []
    return [Slot(item_name(parent, f"[{key!r}]"), parent, key) for key in held if key not in before and type(key) is str]


def with_keys_made(again: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps a capture function: where it is refused with MadeKeys, `again(*its arguments)`
    undoes what the refused capture set up, and it captures again with those keys made, its
    graph noting them (`call.default_keys`). Where that capture makes keys too, its MadeKeys
    is the refusal."""

    def wrap(capture: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(capture)
        def capturing(*args: Any, **kwargs: Any) -> Any:
            try:
                return capture(*args, **kwargs)
            except MadeKeys as refused:
                again(*args, **kwargs)
                with keys_made(refused.keys):
                    tg = capture(*args, **kwargs)
                tg.call.default_keys = refused.keys
                return tg

        return capturing

    return wrap


def make_keys(keys: list[Slot]) -> None:
    """Each key made where its dict, a defaultdict, lacks it: by reading it, as the step does."""
    for key in keys:
        held = key.owner.get()
        if isinstance(held, collections.defaultdict) and key.key not in held:
            held[key.key]  # noqa: B018 - the read makes the key (__missing__)


@contextlib.contextmanager
def keys_made(keys: list[Slot]) -> Iterator[None]:
    """The keys made while the block runs; those it made are taken out after."""
    missing = [key for key in keys if key.get() is MISSING]
    make_keys(keys)
    try:
        yield
    finally:
        for key in missing:
            key.set(MISSING)
