"""A plan: which activations to recompute, why, and what that is predicted to cost.

Every planner returns one; the rewriter and the reports read one. It names storages by
their stable keys (analysis.TensorInfo.key), never by ids, so that a plan saved as JSON
can be checked against, and applied to, a fresh capture of the same graph.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remat.errors import BudgetError, PlanError
from remat.schedule import GraphIndex, Schedule, build_schedule, merge_spans, recompute_seconds, simulate_schedule
from remat.serialize import check_fields, describe_value, dump_document, load_document
from remat.simulator import Timeline

PLAN_FORMAT = "remat.plan"
PLAN_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Recomputed:
    """One dropped activation and how it is rebuilt from what the final plan keeps.

    `ops` are the forward ops copied to rebuild it (in execution order, its closure under
    the final plan) and `sources` the kept values they read (parameters, inputs, kept
    activations). Entries may share ops, and the schedule may rebuild a value more than
    once, so their seconds do not add up to the plan's overhead (schedule.py decides).
    """

    key: str
    nbytes: int
    sources: list[str]  # node names of the kept values the rebuild reads
    ops: list[str]  # node names of the forward ops copied to rebuild it
    recompute_seconds: float  # summed median seconds of `ops`
    ratio: float | None  # nbytes / recompute_seconds (None when the ops take no time)


@dataclass
class Plan:
    planner: str
    fingerprint: str
    budget_bytes: int
    recomputed: list[Recomputed]  # in the order the planner picked them
    predicted_peak_bytes: int
    predicted_step_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead_seconds: float  # recompute_seconds() of the final schedule
    baseline_iteration_seconds: float
    planning_seconds: float
    num_recomputed: int
    persistent_bytes: int = 0
    baseline_step_peak_bytes: int = 0
    model: str | None = None
    batch_size: int | None = None
    optimizer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    share_rebuilt: bool = False  # the schedule policy it was made for (build_schedule)

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.recomputed]

    @property
    def predicted_overhead_fraction(self) -> float:
        return self.predicted_overhead_seconds / self.baseline_iteration_seconds if self.baseline_iteration_seconds else 0.0

    def dropped(self, index: GraphIndex, check_fingerprint: bool = True) -> set[int]:
        """The storage ids of this graph that the plan recomputes.

        Refuses a plan made for another graph: by the tensors it names, then by the graph
        fingerprint (the same model at another batch size has the same tensor names).
        """
        by_key = index.analysis.storage_by_key()
        missing = [k for k in self.keys if k not in by_key]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise PlanError(
                f"the plan names {len(missing)} tensor(s) this graph does not have ({shown}): it was made for "
                f"another graph{self._made_for()}. Plan this model and batch size again."
            )
        if check_fingerprint:
            self.check_graph(graph_fingerprint_of(index))
        return {by_key[k] for k in self.keys}

    def check_graph(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for another graph{self._made_for()} (fingerprint {self.fingerprint[:12]}…, "
                f"this graph {fingerprint[:12]}…): the model, optimizer or batch shape differ. Plan this graph again."
            )

    def schedule(self, index: GraphIndex) -> Schedule:
        return build_schedule(index, self.dropped(index), self.share_rebuilt)

    def _made_for(self) -> str:
        if self.model is None:
            return ""
        return f" ({self.model}, batch {self.batch_size})" if self.batch_size is not None else f" ({self.model})"

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "plan") -> "Plan":
        """A plan from its JSON object, refused (PlanError, naming the field) unless every
        field is there, of its type, and the entries agree with each other."""
        check_fields(d, cls, where, _PLAN_SIGNS)
        d = {k: v for k, v in d.items() if k not in ("format", "version")}
        if not _SHA256.fullmatch(d["fingerprint"]):
            raise PlanError(
                f"{where}: fingerprint must be a sha256 digest (64 hexadecimal digits), not {describe_value(d['fingerprint'])}"
            )
        seen: dict[str, int] = {}
        for i, r in enumerate(d["recomputed"]):
            if r["key"] in seen:
                raise PlanError(f"{where}: recomputed[{i}] repeats the tensor {r['key']} of recomputed[{seen[r['key']]}]")
            seen[r["key"]] = i
        entries = [Recomputed(**r) for r in d["recomputed"]]
        d["recomputed"] = entries
        plan = cls(**d)
        if plan.num_recomputed != len(entries):
            raise PlanError(f"{where}: num_recomputed is {plan.num_recomputed} but {len(entries)} entries are listed")
        return plan

    def to_json(self, path: str | Path) -> Path:
        return dump_document(path, PLAN_FORMAT, PLAN_VERSION, self.to_dict())

    @classmethod
    def from_json(cls, path: str | Path) -> "Plan":
        return cls.from_dict(load_document(path, PLAN_FORMAT, PLAN_VERSION), where=str(path))


# Fields that are counts, bytes or seconds: a negative one is an edited or broken file.
_PLAN_SIGNS: dict[type, dict[str, str]] = {
    Plan: {
        **{k: "non-negative" for k in (
            "budget_bytes", "predicted_peak_bytes", "predicted_step_peak_bytes", "baseline_peak_bytes",
            "predicted_overhead_seconds", "baseline_iteration_seconds", "planning_seconds", "num_recomputed",
            "persistent_bytes", "baseline_step_peak_bytes",
        )},
        "batch_size": "positive",
    },
    Recomputed: {"nbytes": "non-negative", "recompute_seconds": "non-negative", "ratio": "non-negative"},
}  # fmt: skip


def graph_fingerprint_of(index: GraphIndex) -> str:
    """The captured graph's fingerprint, as the profiler computes it (profiles and plans agree)."""
    try:
        from remat.profiler import graph_fingerprint
    except ImportError:  # pragma: no cover - profiler missing: hash the op sequence ourselves
        h = hashlib.sha256()
        for n in index.order:
            h.update(f"{n} {index.node_map[n].target}\n".encode())
        return h.hexdigest()
    return graph_fingerprint(index.tg)


def check_node_seconds(index: GraphIndex, node_seconds: dict[str, float]) -> None:
    missing = [n for n in index.order if n not in node_seconds]
    if missing:
        raise PlanError(
            f"the node times do not cover this graph: {len(missing)} of its {len(index.order)} nodes have no time "
            f"(e.g. {', '.join(missing[:3])}); the profile was measured on another graph. Profile this graph again."
        )


def describe_recomputed(index: GraphIndex, dropped: set[int] | frozenset[int], order: list[int], node_seconds: dict[str, float]) -> list[Recomputed]:
    """Entries for the storages in `order`, each with its closure under the whole dropped set."""
    dropped = frozenset(dropped)
    tensors = index.analysis.tensors
    out: list[Recomputed] = []
    for sid in order:
        ops = index.closure(index.backward_readers(sid), dropped, set())
        op_set = set(ops)
        sources: list[str] = []
        for n in ops:
            for a in index.reads_of_copy(n):
                if a not in op_set and a not in sources and index.storages.get(a):
                    sources.append(a)
        seconds = float(sum(node_seconds[n] for n in ops))
        nbytes = tensors[sid].nbytes
        out.append(
            Recomputed(
                key=tensors[sid].key,
                nbytes=int(nbytes),
                sources=sources,
                ops=ops,
                recompute_seconds=seconds,
                ratio=(nbytes / seconds) if seconds > 0 else None,
            )
        )
    return out


@dataclass
class Evaluation:
    """A dropped set run through the schedule and the plan simulator."""

    schedule: Schedule
    timeline: Timeline
    overhead_seconds: float

    @property
    def peak_bytes(self) -> int:
        return self.timeline.peak_bytes


def evaluate(
    index: GraphIndex, dropped: set[int] | frozenset[int], node_seconds: dict[str, float], share_rebuilt: bool = False
) -> Evaluation:
    schedule = build_schedule(index, dropped, share_rebuilt)
    return Evaluation(schedule, simulate_schedule(index, schedule), recompute_seconds(schedule, node_seconds))


def assemble_plan(
    planner: str,
    index: GraphIndex,
    node_seconds: dict[str, float],
    budget_bytes: int,
    picks: list[int],
    final: Evaluation,
    baseline: Timeline,
    planning_seconds: float,
    *,
    fingerprint: str | None = None,
    model: str | None = None,
    batch_size: int | None = None,
    optimizer: str | None = None,
    baseline_iteration_seconds: float | None = None,
    meta: dict[str, Any] | None = None,
    share_rebuilt: bool = False,
) -> Plan:
    entries = describe_recomputed(index, set(picks), picks, node_seconds)
    return Plan(
        share_rebuilt=share_rebuilt,
        planner=planner,
        fingerprint=fingerprint if fingerprint is not None else graph_fingerprint_of(index),
        budget_bytes=int(budget_bytes),
        recomputed=entries,
        predicted_peak_bytes=int(final.timeline.peak_bytes),
        predicted_step_peak_bytes=int(final.timeline.step_peak_bytes),
        baseline_peak_bytes=int(baseline.peak_bytes),
        predicted_overhead_seconds=float(final.overhead_seconds),
        baseline_iteration_seconds=float(
            baseline_iteration_seconds if baseline_iteration_seconds is not None else sum(node_seconds[n] for n in index.order)
        ),
        planning_seconds=float(planning_seconds),
        num_recomputed=len(entries),
        persistent_bytes=int(baseline.persistent_bytes),
        baseline_step_peak_bytes=int(baseline.step_peak_bytes),
        model=model,
        batch_size=batch_size,
        optimizer=optimizer,
        meta=dict(meta or {}),
    )


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
      schedule (`share_rebuilt`), in the earlier block that rebuilt it on the way to
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

    def __init__(self, index: GraphIndex, baseline: Timeline, share_rebuilt: bool = False):
        self.index = index
        self.share_rebuilt = share_rebuilt
        tensors = index.analysis.tensors
        n = len(index.order)
        self._n = n
        self._tail = np.array([r for r, name in enumerate(index.order) if name not in index.forward], dtype=np.int64)
        self.persistent = int(baseline.persistent_bytes)
        self._m = len(self._tail)
        at = np.zeros(n + 2, dtype=np.int64)  # live at node r
        across = np.zeros(n + 2, dtype=np.int64)  # live before node r's block and at r
        for t in tensors:
            if not t.persistent and t.created >= 0 and index.order[t.created] not in index.forward:
                last = min(t.last_use, n - 1)
                _add(at, t.created, last, t.nbytes)
                _add(across, t.created + 1, last, t.nbytes)
        self._safe = index.activations_read_alone()
        for sid in self._safe:
            t = tensors[sid]
            _add(at, t.created, min(t.last_use, n - 1), t.nbytes)
            _add(across, t.created + 1, min(t.last_use, n - 1), t.nbytes)
        # A node's kernel scratch (index.scratch, measured) is live while it runs: at the
        # node itself, and at a copy of it.
        self._scratch = dict(index.scratch)
        for r in self._tail.tolist():
            _add(at, r, r, self._scratch.get(index.order[r], 0))
        self._at, self._across = at, across
        # Per forward value read after the forward pass: the rank of its first such reader,
        # and per storage the span over which the copy those readers share is live.
        self._first_late = {
            a: min(index.rank[u] for u in index.users.get(a, []) if u not in index.forward) for a in index.last_late_reader
        }
        self._value_spans = index.copy_spans()
        self._spans = index.activation_copy_spans()  # per activation: where a copy of it is live once it is dropped
        # Where blocks can be: before the nodes after the forward pass that read a forward
        # value on a given activation (a block runs only before a node that reads a value
        # that is not available), or one on a storage that is never available.
        late_ranks: dict[int, set[int]] = {}
        always: set[int] = set()
        for r in self._tail.tolist():
            for a in index.inputs[index.order[r]]:
                if a not in index.forward:
                    continue
                for s in index.storages.get(a, []):
                    if s in index.activation:
                        late_ranks.setdefault(s, set()).add(r)
                    elif s not in index.persistent:
                        always.add(r)
        self._late_ranks = {s: sorted(rs) for s, rs in late_ranks.items()}
        self._always = always
        self._reads = {a: index.reads_of_copy(a) for a in index.forward}
        # Per forward op: the storages (not persistent) a copy of it makes and reads, and
        # the bytes it makes, and reads plus its scratch.
        self._outs = {a: [s for s in index.storages.get(a, []) if s not in index.persistent] for a in index.forward}
        self._ins = {
            a: list(dict.fromkeys(s for b in self._reads[a] for s in index.storages.get(b, []) if s not in index.persistent))
            for a in index.forward
        }
        self._out_bytes = {a: sum(tensors[s].nbytes for s in self._outs[a]) for a in index.forward}
        self._in_bytes = {a: sum(tensors[s].nbytes for s in self._ins[a]) + self._scratch.get(a, 0) for a in index.forward}
        self._shared_until = {a: index.storage_last_read(a) for a in index.forward}

    def __call__(self, dropped: set[int] | frozenset[int], above: int | None = None) -> int:
        """The bound for `dropped`. With `above`, stop early once what is summed so far exceeds
        it (the cheap part first): the answer is then still a lower bound, above `above`."""
        if not self._m:
            return self.persistent
        tensors = self.index.analysis.tensors
        n = self._n
        at, across = self._at.copy(), self._across.copy()
        for s in dropped:
            t = tensors[s]
            if s in self._safe:  # not kept: take back its kept interval
                _add(at, t.created, min(t.last_use, n - 1), -t.nbytes)
                _add(across, t.created + 1, min(t.last_use, n - 1), -t.nbytes)
            for lo, hi in self._spans.get(s, ()):
                _add(at, lo, hi, t.nbytes)
                _add(across, lo + 1, hi, t.nbytes)
        best = int(np.cumsum(at[:n])[self._tail].max())
        if not dropped or (above is not None and self.persistent + best > above):
            return self.persistent + best
        blocks, held = self._blocks(dropped)
        spans: dict[int, list[tuple[int, int]]] = {}  # storages whose copies live longer than self._spans says
        if held:
            # Under the shared schedule a copy made in an earlier block than its first
            # reader's is live from there: its spans start at that block.
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
            best = int(np.cumsum(at[:n])[self._tail].max())
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
        """The blocks of build_schedule(index, dropped, share_rebuilt), as (rank of the node
        the block runs before, the forward ops it copies), found the way build_schedule
        finds them but only before the nodes that read a value on a dropped storage; and,
        under the shared schedule, the values (with the rank of the block) that a block
        rebuilds and holds before their first reader after the forward pass."""
        index = self.index
        ranks = set(self._always)
        for s in dropped:
            ranks.update(self._late_ranks.get(s, ()))
        gone: dict[str, bool] = {}

        def unavailable(a: str) -> bool:
            g = gone.get(a)
            if g is None:
                g = gone[a] = not index.available(a, dropped)
            return g

        target: set[str] = set()  # values whose copy later readers share (while r <= _shared_until)
        shared_until, reads, first_late = self._shared_until, self._reads, self._first_late
        blocks: list[tuple[int, set[str]]] = []
        held: list[tuple[str, int]] = []
        for r in sorted(ranks):

            def rebuilt_here(a: str) -> bool:
                return unavailable(a) and not (a in target and r <= shared_until[a])

            needed = [a for a in index.inputs[index.order[r]] if rebuilt_here(a)]
            if not needed:
                continue
            seen: set[str] = set()
            todo = list(needed)
            while todo:
                c = todo.pop()
                if c in seen:
                    continue
                seen.add(c)
                todo.extend(a for a in reads[c] if a not in seen and rebuilt_here(a))
            target.update(needed)
            if self.share_rebuilt:
                for c in seen:
                    if c in index.last_late_reader:
                        target.add(c)
                        if r < first_late[c]:
                            held.append((c, r))
            blocks.append((r, seen))
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
            held = self.share_rebuilt and r <= index.last_late_reader.get(c, -1)
            for st in outs[c]:
                start.setdefault(st, i)
                end[st] = k if held else max(end.get(st, i), i)
            for a in self._reads[c]:
                if a in pos:
                    for st in outs[a]:
                        end[st] = max(end[st], i)
        for a in index.inputs[index.order[r]]:
            if a in pos:
                for st in outs[a]:
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
        t = self.index.analysis.tensors[st]
        if st in spans:
            return any(lo < r <= hi for lo, hi in spans[st])
        if st in dropped:
            return any(lo < r <= hi for lo, hi in self._spans.get(st, ()))
        if st in self._safe:
            return t.created < r <= t.last_use
        if st in self.index.activation:
            return False
        return t.created >= 0 and self.index.order[t.created] not in self.index.forward and t.created < r <= t.last_use


def _add(diff: np.ndarray, lo: int, hi: int, nbytes: int) -> None:
    """Add `nbytes` over ranks [lo, hi] of a difference array."""
    if hi >= lo:
        diff[lo] += nbytes
        diff[hi + 1] -= nbytes


REFINE_SECONDS = 5.0  # how long a failed planner may spend pinning down the smallest peak it can reach


@dataclass(frozen=True)
class Reach:
    """The smallest peak a planner's plans reach: `best` was simulated; none is below `lower`."""

    best: int
    lower: int
    exact: bool


class Evaluator:
    """Checks dropped sets against a budget, simulating only those that could fit.

    Keeps what a planner needs to report: how many simulations it ran, and the smallest
    peak over every set it was asked about (`smallest_peak`: sets skipped by the bound
    are simulated at the end, only if their bound is below the best peak seen).
    """

    def __init__(
        self, index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, use_bound: bool = True, share_rebuilt: bool = False
    ):
        self.share_rebuilt = share_rebuilt
        self.index = index
        self.use_bound = use_bound
        self.node_seconds = node_seconds
        self.budget_bytes = int(budget_bytes)
        self.baseline = evaluate(index, set(), node_seconds)
        self.bound = PeakLowerBound(index, self.baseline.timeline, share_rebuilt=share_rebuilt)  # for the schedule it simulates
        self.simulations = 1
        self.skipped_by_bound = 0
        self.bound_violations = 0  # a simulated peak below its bound: the bound is wrong (tests assert none)
        self._best_peak = self.baseline.peak_bytes
        self._skipped: list[tuple[int, frozenset[int]]] = []

    def check(self, dropped: set[int] | frozenset[int]) -> tuple[bool, int | None, Evaluation | None]:
        """(fits?, simulated peak or None if skipped, evaluation or None)."""
        dropped = frozenset(dropped)
        lb = self.bound(dropped, above=self.budget_bytes)
        if self.use_bound and lb > self.budget_bytes:
            self.skipped_by_bound += 1
            self._skipped.append((lb, dropped))
            return False, None, None
        ev = evaluate(self.index, dropped, self.node_seconds, self.share_rebuilt)
        self.simulations += 1
        if ev.peak_bytes < lb:
            self.bound_violations += 1
        self._best_peak = min(self._best_peak, ev.peak_bytes)
        return ev.peak_bytes <= self.budget_bytes, ev.peak_bytes, ev

    def smallest_peak(self, time_limit: float | None = REFINE_SECONDS) -> "Reach":
        """The smallest peak over every set checked so far.

        Sets skipped by the bound are simulated now, lowest bound first (smaller sets
        first among equal bounds: they are cheaper), while their bound is below the best
        peak seen. Past `time_limit` seconds it stops and says how far it got: plans
        that drop most activations can take seconds each to simulate.
        """
        best = self._best_peak
        t0 = time.perf_counter()
        pending = sorted(self._skipped, key=lambda x: (x[0], len(x[1])))
        for lb, dropped in pending:
            if lb >= best:
                return Reach(best, best, True)
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                return Reach(best, lb, False)
            if self.bound(dropped) >= best:  # the whole bound (above stopped at the cheap part)
                continue
            peak = evaluate(self.index, dropped, self.node_seconds, self.share_rebuilt).peak_bytes
            self.simulations += 1
            if peak < lb:
                self.bound_violations += 1
            best = min(best, peak)
        return Reach(best, best, True)

    def stats(self) -> dict[str, int]:
        return {"simulations": self.simulations, "skipped_by_bound": self.skipped_by_bound, "bound_violations": self.bound_violations}


def no_plan_error(planner: str, budget_bytes: int, reach: Reach | int, baseline_peak: int, num_candidates: int) -> BudgetError:
    """The BudgetError of a planner with no plan under the budget; `reach` may be a bare (exact) peak."""
    from remat.budget import format_bytes

    if not isinstance(reach, Reach):
        reach = Reach(int(reach), int(reach), True)

    if reach.exact:
        smallest = f"the smallest peak it could reach is {format_bytes(reach.best)} ({reach.best} bytes)"
    else:
        smallest = (
            f"the smallest peak it could reach is {format_bytes(reach.best)} ({reach.best} bytes) among the plans "
            f"it simulated, and none of its plans goes below {format_bytes(reach.lower)} ({reach.lower} bytes)"
        )
    return BudgetError(
        f"no {planner} plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): {smallest}, "
        f"from {format_bytes(baseline_peak)} without recomputation, with {num_candidates} activations that may be "
        f"recomputed. Raise the budget to at least {format_bytes(reach.best)} (--budget {reach.best}), or lower "
        "the batch size.",
        reach=reach,
    )
