"""Running a dropped set through the schedule and the simulator, for every planner:
one set (`evaluate`), many against a budget with the lower bound in front (`Evaluator`),
the plan made of the chosen set (`assemble_plan`), and the error when none fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from remat.budget import format_bytes
from remat.errors import BudgetError, PlanError
from remat.memory.schedule import GraphIndex, RebuildPolicy, Schedule, ScheduleTooLarge, build_schedule, recompute_seconds
from remat.memory.simulator import ScheduleIntervals, Timeline, schedule_intervals, simulate_schedule
from remat.passes.update_buckets import made_from, positions
from remat.planners.bound import PeakLowerBound
from remat.profile.time_model import OpCosts, StepTime, fresh_pages_seconds, simulate_time
from remat.planners.plan import Plan, Recomputed, graph_fingerprint_of


@dataclass
class Evaluation:
    """A dropped set run through the schedule and the plan simulator."""

    schedule: Schedule
    timeline: Timeline
    overhead_seconds: float
    intervals: ScheduleIntervals | None = None  # with the copies' touches, where asked for

    @property
    def peak_bytes(self) -> int:
        return self.timeline.peak_bytes


def evaluate(
    index: GraphIndex,
    dropped: set[int] | frozenset[int],
    node_seconds: dict[str, float],
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
    touches: bool = False,
    copy_limit: int | None = None,
) -> Evaluation:
    """`touches`: keep the schedule's intervals with what each copy touches (for
    KeepOneMoreBound). `copy_limit`: build_schedule's."""
    schedule = build_schedule(index, dropped, policy, copy_limit)
    made = schedule_intervals(index, schedule, touches=True) if touches else None
    timeline = simulate_schedule(index, schedule, made=made)
    return Evaluation(schedule, timeline, recompute_seconds(schedule, node_seconds), made)


# A rebuilt copy counts this many schedule steps of simulation work (building its block's
# closure costs that much more): the unit in which searches limit themselves, so that
# where they stop does not depend on the machine's speed.
COPY_WORK = 8


def simulation_work(evaluation: Evaluation) -> int:
    """The simulation work `evaluation` took: its schedule steps and its copies."""
    schedule = evaluation.schedule
    return len(schedule.steps) + COPY_WORK * len(schedule.copy_positions)


def step_time(index: GraphIndex, schedule: Schedule, costs: OpCosts) -> StepTime:
    """The schedule's ops on the host and device timelines (time_model), each priced as
    the captured op it runs; a bucket of a multi-tensor update at its share of the op's
    list positions on the device and a whole issue on the host; an op that writes into a
    dying input (lean_ops) less the fresh pages its own output would have cost."""
    captured = index.captured or index
    lean = index.tg.lean_into
    host, device = [], []
    for step in schedule.steps:
        name = step.node
        if name in costs.device:
            host.append(costs.host[name])
            saved = 0.0
            if name in lean and not step.copy:
                saved = fresh_pages_seconds(_output_bytes(index.node_map[name]), costs.first_touch_seconds_per_byte)
            device.append(max(0.0, costs.device[name] - saved))
            continue
        whole = made_from(name)
        share = positions(index.node_map[name]) / max(1, positions(captured.node_map[whole]))
        host.append(costs.host[whole])
        device.append(costs.device[whole] * min(1.0, share))
    return simulate_time(host, device, costs.synchronous)


def _output_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def baseline_of(index: GraphIndex) -> Evaluation:
    """The graph's own schedule (nothing dropped) simulated: the same for every budget, policy
    and planner, so worked out once per graph (and its measured scratch). Shared: callers
    must not change it."""
    cached = index.__dict__.get("_baseline_evaluation")
    if cached is None or cached[0] is not index.scratch:
        cached = index.__dict__["_baseline_evaluation"] = (index.scratch, evaluate(index, frozenset(), {}))
    return cached[1]


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
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
) -> Plan:
    entries = describe_recomputed(index, set(picks), picks, node_seconds)
    return Plan(
        share_rebuilt=policy.shares,
        planner=planner,
        fingerprint=fingerprint if fingerprint is not None else graph_fingerprint_of(index),
        budget_bytes=int(budget_bytes),
        recomputed=entries,
        predicted_peak_bytes=int(final.timeline.peak_bytes),
        predicted_step_peak_bytes=int(final.timeline.step_peak_bytes),
        baseline_peak_bytes=int(baseline.peak_bytes),
        predicted_overhead_seconds=float(final.overhead_seconds),
        baseline_iteration_seconds=float(
            baseline_iteration_seconds if baseline_iteration_seconds is not None else sum(node_seconds[n] for n in (index.captured or index).order)
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


def describe_recomputed(index: GraphIndex, dropped: set[int] | frozenset[int], order: list[int], node_seconds: dict[str, float]) -> list[Recomputed]:
    """Entries for the storages in `order`, each with its closure under the whole dropped set."""
    dropped = frozenset(dropped)
    tensors = index.analysis.tensors
    out: list[Recomputed] = []
    for sid in order:
        ops = index.closure(index.backward_readers(sid), dropped)
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


# The simulation work a failed planner may spend pinning down the smallest peak it can
# reach (about 3 s on a 2-core CPU) ...
REACH_WORK = 3_000_000
# ... and how close it pins it: near the floor each simulation can take half a second, for
# plans whose bounds differ by a few hundred KB of a GB.
REACH_TOLERANCE = 0.001


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
        self, index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, use_bound: bool = True, policy: RebuildPolicy = RebuildPolicy.PER_BLOCK
    ):
        self.policy = policy
        self.index = index
        self.use_bound = use_bound
        self.node_seconds = node_seconds
        self.budget_bytes = int(budget_bytes)
        self.baseline = baseline_of(index)
        self.bound = PeakLowerBound(index, self.baseline.timeline, policy)  # for the schedule it simulates
        self.simulations = 1
        self.skipped_by_bound = 0
        self.bound_violations = 0  # a simulated peak below its bound: the bound is wrong (tests assert none)
        self._best_peak = self.baseline.peak_bytes
        self._skipped: list[tuple[int, frozenset[int]]] = []
        self.last_bound = self.baseline.peak_bytes  # the lower bound of the set checked last

    def check(self, dropped: set[int] | frozenset[int]) -> tuple[bool, int | None, Evaluation | None]:
        """(fits?, simulated peak or None if skipped, evaluation or None)."""
        dropped = frozenset(dropped)
        lb = self.last_bound = self.bound(dropped, above=self.budget_bytes)
        if self.use_bound and lb > self.budget_bytes:
            self.skipped_by_bound += 1
            self._skipped.append((lb, dropped))
            return False, None, None
        ev = evaluate(self.index, dropped, self.node_seconds, self.policy)
        self.simulations += 1
        if ev.peak_bytes < lb:
            self.bound_violations += 1
        self._best_peak = min(self._best_peak, ev.peak_bytes)
        return ev.peak_bytes <= self.budget_bytes, ev.peak_bytes, ev

    def smallest_peak(self, work_limit: int = REACH_WORK) -> "Reach":
        """The smallest peak over every set checked so far.

        Sets skipped by the bound are simulated now, lowest bound first (smaller sets
        first among equal bounds: they are cheaper), while their bound is below the best
        peak seen. Past `work_limit` units of simulation work (`simulation_work`), or once
        every bound left is within `REACH_TOLERANCE` of the best peak after it simulated
        one set itself, it stops and says how far it got: plans that drop most
        activations can take seconds each to simulate. Work, not seconds, so that the
        peak it names is the same on every run.
        """
        best = self._best_peak
        pending = sorted(self._skipped, key=lambda x: (x[0], len(x[1])))
        simulated = work = 0
        for lb, dropped in pending:
            if lb >= best:
                return Reach(best, best, True)
            close = simulated and lb >= best * (1 - REACH_TOLERANCE)
            if close or work >= work_limit:
                return Reach(best, lb, False)
            if self.bound(dropped) >= best:  # the whole bound (above stopped at the cheap part)
                continue
            try:
                evaluation = evaluate(self.index, dropped, self.node_seconds, self.policy, copy_limit=(work_limit - work) // (1 + COPY_WORK))
            except ScheduleTooLarge:
                return Reach(best, lb, False)
            except PlanError:
                continue  # a set the schedule cannot run (picks that do not combine): no peak
            peak = evaluation.peak_bytes
            self.simulations += 1
            simulated += 1
            work += simulation_work(evaluation)
            if peak < lb:
                self.bound_violations += 1
            best = min(best, peak)
        return Reach(best, best, True)

    def stats(self) -> dict[str, int]:
        return {"simulations": self.simulations, "skipped_by_bound": self.skipped_by_bound, "bound_violations": self.bound_violations}


def no_plan_error(planner: str, budget_bytes: int, reach: "Reach | int | Callable[[], Reach]", baseline_peak: int, num_candidates: int) -> BudgetError:
    """The BudgetError of a planner with no plan under the budget; `reach` may be a bare
    (exact) peak, or a function that pins it down when the error is first read."""

    def message(reach: Reach) -> str:
        if reach.exact:
            smallest = f"the smallest peak it could reach is {format_bytes(reach.best)} ({reach.best} bytes)"
        else:
            smallest = (
                f"the smallest peak it could reach is {format_bytes(reach.best)} ({reach.best} bytes) among the plans "
                f"it simulated, and none of its plans goes below {format_bytes(reach.lower)} ({reach.lower} bytes)"
            )
        return (
            f"no {planner} plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): {smallest}, "
            f"from {format_bytes(baseline_peak)} without recomputation, with {num_candidates} activations that may be "
            f"recomputed. Raise the budget to at least {format_bytes(reach.best)} (memory_budget={reach.best}, or "
            f"--budget {reach.best} on the command line), or lower the batch size."
        )

    if isinstance(reach, int):
        reach = Reach(int(reach), int(reach), True)
    return BudgetError(message, reach=reach, headline=f"no {planner} plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes)")
