"""Tensors the step leaves in the user's state: `self.aux_loss = ...` in a mixture-of-experts
layer's forward, `self.last_logits = logits.detach()` in a trainer.

Traced once, the slot would hold a traced placeholder after capture, and nothing the
steps compute. So when the step's Python code ends, each slot of the user's state
(python_state's) that holds a tensor made by the trace, other than the graph input it
held, is noted and put back; the tensor becomes an output of the graph, and after each
run the slot is set to its value (detached: the step's autograd graph is freed by then,
as eager's is). A slot that held nothing before (a field the step creates) stays part of
the step's cache key: the step is compiled again once it holds a tensor. Tensors in a
list or dict the step changes stay refused (python_state).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch._subclasses.fake_tensor import FakeTensor

from remat.capture.state.python_state import MISSING, Slot


@dataclass(frozen=True)
class KeptTensor:
    """A slot set to the graph's next output after each run."""

    slot: Slot
    keyed: bool  # it held nothing before: its presence stays part of the cache key
    count = 1

    def where(self) -> str:
        return f"kept in {self.slot.name}"

    def replay(self, values: list[Any]) -> None:
        self.slot.set(values[0])


@contextlib.contextmanager
def setting(slots: Callable[[], list[tuple[Slot, Any]]], inputs: set[int]) -> Iterator[list[tuple[KeptTensor, Any]]]:
    """Around the step's Python code while it is traced: after it, each slot left holding a
    traced tensor other than what it held at the start (a graph input, `inputs` by id),
    with that tensor; each slot put back."""
    before = {slot.name: value for slot, value in slots()}
    set_: list[tuple[KeptTensor, Any]] = []
    traced = False
    try:
        yield set_
        traced = True
    finally:  # a trace that fails (one side of a value check tried) puts them back too
        for slot, value in slots():
            held = before.get(slot.name, MISSING)
            if isinstance(value, FakeTensor) and value is not held and id(value) not in inputs:
                if traced:
                    set_.append((KeptTensor(slot, keyed=held is MISSING), value))
                slot.set(held)
