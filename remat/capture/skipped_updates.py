"""An update GradScaler skips when a gradient overflows, held in the graph.

`torch.amp.GradScaler.step` calls `optimizer.step()` only where its overflow check found
no inf or NaN: `if not sum(v.item() for v in found_inf_per_device.values())`, a Python
branch on tensor values that one captured graph cannot hold (a fused optimizer is handed
the check instead, and its kernel skips the update itself). While the step is traced, the
scaler's branch is replaced by the update run under `masked_writes(skip)`: every write the
update makes to a tensor that existed before it (a parameter, its gradient, the
optimizer's state) is made on a copy, and the tensor takes the copy's values only where
`skip` is false, `torch.where(skip, old, new)`, which selects, bit for bit, eager's
values on both sides. Tensors the update makes for itself are written as they are.

So the update costs its ops whether or not it is skipped, and each write holds one
temporary as large as what it writes, as the out-of-place op would (a multi-tensor op is
split so that its copies hold no more than its largest tensor's). After each run the
runtime reads the skip on the host, as eager's branch does, for what eager's Python does
on a skipped step (`SkippedSteps`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from remat.capture import optimizer_state, optimizers


def _written(func: torch._ops.OpOverload) -> list[int]:
    """Positions of the arguments `func` writes into (its schema's `Tensor(a!)`)."""
    return [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


class _MaskedWrites(TorchDispatchMode):
    def __init__(self, skip: torch.Tensor):
        super().__init__()
        self.skip = skip
        self.skip_on: dict[torch.device, torch.Tensor] = {skip.device: skip}
        self.made: dict[int, weakref.ref] = {}  # id -> tensor, for the tensors the update made (not views of older ones)
        # id -> (tensor, its value had the update not been skipped), for the one-element old tensors it wrote
        self.ahead: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def _is_old(self, t: Any) -> bool:
        made = self.made.get(id(t))
        return isinstance(t, torch.Tensor) and (made is None or made() is not t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - TorchDispatchMode's signature
        kwargs = kwargs or {}
        schema = func._schema
        positions = _written(func)
        bound = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        targets = [bound[i] for i in positions]
        olds = [t for target in targets for t in (target if isinstance(target, (list, tuple)) else [target]) if self._is_old(t)]
        if not olds:
            out = func(*pytree.tree_map(self._ahead, list(args)), **pytree.tree_map(self._ahead, kwargs))
            self._note_made(func, bound, out)
            return out
        if func.__name__.startswith("_foreach_") and not schema.returns:
            for chunk in _chunks(olds, args, kwargs):
                self._masked(func, *chunk)
            return None
        return self._masked(func, args, kwargs, olds)

    def _skip_on(self, device: torch.device) -> torch.Tensor:
        """The skip where `device`'s tensors are (a CPU step count beside CUDA gradients), copied there once."""
        if device not in self.skip_on:
            self.skip_on[device] = self.skip.to(device)
        return self.skip_on[device]

    def _ahead(self, x: Any) -> Any:
        """What the update reads for `x`: a one-element tensor it wrote (a step count) is read
        as the update wrote it, skipped or not, so that the update computes on a skipped
        step what it would have (`1 - beta1 ** step` is never zero: Python's division by it
        would raise). Its values are the same where it is not skipped, and discarded where
        it is."""
        held = self.ahead.get(id(x)) if isinstance(x, torch.Tensor) else None
        return held[1] if held is not None and held[0]() is x else x

    def _masked(self, func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any], olds: list[torch.Tensor]) -> Any:
        """`func` run on copies of the old tensors it writes; each then takes its copy's values where no skip."""
        copies = {id(t): self._ahead(t).clone() for t in olds}

        def swap(x: Any) -> Any:
            return copies.get(id(x), self._ahead(x)) if isinstance(x, torch.Tensor) else x

        out = func(*pytree.tree_map(swap, list(args)), **pytree.tree_map(swap, kwargs))
        for t in olds:
            t.copy_(torch.where(self._skip_on(t.device), t, copies[id(t)]))
            if t.numel() == 1:
                self.ahead[id(t)] = (weakref.ref(t), copies[id(t)])
        # An in-place op returns what it wrote into: give back the originals, not the copies.
        back = {id(copies[id(t)]): t for t in olds}
        return pytree.tree_map(lambda x: back.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    def _note_made(self, func: torch._ops.OpOverload, bound: list[Any], out: Any) -> None:
        """Record the op's new tensors as made by the update; a view of an older tensor
        (`is_view`'s outputs alias an input) is old as its base is."""
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        if aliases and any(self._is_old(t) for t in pytree.tree_leaves(bound)):
            return
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = weakref.ref(t)


def _chunks(olds: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[list[Any], dict[str, Any], list[torch.Tensor]]]:
    """A multi-tensor op's call split by positions into calls of its own (each list argument
    sliced alike) whose old tensors together are no larger than the largest one's: the copies
    then hold no more than the single-tensor update's largest. Each element is computed by
    the same kernel whatever the list's length, so the values are the whole call's."""
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    old_ids = {id(t) for t in olds}
    sized = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
    per_position = [sum(t.nbytes for a in sized for t in [a[i]] if isinstance(t, torch.Tensor) and id(t) in old_ids) for i in range(n)]
    cap = max(per_position)
    start, held = 0, 0
    for i in range(n + 1):
        if i == n or (held and held + per_position[i] > cap):
            part = slice(start, i)
            sliced = lambda a: list(a[part]) if isinstance(a, (list, tuple)) and len(a) == n else a  # noqa: E731
            chunk_args = [sliced(a) for a in args]
            chunk_kwargs = {k: sliced(v) for k, v in kwargs.items()}
            yield chunk_args, chunk_kwargs, [t for a in chunk_args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor) and id(t) in old_ids]
            start, held = i, 0
        if i < n:
            held += per_position[i]


@contextlib.contextmanager
def masked_writes(skip: torch.Tensor) -> Iterator[None]:
    """While inside: writes to tensors made before take effect only where `skip` is false."""
    with _MaskedWrites(skip):
        yield


@dataclass(frozen=True)
class SkippedSteps:
    """After each run, what follows from the skips the graph computed, as it follows in eager:
    an optimizer whose first update was skipped has no state (the state made ahead of the
    run is taken out: optimizer_state.drop_made_ahead), and a library's flag of a skipped
    step is set (Accelerate's `AcceleratedOptimizer.step_was_skipped`, which its scheduler
    and Hugging Face's Trainer read to skip the learning-rate step). The trace ran every
    update, so it left each flag unset."""

    optimizers: tuple[torch.optim.Optimizer, ...]  # one per value: the optimizer whose update it skips
    flags: tuple[tuple[Any, str] | None, ...]  # for each: (the wrapper, the attribute) it keeps the skip in
    keyed = True  # it holds no slot of the user's state

    @property
    def count(self) -> int:
        return len(self.optimizers)

    def where(self) -> str:
        return "skipped updates of " + ", ".join(type(o).__name__ for o in self.optimizers)

    def replay(self, values: list[Any]) -> None:
        for optimizer, flag, skipped in zip(self.optimizers, self.flags, values, strict=True):
            if bool(skipped):
                optimizer_state.drop_made_ahead(optimizer)
            if flag is not None:
                setattr(flag[0], flag[1], bool(skipped))


def _overflow_flag(wrapper: Any) -> str | None:
    """The attribute in which a library's optimizer wrapper keeps whether the scaler skipped its update."""
    accelerate = sys.modules.get("accelerate.optimizer")
    if accelerate is not None and isinstance(wrapper, accelerate.AcceleratedOptimizer):
        return "_is_overflow"
    return None


def skipped_steps(passed: Any, skips: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]]) -> tuple[list[SkippedSteps], list[list[torch.Tensor]]]:
    """The state update for the skips the trace recorded (by the id of the optimizer whose
    update was masked), with the values it takes from the graph; the wrappers' flags are
    looked for among the optimizers `passed` to the step (one, or a list)."""
    if not skips:
        return [], []
    wrappers = {id(optimizers.innermost(w)): w for w in (passed if isinstance(passed, (list, tuple)) else [passed])}
    flags = []
    for key in skips:
        wrapper = wrappers.get(key)
        attr = _overflow_flag(wrapper) if wrapper is not None else None
        flags.append((wrapper, attr) if attr is not None else None)
    return [SkippedSteps(tuple(o for o, _ in skips.values()), tuple(flags))], [[skip for _, skip in skips.values()]]


@contextlib.contextmanager
def skipped_in_graph(skips: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]]) -> Iterator[None]:
    """While the step is traced: GradScaler's skipped update is masked in the graph rather
    than branched on in Python; `skips` gets each masked optimizer's skip (by its id)."""

    def masked_step(scaler: torch.amp.GradScaler, optimizer: Any, per_optimizer: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        found = list(per_optimizer["found_inf_per_device"].values())
        skip = sum((f.to(found[0].device) for f in found[1:]), found[0]) != 0  # eager: `if not sum(f.item() ...)`
        inner = optimizers.innermost(optimizer)
        skips[id(inner)] = (inner, skip)
        with masked_writes(skip):
            return optimizer.step(*args, **kwargs)

    original = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = masked_step
    try:
        yield
    finally:
        torch.amp.GradScaler._maybe_opt_step = original
