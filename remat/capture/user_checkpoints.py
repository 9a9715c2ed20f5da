"""The user's own `torch.utils.checkpoint` calls, run as plain calls while the step is traced.

Traced as they are, a checkpointed region is copied into the backward pass, and the
generator state that checkpoint restores before recomputing it is restored at trace time
only: a dropout in the region then draws new numbers when the graph runs, and the
gradients differ from eager's without any error. Run as a plain call, the region is in
the forward graph once, and remat plans its recomputation with every other activation (a
recomputed random op replays its draws). The values are eager's: a checkpoint that
preserves the RNG state recomputes exactly what its forward computed. One that does not
(`preserve_rng_state=False`) draws new numbers in eager too, and is traced as it is. A
reentrant checkpoint none of whose inputs requires grad gives no gradient to the
parameters inside, in eager: run under no_grad, as there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils.checkpoint as ckpt


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    reentrant = ckpt.CheckpointFunction
    own_apply = reentrant.__dict__.get("apply")
    apply = reentrant.apply
    generator = ckpt._checkpoint_without_reentrant_generator

    def plain_apply(function: Any, preserve: bool, *args: Any) -> Any:
        if not preserve:
            return apply(function, preserve, *args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # The reentrant checkpoint is an autograd.Function: with no input that requires
            # grad its outputs require none, and the parameters inside get no gradient.
            with torch.no_grad():
                return function(*args)
        return function(*args)

    def plain_generator(fn: Any, preserve_rng_state: bool = True, *rest: Any, **kwargs: Any) -> Iterator[None]:
        # checkpoint() calls the function between the generator's two steps.
        if not preserve_rng_state:
            yield from generator(fn, preserve_rng_state, *rest, **kwargs)
            return
        yield

    reentrant.apply = plain_apply  # type: ignore[method-assign]
    ckpt._checkpoint_without_reentrant_generator = plain_generator
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = generator
        if own_apply is None:
            del reentrant.apply
        else:
            reentrant.apply = own_apply  # type: ignore[method-assign]
