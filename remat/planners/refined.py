"""μ-TWO's plan, improved by a short local search: the default planner.

μ-TWO's greedy (`mutwo`) never takes a pick back, and prices each tensor alone. Four
moves, run once on the plan kept over every graph planned (`improve`), each checked by
the schedule and the plan simulator as for every planner, each kept only where the plan
still fits and costs less:

1. **Rebuild policy.** The same drop set under the other policy (`RebuildPolicy`): the
   greedy ran under both, but each stopped at its own first fitting prefix, and a set
   found per block can cost a quarter as much with rebuilt values shared. Where the set
   does not fit under the other policy, it is filled to fit (as in an exchange).
2. **Take back** each pick the plan no longer needs, the one whose rebuild costs most
   first (a bound, `KeepOneMoreBound`, skips those whose return cannot fit).
3. **Exchange** a costly pick for cheaper ones: drop it from the set, and while the plan
   is over the budget, add the activations live at the simulated peak that free most
   bytes per second of rebuild until their bytes cover the excess; then take back again.
   Added activations that raise the peak (their copies held across a later peak) are
   taken out again and passed over.
   The costliest `EXCHANGE_PICKS` picks are tried per round, for up to `EXCHANGE_ROUNDS`
   rounds that each find a cheaper plan, and `EXCHANGE_SIMULATIONS` simulations in all
   (fewer on large graphs: `EXCHANGE_STEPS` schedule steps simulated).
4. **Repeats alike.** Where the model repeats a block (transformer layers, a stage's
   bottlenecks: `profile.repeats`), each activation of the block and its counterparts
   in the other repeats form a class. The plan kept so far is made uniform per class:
   a class is dropped in every repeat where the plan drops more than a share of it
   (`ALIKE_SHARES`), else in none; the plan is filled to fit as in an exchange, picks are
   taken back, and the cheapest such plan gets its own rounds of exchanges. A move of
   about a dozen simulations: tried only where they are cheap (`ALIKE_STEPS`, graphs up to
   about 15,000 nodes), so that large graphs keep their planning time. The moves
   above change one pick at a time and stop at the first plan no single change improves;
   the same choice in every layer is a move of many picks at once, and often the better
   plan, since the layers cost and hold alike.

The whole search stops after a fixed amount of simulation work (`SEARCH_WORK`: schedule
steps, each rebuilt copy counted `COPY_WORK` times), the first take-back after half of it:
near the floor a plan rebuilds thousands of copies and one simulation takes a tenth of a
second. Work, not seconds, so that a plan does not depend on the machine's speed.

Every order is fixed (ties broken by storage id), so the plan is deterministic. The plan
records μ-TWO's cost and what each move did (`meta["refined"]`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from remat.errors import PlanError
from remat.profile.repeats import forward_counterparts
from remat.memory.schedule import GraphIndex, RebuildPolicy, ScheduleTooLarge
from remat.planners import mutwo
from remat.planners.bound import KeepOneMoreBound
from remat.planners.evaluate import COPY_WORK, Evaluation, assemble_plan, baseline_of, evaluate, simulation_work
from remat.planners.plan import Plan

EXCHANGE_PICKS = 8  # picks tried per exchange round, costliest first
EXCHANGE_ROUNDS = 4  # rounds, each ending at the first exchange that lowers the cost
FILL_ATTEMPTS = 3  # simulations while filling the excess after a pick is dropped
EXCHANGE_FROM = 1.25  # exchange from a policy's point only within this factor of the cheapest cost
EXCHANGE_SIMULATIONS = 24  # in all, and no more than
EXCHANGE_STEPS = 60_000  # schedule steps simulated in all (a 30,000-node graph's simulation takes 0.1 s)
ALIKE_SHARES = (0.5, 0.25, 0.75)  # a class is dropped in every repeat where the plan drops more than this share of it
ALIKE_STEPS = 200_000  # schedule steps simulated before a further share is tried
ALIKE_SIMULATIONS = 12  # tried only where ALIKE_STEPS covers this many simulations of the plan (about 15,000 nodes)
# The whole search stops after this much simulation work (evaluate.simulation_work). About a
# microsecond a unit on a 2-core CPU, so about 1.5 s: near the floor a simulation holds
# thousands of copies, and the search would otherwise take its time from the plan's size.
SEARCH_WORK = 1_500_000


def plan(index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, **meta) -> Plan:
    """The planner interface (remat.planners.make_plan): μ-TWO's plan of one graph."""
    first = mutwo.plan(index, node_seconds, budget_bytes, planner_name="refined", **meta)
    first.planner = "refined"
    first.meta["refined"] = {"mutwo_overhead_seconds": first.predicted_overhead_seconds}
    return first


def improve(index: GraphIndex, first: Plan, node_seconds: dict[str, float], budget_bytes: int) -> Plan:
    """`first` (μ-TWO's plan of `index`) improved by the four moves (module docstring)."""
    t0 = time.perf_counter()
    storage = index.analysis.storage_by_key()
    picks = frozenset(storage[r.key] for r in first.recomputed)
    search = _LocalSearch(index, node_seconds, budget_bytes)
    start = search.fitting(picks, first.policy)
    if start is None:  # μ-TWO simulated this very plan under the budget: nothing to improve from
        return first
    # The first take-back gets half the work at most: the moves after it can gain more
    # (the other policy alone can cut the cost by three quarters).
    search.work_limit = SEARCH_WORK // 2
    points = [search.take_back(start)]
    search.work_limit = SEARCH_WORK
    # The other policy from the set taken back, or else from μ-TWO's set, where either fits,
    # or else from the set taken back filled to fit under it.
    other = next(p for p in RebuildPolicy if p is not first.policy)
    start = search.fitting(points[0].dropped, other) or search.fitting(picks, other) or search.fill(points[0].dropped, other)
    if start is not None:
        points.append(search.take_back(start))
    cheapest = min(points, key=_Point.rank)
    # Exchanges from each policy's point that is not far behind the cheapest, the cheapest first.
    search.exchange_until = (search.simulations + EXCHANGE_SIMULATIONS, search.steps + EXCHANGE_STEPS)
    # Measured from the cheapest, so a negative overhead (a plan predicted faster than the
    # captured step: lean variants, moved updates) keeps the cheapest point among them.
    near = sorted((p for p in points if p.cost - cheapest.cost <= (EXCHANGE_FROM - 1) * abs(cheapest.cost)), key=_Point.rank)
    best = min((search.exchange(p) for p in near), key=_Point.rank)
    exchanged = best
    alike = search.alike(best)
    if alike is not None:
        search.exchange_until = (search.simulations + EXCHANGE_SIMULATIONS, search.steps + EXCHANGE_STEPS)
        best = min(best, search.exchange(alike), key=_Point.rank)
    record = {
        "mutwo_overhead_seconds": first.predicted_overhead_seconds,
        "mutwo_num_recomputed": first.num_recomputed,
        "mutwo_schedule": first.policy.value,
        "taken_back_overhead_seconds": cheapest.cost,  # the cheapest plan before any exchange
        "taken_back": len(picks - cheapest.dropped),
        "exchanges": search.exchanges,
        "found_by": _found_by(first, picks, cheapest, best, exchanged),
        "simulations": search.simulations,
        "skipped_by_keep_bound": search.skipped,
        "work": search.work,
        "stopped_out_of_work": search.out_of_work,
        "seconds": time.perf_counter() - t0,
    }
    if best.dropped == picks and best.policy is first.policy:
        first.meta["refined"] = record
        return first
    meta = {k: v for k, v in first.meta.items() if k != "other_schedule"}  # the competition was μ-TWO's
    meta.update(refined=record, schedule=best.policy.value)
    order = [storage[r.key] for r in first.recomputed if storage[r.key] in best.dropped]
    order += sorted(best.dropped - set(order))  # exchanged in, in storage order
    return assemble_plan(
        "refined", index, node_seconds, budget_bytes, order, best.evaluation, baseline_of(index).timeline,
        first.planning_seconds + time.perf_counter() - t0, meta=meta, policy=best.policy,
        fingerprint=first.fingerprint, model=first.model, batch_size=first.batch_size, optimizer=first.optimizer,
        baseline_iteration_seconds=first.baseline_iteration_seconds,
    )  # fmt: skip


def _found_by(first: Plan, picks: frozenset[int], taken_back: _Point, best: _Point, exchanged: _Point) -> list[str]:
    """The moves that made the plan kept, after μ-TWO's greedy."""
    moves = ["mutwo"]
    if best.policy is not first.policy:
        moves.append("other rebuild policy")
    if taken_back.dropped < picks or best.dropped < picks:
        moves.append("take back")
    if exchanged.cost < taken_back.cost:
        moves.append("exchange")
    if best is not exchanged:
        moves.append("repeats alike")
    return moves


def _counterpart_classes(index: GraphIndex) -> list[frozenset[int]]:
    """The candidate activations grouped with their counterparts in the other repeats of
    their block: the same output of the same op, one layer apart (classes of two or more)."""
    counterpart = forward_counterparts(index.tg)
    tensors = index.analysis.tensors
    groups: dict[tuple[str, int], list[int]] = {}
    for sid in index.candidates():
        node = index.order[tensors[sid].created]
        if node in counterpart:
            outputs = index.storages[node]
            groups.setdefault((counterpart[node], outputs.index(sid) if sid in outputs else -1), []).append(sid)
    return [frozenset(g) for g in groups.values() if len(g) > 1]


@dataclass(frozen=True)
class _Point:
    """A drop set that fits, with its simulation, under one rebuild policy."""

    dropped: frozenset[int]
    evaluation: Evaluation
    policy: RebuildPolicy

    @property
    def cost(self) -> float:
        return self.evaluation.overhead_seconds

    def rank(self) -> tuple[float, int]:
        return (self.cost, self.evaluation.peak_bytes)


@dataclass
class _LocalSearch:
    index: GraphIndex
    node_seconds: dict[str, float]
    budget_bytes: int
    simulations: int = 0
    skipped: int = 0
    exchanges: int = 0
    steps: int = 0  # schedule steps simulated
    work: int = 0  # simulation work done (SEARCH_WORK)
    work_limit: int = SEARCH_WORK
    exchange_until: tuple[int, int] = (0, 0)  # the simulations and steps at which exchanges stop
    _alone: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._candidates = self.index.candidates()

    def evaluate(self, dropped: frozenset[int], policy: RebuildPolicy) -> Evaluation:
        """`dropped` simulated; ScheduleTooLarge (a PlanError: no plan to the callers) where
        its copies alone would pass the work left, which then ends the search."""
        self.simulations += 1  # attempts, those the schedule refuses included
        try:
            evaluation = evaluate(self.index, dropped, self.node_seconds, policy, touches=True, copy_limit=(self.work_limit - self.work) // (1 + COPY_WORK))
        except ScheduleTooLarge:
            self.work = self.work_limit
            raise
        self.steps += len(evaluation.schedule.steps)
        self.work += simulation_work(evaluation)
        return evaluation

    @property
    def out_of_work(self) -> bool:
        return self.work >= self.work_limit

    def seconds_alone(self, sid: int) -> float:
        """Seconds to rebuild `sid` with nothing else dropped: the price the exchange ranks by."""
        if sid not in self._alone:
            self._alone[sid] = float(sum(self.node_seconds[n] for n in mutwo.rebuild_ops_alone(self.index, sid)))
        return self._alone[sid]

    def take_back(self, point: _Point, among: frozenset[int] | None = None) -> _Point:
        """`point` with each pick (of `among`, where given) removed, costliest rebuild first,
        where it still fits at no more cost."""
        bound = None
        for sid in sorted(point.dropped if among is None else among, key=lambda s: (-self.seconds_alone(s), s)):
            if self.out_of_work:
                break
            if bound is None:
                bound = KeepOneMoreBound(self.index, point.evaluation.schedule, point.evaluation.timeline, point.evaluation.intervals)
            if bound(sid) > self.budget_bytes:
                self.skipped += 1
                continue
            trial = self.fitting(point.dropped - {sid}, point.policy)
            if trial is not None and trial.cost <= point.cost:
                point = trial
                bound = None
        return point

    def exchange(self, point: _Point) -> _Point:
        """`point` after rounds of exchanging a costly pick for cheaper ones (module docstring)."""
        for _ in range(EXCHANGE_ROUNDS):
            costliest = sorted(point.dropped, key=lambda s: (-self.seconds_alone(s), s))[:EXCHANGE_PICKS]
            for sid in costliest:
                if self.simulations >= self.exchange_until[0] or self.steps >= self.exchange_until[1] or self.out_of_work:
                    return point
                filled = self.fill(point.dropped - {sid}, point.policy, excluded=sid)
                if filled is None:
                    continue
                # The picks just added first: most of the fill's excess is in them. Only an
                # exchange that pays then gets the whole take-back.
                trial = self.take_back(filled, among=filled.dropped - point.dropped)
                if trial.cost < point.cost:
                    point = self.take_back(trial)
                    self.exchanges += 1
                    break
            else:
                return point
        return point

    def alike(self, point: _Point) -> _Point | None:
        """The cheapest plan made from `point` uniform per class of counterparts, filled
        to fit and with picks taken back (module docstring); None where none fits or the
        graph is too large for the move."""
        if len(point.evaluation.schedule.steps) * ALIKE_SIMULATIONS > ALIKE_STEPS:
            return None
        classes = _counterpart_classes(self.index)
        best, tried, until = None, {point.dropped}, self.steps + ALIKE_STEPS
        for share in ALIKE_SHARES:
            if self.steps >= until or self.out_of_work:
                break
            dropped = set(point.dropped)
            for members in classes:
                if len(members & point.dropped) > share * len(members):
                    dropped |= members
                else:
                    dropped -= members
            if frozenset(dropped) in tried:
                continue
            tried.add(frozenset(dropped))
            filled = self.fill(frozenset(dropped), point.policy, excluded=None)
            if filled is not None:
                trial = self.take_back(filled)
                if best is None or trial.rank() < best.rank():
                    best = trial
        return best

    def fill(self, dropped: frozenset[int], policy: RebuildPolicy, excluded: int | None = None) -> _Point | None:
        """`dropped` with activations live at the simulated peak added until the plan fits, or None.

        Additions that raise the peak (their rebuilt copies held across a later peak, as
        under the shared policy) are taken back and passed over in the next attempt."""
        tensors = self.index.analysis.tensors
        passed_over: set[int] = set() if excluded is None else {excluded}
        before: tuple[frozenset[int], Evaluation] | None = None
        for attempt in range(FILL_ATTEMPTS + 1):
            if self.out_of_work:
                return None
            try:
                evaluation = self.evaluate(dropped, policy)
            except PlanError:
                return None
            if evaluation.peak_bytes <= self.budget_bytes:
                return _Point(dropped, evaluation, policy)
            if attempt == FILL_ATTEMPTS:
                return None
            if before is not None and evaluation.peak_bytes > before[1].peak_bytes:
                passed_over |= dropped - before[0]
                dropped, evaluation = before
            at = self.index.rank[evaluation.schedule.steps[evaluation.timeline.peak_rank].node]
            live = [s for s in self._candidates if s not in dropped and s not in passed_over and tensors[s].created < at <= tensors[s].last_use]
            live.sort(key=lambda s: (-tensors[s].nbytes / max(self.seconds_alone(s), 1e-12), s))
            excess, added = evaluation.peak_bytes - self.budget_bytes, []
            for s in live:
                added.append(s)
                excess -= tensors[s].nbytes
                if excess <= 0:
                    break
            if not added:
                return None
            before = (dropped, evaluation)
            dropped = dropped | frozenset(added)
        return None

    def fitting(self, dropped: frozenset[int], policy: RebuildPolicy) -> _Point | None:
        """`dropped` under `policy` where it fits, else None (and None once out of work)."""
        if self.out_of_work:
            return None
        try:
            evaluation = self.evaluate(dropped, policy)
        except PlanError:
            return None
        return _Point(dropped, evaluation, policy) if evaluation.peak_bytes <= self.budget_bytes else None
