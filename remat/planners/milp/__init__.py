"""Exact planner: a mixed-integer program over which activations to drop.

The decision is one binary per candidate activation, d_s = 1 if it is dropped; the
schedule (schedule.py) fixes everything else, and the program models that schedule:

- x[u, c] = 1 if forward op c is copied into the block before backward node u. A value
  u reads is rebuilt at its first late reader when it is unavailable (one of its storages
  is dropped, or is a forward temporary); the block is the closure through unavailable
  values that are not a shared target still alive at u. Both are lower bounds on x
  (x[u, c] >= U(c) for a needed input, x[u, c] >= x[u, c'] + U(c) - 1 along an edge
  c' reads c), and the objective pays for every copy, so at the optimum x is the block.
- When a shared target is alive (the schedule's storage-level reuse): an unavailable
  value a read after the forward pass is rebuilt at its first late reader, and that copy
  serves every later block, as a needed input or as an intermediate of a closure, up to
  the last late read of *any* value on a's storages (GraphIndex.shared_until: views
  of a, such as the `detach` autograd saves, count), not only up to a's own last reader.
  The window is fixed by the graph (it starts where a is first read, and a is not rebuilt
  again inside it), so the blocks stay linear in d and the objective is exact.
- rm[n] = 1 if forward op n is removed (only copies read it): rm[n] <= copies of n,
  rm[n] <= rm[f] for each forward reader f, rm[n] <= U(n); the objective gains its time.
- objective: sum of copy times minus removed times = schedule.recompute_seconds of
  build_schedule(index, dropped) for every dropped set (tests check it on every subset of
  small candidate sets, binaries fixed).
- memory: at each backward node, PeakLowerBound's linear form (kept activations live over
  their interval, dropped ones over the span of their late readers, extended to the last
  reader of the backward views of the rebuilt copy (GraphIndex.copy_spans), storages made after
  the forward pass as they are) plus the node's kernel scratch; and at each copy c of a
  block, what is live over the whole block plus c's new bytes, its scratch and its inputs
  rebuilt in the block. Every term is a lower bound on what the simulator counts (a
  copy the schedule reuses past those spans is held longer still, which is not
  counted), so with the exact objective the program is a relaxation of the schedule:
  for every dropped set it costs what the schedule costs, and admits the set under any
  budget the simulated peak fits. Its optimum (or HiGHS's dual bound) is thus a lower
  bound on the best true cost.

The truth is build_schedule + simulate_schedule. Each solution of the program is run
through them; whatever it is, a no-good cut then excludes it, and the program is solved
again, until its bound reaches the best fitting plan found (proven optimal), the program
has no solution left, or the time limit. The returned plan carries the proven gap
(best true cost - lower bound) in its meta.

The shared schedule (build_schedule(..., RebuildPolicy.SHARED): every rebuilt value that a
later node reads is held for it up to its storage's last late read, not only the targets)
has a program of its own, the same with three changes:
- P_a = the copies of a made so far in the blocks up to shared_until(a), for each
  value a with late readers; P_a <= 1 (held, a is not copied again in that window). A
  block's rows for a subtract the P_a of the blocks before it: x[u, a] >= U(a) - P_a,
  x[u, a] >= x[u, c] + U(a) - 1 - P_a.
- Copies only where needed: x[u, a] <= U(a), and x[u, a] <= the copies in u's block that
  read a (unless u reads a itself). Per block the objective alone keeps x down, but
  shared, a copy made early (in a block that does not need it) is held for later blocks
  and would price a set below its schedule. With d fixed, block by block in order, these
  rows leave exactly build_schedule's copies, so this objective is exact too (tests check
  it as for the per-block program).
- memory: a copy of a made before a's first late reader is held until that reader: its
  new storages count at each backward node in between (P_a of the blocks up to there),
  except where a span of the same storage already counts it.

Both run (plan(), through compete_schedules): the per-block program first, then its fitting drop sets re-run under
the shared schedule (a plan in hand), then the shared program, cut off at the cheapest
plan in hand. The plan is the cheaper of the two schedules' best, and "optimal", the
bound and the gap hold over both (meta "milp_schedules"). The shared program's LP
relaxation is weaker (held copies are sums of fractional copies), so it branches more:
seconds on bert-tiny where the per-block one takes a tenth of that.

Coarsening: with `group_size` k > 1 (or automatically above `max_binaries` candidates),
candidates are grouped k at a time in creation order and a group is dropped or kept as
a whole; the bound is then a bound over grouped plans only, and the meta says so.

The program's families of variables and rows are in `model.py`, the lazy cut loop in
`cut_loop.py`, and this module runs both policies and writes the plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from remat.budget import format_bytes
from remat.errors import BudgetError, PlanError
from remat.memory.schedule import GraphIndex, RebuildPolicy
from remat.planners.compete import compete_schedules, other_schedule_meta
from remat.planners.evaluate import Evaluation, assemble_plan, baseline_of, evaluate
from remat.planners.milp.model import MilpModel
from remat.planners.milp.cut_loop import DEFAULT_TIME_LIMIT, MilpResult, solve
from remat.planners.plan import Plan

__all__ = ["DEFAULT_TIME_LIMIT", "MilpModel", "MilpResult", "model_for", "plan", "solve"]

SHARED_TRIES = 8  # fitting per-block plans re-run under the shared schedule, cheapest first (a plan in hand for its program)
MAX_BINARIES = 400  # above this many candidates, group them (coarsening)

_CACHE: dict[tuple, MilpModel] = {}
_CACHE_SIZE = 4  # the two schedules' programs of a graph, and room for a second grouping


def model_for(
    index: GraphIndex,
    node_seconds: dict[str, float],
    candidates: list[int] | None,
    group_size: int,
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
) -> MilpModel:
    """The program's structure, built once per graph, node times, grouping and schedule (frontiers reuse it)."""
    key = (id(index), id(node_seconds), tuple(candidates) if candidates is not None else None, group_size,
           tuple(sorted(index.scratch.items())), policy)  # fmt: skip
    model = _CACHE.get(key)
    if model is None or model.index is not index or model.node_seconds is not node_seconds:
        # Keys hold ids: a model of another graph (or a collected one whose id came back) goes.
        for k in [k for k, m in _CACHE.items() if m.index is not index or m.node_seconds is not node_seconds]:
            del _CACHE[k]
        while len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        model = _CACHE[key] = MilpModel.build(index, node_seconds, candidates, group_size, policy=policy)
    return model


PROVEN = ("optimal", "infeasible", "cutoff")  # a run's statuses that prove its part of the bound


@dataclass
class _PolicyRun:
    """One policy's program, its run, and its cheapest plan: (cost, dropped, evaluation,
    the program's cost or None for a per-block set re-run under this policy)."""

    model: MilpModel
    result: MilpResult
    best: tuple[float, frozenset[int], Evaluation, float | None] | None
    tried: int = 0

    @property
    def overhead(self) -> float:
        return self.best[0] if self.best is not None else math.inf


def _cheaper(best: Any, dropped: frozenset[int] | None, ev: Evaluation | None, model_cost: float | None) -> Any:
    if dropped is not None and ev is not None and (best is None or ev.overhead_seconds < best[0]):
        return (float(ev.overhead_seconds), dropped, ev, model_cost)
    return best


def plan(
    index: GraphIndex,
    node_seconds: dict[str, float],
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    candidates: list[int] | None = None,
    group_size: int | None = None,
    max_binaries: int = MAX_BINARIES,
    compete_shared: bool = True,
    **meta: Any,
) -> Plan:
    """The planner interface (remat.planners.make_plan); `time_limit` in seconds.

    One program per rebuild policy, run by compete_schedules as μ-TWO's plan() runs its
    greedy: per block first, with up to half the time limit; the fitting drop sets its
    cut loop found are then run under the shared policy (SHARED_TRIES, cheapest first: a
    plan in hand), and the shared program runs with the rest of the time, cut off at the
    cheapest plan in hand (it only has to prove that no shared plan is cheaper). The plan
    is the cheapest over both; `meta["schedule"]` says which, `meta["other_schedule"]`
    what the other reached. "optimal", `milp_lower_bound` and `milp_gap_seconds` hold
    over the schedules in `meta["milp_schedules"]`; `meta["milp_per_block"]` and
    `meta["milp_shared"]` hold each program's own run. `compete_shared=False`: the
    per-block program alone, with the whole time limit.
    """
    t0 = time.perf_counter()
    if index.tg.backward_passes > 1:
        raise PlanError(
            f"the exact planner models one forward and one backward pass; this step runs {index.tg.backward_passes} "
            "(micro-batches accumulating gradients). Use --planner mutwo or chen."
        )
    extra = dict(meta.pop("meta", None) or {})
    baseline = baseline_of(index)
    policies = [RebuildPolicy.PER_BLOCK, RebuildPolicy.SHARED] if compete_shared else [RebuildPolicy.PER_BLOCK]
    schedules = ",".join(p.value for p in policies)
    if baseline.peak_bytes <= budget_bytes:
        extra.update(milp_status="optimal", milp_lower_bound=0.0, milp_gap_seconds=0.0, milp_iterations=0, milp_solver_seconds=0.0)
        extra.update(schedule=RebuildPolicy.PER_BLOCK.value, milp_schedules=schedules)
        return assemble_plan("milp", index, node_seconds, budget_bytes, [], baseline, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
    if candidates is None:
        candidates = index.candidates()
    if group_size is None:
        group_size = max(1, math.ceil(len(candidates) / max_binaries))
    deadline = t0 + time_limit
    per_block_fitting: list[tuple[float, frozenset[int]]] = []

    def run(policy: RebuildPolicy, cutoff: float) -> _PolicyRun:
        model = model_for(index, node_seconds, candidates, group_size, policy)
        if policy is RebuildPolicy.PER_BLOCK:
            left = deadline - time.perf_counter()
            result = solve(model, budget_bytes, time_limit=max(0.1, left / 2 if compete_shared else left))
            per_block_fitting.extend(result.fitting)
            return _PolicyRun(model, result, _cheaper(None, result.dropped, result.evaluation, result.model_objective))
        seed, tried = _best_shared(index, node_seconds, budget_bytes, per_block_fitting, deadline)
        best = _cheaper(None, seed[0], seed[1], None) if seed is not None else None
        cutoff = min(cutoff, best[0]) if best is not None else cutoff
        result = solve(model, budget_bytes, time_limit=max(0.1, deadline - time.perf_counter()), cutoff=cutoff)
        return _PolicyRun(model, result, _cheaper(best, result.dropped, result.evaluation, result.model_objective), tried)

    competition = compete_schedules(run, lambda r: r.overhead, compete=lambda _: compete_shared)
    runs = competition.results
    if all(r.best is None for r in runs.values()):
        raise _no_plan(runs, policies, budget_bytes, len(candidates), baseline.peak_bytes, time_limit)
    cost, dropped, ev, model_cost = competition.winner.best  # type: ignore[misc]
    other = other_schedule_meta(competition, lambda r: None if r.best is None else {
        "predicted_overhead_seconds": r.best[0],
        "predicted_peak_bytes": int(r.best[2].peak_bytes),
        "num_recomputed": len(r.best[1]),
    })  # fmt: skip
    if other is not None:
        extra["other_schedule"] = other
    reserve = index.replay_state_reserve(candidates)  # what solve() plans below the budget by
    extra.update(_milp_meta(runs, competition.chosen, schedules, cost, model_cost, group_size, time_limit, len(candidates), reserve))
    picks = sorted(dropped, key=lambda s: (index.analysis.tensors[s].created, s))
    return assemble_plan(
        "milp", index, node_seconds, budget_bytes, picks, ev, baseline.timeline, time.perf_counter() - t0,
        meta=extra, policy=competition.chosen, **meta,
    )  # fmt: skip


def _milp_meta(
    runs: dict[RebuildPolicy, _PolicyRun], chosen: RebuildPolicy, schedules: str, cost: float, model_cost: float | None,
    group_size: int, time_limit: float, num_candidates: int, reserve: int,
) -> dict[str, Any]:  # fmt: skip
    """The plan's meta about the programs: each policy's run, and the bound over both (each
    run's bound holds over its policy's plans; a run cut off at a plan's cost proves that
    none of its plans is cheaper than that plan).

    Where rebuilds may replay random ops, the programs plan under the budget less the most
    their generator states can hold (`reserve`): a plan that fits only in those last bytes
    is not among theirs, so "optimal" is then "optimal_below_reserve", and no lower bound
    on the true optimum is claimed (on bert-tiny batch 16 at 0.8, μ-TWO's plan fits 28 KB
    under the budget, inside the reserve, at 0.33% where the program's optimum is 0.61%)."""
    out: dict[str, Any] = {}
    lower = min(r.result.lower_bound for r in runs.values())
    for policy, r in runs.items():
        res = r.result
        out[f"milp_{policy.value.replace('-', '_')}"] = {
            "status": res.status, "lower_bound": _finite(res.lower_bound), "iterations": res.iterations, "cuts": res.cuts,
            "over_budget": res.over_budget, "rejected": res.rejected, "solver_seconds": res.solver_seconds,
            "build_seconds": r.model.build_seconds, "best_seconds": r.best[0] if r.best is not None else None,
            **r.model.stats,
        }  # fmt: skip
    per_block = runs[RebuildPolicy.PER_BLOCK]
    proven = all(r.result.status in PROVEN for r in runs.values())
    out.update(
        schedule=chosen.value,
        milp_schedules=schedules,
        milp_status=("optimal" if not reserve else "optimal_below_reserve") if proven else "time_limit",
        milp_replay_reserve_bytes=reserve,
        # None where a run stopped before any bound (JSON has no infinities), or where the
        # reserve leaves plans out.
        milp_lower_bound=None if reserve else _finite(lower),
        milp_gap_seconds=None if reserve else _finite(max(0.0, cost - lower)),
        milp_model_cost=model_cost,
        milp_iterations=sum(r.result.iterations for r in runs.values()),
        milp_cuts=sum(r.result.cuts for r in runs.values()),
        milp_over_budget=sum(r.result.over_budget for r in runs.values()),
        milp_rejected=sum(r.result.rejected for r in runs.values()),
        milp_solver_seconds=sum(r.result.solver_seconds for r in runs.values()),
        milp_build_seconds=sum(r.model.build_seconds for r in runs.values()),
        milp_shared_tried=runs[RebuildPolicy.SHARED].tried if RebuildPolicy.SHARED in runs else 0,
        milp_group_size=group_size,
        milp_time_limit=time_limit,
        candidates=num_candidates,
        **{f"milp_{k}": v for k, v in per_block.model.stats.items()},
    )
    return out


def _no_plan(
    runs: dict[RebuildPolicy, _PolicyRun], policies: list[RebuildPolicy], budget_bytes: int, num_candidates: int,
    baseline_peak: int, time_limit: float,
) -> BudgetError:  # fmt: skip
    results = [r.result for r in runs.values()]
    if all(r.status == "infeasible" for r in results):
        least = min((r.smallest_peak for r in results if r.smallest_peak is not None), default=baseline_peak)
        return BudgetError(
            f"no milp plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): the exact planner "
            f"proved that no choice among the {num_candidates} activations that may be recomputed reaches it "
            f"under the {' or the '.join(p.value for p in policies)} rebuild schedule "
            f"(the peak stays at or above {format_bytes(least)} ({least} bytes) on its lower bound; "
            f"{format_bytes(baseline_peak)} without recomputation). Raise the budget, or lower the batch size."
        )
    return BudgetError(
        f"the milp planner found no plan within the budget of {budget_bytes} bytes in its time limit of "
        f"{time_limit:g} s ({sum(r.iterations for r in results)} solutions tried, "
        f"{sum(r.over_budget for r in results)} over the budget, {sum(r.rejected for r in results)} "
        "refused by the schedule); raise --time-limit, or use the mutwo planner"
    )


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _best_shared(
    index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, fitting: list[tuple[float, frozenset[int]]], deadline: float
) -> tuple[tuple[frozenset[int], Evaluation] | None, int]:
    """The cheapest of `fitting` (per-block-fitting drop sets, cheapest first) that fits under
    the shared schedule, and how many were tried. The shared schedule holds every rebuilt
    value for its later readers: fewer rebuilds, more memory held, so a set that fits per
    block may not fit shared. The per-block optimum is always tried, the others while the
    time limit lasts. Cheap (a few simulations), and a plan in hand for the shared program."""
    best: tuple[frozenset[int], Evaluation] | None = None
    tried = 0
    for _, dropped in fitting[:SHARED_TRIES]:
        if tried and time.perf_counter() > deadline:
            break
        tried += 1
        try:
            ev = evaluate(index, dropped, node_seconds, RebuildPolicy.SHARED)
        except PlanError:
            continue
        if ev.peak_bytes <= budget_bytes and (best is None or ev.overhead_seconds < best[1].overhead_seconds):
            best = (dropped, ev)
    return best, tried
