"""Repeated blocks of a captured iteration: transformer layers, the bottlenecks of a stage.

A deep model's graph is mostly the same few blocks over and over, in the forward pass,
in reverse in the backward pass, and once per layer's parameters in the optimizer step.
Two runs of nodes are the same block when, node by node, they run the same op with the
same constant arguments on inputs and outputs of the same shapes, strides and dtypes,
each input a graph input (each layer's own weight) or an op's value alike. Where the
inputs come from is not compared: the backward of layer k reads layer k's activations,
the first layer reads the embedding, the others the layer before.

Found by periods: for a period p, node i matches node i + p when the rule above holds;
a run of matches at least p long is a chain of repeats of length p. Candidate periods
are the distances between consecutive occurrences of the same op signature; the period
that covers the most nodes is taken first, its nodes set aside, and so on.

What the repeats are for: the profile lists them (how much of the iteration each kind of
block takes), and on request (`profile(..., pool_repeats=True)`) prices each node with the
timed samples of its counterparts in the other repeats too: the same kernel on the same
shapes, after the same ops. The default planner tries the same choice of activations in
every repeat of a forward block (`forward_counterparts`, planners.refined).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx

from remat.capture.train_graph import TrainGraph

MIN_BLOCK = 4  # shorter periods are op-level repeats (q, k, v projections), not blocks
CANDIDATE_PERIODS = 24  # most frequent distances tried per round


@dataclass(frozen=True)
class Block:
    """One kind of block and where it repeats: `count` runs of `length` nodes from `start`."""

    start: int  # rank of the first node of the first repeat
    length: int
    count: int

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.length * self.count)

    def starts(self) -> list[int]:
        return [self.start + k * self.length for k in range(self.count)]


@dataclass
class Repeats:
    """The repeated blocks of one graph (disjoint, by first rank) and, per node, its first repeat's counterpart."""

    blocks: list[Block]
    representative: np.ndarray  # rank -> rank of the same node in its block's first repeat (itself when not repeated)
    phases: list[str] = field(default_factory=list)  # the phase of each block

    @property
    def repeated_nodes(self) -> int:
        return sum(b.length * b.count for b in self.blocks)

    def classes(self) -> dict[int, list[int]]:
        """Representative rank -> every rank it stands for, for the nodes that repeat."""
        out: dict[int, list[int]] = {}
        for b in self.blocks:
            for r in b.ranks:
                out.setdefault(int(self.representative[r]), []).append(r)
        return out

    def summary(self) -> list[dict[str, int | str]]:
        return [{"phase": ph, "start": b.start, "length": b.length, "count": b.count} for b, ph in zip(self.blocks, self.phases)]


def pooled_medians(samples: np.ndarray, repeats: Repeats) -> np.ndarray:
    """Per node, the median of its timed samples (runs x nodes) and its counterparts' in the other repeats."""
    out = np.median(samples, axis=0) if len(samples) else np.zeros(samples.shape[1])
    for b in repeats.blocks:
        chunk = samples[:, b.start : b.start + b.length * b.count]
        median = np.median(chunk.reshape(-1, b.length), axis=0)  # rows: every (run, repeat)
        out[b.ranks] = np.tile(median, b.count)
    return out


def find_repeats(tg: TrainGraph, forward_only: bool = False) -> Repeats:
    """The repeated blocks of `tg`'s op nodes in execution order (module docstring); with
    `forward_only`, of its forward op nodes only (ranks then count those)."""
    ops = tg.op_nodes()
    if forward_only:
        ops = [o for o in ops if tg.phase[o.name].value == "forward"]
    n = len(ops)
    signature = _signatures(ops)
    phase = np.array([_PHASES.index(tg.phase[o.name].value) for o in ops], dtype=np.int8)
    free = np.ones(n, dtype=bool)  # not yet in a block
    blocks: list[Block] = []
    while True:
        best: tuple[int, int, list[Block]] | None = None  # (covered, -period, blocks)
        for p in _candidate_periods(signature, free):
            found = _blocks_of_period(p, signature, phase, free)
            covered = sum(b.length * b.count for b in found)
            if covered and (best is None or (covered, -p) > best[:2]):
                best = (covered, -p, found)
        if best is None:
            break
        for b in best[2]:
            blocks.append(b)
            free[b.start : b.start + b.length * b.count] = False
    blocks.sort(key=lambda b: b.start)
    representative = np.arange(n)
    for b in blocks:
        for s in b.starts()[1:]:
            representative[s : s + b.length] = np.arange(b.start, b.start + b.length)
    return Repeats(blocks, representative, [_PHASES[phase[b.start]] for b in blocks])


_PHASES = ("forward", "backward", "optimizer")


def forward_counterparts(tg: TrainGraph) -> dict[str, str]:
    """Forward op node -> its counterpart in the first repeat of its block, for every
    forward node in a repeated block: the same layer's op, one layer earlier or later."""
    ops = [o for o in tg.op_nodes() if tg.phase[o.name].value == "forward"]
    repeats = find_repeats(tg, forward_only=True)
    return {ops[r].name: ops[int(repeats.representative[r])].name for b in repeats.blocks for r in b.ranks}


def _candidate_periods(signature: np.ndarray, free: np.ndarray) -> list[int]:
    """The most frequent distances between consecutive free nodes of equal signature."""
    ranks = np.flatnonzero(free)
    if len(ranks) < 2 * MIN_BLOCK:
        return []
    order = np.lexsort((ranks, signature[ranks]))
    sig, pos = signature[ranks][order], ranks[order]
    same = sig[1:] == sig[:-1]
    gaps = (pos[1:] - pos[:-1])[same]
    gaps = gaps[gaps >= MIN_BLOCK]
    ranked = sorted(Counter(gaps.tolist()).items(), key=lambda kv: (-kv[1], kv[0]))  # not by hash order: the same every run
    return [int(g) for g, _ in ranked[:CANDIDATE_PERIODS]]


def _blocks_of_period(p: int, signature: np.ndarray, phase: np.ndarray, free: np.ndarray) -> list[Block]:
    """Chains of at least two repeats of length `p` among the free nodes."""
    n = len(signature)
    if 2 * p > n:
        return []
    match = (signature[: n - p] == signature[p:]) & (phase[: n - p] == phase[p:]) & free[: n - p] & free[p:]
    blocks = []
    for start, stop in _runs(match):
        count = (stop - start) // p + 1
        if count >= 2:
            blocks.append(Block(int(start), p, int(count)))
    return blocks


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _signatures(ops: list[torch.fx.Node]) -> np.ndarray:
    """Per op node: a hash of what it runs (op, constants, the shapes of its output and inputs)."""
    signature = np.empty(len(ops), dtype=np.int64)
    for i, node in enumerate(ops):
        parts: list[object] = [str(node.target), _describe(node.meta.get("val"))]
        torch.fx.node.map_aggregate((node.args, node.kwargs), lambda x: parts.append(_argument(x)))
        signature[i] = hash(tuple(parts))
    return signature


def _argument(x: object) -> object:
    if isinstance(x, torch.fx.Node):
        return ("in", _describe(x.meta.get("val")), x.op == "placeholder")
    return repr(x)


def _describe(val: object) -> object:
    """Shape, stride and dtype of a value (nested for tuples), or its type."""
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), str(val.dtype), str(val.device))
    if isinstance(val, (list, tuple)):
        return tuple(_describe(v) for v in val)
    return type(val).__name__
