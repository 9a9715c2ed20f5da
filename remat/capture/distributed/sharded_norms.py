"""Norms of FSDP2-sharded gradients, traced as DTensor computes them (`clip_grad_norm_`).

Under FSDP2 each gradient is a DTensor sharded on dim 0, and its norm is a *partial* value
(DTensor's `_NormPartial`): each rank holds the norm of its shard. DTensor keeps the value
partial through `torch.stack`, and before any other op reads it, it reduces it across the
ranks: for the 2-norm, `x ** 2`, an all-reduce (sum), `** 0.5`, elementwise. So
`clip_grad_norm_` (per-gradient norms, stacked, the norm of the stack, the clip
coefficient, the gradients multiplied by it) all-reduces the stacked vector of the
gradients' norms once, before the norm of norms.

While remat traces, the gradients are plain tensors on each rank's shard
(`sharded.local_view`). `ShardNorms`, a dispatch mode over the trace, does what DTensor
does: it marks the norms of sharded gradients partial, keeps them partial through
`stack`, and reduces a partial value with a traced all-reduce the moment another op reads
it. The graph then holds the collective, and the norm and the clipped gradients are
eager FSDP2's, bit for bit.

Only the 2-norm (every trainer's default) of evenly sharded gradients is built. Another
order is refused by name, and so is the norm of an unevenly sharded gradient: eager takes
it over a rank's own rows, the graph holds the padded shard (the same shape on every
rank), and a norm over trailing zero rows can differ from it in the last bit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat.capture.distributed.data_parallel import ALL_REDUCE, WAIT
from remat.errors import CaptureError

_aten = torch.ops.aten
NORM_OPS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)
# In-place scaling of the gradients by a number or a reduced (replicated) tensor: the same
# on each shard as on the whole (clip_grad_norm_'s last step).
SCALING_OPS = (_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar, _aten.mul_.Tensor, _aten.mul_.Scalar)


class ShardNorms(TorchDispatchMode):
    """See the module's docstring. `grads()` maps the id of each sharded parameter's gradient
    (as the trace holds it now) to the parameter's name and whether it is sharded unevenly."""

    def __init__(self, grads: Callable[[], dict[int, tuple[str, bool]]], group_name: str):
        super().__init__()
        self.grads, self.group_name = grads, group_name
        self.partial: dict[int, torch.Tensor] = {}  # id -> a partial 2-norm (held: ids stay unique)
        self.reduced: dict[int, torch.Tensor] = {}  # id of a partial value -> its reduction

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in NORM_OPS:
            grads = self.grads()
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            ours = [id(t) in grads for t in tensors]
            if tensors and all(ours):
                return self._norms(func, args, kwargs, [grads[id(t)] for t in tensors])
            if any(ours):  # sharded gradients beside other tensors: no DTensor placement says what that is
                raise CaptureError(
                    "train_step takes norms of sharded gradients together with other tensors in one call; under FSDP2 "
                    "remat reduces the norms of the gradients alone across the ranks: take those in a call of their own"
                )
        elif func is _aten.stack.default and args[0] and all(id(t) in self.partial for t in args[0]):
            return self._mark(func(*args, **kwargs))
        if self.partial:
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._reduced, (args, kwargs))
        return func(*args, **kwargs)

    def _norms(self, func: Any, args: tuple, kwargs: dict, params: list[tuple[str, bool]]) -> Any:
        names = ("ord", "dim", "keepdim", "dtype") if func is _aten.linalg_vector_norm.default else ("ord", "dtype")
        given = dict(zip(names, args[1:]), **kwargs)
        order = given.get("ord", 2)
        if float(order) != 2.0 or given.get("dim") is not None:
            raise CaptureError(
                f"train_step takes a {order}-norm of sharded gradients (over dims {given.get('dim')}); under FSDP2 remat "
                "reduces across the ranks only the 2-norm of whole gradients (clip_grad_norm_'s default): use norm_type=2"
            )
        uneven = [name for name, is_uneven in params if is_uneven]
        if uneven:
            raise CaptureError(
                f"train_step takes the norm of the gradient of {uneven[0]}, which FSDP2 shards unevenly (its first dimension "
                "is not a multiple of the world size): remat holds it padded, and a norm over the padding could differ from "
                "eager's in the last bit. Pad that dimension to a multiple of the world size (a vocabulary: "
                "model.resize_token_embeddings(n, pad_to_multiple_of=world_size)), or do not clip"
            )
        out = func(*args, **kwargs)
        if isinstance(out, (list, tuple)):
            for t in out:
                self._mark(t)
            return out
        return self._mark(out)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        self.partial[id(t)] = t
        return t

    def _reduced(self, t: torch.Tensor) -> torch.Tensor:
        """A partial 2-norm as DTensor makes it whole: squared, summed over the ranks, rooted."""
        if id(t) not in self.partial:
            return t
        done = self.reduced.get(id(t))
        if done is None:
            summed = WAIT(ALL_REDUCE(torch.pow(t, 2.0), "sum", self.group_name))
            done = self.reduced[id(t)] = torch.pow(summed, 0.5)
        return done


@contextlib.contextmanager
def norms_across_shards(sharding: Any, traced_params: dict[str, torch.Tensor], real_params: dict[str, torch.Tensor]) -> Iterator[None]:
    """While tracing a sharded model's step: `ShardNorms` over it (nothing for other models)."""
    if sharding is None:
        yield
        return
    uneven_of_local = {id(sp.local): sp.full_rows % sharding.world_size != 0 for sp in sharding.params}
    uneven = {n: uneven_of_local[id(p)] for n, p in real_params.items() if id(p) in uneven_of_local}

    def grads() -> dict[int, tuple[str, bool]]:
        return {id(g): (n, uneven[n]) for n, p in traced_params.items() if n in uneven and (g := p.grad) is not None}

    with ShardNorms(grads, sharding.group_name):
        yield
