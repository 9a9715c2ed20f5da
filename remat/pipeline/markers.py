"""Markers: an op that does nothing, placed while tracing so that the graph records where
the backward passes and the optimizer step began and which tensors were the gradients."""

from __future__ import annotations


import torch
import torch.fx




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
