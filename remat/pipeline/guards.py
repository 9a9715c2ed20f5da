"""The quick check at each call that the watched Python state is as a compiled graph's key
found it.

Finding the key walks the model's modules, the user's code and objects
(python_state.state_slots): milliseconds on a large model, at every call. The walk's
result depends only on what it read: the value in each slot, the keys of the dicts it
looked names up in, the model's tree of modules and the items of the containers it
looked into. `Guards` records those as identities (and keys) and checks them again
(dynamo's guards on object identity and dict contents, in Python): while they all hold,
the walk would find the same slots holding the same values, so the key is the same. A
mutable container and a tensor are frozen again (python_state.frozen) and compared, a
float read at every call by its key (read_numbers). Where any check fails, the step walks
again (and finds the key itself, compiling where it is new); nothing is taken on trust.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.pipeline import read_numbers
from remat.pipeline.python_state import frozen
from remat.pipeline.slots import MISSING, Slot, fields_of

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_SHALLOW = 64  # a container with more items is frozen again instead of compared item by item


@dataclass
class Guards:
    same_object: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)  # holder[key] is value (MISSING: absent)
    same_cell: list[tuple[types.CellType, Any]] = field(default_factory=list)
    same_keys: list[tuple[dict[Any, Any], tuple[Any, ...]]] = field(default_factory=list)  # dicts the walk looked names up in
    same_items: list[tuple[Any, tuple[int, ...]]] = field(default_factory=list)  # containers it looked into: their items' ids
    same_frozen: list[tuple[Slot, Any]] = field(default_factory=list)  # mutable values and tensors, frozen
    same_key: list[tuple[Slot, bool, Any]] = field(default_factory=list)  # floats read at every call: read_numbers.key

    @classmethod
    def of(
        cls, model: torch.nn.Module, slots: list[tuple[Slot, Any]], skip: set[str], read: set[str], signed: set[str],
    ) -> Guards:  # fmt: skip
        """The checks for what `slots` (python_state.state_slots, just walked) depend on:
        `skip` are left out of the key (updated by the step at every call), `read` are
        floats read at every call (their key only), `signed` those whose sign the graph assumes."""
        g = cls()
        holders: dict[int, dict[Any, Any]] = {}
        trees: dict[int, dict[str, Any]] = {}  # each module's table of submodules, the model's and another's held in a slot
        for module in model.modules():
            holders[id(vars(module))] = vars(module)
            trees[id(module._modules)] = module._modules
        for slot, value in slots:
            if slot.library:
                continue
            if isinstance(value, torch.nn.Module):
                trees.update((id(m._modules), m._modules) for m in value.modules())
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
            if slot.name in skip:
                continue
            if slot.name in read:
                g.same_key.append((slot, slot.name in signed, read_numbers.key(value, slot.name in signed)))
                continue
            if isinstance(slot.owner, types.CellType):
                g.same_cell.append((slot.owner, value))
            elif holder is not None and isinstance(slot.key, str):
                g.same_object.append((holder, slot.key, value))
            else:
                g.same_frozen.append((slot, frozen(value)))
                continue
            if isinstance(value, (list, dict, set)) and len(value) <= _SHALLOW:
                g.same_items.append((value, _ids(value)))  # the same items: the same value, where they are plain
                if not _plain_items(value):
                    g.same_frozen.append((slot, frozen(value)))
            elif isinstance(value, torch.Tensor) or (isinstance(value, _CONTAINERS) and not _plain_items(value)):
                g.same_frozen.append((slot, frozen(value)))
        g.same_keys = [(d, tuple(d)) for d in holders.values()]
        g.same_items += [(tree, _ids(tree)) for tree in trees.values()]
        return g

    def hold(self) -> bool:
        for holder, key, value in self.same_object:
            if holder.get(key, MISSING) is not value:
                return False
        for cell, value in self.same_cell:
            try:
                if cell.cell_contents is not value:
                    return False
            except ValueError:
                return False
        for d, keys in self.same_keys:
            if tuple(d) != keys:
                return False
        for container, ids in self.same_items:
            if _ids(container) != ids:
                return False
        for slot, signed, key in self.same_key:
            if read_numbers.key(slot.get(), signed) != key:
                return False
        return all(frozen(slot.get()) == value for slot, value in self.same_frozen)


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
    return all(isinstance(x, _PLAIN) for x in items)


def _ids(container: Any) -> tuple[int, ...]:
    if isinstance(container, dict):
        return tuple(id(x) for kv in container.items() for x in kv)
    return tuple(map(id, container))
