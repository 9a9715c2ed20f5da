"""Where a value of the user's Python state lives (dynamo's `Source`): a global, a closure
cell, an attribute of a module or object, a key of a dict another slot holds, an argument
a `functools.partial` binds."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

MISSING = object()


@dataclass
class Slot:
    """Where a value is held: an attribute of a module or of a user's object, a key of a
    function's globals, a closure cell, a key of the dict another slot holds then, or a
    positional argument of a partial (a keyword one is a key of its keywords dict)."""

    name: str  # as an error shows it
    owner: Any
    key: str
    # A library object's field holding tensors (library_objects): read by the graph where
    # it reads them, never part of the watched values (the graph's inputs check their shapes).
    library: bool = False

    def place(self) -> tuple[int, str]:
        """Which place it is, whatever the path it was found by."""
        return (id(self.owner.get()) if isinstance(self.owner, Slot) else id(self.owner), self.key)

    def get(self) -> Any:
        if isinstance(self.owner, functools.partial):  # a positional argument it binds (key: its index)
            return self.owner.args[int(self.key)]
        if isinstance(self.owner, Slot):
            held = self.owner.get()
            return held.get(self.key, MISSING) if isinstance(held, dict) else MISSING
        if isinstance(self.owner, dict):
            return self.owner.get(self.key, MISSING)
        if isinstance(self.owner, types.CellType):
            try:
                return self.owner.cell_contents
            except ValueError:  # an empty cell
                return MISSING
        return vars(self.owner).get(self.key, MISSING)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, functools.partial):
            p, i = self.owner, int(self.key)
            p.__setstate__((p.func, (*p.args[:i], value, *p.args[i + 1 :]), p.keywords, p.__dict__ or None))
        elif isinstance(self.owner, Slot):
            Slot(self.name, self.owner.get(), self.key).set(value)
        elif value is MISSING:  # it was not there
            if isinstance(self.owner, dict):
                self.owner.pop(self.key, None)
            elif isinstance(self.owner, type):  # a class's attributes are a read-only mapping
                if self.key in vars(self.owner):
                    delattr(self.owner, self.key)
            elif not isinstance(self.owner, types.CellType):
                vars(self.owner).pop(self.key, None)
        elif isinstance(self.owner, dict):
            self.owner[self.key] = value
        elif isinstance(self.owner, types.CellType):
            self.owner.cell_contents = value
        else:
            setattr(self.owner, self.key, value)


def item_name(slot: Slot, index: str) -> str:
    """`index` after the name of what the slot holds: `state['seen'] (from the closure of step)`."""
    base, closure, fn = slot.name.partition(" (from the closure of ")
    return f"{base}{index}{closure}{fn}"


def fields_of(obj: Any) -> dict[str, Any] | None:
    """An object's attributes (None for one with __slots__ only)."""
    try:
        return vars(obj)
    except TypeError:
        return None
