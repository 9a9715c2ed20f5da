"""The execution order of a graph in which some activations are dropped and recomputed.

This is the one place that decides *where* recomputation happens; the plan simulator and
the rewriter both read a `Schedule`, so what is simulated is what runs.

Rules (DESIGN.md, "Correctness"):
- A forward value is *available* in the backward pass if it is a graph input, a constant,
  not a tensor, or lives only in kept activation storages. Anything else a later node
  reads is rebuilt: its forward op is copied, with its inputs rebuilt the same way,
  so the sources of a rebuild are always kept activations, parameters and inputs.
- Copies go in a *block* just before the first node after the forward pass that needs
  them. A rebuilt activation that a later node reads (a *target*) lives until its last
  reader, which all read that one copy; the intermediates a block needs only to rebuild
  its targets die within the block, and a later block that needs them again rebuilds
  them again (μ-TWO's cost model: a source of several recomputed tensors is recomputed
  once for each). Within a block every value is rebuilt once and shared.
- Forward ops whose only readers now read the copy are removed from the forward pass
  (if they are pure), so an activation used only in the backward pass is computed there.
- Random ops are never copied. Mutating ops are copied only when everything they write
  was itself rebuilt in the same closure (e.g. `x += residual` on a rebuilt `x`); BatchNorm
  is copied as its stat-free twin, so running statistics are updated exactly once.
- A source must hold the same value at rebuild time as when the original op read it: no
  in-place write to it in between. A rebuilt storage must see every write the original
  saw before the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from remat.errors import PlanError
from remat.memory.graph_index import GraphIndex, RebuildPolicy

__all__ = ["ORIGINAL", "GraphIndex", "RebuildPolicy", "Schedule", "ScheduleTooLarge", "Step", "build_schedule", "recompute_seconds"]


ORIGINAL = -1  # the instance number of a value computed by its original node


class ScheduleTooLarge(PlanError):
    """The schedule would hold more copies than the caller's `copy_limit`: a search with a
    fixed amount of work left cannot afford to simulate it."""


class Step(NamedTuple):
    node: str  # the original node this step runs
    instance: int = ORIGINAL  # >= 0: a rebuild placed in the backward pass, numbered

    @property
    def copy(self) -> bool:
        return self.instance != ORIGINAL


@dataclass
class Schedule:
    steps: list[Step]
    reads: list[list[tuple[str, int]]]  # per step: (node, instance) of each value it reads
    removed: list[str]  # forward nodes dropped because only rebuilt copies are read
    output_reads: list[tuple[str, int]]
    dropped: frozenset[int]  # the storages the schedule was built for
    copy_positions: list[int]  # where in `steps` the copies are, in order
    resolved: list[str]  # the nodes (not copies) that read some value other than as captured

    @property
    def copies(self) -> list[str]:
        return [self.steps[i].node for i in self.copy_positions]

    def plain_steps(self, index: GraphIndex) -> tuple[np.ndarray, np.ndarray]:
        """The positions of the steps that are not copies, and their nodes' ranks: those
        steps run the captured order less the removed nodes, in that order."""
        is_copy = np.zeros(len(self.steps), dtype=bool)
        is_copy[self.copy_positions] = True
        kept = np.ones(len(index.order), dtype=bool)
        kept[[index.rank[n] for n in self.removed]] = False
        return np.flatnonzero(~is_copy), np.flatnonzero(kept)


@dataclass
class _AsCaptured:
    """The steps of the captured order where nothing they read is rebuilt, what each reads,
    and the positions of the nodes after the forward pass that read a forward value (the
    only ones a block can precede): the same in every schedule of the index, so made once
    and kept with it."""

    steps: list[Step]
    reads: list[list[tuple[str, int]]]
    late_readers: dict[str, list[int]]  # forward value -> the positions of those nodes that read it


def _as_captured(index: GraphIndex) -> _AsCaptured:
    cache = index.__dict__.get("_as_captured")
    if cache is None:
        forward = index.forward
        cache = index.__dict__["_as_captured"] = _AsCaptured(
            steps=[Step(u) for u in index.order],
            reads=[[(a, ORIGINAL) for a in index.inputs[u]] for u in index.order],
            late_readers={a: [index.rank[u] for u in index.users[a] if u not in forward] for a in forward},
        )
    return cache


def recompute_seconds(schedule: Schedule, node_seconds: dict[str, float]) -> float:
    """Predicted extra time of a schedule: the copies, less the forward ops it removed."""
    return sum(node_seconds[n] for n in schedule.copies) - sum(node_seconds[n] for n in schedule.removed)


def build_schedule(
    index: GraphIndex,
    dropped: set[int] | frozenset[int],
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
    copy_limit: int | None = None,
) -> Schedule:
    """The order the rewritten graph runs in when the storages in `dropped` are recomputed,
    with the blocks of `index.block_ops` and the copies later blocks share
    (`index.block_targets` under `policy`, while `index.shared_until`).
    `copy_limit`: raise ScheduleTooLarge as soon as the copies pass it."""
    dropped = frozenset(dropped)
    bad = [s for s in dropped if s not in index.activation]
    if bad:
        keys = ", ".join(index.analysis.tensors[s].key for s in bad[:5])
        raise PlanError(f"only activations can be recomputed; not activations: {keys}")

    # One pass in the captured order: forward nodes as they are, each later node preceded
    # by the block that rebuilds what it reads and is not available. Forward and backward
    # passes may alternate (micro-batches accumulating gradients in one step). Only a node
    # after the forward pass that reads a forward value can need a block; the runs between
    # them are taken as captured.
    all_steps: list[Step] = []
    all_reads: list[list[tuple[str, int]]] = []
    copied: set[str] = set()
    resolved: list[str] = []
    target: dict[str, int] = {}  # value -> instance of its rebuilt copy that later readers share
    next_instance = 0
    gone = index.unavailable(dropped)
    as_captured = _as_captured(index)
    done = 0  # the captured steps before this position are placed
    copy_positions: list[int] = []
    blocks_at: list[int] = []  # the captured position of each node a block precedes
    copies_through: list[int] = []  # the copies placed up to and including that block
    for i in sorted({i for a in gone for i in as_captured.late_readers.get(a, ())}):  # the nodes that read a value gone
        u = index.order[i]
        all_steps.extend(as_captured.steps[done:i])
        all_reads.extend(as_captured.reads[done:i])
        done = i + 1
        r_u = index.rank[u]
        block: dict[str, int] = {}

        def resolve(a: str) -> int | None:
            """Which instance of `a` node u's block can read; None: it must be rebuilt here."""
            if a not in gone:
                return ORIGINAL
            if a in block:
                return block[a]
            if a in target and r_u <= index.shared_until(a):
                return target[a]
            return None

        ops = index.block_ops(u, lambda a: resolve(a) is None)
        if copy_limit is not None and len(copy_positions) + len(ops) > copy_limit:
            raise ScheduleTooLarge(f"more than {copy_limit} copies")
        for c in ops:
            why = index.check_copy(c, block, dropped, r_u)
            if why is not None:
                raise PlanError(f"cannot recompute what {u} needs: {why}")
            reads = [(a, resolve(a)) for a in index.reads_of_copy(c)]
            block[c] = next_instance
            copy_positions.append(len(all_steps))
            all_steps.append(Step(c, next_instance))
            all_reads.append(reads)  # type: ignore[arg-type]
            next_instance += 1
        copied.update(ops)
        resolved.append(u)
        blocks_at.append(i)
        copies_through.append(len(copy_positions))
        for c in index.block_targets(u, ops, policy):
            target[c] = block[c]
        all_steps.append(Step(u))
        all_reads.append([(a, resolve(a)) for a in index.inputs[u]])  # type: ignore[misc]
    all_steps.extend(as_captured.steps[done:])
    all_reads.extend(as_captured.reads[done:])
    output_reads = [(a, ORIGINAL) for a in index.output_inputs]
    if not gone.isdisjoint(index.output_inputs):
        raise PlanError("a graph output cannot be recomputed")

    # Forward nodes that nothing reads any more (their readers now read copies) and that
    # have no side effect are removed: the value is then computed in the backward only.
    # Only a copied node can be: it is not available, so no node after the forward pass
    # reads its original, and its readers are the forward nodes reading it (and the
    # graph's output), less those removed.
    readers = {n: index.forward_readers(n) for n in copied}
    removed: set[str] = set()
    for n in sorted(copied, key=index.rank.__getitem__, reverse=True):
        if readers[n] == 0 and n not in index.random and not index.writes[n]:
            removed.add(n)
            for a in index.inputs[n]:
                if a in readers:
                    readers[a] -= 1
    removed_in_order = sorted(removed, key=index.rank.__getitem__)
    if removed:
        # A removed node is a forward node, so no block runs just before it: its step sits
        # at its captured position plus the copies of the blocks before it.
        ranks = np.array([index.rank[n] for n in removed_in_order], dtype=np.int64)
        before = np.searchsorted(np.array(blocks_at, dtype=np.int64), ranks, side="right")
        gaps = (ranks + np.concatenate([[0], np.array(copies_through, dtype=np.int64)])[before]).tolist()
        kept_steps: list[Step] = []
        kept_reads: list[list[tuple[str, int]]] = []
        start = 0
        for g in gaps:
            kept_steps.extend(all_steps[start:g])
            kept_reads.extend(all_reads[start:g])
            start = g + 1
        all_steps, all_reads = kept_steps + all_steps[start:], kept_reads + all_reads[start:]
        positions = np.array(copy_positions, dtype=np.int64)
        copy_positions = (positions - np.searchsorted(np.array(gaps, dtype=np.int64), positions)).tolist()
    return Schedule(
        steps=all_steps,
        reads=all_reads,
        removed=removed_in_order,
        output_reads=output_reads,
        dropped=dropped,
        copy_positions=copy_positions,
        resolved=resolved,
    )


