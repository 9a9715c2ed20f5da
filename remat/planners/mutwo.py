"""The μ-TWO recomputation planner (Purandare et al., MLSys 2023; after Capuchin, ASPLOS 2020).

DESIGN.md, "The μ-TWO recomputation planner". The greedy core (`greedy`) is a pure
function over small records (size, recompute sources, recompute time) and a `fits`
callback; `plan_mutwo` builds the records from a graph and answers `fits` with the
schedule and the plan simulator, so that what the greedy checks is what will run.

The greedy's cost model is the paper's: a tensor recomputed through another recomputed
tensor pays for that one's recompute again (times add up along chains), as the schedule
does too (a block's intermediates are rebuilt for each later block that needs them).
Its running sums only rank candidates: the overhead a plan reports is the schedule's
(`recompute_seconds`), which also shares rebuilds within a block and removes forward ops
that only fed dropped tensors.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from remat.errors import PlanError
from remat.memory.schedule import GraphIndex, RebuildPolicy
from remat.planners.compete import compete_schedules, other_schedule_meta
from remat.planners.evaluate import REACH_WORK, Evaluation, Evaluator, assemble_plan, no_plan_error
from remat.planners.plan import Plan

Id = Hashable


# ---------------------------------------------------------------------- the greedy core


@dataclass(frozen=True)
class Candidate:
    """One activation that may be recomputed, as the greedy sees it before any pick."""

    id: Id
    size: int  # bytes freed by dropping it
    sources: frozenset  # ids of the tensors its recompute reads (kept activations, parameters, inputs)
    time: float  # seconds to recompute it from those sources
    order: int = 0  # tie-break: among equal ratios and sizes, the earliest (creation rank) first


@dataclass
class PickLog:
    """What one step of the greedy did (DESIGN.md step 2), and the simulated peak after it."""

    pick: Id
    ratio: float  # its ratio when picked: size / total recompute time
    total_time: float  # its total recompute time when picked
    recomputed_updates: dict  # id -> (sources, time): already-recomputed tensors that now recompute through it
    candidate_updates: dict  # id -> (sources, time): remaining candidates that had it as a source
    total_time_updates: dict  # id -> total time: remaining candidates among its sources
    peak: int | None  # simulated peak after the pick (None: not simulated, provably above the budget)
    fits: bool
    rejected: str | None = None  # why the schedule refused this pick (it was then left out)


@dataclass
class GreedyResult:
    picks: list  # ids in pick order (rejected picks excluded)
    log: list[PickLog]
    fitted: bool
    sources: dict = field(default_factory=dict)  # id -> final sources of each pick
    times: dict = field(default_factory=dict)  # id -> final recompute time of each pick


def ratio_of(size: int, total_time: float) -> float:
    return math.inf if total_time <= 0 else size / total_time


def greedy(candidates: list[Candidate], fits: Callable[[list], tuple[bool, int | None]]) -> GreedyResult:
    """Pick candidates by recompute ratio until `fits(picks)` says the plan fits.

    `fits` gets the picks so far (the newest last) and answers (fits?, simulated peak);
    it may raise PlanError to refuse a pick, which is then dropped from the candidates.
    Ties in ratio go to the larger tensor, then to the smaller `order`.
    """
    ids = [c.id for c in candidates]
    if len(set(ids)) != len(ids):
        raise ValueError("candidate ids must be unique")
    size = {c.id: c.size for c in candidates}
    order = {c.id: c.order for c in candidates}
    sources: dict[Id, set] = {c.id: set(c.sources) for c in candidates}
    rtime: dict[Id, float] = {c.id: float(c.time) for c in candidates}
    remaining: set = set(ids)
    recomputed: list = []
    is_recomputed: set = set()
    # Who reads whom, kept both ways: users[s] = tensors (recomputed or not) with s in their sources.
    users: dict[Id, set] = {}
    for c in candidates:
        for s in c.sources:
            users.setdefault(s, set()).add(c.id)
    # dependents[c] = recomputed tensors with c among their sources: if c is recomputed
    # too, each of them pays for c once more (DESIGN.md step 2, third bullet).
    dependents: dict[Id, int] = {}

    def total(cid: Id) -> float:
        return rtime[cid] * (1 + dependents.get(cid, 0))

    # The best remaining candidate: highest ratio, then largest, then earliest (then the
    # order given). A heap with an entry pushed whenever a candidate's ratio changes; an
    # entry whose key is no longer its candidate's is skipped when it surfaces.
    position = {c: i for i, c in enumerate(ids)}

    def key(c: Id) -> tuple:
        return (-ratio_of(size[c], total(c)), -size[c], order[c], position[c])

    current = {c: key(c) for c in ids}
    heap = [(k, c) for c, k in current.items()]
    heapq.heapify(heap)

    def rekey(c: Id) -> None:
        if c in remaining:
            k = key(c)
            if k != current[c]:
                current[c] = k
                heapq.heappush(heap, (k, c))

    log: list[PickLog] = []
    while remaining:
        while True:
            k, best = heapq.heappop(heap)
            if best in remaining and current[best] == k:
                break
        best_total = total(best)
        remaining.discard(best)
        try:
            ok, peak = fits([*recomputed, best])
        except PlanError as e:
            log.append(PickLog(best, ratio_of(size[best], best_total), best_total, {}, {}, {}, None, False, str(e)))
            continue
        recomputed.append(best)
        is_recomputed.add(best)
        t_sources = set(sources[best])
        t_time = rtime[best]
        for s in t_sources:
            dependents[s] = dependents.get(s, 0) + 1
            rekey(s)
        rec_updates: dict = {}
        cand_updates: dict = {}
        for u in sorted(users.pop(best, set()), key=order.__getitem__):
            if u == best:
                continue
            srcs = sources[u]
            srcs.discard(best)
            for s in t_sources:
                if s not in srcs:
                    srcs.add(s)
                    users.setdefault(s, set()).add(u)
                    if u in is_recomputed:
                        dependents[s] = dependents.get(s, 0) + 1
                        rekey(s)
            rtime[u] += t_time
            rekey(u)
            target = rec_updates if u in is_recomputed else cand_updates
            target[u] = (frozenset(srcs), rtime[u])
        total_updates = {s: total(s) for s in sorted((s for s in t_sources if s in remaining), key=order.__getitem__)}
        log.append(PickLog(best, ratio_of(size[best], best_total), best_total, rec_updates, cand_updates, total_updates, peak, ok))
        if ok:
            break
    fitted = bool(log) and log[-1].fits
    return GreedyResult(
        picks=recomputed,
        log=log,
        fitted=fitted,
        sources={r: frozenset(sources[r]) for r in recomputed},
        times={r: rtime[r] for r in recomputed},
    )


# ---------------------------------------------------------------------- from a graph


def rebuild_ops_alone(index: GraphIndex, sid: int) -> list[str]:
    """The forward ops that rebuild storage `sid` for its backward readers when only it is dropped."""
    return _rebuilt_alone(index, sid)[0]


def _rebuilt_alone(index: GraphIndex, sid: int) -> tuple[list[str], frozenset[int]]:
    """`rebuild_ops_alone` and the storages those ops read (besides `sid`), worked out once
    per graph: every planner run on it, at every budget, asks again."""
    cache = index.__dict__.setdefault("_rebuilt_alone", {})
    found = cache.get(sid)
    if found is None:
        ops = index.closure(index.backward_readers(sid), frozenset([sid]))
        op_set = set(ops)
        srcs: set[int] = set()
        for n in ops:
            for a in index.reads_of_copy(n):
                if a not in op_set:
                    srcs.update(index.storages.get(a, []))
        srcs.discard(sid)
        found = cache[sid] = (ops, frozenset(srcs))
    return found


def candidate_records(index: GraphIndex, node_seconds: dict[str, float]) -> list[Candidate]:
    """Every activation that may be recomputed, with its sources and time when only it is dropped."""
    out: list[Candidate] = []
    tensors = index.analysis.tensors
    for t in (tensors[s] for s in index.candidates()):
        ops, srcs = _rebuilt_alone(index, t.id)
        out.append(Candidate(id=t.id, size=t.nbytes, sources=srcs, time=float(sum(node_seconds[n] for n in ops)), order=t.created))
    return out


@dataclass
class MutwoResult:
    plan: Plan
    greedy: GreedyResult
    records: list[Candidate]


def plan_mutwo(
    index: GraphIndex,
    node_seconds: dict[str, float],
    budget_bytes: int,
    *,
    simulate_every_pick: bool = False,
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
    give_up_above_seconds: float | None = None,
    patience: int | None = None,
    bound_patience: int | None = None,
    planner_name: str = "mutwo",  # the planner a refusal names: refined's, when refined runs this first
    rank_by_ops: bool = False,
    retry_ranked_by_ops: bool = True,
    **meta,
) -> MutwoResult:
    """μ-TWO's greedy on a graph: the first pick sequence whose simulated peak fits.

    Every prefix of the picks is checked with the plan simulator, except those that a
    lower bound (plan.PeakLowerBound) already puts above the budget (their log entry has
    no peak): the stop is the first pick that fits, as if every prefix had been
    simulated. `simulate_every_pick` simulates them all anyway, for a complete log.
    `policy` is the rebuild policy the picks are simulated (and later run) with
    (schedule.build_schedule). A BudgetError it raises carries the `Reach` as `.reach`.

    The greedy ranks by measured seconds, so which sets its prefixes pass through can
    differ between two profiles of one graph. Where no prefix fits, it runs again ranked
    by ops rebuilt (`rank_by_ops`: every op counted one second, the plan still priced in
    measured seconds): the smallest peak that run reaches, the one the error names,
    depends on the graph alone, and every budget from it up is met by the same prefixes
    on every run. `retry_ranked_by_ops=False`: no second run (the shared policy's run,
    whose error only records why it lost).

    Two stops, for a run that only competes with a plan already found (see `plan`):
    `give_up_above_seconds` ends the greedy once a simulated prefix's predicted
    overhead reaches it (more picks only add rebuilds), `patience` once that many
    simulated prefixes in a row have not lowered the smallest peak seen (under the
    shared schedule, held rebuilds can make the peak rise with every further pick), and
    `bound_patience` once that many prefixes in a row, simulated or not, have not lowered
    the smallest of their peaks and lower bounds.
    Both are deterministic, so plans stay reproducible.
    """
    t0 = time.perf_counter()
    ev = Evaluator(index, node_seconds, budget_bytes, use_bound=not simulate_every_pick, policy=policy)
    baseline = ev.baseline
    extra = dict(meta.pop("meta", None) or {})
    extra["schedule"] = policy.value
    if baseline.peak_bytes <= budget_bytes:
        plan = assemble_plan("mutwo", index, node_seconds, budget_bytes, [], baseline, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
        return MutwoResult(plan, GreedyResult([], [], True), [])
    records = candidate_records(index, dict.fromkeys(node_seconds, 1.0) if rank_by_ops else node_seconds)
    if rank_by_ops:
        extra["ranked_by"] = "ops rebuilt (no prefix ranked by measured seconds fits)"
    last: dict[str, Evaluation] = {}
    stale = _Lowest(baseline.peak_bytes)  # simulated peaks
    low = _Lowest(baseline.peak_bytes)  # simulated peaks and lower bounds

    def fits(picks: list) -> tuple[bool, int | None]:
        ok, peak, evaluation = ev.check(set(picks))
        since_low = low.saw(ev.last_bound if peak is None else peak)
        if not ok and bound_patience is not None and since_low >= bound_patience:
            raise _GiveUp
        if ok:
            assert evaluation is not None
            last["fit"] = evaluation
        elif evaluation is not None:
            if give_up_above_seconds is not None and evaluation.overhead_seconds >= give_up_above_seconds:
                raise _GiveUp
            since_lower = stale.saw(evaluation.peak_bytes)
            if patience is not None and since_lower >= patience:
                raise _GiveUp
        return ok, peak

    gave_up = False
    try:
        result = greedy(records, fits)
    except _GiveUp:
        result, gave_up = GreedyResult([], [], False), True
    if not result.fitted and retry_ranked_by_ops and not rank_by_ops:
        # Measured times ranked the picks: another run's profile may rank them otherwise.
        return plan_mutwo(
            index, node_seconds, budget_bytes, simulate_every_pick=simulate_every_pick, policy=policy, planner_name=planner_name,
            rank_by_ops=True, retry_ranked_by_ops=False, meta=extra, **meta,
        )  # fmt: skip
    if not result.fitted:
        # Pinned down only if the error is read (the shared policy's may never be).
        raise no_plan_error(planner_name, budget_bytes, lambda: ev.smallest_peak(work_limit=0 if gave_up else REACH_WORK), baseline.peak_bytes, len(records))
    extra.update(ev.stats())
    extra["candidates"] = len(records)
    plan = assemble_plan(
        "mutwo",
        index,
        node_seconds,
        budget_bytes,
        list(result.picks),
        last["fit"],
        baseline.timeline,
        time.perf_counter() - t0,
        meta=extra,
        policy=policy,
        **meta,
    )
    return MutwoResult(plan, result, records)


# Simulated prefixes in a row without a lower peak before the shared-schedule greedy
# stops (on ResNet-152 its peak only rises after the first few hundred picks, and each
# simulation of a large drop set takes a fraction of a second).
SHARED_PATIENCE = 8
# Prefixes in a row, simulated or only bounded, without a lower peak or bound, before the
# shared-schedule greedy stops: on ResNet-152 near its floor the bound stops falling a few
# hundred picks in and the run would go on through every candidate (over a second of
# bounds) to find nothing; where it finds a plan, no more than a handful go by.
SHARED_BOUND_PATIENCE = 50


@dataclass
class _Lowest:
    """The lowest value seen so far, and how many values in a row since have not been lower."""

    best: int
    since: int = 0

    def saw(self, value: int) -> int:
        self.since = 0 if value < self.best else self.since + 1
        self.best = min(self.best, value)
        return self.since


class _GiveUp(Exception):
    """Raised inside the greedy's `fits` to end a run that can no longer win."""


def plan(index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, **meta) -> Plan:
    """The planner interface (remat.planners.make_plan).

    The greedy decides what to drop; how the dropped tensors are rebuilt is the
    schedule's policy (RebuildPolicy), and `compete_schedules` runs the greedy under
    both: per block first, then, when that plan recomputes anything, shared, which stops
    once it cannot win (`plan_mutwo`'s stops). `meta["schedule"]` says which policy the
    plan is for, `meta["other_schedule"]` what the other reached. What is reachable, and
    the error when nothing fits, are the per-block run's.
    """
    t0 = time.perf_counter()
    rest = {k: v for k, v in meta.items() if k != "meta"}

    def run(policy: RebuildPolicy, cutoff: float) -> MutwoResult:
        stops = {} if policy is RebuildPolicy.PER_BLOCK else {
            "give_up_above_seconds": cutoff, "patience": SHARED_PATIENCE, "bound_patience": SHARED_BOUND_PATIENCE, "retry_ranked_by_ops": False,
        }  # fmt: skip
        return plan_mutwo(index, node_seconds, budget_bytes, policy=policy, **stops, meta=dict(meta.get("meta") or {}), **rest)

    competition = compete_schedules(run, lambda r: r.plan.predicted_overhead_seconds, compete=lambda r: bool(r.plan.recomputed))
    plan = competition.winner.plan
    other = other_schedule_meta(competition, lambda r: {
        "predicted_overhead_seconds": r.plan.predicted_overhead_seconds,
        "predicted_peak_bytes": r.plan.predicted_peak_bytes,
        "num_recomputed": r.plan.num_recomputed,
    })  # fmt: skip
    if other is not None:
        plan.meta["other_schedule"] = other
    plan.planning_seconds = time.perf_counter() - t0
    return plan
