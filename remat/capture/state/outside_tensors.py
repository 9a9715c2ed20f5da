"""Tensors train_step uses that are not the model's, its optimizer's or the batch's.

A distillation step runs a frozen teacher held in a global or a trainer's field; an EMA
copy of the weights is updated in place after `optimizer.step()`; a loss reads a global
tensor of class weights; a regularizer walks a global list of the model's parameters.
Such tensors are found where python_state looks (the user's globals, closures and
objects, the modules those hold, the model's modules' own attributes), swapped for
placeholders while the step is traced, and become graph inputs of kind OUTSIDE: read
again from where they are held at every call, like the model's buffers, so that an
in-place write (an EMA update) reaches the user's tensor as in eager, and a tensor
changed between steps is the one the step reads. A tensor that is the model's own (a
list of its parameters) stands for the model's placeholder instead.

A library's object held in those places (a noise scheduler, an EMA helper) is looked into
too: its fields that hold a tensor or a list, tuple or dict of tensors, and those of the
library objects in its fields (python_state.library_tensors).
Not followed: tensors inside tuples other than plain ones and namedtuples, objects inside lists (but
modules), and objects deeper in a library's objects; a step that uses one is refused at capture, naming
the tensor's shape and the line that uses it.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, fake_tensor_tls

from remat.errors import CaptureError
from remat.capture.state import user_code
from remat.capture.state.slots import MISSING, Slot
from remat.capture.trace_checks import users_frame
from remat.capture.train_graph import InputKind

_MOST_ITEMS = 10_000  # a larger container is not searched
DEPTH = 3  # containers in containers


@dataclass(frozen=True)
class Location:
    """Where one tensor is held: the value of a slot, then keys from it: attribute names
    down a module (a parameter, a buffer, a plain attribute), list indices, dict keys."""

    slot: Slot
    path: tuple[Any, ...]
    name: str  # as an error shows it: "global TEACHER.fc.weight", "global EMA[3]"

    def get(self) -> Any:
        value = self.slot.get()
        for key in self.path:
            value = _child(value, key)
            if value is MISSING:
                break
        return value


def _child(holder: Any, key: Any) -> Any:
    if isinstance(holder, torch.nn.Module):
        return getattr(holder, key, MISSING)
    if isinstance(holder, dict):
        return holder.get(key, MISSING)
    if isinstance(holder, (list, tuple)) and isinstance(key, int) and key < len(holder):
        return holder[key]
    return MISSING


@dataclass(frozen=True)
class OutsideTensor:
    """One tensor outside the model that the graph reads, and every place it is held (a
    teacher's tied weight is held twice); the first is where it is read at each call."""

    name: str
    locations: tuple[Location, ...]

    def get(self) -> torch.Tensor:
        value = self.locations[0].get()
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"{self.name}, a tensor outside the model that the compiled step reads, is "
                f"{'gone' if value is MISSING else f'now a {type(value).__name__}'}; compile a new step (remat.compile) "
                "for what the step uses now."
            )
        return value


def find(slots: list[tuple[Slot, Any]]) -> dict[int, list[Location]]:
    """Every tensor held in the Python state the step can reach (python_state.state_slots),
    by id, with where it is held."""
    found: dict[int, list[Location]] = {}
    for slot, value in slots:
        for path, name, t in _tensors_in(value, (), slot.name, 0):
            found.setdefault(id(t), []).append(Location(slot, path, name))
    return found


def _tensors_in(value: Any, path: tuple[Any, ...], name: str, depth: int) -> Iterator[tuple[tuple[Any, ...], str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, name, value
    elif isinstance(value, torch.nn.Module):  # in a container too: python_state watches its attributes there
        for qualified, t in [*value.named_parameters(remove_duplicate=False), *value.named_buffers(remove_duplicate=False)]:
            yield (*path, *qualified.split(".")), f"{name}.{qualified}", t
    elif depth < DEPTH and isinstance(value, (list, tuple)) and len(value) <= _MOST_ITEMS:
        if isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_fields"):
            return  # a placeholder is put into a tuple by making it again (_put): a plain tuple or a namedtuple
        for i, v in enumerate(value):
            yield from _tensors_in(v, (*path, i), f"{name}[{i}]", depth + 1)
    elif depth < DEPTH and isinstance(value, dict) and len(value) <= _MOST_ITEMS:
        for k, v in value.items():
            if isinstance(k, (str, int)) or (type(k) is tuple and all(type(x) in (str, int, float, bool) for x in k)):  # a cache by (length, width)
                yield from _tensors_in(v, (*path, k), f"{name}[{k!r}]", depth + 1)


@contextlib.contextmanager
def swapped(held: dict[int, list[Location]], placeholders: dict[int, torch.Tensor]) -> Iterator[None]:
    """While the block runs (the step traced), wherever the user's state holds one of the
    step's tensors, its placeholder (`placeholders`: by the real tensor's id), which
    requires a gradient where the tensor does; everything put back after, in reverse order.
    A library's tensor found nowhere is a constant of the graph meanwhile (`library_constants`)."""
    undo: list[Callable[[], None]] = []
    try:
        for tid, locations in held.items():
            t = placeholders.get(tid)
            if t is None:
                continue
            real = locations[0].get()
            if t.is_leaf and real.requires_grad != t.requires_grad:
                t.requires_grad_(real.requires_grad)
            for location in locations:
                undo.append(_put(location, t))
        with library_constants():
            yield
    finally:
        for fn in reversed(undo):
            fn()


def _put(location: Location, t: torch.Tensor) -> Callable[[], None]:
    """Put `t` where `location` is; returns how to undo it. A tuple on the way (an LSTM's
    `(h, c)` in a dict) is made again with it, and set where the tuple was."""
    slot, path = location.slot, location.path
    holders = [slot.get()]
    for key in path[:-1]:
        holders.append(_child(holders[-1], key))
    depth = len(path)
    while depth > 0 and isinstance(holders[depth - 1], tuple):
        depth -= 1
        t = _with_item(holders[depth], path[depth], t)
    if depth == 0:
        old = slot.get()
        slot.set(t)
        return lambda: slot.set(old)
    holder, key = holders[depth - 1], path[depth - 1]
    if isinstance(holder, torch.nn.Module):
        for table in (holder._parameters, holder._buffers):
            if key in table:
                old = table[key]
                table[key] = t  # type: ignore[assignment]  # a placeholder where a Parameter was: as torch.func does
                return lambda: table.__setitem__(key, old)
        old = vars(holder)[key]
        vars(holder)[key] = t
        return lambda: vars(holder).__setitem__(key, old)
    old = holder[key]
    holder[key] = t
    return lambda: holder.__setitem__(key, old)


def _with_item(holder: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    items = [value if i == index else v for i, v in enumerate(holder)]
    return type(holder)(*items) if hasattr(holder, "_fields") else tuple(items)


@contextlib.contextmanager
def library_constants() -> Iterator[None]:
    """While the step is traced, a tensor a library's own code uses that remat finds nowhere
    it looks (a solver's coefficients kept in the library's module: torchdiffeq's
    Dormand-Prince tableau) is a constant of the graph, as make_fx holds one (an attribute of
    the graph module, read at each run); one the user's code uses stays refused, the error
    naming where remat looks (trace_failures)."""
    validate = FakeTensorMode.validate_and_convert_non_fake_tensors

    def validating(mode: FakeTensorMode, func: Any, converter: Any, flat_args: Any, args_spec: Any) -> Any:
        real = [a for a in flat_args if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)]
        frame = users_frame(traceback.extract_stack()) if real else None
        if frame is None or user_code.is_user_file(frame.filename) or any(t.requires_grad for t in real):
            # (one that requires a gradient would get none: eager would accumulate its .grad)
            return validate(mode, func, converter, flat_args, args_spec)
        before, fake_tensor_tls.allow_non_fake_inputs_override = fake_tensor_tls.allow_non_fake_inputs_override, True
        try:
            return validate(mode, func, converter, flat_args, args_spec)
        finally:
            fake_tensor_tls.allow_non_fake_inputs_override = before

    FakeTensorMode.validate_and_convert_non_fake_tensors = validating  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensorMode.validate_and_convert_non_fake_tensors = validate  # type: ignore[method-assign]


def check_no_gradient(outside: list[OutsideTensor], traced: list[torch.Tensor]) -> None:
    """Refuse a step whose backward reaches a tensor outside the model: eager would add to its
    `.grad` at every step (a teacher not frozen, nor run under no_grad), which the graph,
    returning only the model's gradients, would not."""
    for held, t in zip(outside, traced):
        if t.grad is not None:
            raise CaptureError(
                f"the step's backward computes a gradient for {held.name}, a tensor outside the model, which eager would "
                "accumulate into its .grad: run that part under torch.no_grad() (or .detach() its output) if it is not "
                "trained; if it is (a GAN's discriminator with its own optimizer), make it part of the model (a submodule "
                "or a parameter) trained by the step's optimizer: remat captures one model and one optimizer."
            )


def read_by_graph(inputs: list[Any], outside: list[OutsideTensor], device: str, own: dict[str, torch.Tensor]) -> dict[str, OutsideTensor]:
    """The tensors outside the model that the graph reads (by input name), each on the
    step's device and sharing no memory with the model's, optimizer's or batch's tensors
    (`own`, by name) nor with another of them."""
    by_name = {held.name: held for held in outside}
    storages = {storage_key(t): name for name, t in own.items()}
    storages.pop(None, None)
    out: dict[str, OutsideTensor] = {}
    for inp in inputs:
        if inp.kind is not InputKind.OUTSIDE:
            continue
        held = by_name[inp.name]
        if inp.device != device:
            raise CaptureError(
                f"the step reads {inp.name}, a tensor outside the model, on {inp.device}, while the model is on "
                f"{device}: move it to {device} before compiling."
            )
        key = storage_key(held.get())
        if key in storages:
            # The graph orders its ops by the values they read and write; a view of another input's
            # memory would be read before or after that input's in-place update regardless.
            raise CaptureError(
                f"the step reads {inp.name}, a tensor outside the model that shares its memory with {storages[key]} (a "
                "view or a .detach() of it): use that tensor itself in the step, or hold a .clone() of it."
            )
        if key is not None:
            storages[key] = inp.name
        out[inp.name] = held
    return out


def storage_key(t: torch.Tensor) -> int | None:
    """What tells two tensors sharing memory apart from two that do not (None: no memory of its own to share)."""
    if t.layout is not torch.strided or t.device.type == "meta" or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()
