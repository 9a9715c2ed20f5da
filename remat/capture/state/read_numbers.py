"""Floats the loop changes between steps, read at every call as graph inputs.

A plain float the step reads (a loss weight in a config object, a model's temperature, a
global) is a constant of the traced graph, so a loop that anneals it would get a compile
for every value. Once such a float has changed between steps, the runtime captures the
step again with it read as the optimizer's hyperparameters are (capture.hyperparams): a
0-dim float64 graph input, turned back into a Python scalar inside the trace (`.item()`, a
symbolic float), so the step's arithmetic on it is eager's, on the same double, bitwise.
From then on its value is read from where it is held at every call, and a new value costs
nothing.

A float the traced code compares with zero (`if self.aux_weight > 0:`, `if alpha:`) keeps
its sign from the capture, as a hyperparameter the update branches on does: the trace is
told the sign, and the step is compiled again only when the sign changes. A zero is held
as the constant it is (0.0 or -0.0), since what a symbol known to equal zero decides is
not always known to the tracer. A float it
branches on otherwise (`if alpha > 0.5`, `F.dropout`'s check that its rate is in [0, 1])
cannot be a symbol: it stays a constant of the graph, compiled again for each value as
before. What one trace learns of a field holds for that field of every object of its
class (every dropout's `p`), so a model of many layers costs a trace or two, not two per layer.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from remat.errors import CaptureError
from remat.capture.hyperparams import sign, traced_float
from remat.capture.state.python_state import Slot
from remat.capture.train_graph import InputKind, TrainGraph


@dataclass
class Reading:
    """The floats one capture reads at every call: where each is held, those still traced
    as symbols (a trace that trips on one leaves it a constant), and the signs the traces
    assume (those compared with zero)."""

    slots: dict[str, Slot]
    symbolic: dict[str, Slot] = field(default_factory=dict)
    signs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, slots: list[tuple[Slot, Any]], names: frozenset[str]) -> Reading:
        """The slots of `names` that hold a float now."""
        held = {slot.name: slot for slot, value in slots if slot.name in names and type(value) is float}
        return cls(held, dict(held))

    def tripped(self, branched: list[str], other_failure: bool) -> bool:
        """After a trace failed: each number it branched on (`branched`, names) keeps its
        sign from now on, or, where it had one already, is left a constant; on any other
        failure (`other_failure`: a use a symbol cannot take, `torch.tensor(alpha)`) every
        number is, as without them. True if the trace is worth running again."""
        hit = [name for name in branched if name in self.symbolic]
        # A trip on one field is taken as a trip on the same field of every object of its
        # class (each dropout's `p`): the same code reads them, and one trace per object
        # would cost a trace per layer. A sibling that would not have tripped is left a
        # sign or a constant early, compiled per value as before: slower, never wrong.
        kinds = {_kind(self.symbolic[name]) for name in hit}
        hit += [name for name, slot in self.symbolic.items() if name not in hit and _kind(slot) in kinds]
        for name in hit:
            if name in self.signs:
                del self.symbolic[name], self.signs[name]
            else:
                self.signs[name] = sign(self.symbolic[name].get())
        if hit or not (other_failure and self.symbolic):
            return bool(hit)
        self.symbolic.clear()
        self.signs.clear()
        return True

    def attach(self, tg: TrainGraph) -> None:
        """Where the graph's NUMBER inputs are read from, and the signs it assumes (a zero's
        input is not read: the graph holds the zero)."""
        tg.call.numbers = {i.name: self.slots[i.name] for i in tg.inputs if i.kind is InputKind.NUMBER}
        tg.call.number_signs = {name: s for name, s in self.signs.items() if name in self.symbolic}

    @contextlib.contextmanager
    def traced(self, tensors: dict[str, torch.Tensor], symbols: dict[str, str]) -> Iterator[None]:
        """While tracing: each number still a symbol is the `.item()` of its graph input
        (`tensors`, by name) in its slot, with its sign known where one is assumed, and a
        zero is itself; `symbols` is filled with each symbol's name, to name a branch the
        trace trips on. The floats are put back after."""
        saved = {name: slot.get() for name, slot in self.symbolic.items()}
        placed: dict[str, Any] = {}
        try:
            for name, slot in self.symbolic.items():
                if self.signs.get(name) == 0:
                    placed[name] = saved[name]  # the zero itself, with its sign bit
                    continue
                placed[name] = value = traced_float(tensors[name], name, self.signs.get(name), symbols)
                slot.set(value)
            yield
            for name, slot in self.symbolic.items():
                if slot.get() is not placed[name]:
                    raise CaptureError(
                        f"train_step changed {name} while it ran, which the loop also changes between steps; remat reads "
                        "it at every call. Change it in one place: between steps, or in the step only."
                    )
        finally:
            for name, slot in self.symbolic.items():
                slot.set(saved[name])


def _kind(slot: Slot) -> tuple[Any, ...]:
    """Which fields one piece of code reads alike: a field of an object, by its class and
    key; any other place (a global, a dict's key, a cell) is its own kind."""
    if isinstance(slot.owner, (Slot, dict, types.CellType, functools.partial, types.ModuleType)):
        return (slot.name,)
    return (type(slot.owner), slot.key)


def value(slot: Slot) -> torch.Tensor:
    """The graph input for a number read at every call, from its slot as it is now."""
    return torch.scalar_tensor(number(slot), dtype=torch.float64)


def number(slot: Slot) -> float:
    """A number read at every call, as it is now in its slot."""
    now = slot.get()
    if type(now) is not float:  # the step's cache key sees the type change first: a safeguard
        raise CaptureError(f"{slot.name} was a float when the step was compiled and is now {type(now).__name__}; compile a new step")
    return now


def key(value: Any, signed: bool) -> tuple[bool, int | None, str]:
    """What the cache key holds of a number read at every call: whether it is a float, its
    sign where the graph assumes it, and a zero itself (which the graph then holds)."""
    is_float = type(value) is float
    known = sign(value) if signed and is_float else None
    return (is_float, known, repr(value) if known == 0 else "")
