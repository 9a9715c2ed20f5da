"""The quick check at each call that the watched Python state is as a compiled graph's key
found it.

Finding the key walks the model's modules, the user's code and objects
(python_state.state_slots): milliseconds on a large model, at every call. The walk's
result depends only on what it read: the value in each slot, the keys of the dicts it
looked names up in, the model's tree of modules and the items of the containers it
looked into. `Guards` records those as identities (and keys) and checks them again
(dynamo's guards on object identity and dict contents, in Python): while they all hold,
the walk would find the same slots holding the same values, so the key is the same. A
mutable container and a tensor are frozen again (slots.frozen) and compared, a
float read at every call by its key (read_numbers). Where any check fails, the step walks
again (and finds the key itself, compiling where it is new); nothing is taken on trust.
"""

from __future__ import annotations

import operator
import types
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterable

import numpy as np
import torch

from remat.capture.state import library_objects, read_numbers
from remat.capture.state.slots import CONTAINERS, MISSING, PLAIN, Slot, fields_of, frozen

_SHALLOW = 64  # a container with more items is frozen again instead of compared item by item


@dataclass
class SameContents:
    """Dicts and other containers (lists, sets) whose items (a dict's keys and values) are
    the same objects as when recorded. Checked with C-level maps: tens of nanoseconds an
    item. A small dict's entries are looked up by key (a look-up costs less than walking
    many small dicts); a large one's keys and values are walked in order."""

    containers: list[Any]
    sizes: list[int]
    owners: list[dict[Any, Any]]  # a small dict's entries: the dict, once for each key
    keys: list[Any]
    walked: list[Any]  # the large dicts, then the containers but dicts
    walked_keys: list[Any]  # the large dicts' keys, in order
    items: list[Any]  # the small dicts' values, the large dicts' values, the others' items

    @classmethod
    def of(cls, containers: Iterable[Any]) -> SameContents:
        containers = list(containers)
        small = [c for c in containers if isinstance(c, dict) and len(c) <= _SMALL_DICT]
        large = [c for c in containers if isinstance(c, dict) and len(c) > _SMALL_DICT]
        others = [c for c in containers if not isinstance(c, dict)]
        out = cls(
            containers, list(map(len, containers)), [d for d in small for _ in d], [k for d in small for k in d],
            large + others, list(chain.from_iterable(large)), [],
        )  # fmt: skip
        out.items = out._items()
        return out

    def _items(self) -> list[Any]:
        return list(chain(
            map(operator.getitem, self.owners, self.keys),
            # (A scripted module's tables are torch.jit's own mappings: their values, too.)
            chain.from_iterable(c.values() if hasattr(c, "values") else c for c in self.walked),
        ))  # fmt: skip

    def hold(self) -> bool:
        """With the same sizes and every key found, a dict has the same keys."""
        if list(map(len, self.containers)) != self.sizes:
            return False
        if self.walked_keys and not same_objects(list(chain.from_iterable(c for c in self.walked if isinstance(c, dict))), self.walked_keys):
            return False
        try:
            items = self._items()
        except KeyError:
            return False
        return same_objects(items, self.items)


_SMALL_DICT = 16


@dataclass
class SameEntries:
    """Entries `holder[key]` that hold the same objects as when recorded (MISSING: absent),
    compared with C-level maps."""

    holders: list[Any]
    keys: list[Any]
    values: list[Any]
    absent_from: list[Any]  # each holder's `__contains__`, for the entries absent then
    absent_keys: list[Any]

    @classmethod
    def of(cls, entries: Iterable[tuple[Any, Any, Any]]) -> SameEntries:
        out = cls([], [], [], [], [])
        for holder, key, value in entries:
            if value is MISSING:
                out.absent_from.append(holder.__contains__)
                out.absent_keys.append(key)
            else:
                out.holders.append(holder)
                out.keys.append(key)
                out.values.append(value)
        return out

    def hold(self) -> bool:
        try:
            now = list(map(operator.getitem, self.holders, self.keys))
        except KeyError:
            return False
        return same_objects(now, self.values) and not any(map(operator.call, self.absent_from, self.absent_keys))


def same_objects(now: list[Any], was: list[Any]) -> bool:
    """Item by item the same objects (not equal values: a tensor's == is elementwise)."""
    return len(now) == len(was) and all(map(operator.is_, now, was))


@dataclass
class Guards:
    same_object: list[tuple[Any, str, Any]] = field(default_factory=list)  # holder[key] is value (MISSING: absent)
    same_cell: list[tuple[types.CellType, Any]] = field(default_factory=list)
    same_items: SameContents | None = None  # containers it looked into, and the modules' tables of submodules
    same_frozen: list[tuple[Slot, Any]] = field(default_factory=list)  # mutable values and tensors, frozen
    same_key: list[tuple[Slot, Any]] = field(default_factory=list)  # numbers read at every call: their key by `rules`
    rules: read_numbers.KeyRules = field(default_factory=read_numbers.KeyRules)
    # same_object, and the keys of the dicts the walk looked names up in, in forms
    # compared by C-level maps (_flat_checks)
    _checks: tuple[Any, ...] = field(default=(SameEntries([], [], [], [], []), [], [], [], []), repr=False)

    @classmethod
    def of(
        cls, model: torch.nn.Module, slots: list[tuple[Slot, Any]], skip: set[str], read: set[str], rules: read_numbers.KeyRules,
        library_read: frozenset[tuple[int, str]] = frozenset(),
    ) -> Guards:  # fmt: skip
        """The checks for what `slots` (python_state.state_slots, just walked) depend on:
        `skip` are left out of the key (updated by the step at every call), `read` are
        numbers read at every call (their key by `rules` only), `library_read` the library
        fields the traces read (a library's flag)."""
        g = cls(rules=rules)
        holders: dict[int, dict[Any, Any]] = {}
        # Containers whose items are compared: each module's table of submodules (the
        # model's, and another's held in a slot), and plain containers held in slots.
        looked_into: dict[int, Any] = {}
        for module in model.modules():
            holders[id(vars(module))] = vars(module)
            looked_into[id(module._modules)] = module._modules
            for t in [*module._parameters.values(), *module._buffers.values()]:  # their attributes (a flag, a kept tensor)
                if t is not None:
                    holders[id(vars(t))] = vars(t)
        for slot, value in slots:
            if slot.library:
                if slot.name not in skip and library_objects.read_by_trace(slot, library_read):
                    g.same_object.append((vars(slot.owner), slot.key, value))
                continue
            if isinstance(value, torch.nn.Module):
                looked_into.update((id(m._modules), m._modules) for m in value.modules())
            holder = _holder(slot)
            if holder is not None:
                holders[id(holder)] = holder
            if isinstance(slot.owner, Slot):  # a key of a dict split by key: the dict, and where it is held
                parent, held = slot.owner, slot.owner.get()
                if isinstance(held, dict):
                    holders[id(held)] = held
                parent_holder = _holder(parent)
                if parent_holder is not None:
                    holders[id(parent_holder)] = parent_holder
                    g.same_object.append((parent_holder, parent.key, held))
                elif isinstance(parent.owner, types.CellType):
                    g.same_cell.append((parent.owner, held))
            if slot.name in read:  # an int the step counts up too: its key, not its value
                g.same_key.append((slot, rules.key(slot.name, value)))
                continue
            if slot.name in skip:
                continue
            if isinstance(slot.owner, types.CellType):
                g.same_cell.append((slot.owner, value))
            elif holder is not None and isinstance(slot.key, str):
                g.same_object.append((holder, slot.key, value))
            else:
                g.same_frozen.append((slot, frozen(value)))
                continue
            if isinstance(value, (list, dict, set)) and len(value) <= _SHALLOW:
                looked_into[id(value)] = value  # the same items: the same value, where they are plain
                if not _plain_items(value):
                    g.same_frozen.append((slot, frozen(value)))
            elif isinstance(value, (torch.Tensor, np.ndarray)) or (isinstance(value, CONTAINERS) and not _plain_items(value)):
                g.same_frozen.append((slot, frozen(value)))  # (an array changed in place is the same object)
        g.same_items = SameContents.of(looked_into.values())
        g._checks = _flat_checks(g.same_object, list(holders.values()))
        return g

    def hold(self) -> bool:
        entries, holders, sizes, contains, present = self._checks
        if not entries.hold():
            return False
        if list(map(len, holders)) != sizes or not all(map(operator.call, contains, present)):
            return False
        for cell, value in self.same_cell:
            try:
                if cell.cell_contents is not value:
                    return False
            except ValueError:
                return False
        if self.same_items is not None and not self.same_items.hold():
            return False
        if any(self.rules.key(slot.name, slot.get()) != key for slot, key in self.same_key):
            return False
        return all(frozen(slot.get()) == value for slot, value in self.same_frozen)


# A module's own tables (`_parameters`, `_modules`, its hook dicts, `training`): never
# deleted from a working module.
_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))


def _flat_checks(same_object: list[tuple[Any, str, Any]], holders: list[Any]) -> tuple[Any, ...]:
    """`same_object` as SameEntries, and the keys of `holders` as their sizes and the keys
    to find in them: with the same size, and every key present that was (those of
    `same_object` by their values, the rest here), a dict has the same keys. A module's
    own tables are taken as present."""
    held = {(id(h), key) for h, key, value in same_object if value is not MISSING}
    contains, present = [], []
    for h in holders:
        internal = _MODULE_FIELDS if "_modules" in h and "_parameters" in h else frozenset()
        for key in h:
            if (id(h), key) not in held and key not in internal:
                contains.append(h.__contains__)
                present.append(key)
    return SameEntries.of(same_object), holders, list(map(len, holders)), contains, present


def _holder(slot: Slot) -> dict[Any, Any] | None:
    """The dict a slot's value is looked up in: a function's globals, a module's or object's
    attributes (None: a closure cell, or a key of a dict another slot holds)."""
    if isinstance(slot.owner, dict):
        return slot.owner
    if isinstance(slot.owner, (Slot, types.CellType)):
        return None
    return fields_of(slot.owner)


def _plain_items(container: Any) -> bool:
    """Whether every item (every key and value of a dict) is a plain value, which cannot
    change in place: the same items are then the same value."""
    items = [x for kv in container.items() for x in kv] if isinstance(container, dict) else container
    return all(isinstance(x, PLAIN) for x in items)
