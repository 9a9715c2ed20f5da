"""Shape functions for ops whose torch meta function checks what only the CUDA kernel
needs: there the CPU kernel, run on zeros of the inputs' shapes, says what the op gives.

remat traces the step on fake tensors, whose shapes come from each op's meta function.
`aten._grouped_mm`'s (a mixture-of-experts layer's matrix products in `transformers`)
refuses float32, which the CPU kernel runs; eager PyTorch trains such a model in float32
on a CPU, so the trace must too. Only ops listed here, and only for inputs all on a CPU:
anywhere else the meta function decides as before."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode, run_fallback_kernel

aten = torch.ops.aten

# Ops whose meta function mirrors the CUDA kernel's dtype checks, with a CPU kernel that
# runs more (float32, float16): their outputs' shapes do not depend on the inputs' values.
CPU_KERNEL_SHAPES = frozenset({aten._grouped_mm.default})


def _listed(func: torch._ops.OpOverload) -> bool:
    return func in CPU_KERNEL_SHAPES


def _cpu_kernel_on_zeros(fake_mode: FakeTensorMode, func: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors) or any(isinstance(d, torch.SymInt) for t in tensors for d in t.shape):
        return NotImplemented  # the meta function decides
    return run_fallback_kernel(fake_mode, func, flat, spec, RuntimeError(f"{func} failed on zeros of its inputs' shapes"))


@contextlib.contextmanager
def cpu_kernels_as_shape_functions() -> Iterator[None]:
    """While the block runs, fake tensors take the listed ops' shapes from the CPU kernel.
    Afterwards torch decides as before: the fake tensors' dispatch cache, which every fake
    mode shares, forgets the outputs it kept for the listed ops."""
    entry = (_listed, _cpu_kernel_on_zeros)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
        for key in [k for k in FakeTensorMode.cache if k.key and _listed(k.key[0])]:
            del FakeTensorMode.cache[key]
