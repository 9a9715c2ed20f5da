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

Targets flattened by a mask (`labels.masked_select(labels != pad)`, as Hugging Face's CTC
heads do) have a length that is the mask's count, a value. While the step is traced,
`masked_select` gives a stand-in, `remat::masked_select_flat`, of the inputs' full length;
where the stand-in is only ever CTC's targets, the loss reads the same values from a
static form instead: the selected elements moved to the front in their order (a stable
sort of the mask), and row b the `target_lengths[b]` of them from the row's offset, which
is where the kernel reads concatenated targets. The kernel then computes, per row, what
it computes on eager's flat targets: bitwise the same loss and gradient. Lengths that do
not add up to the mask's count raise as eager's kernel does (a branch on their values,
checked at every call, ops/value_checks.py). A stand-in that anything else reads is
refused after the trace (`flat_selections`), as `masked_select` was before.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from remat.ops.value_checks import KernelCheck

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


@torch.library.custom_op("remat::masked_select_flat", mutates_args=())
def masked_select_flat(source: torch.Tensor, mask: torch.Tensor, where: str) -> torch.Tensor:
    """masked_select's elements first, in order, then the rest: a stand-in of static length
    that the trace holds only where CTC's targets read it (`where`: the line that called it)."""
    return _selected_first(source, mask)


@masked_select_flat.register_fake
def _(source, mask, where):
    return source.new_empty(torch.broadcast_shapes(source.shape, mask.shape).numel())


MASKED_SELECT_FLAT = torch.ops.remat.masked_select_flat.default


def _selected_first(source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`source`'s elements where `mask` holds, in order, then the rest (flat; a stable sort of the mask)."""
    source, mask = torch.broadcast_tensors(source, mask)
    return source.reshape(-1)[torch.argsort(mask.reshape(-1).logical_not().to(torch.uint8), stable=True)]


def flat_selections(gm: torch.fx.GraphModule) -> list[str]:
    """Where a masked_select stand-in is read by anything (the line that made it), after
    the stand-ins nothing reads are dropped."""
    read = []
    for node in list(gm.graph.nodes):
        if node.target is MASKED_SELECT_FLAT:
            if node.users:
                read.append(node.args[2])
            else:
                gm.graph.erase_node(node)
    return read


def _rows_of_flat(source: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(batch, width) targets whose row b holds what CTC reads of concatenated targets for
    row b: `lengths[b]` elements of masked_select(source, mask) from the sum of the lengths
    before it. Width: the mask's last dimension (a row's length where each row is a sequence)."""
    mask = mask.expand(torch.broadcast_shapes(source.shape, mask.shape))
    count, width = mask.sum(), mask.shape[-1]
    if lengths.sum() != count:
        raise KernelCheck("Expected the targets' size at dimension 0, the number of elements masked_select selected, to be the sum of the target lengths (ctc_loss)")
    if (lengths > width).any():
        raise KernelCheck(
            f"remat holds CTC targets flattened by masked_select with rows of at most {width} (the mask's last "
            "dimension); a target length is longer. Pass the targets padded, (batch, length), with their lengths."
        )
    flat = _selected_first(source, mask)
    starts = lengths.cumsum(0) - lengths
    return flat[(starts[:, None] + torch.arange(width)).clamp_max(flat.numel() - 1)]


def _integral_and_mask(source: Any, mask: Any) -> bool:
    """Integers (as CTC's targets are) selected by a boolean mask."""
    tensors = isinstance(source, torch.Tensor) and isinstance(mask, torch.Tensor)
    return tensors and mask.dtype == torch.bool and not (source.is_floating_point() or source.is_complex())


class _FlatTargets(TorchFunctionMode):
    """masked_select of integers as its stand-in, remembering what it selected from."""

    def __init__(self, where_now: Callable[[], str]):
        super().__init__()
        self.where_now = where_now
        self.selected: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(stand-in) -> (it, source, mask)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - TorchFunctionMode's signature
        kwargs = kwargs or {}
        if func in (torch.masked_select, torch.Tensor.masked_select) and not kwargs and len(args) == 2 and _integral_and_mask(*args):
            out = masked_select_flat(args[0], args[1], self.where_now())
            self.selected[id(out)] = (out, args[0], args[1])
            return out
        return func(*args, **kwargs)

    def source_of(self, t: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        held = self.selected.get(id(t))
        return held[1:] if held is not None and held[0] is t else None


@contextlib.contextmanager
def static_shapes(where_now: Callable[[], str] = lambda: "") -> Iterator[None]:
    """torch.ctc_loss on padded targets, or targets flattened by masked_select, with tensor
    lengths, on the CPU, through ctc_loss_padded. `where_now`: the user's line calling now."""
    plain = torch.ctc_loss
    flat_targets = _FlatTargets(where_now)

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
        tensors = (log_probs, targets, input_lengths, target_lengths)
        on_cpu = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors) and log_probs.dim() == 3
        selected = flat_targets.source_of(targets)
        if on_cpu and selected is not None and target_lengths.dim() == 1:
            targets = _rows_of_flat(*selected, target_lengths)
        if not (on_cpu and targets.dim() == 2):
            return plain(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        loss = ctc_loss_padded(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]
        if zero_infinity:
            loss = torch.where(loss == float("inf"), torch.zeros((), dtype=loss.dtype), loss)
        if reduction == _REDUCTIONS["mean"]:
            return (loss / target_lengths.clamp_min(1).to(loss.dtype)).mean()
        return loss.sum() if reduction == _REDUCTIONS["sum"] else loss

    torch.ctc_loss = ctc_loss
    try:
        with flat_targets:
            yield
    finally:
        torch.ctc_loss = plain
