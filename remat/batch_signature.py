"""A batch's signature: what of a batch decides which compiled graph takes it (its
structure, each leaf's shape, dtype and device, and the plain values a graph reads), and
the error for a batch a graph cannot take."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.capture.batch_leaves import STAND_IN_TYPES, batch_leaf_names, flatten_batch, is_graph_leaf, is_plain_value, read_key
from remat.capture.train_graph import TrainGraph
from remat.errors import CaptureError

Signature = tuple[tuple[tuple[int, ...], Any, str], ...]


def signature(batch: Any, read: frozenset[int] = frozenset(), sides: dict[int, tuple[Any, ...]] | None = None) -> tuple[str, Signature]:
    """The batch's structure, as text, and each leaf's shape, dtype and where: a tensor's
    device; a plain value's (a str, an int) its value where a graph reads it (at a
    position in `read`), and its type alone, or for an int read at every call that a graph
    compares, which side of each comparison (`sides`: read_numbers.Condition) it is on."""
    leaves, spec = flatten_batch(batch)
    values = dict(read_key(leaves, read))
    sides = sides or {}
    sig = tuple(
        (tuple(leaf.shape), leaf.dtype, str(leaf.device)) if isinstance(leaf, torch.Tensor)
        else ((), int, tuple(c.holds(leaf) for c in sides[i])) if i in sides and i not in values and type(leaf) is int
        else ((), type(leaf), values.get(i, "")) if is_plain_value(leaf)
        else ((), float, "")  # a float: read at every call, any value
        for i, leaf in enumerate(leaves)
    )
    return str(spec), sig


def without_values(sig: Signature) -> Signature:
    """A signature without the plain values a graph reads: the batch's shape."""
    return tuple((shape, dtype, where if isinstance(dtype, torch.dtype) else "") for shape, dtype, where in sig)


def shapes_and_values(signatures: list[Signature], now: Signature) -> tuple[int, int]:
    """How many batch shapes the graphs of `signatures` take, and how many graphs the shape
    of `now` has (one per value of the plain values they read)."""
    return len(set(map(without_values, signatures))), len({s for s in signatures if without_values(s) == without_values(now)})


def values_read(batch: Any, read: frozenset[int]) -> list[str]:
    """The names of the batch's strs, bytes and ints a graph reads (at positions in `read`)."""
    leaves, _ = flatten_batch(batch)
    return [name for i, name in enumerate(batch_leaf_names(batch)) if i in read and type(leaves[i]) in STAND_IN_TYPES]


def without_devices(sig: Signature) -> list[tuple[tuple[int, ...], str]]:
    """A signature without devices: what must be equal on every rank (each has its own device)."""
    return [(shape, str(dtype)) for shape, dtype, _ in sig]


def check_dtype_device(batch: Any, tg: TrainGraph) -> None:
    """An error naming the first leaf of `batch` whose dtype or device differs from the graph's."""
    named = [(name, leaf) for name, leaf in zip(batch_leaf_names(batch), pytree.tree_leaves(batch)) if is_graph_leaf(leaf)]
    for (name, leaf), (_, dtype, device) in zip(named, tg.batch_signature()):
        if not isinstance(leaf, torch.Tensor):
            continue  # a float: read at every call, whatever graph takes it
        got_dtype = str(leaf.dtype).replace("torch.", "")
        if got_dtype != dtype or str(leaf.device) != device:
            raise CaptureError(
                f"{name} is {got_dtype} on {leaf.device}, but the step was compiled for {dtype} on {device}; "
                "convert the batch (e.g. .to(device, dtype)) or compile a new step"
            )


def checked_signature(batch: Any, read: frozenset[int], sides: dict[int, tuple[Any, ...]], structure: str | None, graphs: dict[Any, Any]) -> Signature:
    """The batch's signature (the plain values at positions in `read` in it, and the
    `sides` of the ints a graph compares), or an error
    for a batch the step cannot take: one structured otherwise than the step's `structure`
    (None before its first graph), or one whose dtype or device differs from the graphs'
    (`graphs`: the compiled ones, by key) where none has its shape."""
    got, sig = signature(batch, read, sides)
    if structure is not None and got != structure:
        raise CaptureError(
            f"this step was compiled for batches structured as {structure}, got {got}; "
            "compile another step for another batch structure"
        )
    if graphs and all(shapes != sig for shapes, _ in graphs):
        check_dtype_device(batch, next(iter(graphs.values())).tg)
    return sig
