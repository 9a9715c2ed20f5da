"""A lower bound on the simulated peak of a dropped set, from what the schedule must hold."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from remat.memory.spans import merge_spans
from remat.memory.schedule import GraphIndex, RebuildPolicy, Schedule
from remat.memory.simulator import ScheduleIntervals, Timeline, replay_state_intervals, schedule_intervals


class PeakLowerBound:
    """A lower bound on the simulated peak of a plan, from what the schedule must hold.

    In the schedule (schedule.py) the backward and optimizer nodes keep their relative
    order, and each one's rebuilds run in a block just before it. At a node u (rank r):
    - every storage made after the forward pass is live exactly as without a plan (its
      readers all come after the forward pass and read it directly);
    - a kept activation is live if r lies in [created, last use] (it is read directly);
    - a dropped activation is live if r lies between the first and the last reader after
      the forward pass of one value on it (or a reader of a backward view of that value):
      they all read one copy, made in the first reader's block or, under the shared
      policy (RebuildPolicy.SHARED), in the earlier block that rebuilt it on the way to
      something else and held it, from where it is live.
    The blocks are worked out as build_schedule places them: which ops each block
    copies depends only on the dropped set and on which copies earlier blocks left for
    later readers, so a walk over the nodes that read a dropped value finds them without
    building the steps. At each copy its output, its inputs, what earlier copies of the
    block made and the block, its node or (shared) a later reader still reads, and
    everything live both before and after the block are live at once. Each node's
    measured kernel scratch (index.scratch) is added where it runs, at the node and at
    each copy of it, as the simulator does.
    The bound is the largest of those sums, plus the persistent bytes: a few cumsums and
    a walk over the blocks, where a simulation builds and runs a whole schedule. It lets
    a planner skip simulating plans that cannot fit, so it must be built for the
    schedule policy the planner simulates; tests check it against the simulator under
    both. Activations that the backward reads through a value holding other storages
    too are left out when kept (whether that value is rebuilt depends on the others),
    which only lowers it.
    """

    def __init__(self, index: GraphIndex, baseline: Timeline, policy: RebuildPolicy = RebuildPolicy.PER_BLOCK):
        self.index = index
        self.policy = policy
        self.persistent = int(baseline.persistent_bytes)
        self._last: tuple[frozenset[int], np.ndarray, np.ndarray] | None = None
        # The tables hold for every policy and budget: made once per graph (and its measured scratch).
        cached = index.__dict__.get("_peak_bound_tables")
        if cached is None or cached[0] is not index.scratch:
            cached = index.__dict__["_peak_bound_tables"] = (index.scratch, _bound_tables(index))
        self.__dict__.update(cached[1])

    def __call__(self, dropped: set[int] | frozenset[int], above: int | None = None) -> int:
        """The bound for `dropped`. With `above`, stop early once what is summed so far exceeds
        it (the cheap part first): the answer is then still a lower bound, above `above`."""
        if not self._m:
            return self.persistent
        tensors = self.index.analysis.tensors
        n = self._n
        # Planners ask about growing sets (a greedy's prefixes): start from the last set's
        # curves where this one contains it.
        last = self._last
        if last is not None and last[0] <= dropped:
            at, across, added = last[1].copy(), last[2].copy(), dropped - last[0]
        else:
            at, across, added = self._at.copy(), self._across.copy(), dropped
        for s in added:
            t = tensors[s]
            if s in self._safe:  # not kept: take back its kept interval
                lo, hi = self._kept[s]
                _add(at, lo, hi, -t.nbytes)
                _add(across, lo + 1, hi, -t.nbytes)
            for lo, hi in self._spans.get(s, ()):
                _add(at, lo, hi, t.nbytes)
                _add(across, lo + 1, hi, t.nbytes)
        self._last = (frozenset(dropped), at, across)  # not changed below: copied first where it would be
        best = int(np.cumsum(at[:n])[self._tail_at].max())
        if not dropped or (above is not None and self.persistent + best > above):
            return self.persistent + best
        blocks, held = self._blocks(dropped)
        spans: dict[int, list[tuple[int, int]]] = {}  # storages whose copies live longer than self._spans says
        if held:
            # Under the shared schedule a copy made in an earlier block than its first
            # reader's is live from there: its spans start at that block.
            at, across = at.copy(), across.copy()
            extra: dict[int, list[tuple[int, int]]] = {}
            for c, r in held:
                for s, (_, hi) in self._value_spans[c].items():
                    if s in dropped or s not in self.index.activation:
                        extra.setdefault(s, []).append((r, hi))
            for s, xs in extra.items():
                t = tensors[s]
                for lo, hi in self._spans.get(s, ()) if s in dropped else ():
                    _add(at, lo, hi, -t.nbytes)
                    _add(across, lo + 1, hi, -t.nbytes)
                    xs.append((lo, hi))
            spans = merge_spans(extra)
            for s, xs in spans.items():
                for lo, hi in xs:
                    _add(at, lo, hi, tensors[s].nbytes)
                    _add(across, lo + 1, hi, tensors[s].nbytes)
            best = int(np.cumsum(at[:n])[self._tail_at].max())
        across_curve = np.cumsum(across[:n])
        # Blocks by a cheap cap on what they can add (all they make, and the largest
        # inputs and scratch of one copy), highest first: the rest are skipped once the
        # bound is above their cap, or above `above`.
        out_bytes, in_bytes = self._out_bytes, self._in_bytes
        caps = sorted(
            ((int(across_curve[r]) + sum(out_bytes[c] for c in ops) + max(in_bytes[c] for c in ops), r, ops) for r, ops in blocks),
            key=lambda x: -x[0],
        )
        for cap, r, ops in caps:
            if cap <= best or (above is not None and self.persistent + best > above):
                break
            best = max(best, int(across_curve[r]) + self._block_peak(r, ops, dropped, spans))
        return self.persistent + best

    def _blocks(self, dropped: set[int] | frozenset[int]) -> tuple[list[tuple[int, set[str]]], list[tuple[str, int]]]:
        """The blocks of build_schedule(index, dropped, policy), as (rank of the node the
        block runs before, the forward ops it copies), from the same rules
        (`index.block_ops`, `index.block_targets`, `index.shared_until`) but only before the
        nodes that read a value on a dropped storage; and the values (with the rank of the
        block) that a block rebuilds and holds before their first reader after the forward
        pass (only the shared policy holds such values)."""
        index = self.index
        ranks = set(self._always)
        for s in dropped:
            ranks.update(self._late_ranks.get(s, ()))
        gone = index.unavailable(dropped)

        target: set[str] = set()  # values whose copy later blocks share (while r <= shared_until)
        shared_until = self._shared_until
        blocks: list[tuple[int, set[str]]] = []
        held: list[tuple[str, int]] = []
        for r in sorted(ranks):
            u = index.order[r]
            if gone.isdisjoint(index.inputs[u]):
                continue
            ops = index.block_ops(u, lambda a: a in gone and not (a in target and r <= shared_until[a]))
            if not ops:
                continue
            for c in index.block_targets(u, ops, self.policy):
                target.add(c)
                if r < index.first_late_reader[c]:
                    held.append((c, r))
            blocks.append((r, set(ops)))
        return blocks, held

    def _block_peak(self, r: int, ops: set[str], dropped: set[int] | frozenset[int], spans: dict[int, list[tuple[int, int]]]) -> int:
        """The most bytes beyond the `across` curve live at one of these copies (of the block
        before rank r): what they made and is still to be read in the block (or by the node
        at r, or, held by the shared schedule, later), the inputs of the copy running, and
        its scratch."""
        index = self.index
        tensors = index.analysis.tensors
        outs, ins = self._outs, self._ins
        seq = sorted(ops, key=index.rank.__getitem__)
        k = len(seq)
        pos = {c: i for i, c in enumerate(seq)}
        start: dict[int, int] = {}
        end: dict[int, int] = {}
        for i, c in enumerate(seq):
            for st in outs[c]:
                start.setdefault(st, i)
                end[st] = max(end.get(st, i), i)
            for a in self._reads[c]:
                if a in pos:
                    for st in outs[a]:
                        end[st] = max(end[st], i)
        for c in index.block_targets(index.order[r], seq, self.policy):  # held past the block
            if r <= index.last_late_reader[c]:
                for st in outs[c]:
                    end[st] = k
        counted: dict[int, bool] = {}

        def across(st: int) -> bool:
            c = counted.get(st)
            if c is None:
                c = counted[st] = self._counted_across(st, r, dropped, spans)
            return c

        diff = [0] * (k + 2)
        for st, lo in start.items():
            if not across(st):
                diff[lo] += tensors[st].nbytes
                diff[min(end[st], k) + 1] -= tensors[st].nbytes
        best = live = 0
        for i, c in enumerate(seq):
            live += diff[i]
            extra = live + self._scratch.get(c, 0)
            for st in ins[c]:
                lo = start.get(st)
                if (lo is None or not lo <= i <= end[st]) and not across(st):
                    extra += tensors[st].nbytes
            if extra > best:
                best = extra
        return best

    def _counted_across(self, st: int, r: int, dropped: set[int] | frozenset[int], spans: dict[int, list[tuple[int, int]]]) -> bool:
        """Whether storage `st` is already in the `across` curve at rank r (`spans`: the
        spans of the storages whose copies live longer than self._spans says)."""
        if st in spans:
            return any(lo < r <= hi for lo, hi in spans[st])
        if st in dropped:
            return any(lo < r <= hi for lo, hi in self._spans.get(st, ()))
        kept = self._kept.get(st)
        return kept is not None and kept[0] < r <= kept[1]


def _bound_tables(index: GraphIndex) -> dict:
    """What PeakLowerBound reads about a graph, whatever the dropped set: each as the
    attribute of the bound it becomes."""
    t = SimpleNamespace()
    tensors = index.analysis.tensors
    n = len(index.order)
    t._n = n
    t._tail = np.array([r for r, name in enumerate(index.order) if name not in index.forward], dtype=np.int64)
    t._m = len(t._tail)
    # The ranks the bound is taken over, as a slice where they run on (the forward pass
    # first, as usual): a slice of a curve is read without a copy.
    contiguous = t._m > 0 and int(t._tail[-1]) - int(t._tail[0]) + 1 == t._m
    t._tail_at = slice(int(t._tail[0]), int(t._tail[-1]) + 1) if contiguous else t._tail
    at = np.zeros(n + 2, dtype=np.int64)  # live at node r
    across = np.zeros(n + 2, dtype=np.int64)  # live before node r's block and at r
    t._kept = index.kept_intervals()
    for sid, (lo, hi) in t._kept.items():
        _add(at, lo, hi, tensors[sid].nbytes)
        _add(across, lo + 1, hi, tensors[sid].nbytes)
    t._safe = {s for s in t._kept if s in index.activation}
    # A node's kernel scratch (index.scratch, measured) is live while it runs: at the
    # node itself, and at a copy of it.
    t._scratch = dict(index.scratch)
    for r in t._tail.tolist():
        _add(at, r, r, t._scratch.get(index.order[r], 0))
    t._at, t._across = at, across
    # Per forward value read after the forward pass, per storage: the span over which the
    # copy those readers share is live.
    t._value_spans = index.copy_spans()
    t._spans = index.activation_copy_spans()  # per activation: where a copy of it is live once it is dropped
    # Where blocks can be: before the nodes after the forward pass that read a forward
    # value on a given activation (a block runs only before a node that reads a value
    # that is not available), or one on a storage that is never available.
    late_ranks: dict[int, set[int]] = {}
    always: set[int] = set()
    for r in t._tail.tolist():
        for a in index.inputs[index.order[r]]:
            if a not in index.forward:
                continue
            for s in index.storages.get(a, []):
                if s in index.activation:
                    late_ranks.setdefault(s, set()).add(r)
                elif s not in index.persistent:
                    always.add(r)
    t._late_ranks = {s: sorted(rs) for s, rs in late_ranks.items()}
    t._always = always
    t._reads = {a: index.reads_of_copy(a) for a in index.forward}
    t._shared_until = {a: index.shared_until(a) for a in index.forward}
    # Per forward op: the storages (not persistent) a copy of it makes and reads, and
    # the bytes it makes, and reads plus its scratch.
    t._outs = {a: [s for s in index.storages.get(a, []) if s not in index.persistent] for a in index.forward}
    t._ins = {
        a: list(dict.fromkeys(s for b in t._reads[a] for s in index.storages.get(b, []) if s not in index.persistent))
        for a in index.forward
    }
    t._out_bytes = {a: sum(tensors[s].nbytes for s in t._outs[a]) for a in index.forward}
    t._in_bytes = {a: sum(tensors[s].nbytes for s in t._ins[a]) + t._scratch.get(a, 0) for a in index.forward}
    return vars(t)


def _add(diff: np.ndarray, lo: int, hi: int, nbytes: int) -> None:
    """Add `nbytes` over ranks [lo, hi] of a difference array."""
    if hi >= lo:
        diff[lo] += nbytes
        diff[hi + 1] -= nbytes


class KeepOneMoreBound:
    """A lower bound on the simulated peak of a simulated plan with one of its dropped
    storages kept instead, from the plan's own steps.

    Keeping storage s changes the schedule only where s was involved. The forward pass
    runs as before, but s lives on from its last forward use (forward ops removed because
    only copies read them come back, which only adds). After it, only the blocks that
    copied a value on s change: with s available their closures stop there, so some of
    their copies go, with what those copies alone kept alive (sources they read, copies
    held for later readers, generator states saved for replaying a random op). A later
    block that read a copy such a block held rebuilds it itself, which only adds. So at
    each step outside those blocks, from s's last forward use to its last use, the plan
    kept one more holds at least the plan's bytes, plus s, less what those blocks make
    that is live there, and less what they read that is live there after the last step
    outside every block that makes or reads it (up to which it lives anyway). The greedy
    stops at the first prefix that fits, so its slack is small beside most picks: most
    picks cannot be taken back, and this says so without a simulation."""

    def __init__(self, index: GraphIndex, schedule: Schedule, timeline: Timeline, made: ScheduleIntervals | None = None):
        """`made`: the schedule's intervals with touches (`schedule_intervals(..., touches=True)`), where at hand."""
        tensors = index.analysis.tensors
        self._nbytes = [t.nbytes for t in tensors]
        self._last_use = [t.last_use for t in tensors]
        self._last_touch = _last_forward_touch(index)
        steps = schedule.steps
        n = len(steps)
        if made is None or made.copy_touches is None:
            made = schedule_intervals(index, schedule, touches=True)
        assert made.copy_touches is not None
        states = replay_state_intervals(index, schedule)
        state_row = {x: len(made.nbytes) + j for j, (*_, x) in enumerate(states)}
        assert made.last_plain_touch is not None
        # A row may go from its start where a changing block made it, and only after its last
        # step outside the blocks otherwise (generator states: from their start).
        self._start = np.concatenate([made.start, np.array([lo for _, lo, _, _ in states], dtype=np.int64)])
        self._after = np.concatenate([np.maximum(made.last_plain_touch + 1, made.start), np.array([lo for _, lo, _, _ in states], dtype=np.int64)])
        self._end = np.concatenate([made.end, np.array([hi for _, _, hi, _ in states], dtype=np.int64)])
        self._bytes = np.concatenate([made.nbytes, np.array([b for b, *_ in states], dtype=np.int64)]).astype(np.float64)
        # Each step's place in the captured order (its node's rank, or for a copy the rank
        # of the node its block runs before), and its block (-1: not a copy): a copy's block
        # is the first step after it that is not a copy. The steps that are not copies are
        # the captured order less the removed nodes.
        positions, ranks = schedule.plain_steps(index)
        plain_rank = np.full(n + 1, len(index.order), dtype=np.int64)
        plain_rank[positions] = ranks
        is_copy = np.ones(n, dtype=bool)
        is_copy[positions] = False
        following = np.minimum.accumulate(np.where(is_copy, n, np.arange(n))[::-1])[::-1]
        self._at_rank = plain_rank[following]
        self._block = np.where(is_copy, following, -1)
        self._rows = self._rows_by_block(made.copy_touches, [(i, state_row[steps[i].node]) for i in schedule.copy_positions if steps[i].node in state_row], len(self._bytes))
        self._blocks_of: dict[int, set[int]] = {}  # storage -> the blocks copying a value on it
        for i in schedule.copy_positions:
            block = int(self._block[i])
            for s in index.storages.get(steps[i].node, ()):
                self._blocks_of.setdefault(s, set()).add(block)
        self._live = timeline.during
        self._n = n
        self.persistent = int(timeline.persistent_bytes)

    def _rows_by_block(self, copy_touches: tuple[np.ndarray, np.ndarray], state_touches: list[tuple[int, int]], n_rows: int) -> dict[int, np.ndarray]:
        """Block -> the rows its copies make or read (a replayed copy: its generator state's
        row too), each once."""
        at, rows = copy_touches
        if state_touches:
            at = np.concatenate([at, np.array([i for i, _ in state_touches], dtype=np.int64)])
            rows = np.concatenate([rows, np.array([r for _, r in state_touches], dtype=np.int64)])
        pairs = np.unique(self._block[at] * n_rows + rows)
        blocks, first = np.unique(pairs // n_rows, return_index=True)
        return dict(zip(blocks.tolist(), np.split(pairs % n_rows, first[1:])))

    def __call__(self, storage: int) -> int:
        """The bound for the plan with `storage` (dropped in it) kept; 0 where this says nothing."""
        lo = int(np.searchsorted(self._at_rank, self._last_touch.get(storage, -1), side="right"))
        hi = int(np.searchsorted(self._at_rank, self._last_use[storage], side="right"))
        if hi <= lo:
            return 0
        live = self._live[lo:hi]
        blocks = self._blocks_of.get(storage, set())
        if blocks:
            in_blocks = np.zeros(self._n + 2, dtype=bool)  # by block + 1 (a step outside every block: -1)
            in_blocks[np.fromiter(blocks, dtype=np.int64) + 1] = True
            rows = np.unique(np.concatenate([self._rows[b] for b in blocks]))
            weights = self._bytes[rows]
            start = self._start[rows]
            first = np.where(in_blocks[self._block[start] + 1], start, self._after[rows])
            # What those rows hold over [lo, hi): a difference array over that window only
            # (a row from before lo counts from lo; one from hi on, not at all).
            width = hi - lo
            diff = np.bincount(np.clip(first - lo, 0, width), weights, minlength=width + 1)
            diff -= np.bincount(np.clip(np.minimum(self._end[rows], self._n - 1) + 1 - lo, 0, width), weights, minlength=width + 1)
            live = live - np.cumsum(diff[:width]).astype(np.int64)
            stays = ~in_blocks[self._block[lo:hi] + 1]  # the steps outside those blocks
            if not stays.any():
                return 0
            live = live[stays]
        return self.persistent + int(live.max()) + self._nbytes[storage]


def _last_forward_touch(index: GraphIndex) -> dict[int, int]:
    """Per storage, the rank of the last forward op making, reading or writing a value on it;
    worked out once per graph."""
    found = index.__dict__.get("_last_forward_touch")
    if found is None:
        found = index.__dict__["_last_forward_touch"] = {}
        for n in index.order:
            if n not in index.forward:
                continue
            r = index.rank[n]
            for a in (n, *index.inputs[n]):
                for s in index.storages.get(a, ()):
                    found[s] = max(found.get(s, -1), r)
    return found
