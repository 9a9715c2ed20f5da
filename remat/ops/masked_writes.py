"""Writes to tensors that existed before a block, masked: while `masked_writes(skip)` is
entered (under make_fx), every op that writes into a tensor made before the block (a
parameter, its gradient, an optimizer's state) runs on a copy, and the tensor takes the
copy's values only where `skip` is false: `t.copy_(torch.where(skip, t, copy))`, which
selects, bit for bit, the written values or the old ones. Tensors the block makes for
itself are written as they are. This holds a block that eager skips by a Python branch on
a tensor's value (GradScaler's skipped update: capture/optim/optimizer_state.py) in one graph.

So the block costs its ops whether or not it is skipped, and each write holds one
temporary as large as what it writes, as the out-of-place op would (a multi-tensor op is
split so that its copies hold no more than its largest tensor's).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree


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
    """While inside: writes to tensors made before take effect only where `skip` (a
    0-dim bool tensor) is false."""
    with _MaskedWrites(skip):
        yield
