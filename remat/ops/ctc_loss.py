"""CTC loss with a shape the trace can know.

`torch.ctc_loss` with the lengths as tensors (as `nn.CTCLoss` is called) runs
`aten._ctc_loss.Tensor`, whose second output, the forward variables `log_alpha` its
backward reads, is `(batch, time, 2 * max(target_lengths) + 1)`: a shape that depends on
the lengths' values, which a trace on fake tensors refuses. With the targets padded to
`(batch, S)`, `remat::ctc_loss_padded` runs the same kernel and gives `log_alpha` the
width `2 * S + 1` (what it is where the longest target fills the padding), the columns
beyond the kernel's filled with -inf, which its backward, reading by the lengths, never
reaches: the loss and the gradient are eager's, bitwise (tests/test_ctc_loss.py). Where
the longest target is shorter than S, the kernel's own `log_alpha` is a temporary the
memory model does not see (it is copied into the wider one).

`static_shapes()`, around the step while it is traced, makes `torch.ctc_loss` (which
`nn.functional.ctc_loss` calls) use it for CPU tensors of that form, with the reduction
done as ATen's `ctc_loss` does it; other calls go to torch's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

aten = torch.ops.aten
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@torch.library.custom_op("remat::ctc_loss_padded", mutates_args=())
def ctc_loss_padded(
    log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int, zero_infinity: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    nll, alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    width = 2 * targets.shape[1] + 1
    padded = alpha.new_full((*alpha.shape[:2], width), float("-inf"))
    padded[..., : alpha.shape[2]] = alpha
    return nll, padded


@ctc_loss_padded.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    time, batch = log_probs.shape[:2]
    return log_probs.new_empty(batch), log_probs.new_empty(batch, time, 2 * targets.shape[1] + 1)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    log_probs, targets, input_lengths, target_lengths, ctx.blank, ctx.zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths, *output)


def _backward(ctx: Any, grad_nll: torch.Tensor, _grad_alpha: Any) -> tuple:
    log_probs, targets, input_lengths, target_lengths, nll, alpha = ctx.saved_tensors
    grad = aten._ctc_loss_backward.Tensor(grad_nll, log_probs, targets, input_lengths, target_lengths, nll, alpha, ctx.blank, ctx.zero_infinity)
    return grad, None, None, None, None, None


ctc_loss_padded.register_autograd(_backward, setup_context=_setup_context)


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """torch.ctc_loss on padded targets with tensor lengths, on the CPU, through ctc_loss_padded."""
    plain = torch.ctc_loss

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
        tensors = (log_probs, targets, input_lengths, target_lengths)
        if not (all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors) and log_probs.dim() == 3 and targets.dim() == 2):
            return plain(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        loss = ctc_loss_padded(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]
        if zero_infinity:
            loss = torch.where(loss == float("inf"), torch.zeros((), dtype=loss.dtype), loss)
        if reduction == _REDUCTIONS["mean"]:
            return (loss / target_lengths.clamp_min(1).to(loss.dtype)).mean()
        return loss.sum() if reduction == _REDUCTIONS["sum"] else loss

    torch.ctc_loss = ctc_loss
    try:
        yield
    finally:
        torch.ctc_loss = plain
