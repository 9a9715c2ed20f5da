"""Keys a step makes in a `defaultdict` by reading them: `history["loss"].append(loss.item())`,
`totals["loss"] += loss.item()` into a `defaultdict(list)` or `defaultdict(float)`.

Eager's first step makes the key (an empty list, a zero) and then logs or counts into it.
A trace that makes it would leave a placeholder there, so a capture whose traces made keys
in a defaultdict of the user's is refused (`MadeKeys`) and captured once more with those
keys made first: the dict is then split by key as a plain one is (python_state), and each
key's list is a logged list (logged_numbers), each number a counted one (kept_numbers).
Compiling changes nothing in the user's objects, so the keys made for the capture are taken
out after it. At every call, before the step's key is read, the keys it reads are made
where missing, as the step's own read would make them: a dict emptied (or made anew) for an
epoch finds the graph compiled for the first.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

from remat.capture.state.slots import MISSING, Slot, item_name
from remat.errors import CaptureError


class MadeKeys(CaptureError):
    """The traces made keys in the user's defaultdicts (`keys`: a slot each, its owner the
    slot that holds the dict). Its message is the refusal, for a capture that made them first."""

    def __init__(self, message: str, keys: list[Slot]) -> None:
        super().__init__(message)
        self.keys = keys


def new_keys(parent: Slot, before: set[object]) -> list[Slot]:
    """The str keys the dict `parent` holds now and did not hold (`before`), where it is a defaultdict."""
    held = parent.get()
    if not isinstance(held, collections.defaultdict) or held.default_factory is None:
        return []
    return [Slot(item_name(parent, f"[{key!r}]"), parent, key) for key in held if key not in before and type(key) is str]


def make(keys: list[Slot]) -> None:
    """Each key made where its dict, a defaultdict, lacks it: by reading it, as the step does."""
    for key in keys:
        held = key.owner.get()
        if isinstance(held, collections.defaultdict) and key.key not in held:
            held[key.key]  # noqa: B018 - the read makes the key (__missing__)


@contextlib.contextmanager
def made(keys: list[Slot]) -> Iterator[None]:
    """The keys made while the block runs; those it made are taken out after."""
    missing = [key for key in keys if key.get() is MISSING]
    make(keys)
    try:
        yield
    finally:
        for key in missing:
            key.set(MISSING)
