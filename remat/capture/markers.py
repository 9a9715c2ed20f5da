"""Markers: an op that does nothing, placed while tracing so that the graph records where
the backward passes and the optimizer step began and which tensors were the gradients."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx

from remat.errors import CaptureError
from remat.capture.distributed import data_parallel




@torch.library.custom_op("remat::marker", mutates_args=())
def marker(tensors: list[torch.Tensor], tag: str) -> None:
    """Does nothing; its place in the trace records where something happened."""
    return None


@marker.register_fake
def _marker_fake(tensors: list[torch.Tensor], tag: str) -> None:
    return None


MARKER = torch.ops.remat.marker.default


RECORD_FUNCTION_OPS = {
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


@contextlib.contextmanager
def marking_passes(
    t_params: dict[str, torch.Tensor], grad_order: list[str], calls: dict[str, int],
    dp: data_parallel.DataParallel | None, synced: list[bool],
) -> Iterator[None]:  # fmt: skip
    """`torch.autograd.backward` as traced: markers around it, and for a DDP model whose last
    forward syncs gradients, their average over the ranks. And `torch.autograd.grad` for the
    model's parameters without `create_graph` (the step then sets `p.grad` itself): a
    backward pass too, marked so, its gradients those it returns for the parameters."""
    real_backward, real_grad = torch.autograd.backward, torch.autograd.grad
    names = {id(t): n for n, t in t_params.items()}

    def no_update_yet() -> None:
        if calls["updates"]:
            raise CaptureError(
                "train_step runs a backward pass after an optimizer update (updates in turns, as a GAN's discriminator "
                "then generator): remat captures steps whose updates all come after their last backward pass. Compile "
                "each turn as a step of its own, with its own optimizer, and call them one after the other: "
                "remat.compile(d_step, model, opt_d, batch) and remat.compile(g_step, model, opt_g, batch), each step "
                "calling model.zero_grad() before its backward (the other turn's gradients are then cleared, as eager's "
                "next turn clears them)."
            )

    def grad(outputs, inputs, *a, **k):  # type: ignore[no-untyped-def]
        seq = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        if k.get("create_graph") or not any(id(t) in names for t in seq):
            return real_grad(outputs, inputs, *a, **k)  # a gradient penalty's, or the batch's (adversarial training)
        if dp is not None:
            raise CaptureError(
                "train_step takes the gradients of a DistributedDataParallel model's parameters with torch.autograd.grad, "
                "which DDP does not average across ranks; call loss.backward() instead"
            )
        no_update_yet()
        calls["backward"] += 1
        marker([outputs] if isinstance(outputs, torch.Tensor) else list(outputs), "backward_begin")
        result = real_grad(outputs, inputs, *a, **k)
        named = [(names[id(t)], g) for t, g in zip(seq, result) if id(t) in names and g is not None]
        grad_order[:] = [n for n, _ in named]
        marker([g for _, g in named], "grads")
        return result

    def backward(tensors, *a, **k):  # type: ignore[no-untyped-def]
        # Several calls: micro-batches accumulating into the same gradients, then one update.
        no_update_yet()
        calls["backward"] += 1
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        marker(roots, "backward_begin")
        real_backward(tensors, *a, **k)
        if dp is not None and synced and synced[-1]:
            reduce_across_ranks(dp, t_params, calls)
        synced.clear()
        named = [(n, p.grad) for n, p in t_params.items() if p.grad is not None]
        grad_order[:] = [n for n, _ in named]  # the last backward's: the gradients the update reads
        marker([g for _, g in named], "grads")

    torch.autograd.backward, torch.autograd.grad = backward, grad
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = real_backward, real_grad


def marking_updates(calls: dict[str, int]) -> Callable[..., Any]:
    """An optimizer step pre-hook that marks where the update begins (and counts it). A
    step given a closure (forward and backward, as Lightning's loop passes them) runs the
    closure inside step(), before the update: the mark then follows the closure."""

    def update_begins() -> None:
        calls["updates"] += 1
        marker([], "optimizer_begin")

    def hook(opt, args, kwargs):  # type: ignore[no-untyped-def]
        # args as step() got them: the optimizer, then the closure if passed by position
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            update_begins()
            return None

        def closure_then_update():  # type: ignore[no-untyped-def]
            out = closure()
            update_begins()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_update}
        return (args[0], closure_then_update, *args[2:]), kwargs

    return hook


def reduce_across_ranks(dp: data_parallel.DataParallel, t_params: dict[str, torch.Tensor], calls: dict[str, int]) -> None:
    """After a backward pass that DDP would sync: each reduced parameter's gradient averaged over the ranks."""
    calls["reduced"] += 1
    if calls["reduced"] > 1:
        raise CaptureError(
            "the step syncs gradients across ranks in more than one backward pass; run all but the last micro-batch "
            "under model.no_sync(), as DistributedDataParallel's documentation does for gradient accumulation"
        )
    names = [n for n in dp.reduced if t_params[n].grad is not None]
    data_parallel.check_unused(dp, names)
    for n, g in zip(names, data_parallel.reduce_gradients([t_params[n].grad for n in names], dp)):
        t_params[n].grad = g
