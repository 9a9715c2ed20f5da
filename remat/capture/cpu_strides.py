"""Where fake tensors differ from CPU eager, and the dispatch mode that makes the trace
follow eager (used while capturing): kernels whose output strides their fake kernels
predict wrongly, views whose fake strides differ on dimensions of size 1, and CPU devices
with an index ("cpu:0")."""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import compute_elementwise_output_strides, make_channels_last_strides_for, make_contiguous_strides_for
from torch.utils._python_dispatch import TorchDispatchMode

from remat.capture.state import user_code

_BATCH_NORMS = (
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten._native_batch_norm_legit_no_training.default,
)
_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default


# CPU kernels whose first output's strides the fake kernels predict wrongly for
# non-contiguous operands (found by tests/test_randomized.py; the profiler refuses any
# other op whose real strides differ from the trace's):
# - always contiguous: the losses' backward (mse_loss.cpp: zeros_like(input,
#   LEGACY_CONTIGUOUS_MEMORY_FORMAT)), LayerNorm's backward, log_softmax's backward;
# - like the incoming gradient: dropout's backward (the fake kernel follows the mask).
_CPU_CONTIGUOUS_OUTPUT = (
    torch.ops.aten.mse_loss_backward.default,
    torch.ops.aten.smooth_l1_loss_backward.default,
    torch.ops.aten.huber_loss_backward.default,
    torch.ops.aten._log_softmax_backward_data.default,
)
# - elementwise ops whose fake kernels (Python decompositions) lay their output out after
#   another operand than the CPU kernel's TensorIterator, which follows the first among
#   operands of different layouts (an activation's backward with the gradient contiguous
#   and the input transposed):
_ELEMENTWISE_OPERAND_ORDER = (
    torch.ops.aten.softplus_backward.default,
    torch.ops.aten.hardswish_backward.default,
    torch.ops.aten.hardsigmoid_backward.default,
    torch.ops.aten.hardtanh_backward.default,
    torch.ops.aten.elu_backward.default,
    torch.ops.aten.logit_backward.default,
    torch.ops.aten.copysign.Tensor,
)
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default


def _like(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of empty_like(t) (memory format preserved), without tracing anything."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        return tuple(torch.empty_like(torch.empty_strided(t.shape, t.stride(), device="meta")).stride())


def _cpu_output_strides(func: Any, args: tuple) -> tuple[int, tuple[int, ...]] | None:
    """(output index, strides) the CPU kernel gives an output of `func`, where its fake
    kernel is known to predict others for non-contiguous inputs; None elsewhere."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None or x.device.type != "cpu":
        return None
    if func in _CPU_CONTIGUOUS_OUTPUT or (func is _LAYER_NORM_BACKWARD and args[7][0]):
        return 0, tuple(make_contiguous_strides_for(args[1].shape))
    if func is _DROPOUT_BACKWARD:
        return 0, _like(x)
    if func in _ELEMENTWISE_OPERAND_ORDER:
        return 0, tuple(compute_elementwise_output_strides(*(a for a in args if isinstance(a, torch.Tensor))))
    if func in _BATCH_NORMS or (func is _BATCH_NORM_BACKWARD and args[9][0]):
        x = args[1] if func is _BATCH_NORM_BACKWARD else args[0]
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            return 0, tuple(make_channels_last_strides_for(x.shape))
        return 0, tuple(make_contiguous_strides_for(x.shape))
    return None


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _eager_view_strides(args: tuple) -> tuple[int, tuple[int, ...]] | None:
    """The strides eager's view gives (its C++ stride computation, which a meta tensor's view
    runs too), where the fake view's own may differ on a dimension of size 1: a kernel that
    picks its output's memory format from its input's strides reads them (a CPU convolution
    after a permute and a reshape, at batch 1)."""
    x, shape = args[0], args[1]
    if not all(isinstance(v, int) for v in (*x.shape, *x.stride(), *shape)):
        return None
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        try:
            return 0, tuple(torch.empty_strided(x.shape, x.stride(), device="meta").view(shape).stride())
        except RuntimeError:  # not a view of these strides (an _unsafe_view's input was copied first)
            return None


# Ops whose fake outputs CpuLikeEager follows with a view of the real strides.
CORRECTED_STRIDES = frozenset(
    {*_BATCH_NORMS, _BATCH_NORM_BACKWARD, *_CPU_CONTIGUOUS_OUTPUT, *_ELEMENTWISE_OPERAND_ORDER, _LAYER_NORM_BACKWARD, _DROPOUT_BACKWARD}
)


class CpuLikeEager(TorchDispatchMode):
    """Give fake outputs of some CPU ops the strides the CPU kernels give real ones, and
    take a CPU device with an index as plain "cpu".

    BatchNorm's CPU kernels (forward and backward) allocate their first output in the
    input's suggested memory format (contiguous, or channels-last), and the CPU backward
    of mse/smooth_l1/huber losses always contiguous. Their fake kernels keep the strides
    of the input (or of the incoming gradient), which differ when those are not
    contiguous: BatchNorm1d on x.transpose(1, 2), a gradient that flows back through a
    transpose, a loss on a transposed output (pytorch/pytorch#192668). The trace would
    then record views that fail on real tensors ("view size is not compatible"), or
    layouts that change the order of summation: a step that crashes or does not match
    eager. Where they differ, the output is replaced by an `as_strided` view with the
    real strides: a no-op on the real output, and the rest of the trace follows real
    layouts. (The profiler checks every op's real strides against the trace on its first
    run, and refuses a graph where another op differs.)

    "cpu:0" is the CPU to eager PyTorch (`x.to("cpu:0")` gives a tensor on "cpu"), but
    another device to a fake tensor, which then refuses to meet the model's weights
    (Hugging Face's Trainer moves batches to "cpu:0" under DDP). Device arguments are
    traced as "cpu".
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu" and device.index is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        with user_code.torch_dispatch_unrecorded(func, types):
            out = func(*args, **kwargs)
        real = _eager_view_strides(args) if func in _VIEWS else _cpu_output_strides(func, args)
        if real is not None:
            i, want = real
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            y = outs[i]
            if isinstance(y, torch.Tensor) and tuple(y.stride()) != want:
                outs[i] = torch.ops.aten.as_strided.default(y, y.shape, want)
                out = tuple(outs) if isinstance(out, (tuple, list)) else outs[0]
        return out
