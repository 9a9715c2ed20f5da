"""A batch's signature: what of a batch decides which compiled graph takes it (its
structure, and each leaf's shape, dtype and device), and the error for a batch a graph
cannot take."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.capture.step_inputs import batch_leaf_names, flatten_batch
from remat.capture.train_graph import TrainGraph
from remat.errors import CaptureError

Signature = tuple[tuple[tuple[int, ...], Any, str], ...]


def signature(batch: Any) -> tuple[str, Signature]:
    """The batch's structure, as text, and each leaf's shape, dtype and device."""
    leaves, spec = flatten_batch(batch)
    sig = tuple(
        (tuple(leaf.shape), leaf.dtype, str(leaf.device)) if isinstance(leaf, torch.Tensor)
        else ((), float if isinstance(leaf, float) else type(leaf), "")  # a float: read at every call, any value
        for leaf in leaves
    )
    return str(spec), sig


def without_devices(sig: Signature) -> list[tuple[tuple[int, ...], str]]:
    """A signature without devices: what must be equal on every rank (each has its own device)."""
    return [(shape, str(dtype)) for shape, dtype, _ in sig]


def check_dtype_device(batch: Any, tg: TrainGraph) -> None:
    """An error naming the first leaf of `batch` whose dtype or device differs from the graph's."""
    leaves = pytree.tree_leaves(batch)
    for name, leaf, (_, dtype, device) in zip(batch_leaf_names(batch), leaves, tg.batch_signature()):
        if not isinstance(leaf, torch.Tensor):
            continue  # a float: read at every call, whatever graph takes it
        got_dtype = str(leaf.dtype).replace("torch.", "")
        if got_dtype != dtype or str(leaf.device) != device:
            raise CaptureError(
                f"{name} is {got_dtype} on {leaf.device}, but the step was compiled for {dtype} on {device}; "
                "convert the batch (e.g. .to(device, dtype)) or compile a new step"
            )
