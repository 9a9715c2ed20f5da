"""The exact planner: on graphs small enough to enumerate every dropped set, it finds the
optimum that brute force finds (through the same schedule and simulator), proves it,
and its plans run like any other."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
from scipy.optimize import Bounds, milp

from remat.memory.graph_index import RebuildPolicy
from remat.memory.analysis import analyze
from remat.capture.capture import capture
from remat.capture.step_inputs import flat_inputs, run_captured
from remat.measurement.check import check_against_eager, twin
from remat.errors import BudgetError, PlanError
from remat.models import build_model, make_optimizer, make_train_step
from remat.planners.evaluate import evaluate
from remat.planners.plan import Plan
from remat.planners import PLANNERS
from remat.planners import make_plan as _make_plan
from remat.planners import milp as milp_planner
from remat.planners.milp import cut_loop as milp_solve
from remat.passes.rewriter import rewrite
from remat.memory.schedule import GraphIndex
from remat.memory.simulator import simulate_schedule


# The enumerations below are of the captured order: plan it alone.
make_plan = functools.partial(_make_plan, updates_in_backward=False, lean_ops=False)


def _graph(model_name: str, batch_size: int):
    spec = build_model(model_name, batch_size)
    opt = make_optimizer("sgd", spec.model.parameters())
    step = make_train_step(spec.loss_fn, zero_grad_first=True)
    tg = capture(step, spec.model, opt, spec.batch)
    analysis = analyze(tg)
    index = GraphIndex.build(tg, analysis)
    candidates = [t.id for t in analysis.activations() if index.candidate_problem(t.id) is None]
    # The program keeps a reserve for the generator states of replayed random ops instead
    # of pricing them, so it is exact on activations whose rebuilds replay none.
    candidates = [c for c in candidates if index.replay_state_reserve([c]) == 0]
    return spec, opt, step, tg, index, candidates


def _times(index: GraphIndex, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    return {n: 1e-4 * (1 + 9 * rng.random()) for n in index.order}


def _brute_force(index, candidates, node_seconds, policy=RebuildPolicy.PER_BLOCK):
    """(dropped, peak, overhead) of every legal dropped set of `candidates`."""
    out = []
    for k in range(len(candidates) + 1):
        for sub in itertools.combinations(candidates, k):
            try:
                ev = evaluate(index, set(sub), node_seconds, policy)
            except PlanError:
                continue
            out.append((frozenset(sub), ev.peak_bytes, ev.overhead_seconds))
    return out


def _program_cost(model, dropped, budget=None):
    """The program's cost of one dropped set: its binaries fixed to `dropped`, the copy and
    removal variables solved for. With `budget`, the memory rows at that budget are in the
    program too; None when they (or anything else) exclude the set."""
    lower, upper = model.lower.copy(), model.upper.copy()
    for g, members in enumerate(model.groups):
        lower[g] = upper[g] = 1.0 if set(members) <= dropped else 0.0
    rows = model.structure
    if budget is not None:
        mem, least = model.memory_rows(int(budget))
        if least is not None:
            return None
        rows = rows.extend(mem)
    res = milp(model.cost, integrality=model.integrality, bounds=Bounds(lower, upper), constraints=[rows.constraint(model.ncols)])
    return float(res.fun) if res.status == 0 else None


CASES = [
    # (model, batch, how many candidates to enumerate over (None: all), seed of the node times)
    ("mlp-deep", 512, None, 0),
    ("bert-tiny", 4, 9, 1),
    ("resnet-tiny", 4, 9, 2),
]


SCHEDULES = list(RebuildPolicy)


@functools.lru_cache(maxsize=None)
def _case(model_name, batch_size, k, seed):
    """The graph, the enumerated candidates, node times and every dropped set's truth under
    each schedule ({policy: [(dropped, peak, cost)]})."""
    spec, opt, step, tg, index, candidates = _graph(model_name, batch_size)
    rng = random.Random(seed)
    if k is not None and len(candidates) > k:
        candidates = sorted(rng.sample(candidates, k))
    ns = _times(index, seed)
    return index, candidates, ns, {share: _brute_force(index, candidates, ns, share) for share in SCHEDULES}


@pytest.mark.parametrize("policy", SCHEDULES)
@pytest.mark.parametrize("model_name,batch_size,k,seed", CASES)
def test_program_prices_every_dropped_set_as_the_schedule_does(model_name, batch_size, k, seed, policy):
    """Each schedule's program is a relaxation of that schedule: for every dropped set its
    cost (binaries fixed) is the true recompute_seconds (never above it), and its memory
    rows admit the set at its simulated peak. On mlp-deep and resnet-tiny some sets rebuild
    a value whose copy the schedule reuses after that value's own last reader (a later
    reader of its storage, e.g. a `detach` view): a program that ends the copy's life at
    its own last reader prices them above the schedule, and this
    test fails."""
    index, candidates, ns, results = _case(model_name, batch_size, k, seed)
    model = milp_planner.MilpModel.build(index, ns, candidates, policy=policy)
    above = []
    for dropped, peak, cost in results[policy]:
        got = _program_cost(model, dropped, peak)
        assert got is not None, f"the memory rows exclude a set at its own simulated peak {peak}: {sorted(dropped)}"
        if got > cost + 1e-12:
            above.append((sorted(dropped), got, cost))
        # Not only a bound: with d fixed, the rows leave only the schedule's copies.
        assert got == pytest.approx(cost, rel=1e-9, abs=1e-12), (sorted(dropped), got, cost)
    assert not above, f"{len(above)} of {len(results[policy])} sets priced above their true cost, e.g. {above[:3]}"


def test_program_prices_storage_level_reuse():
    """mlp-deep: autograd saves each sigmoid output twice, for the weight gradient's mm and,
    through a `detach` view, for sigmoid_backward. Dropping it, the schedule rebuilds
    addmm and sigmoid for the mm, and the later block that rebuilds the detach view reads
    that copy (alive up to its storage's last read) instead of rebuilding the chain again."""
    spec, opt, step, tg, index, candidates = _graph("mlp-deep", 512)
    ns = _times(index, 0)
    sid = next(s for s in candidates if index.analysis.tensors[s].node == "sigmoid")
    ev = evaluate(index, {sid}, ns)
    # One copy each; the forward detach, now read by nothing, is removed.
    assert ev.schedule.copies == ["addmm", "sigmoid", "detach"] and ev.schedule.removed == ["detach"]
    reader = next(u for u in index.users["detach"] if u not in index.forward)
    assert index.last_late_reader["sigmoid"] < index.rank[reader] <= index.storage_last_read("sigmoid")
    assert ev.overhead_seconds == pytest.approx(ns["addmm"] + ns["sigmoid"])
    model = milp_planner.MilpModel.build(index, ns, candidates)
    assert _program_cost(model, frozenset([sid])) == pytest.approx(ev.overhead_seconds, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("model_name,batch_size,k,seed", CASES)
def test_exact_planner_finds_the_brute_force_optimum(model_name, batch_size, k, seed):
    index, candidates, ns, results = _case(model_name, batch_size, k, seed)
    per_block = results[RebuildPolicy.PER_BLOCK]
    every = [(share, d, p, c) for share in SCHEDULES for d, p, c in results[share]]
    baseline_peak = per_block[0][1]
    lowest = min(p for _, _, p, _ in every)
    assert lowest < baseline_peak, "the enumeration must be able to lower the peak"
    peaks = sorted({p for _, p, _ in per_block if p < baseline_peak})
    budgets = sorted({peaks[0], peaks[len(peaks) // 3], peaks[(2 * len(peaks)) // 3], peaks[-1]})
    for budget in budgets:
        # The per-block program alone: the per-block optimum, proven.
        optimum = min(c for _, p, c in per_block if p <= budget)
        plan = make_plan("milp", index, ns, int(budget), candidates=candidates, time_limit=60, compete_shared=False)
        assert plan.predicted_peak_bytes <= budget and not plan.share_rebuilt
        assert plan.predicted_overhead_seconds == pytest.approx(optimum, rel=1e-9, abs=1e-12), (budget, plan.meta)
        assert plan.meta["milp_status"] == "optimal" and plan.meta["schedule"] == "per-block"
        assert plan.meta["milp_schedules"] == "per-block"
        assert plan.meta["milp_lower_bound"] <= plan.predicted_overhead_seconds + 1e-12
        assert plan.meta["milp_gap_seconds"] == pytest.approx(0.0, abs=1e-9)
        # The plan is what the schedule says it is.
        ev = evaluate(index, plan.dropped(index), ns)
        assert ev.peak_bytes == plan.predicted_peak_bytes
        assert ev.overhead_seconds == pytest.approx(plan.predicted_overhead_seconds)
        # Both programs: the optimum over both schedules, proven.
        best = min(c for _, _, p, c in every if p <= budget)
        both = make_plan("milp", index, ns, int(budget), candidates=candidates, time_limit=60)
        assert both.predicted_peak_bytes <= budget
        assert both.predicted_overhead_seconds == pytest.approx(best, rel=1e-9, abs=1e-12), (budget, both.meta)
        assert both.meta["milp_status"] == "optimal" and both.meta["milp_schedules"] == "per-block,shared"
        assert both.meta["milp_lower_bound"] <= both.predicted_overhead_seconds + 1e-12
        assert both.meta["milp_gap_seconds"] == pytest.approx(0.0, abs=1e-9)
        assert both.share_rebuilt == (both.meta["schedule"] == "shared")
        ev = evaluate(index, both.dropped(index), ns, both.policy)
        assert ev.peak_bytes == both.predicted_peak_bytes
        assert ev.overhead_seconds == pytest.approx(both.predicted_overhead_seconds)
        if both.share_rebuilt:
            assert both.predicted_overhead_seconds < optimum
            assert both.meta["other_schedule"]["predicted_overhead_seconds"] == pytest.approx(optimum)
    # Below the least reachable peak there is no plan, and the exact planner says so.
    with pytest.raises(BudgetError, match="no milp plan fits"):
        make_plan("milp", index, ns, int(lowest) - 1, candidates=candidates, time_limit=60)


def test_exact_planner_is_registered_and_never_worse_than_greedy():
    assert "milp" in PLANNERS
    spec, opt, step, tg, index, candidates = _graph("bert-tiny", 8)
    ns = _times(index, 3)
    base = evaluate(index, set(), ns).timeline
    for fraction in (0.8, 0.95):  # tighter ones take the shared program seconds more
        budget = base.persistent_bytes + int(fraction * base.step_peak_bytes)
        try:
            greedy = make_plan("mutwo", index, ns, budget)
        except BudgetError:
            continue
        exact = make_plan("milp", index, ns, budget, time_limit=60)
        assert exact.predicted_peak_bytes <= budget
        # Both keep the cheaper of the two schedules; the exact planner's optimum is over
        # both, among the plans that fit below its reserve for replayed random ops.
        reserve = exact.meta["milp_replay_reserve_bytes"]
        assert reserve > 0 and exact.meta["milp_status"] == "optimal_below_reserve"
        assert exact.meta["milp_lower_bound"] is None  # not claimed: plans in the reserve are left out
        if greedy.predicted_peak_bytes <= budget - reserve:
            assert exact.predicted_overhead_seconds <= greedy.predicted_overhead_seconds + 1e-12


def test_coarsened_program_returns_a_fitting_plan_and_says_it_is_coarse():
    spec, opt, step, tg, index, candidates = _graph("resnet-tiny", 8)
    ns = _times(index, 4)
    base = evaluate(index, set(), ns).timeline
    budget = base.persistent_bytes + int(0.8 * base.step_peak_bytes)
    fine = make_plan("milp", index, ns, budget, time_limit=60)
    coarse = make_plan("milp", index, ns, budget, time_limit=60, group_size=3)
    assert coarse.meta["milp_group_size"] == 3 and fine.meta["milp_group_size"] == 1
    assert coarse.predicted_peak_bytes <= budget
    # A grouped plan is one of the plain ones: never better than the exact optimum.
    assert coarse.predicted_overhead_seconds >= fine.predicted_overhead_seconds - 1e-12
    # Automatic coarsening above max_binaries candidates.
    auto = make_plan("milp", index, ns, budget, time_limit=60, max_binaries=(len(candidates) + 1) // 2)
    assert auto.meta["milp_group_size"] == 2 and auto.predicted_peak_bytes <= budget


def test_lazy_loop_cuts_solutions_the_schedule_rejects(monkeypatch):
    """If the simulator says a solution is over the budget, it is cut and the next one tried."""
    spec, opt, step, tg, index, candidates = _graph("mlp-deep", 512)
    ns = _times(index, 5)
    results = {}
    for k in range(len(candidates) + 1):
        for sub in itertools.combinations(candidates, k):
            ev = evaluate(index, set(sub), ns)
            results[frozenset(sub)] = (ev.peak_bytes, ev.overhead_seconds)
    base_peak = results[frozenset()][0]
    budget = sorted({p for p, _ in results.values() if p < base_peak})[0]
    optimum = min(c for p, c in results.values() if p <= budget)
    best_set = min((s for s, (p, c) in results.items() if p <= budget), key=lambda s: results[s][1])
    real_evaluate = milp_solve.evaluate
    calls = []

    def picky_evaluate(index_, dropped, node_seconds, policy=RebuildPolicy.PER_BLOCK):
        assert policy is RebuildPolicy.PER_BLOCK  # the per-block program checks its plans per block
        ev = real_evaluate(index_, dropped, node_seconds)
        calls.append(frozenset(dropped))
        if frozenset(dropped) == best_set:  # pretend the optimum does not fit
            ev.timeline.during = ev.timeline.during + (budget + 1)
        return ev

    monkeypatch.setattr(milp_solve, "evaluate", picky_evaluate)
    result = milp_planner.solve(milp_planner.MilpModel.build(index, ns, candidates), int(budget), time_limit=60)
    assert best_set in calls and result.over_budget >= 1 and result.iterations >= 2
    second = min(c for s, (p, c) in results.items() if p <= budget and s != best_set)
    assert result.evaluation is not None and result.evaluation.overhead_seconds == pytest.approx(second)
    assert result.status == "optimal" and second >= optimum


def test_milp_plan_runs_bitwise_like_eager_and_as_simulated():
    spec, opt, step, tg, index, candidates = _graph("bert-tiny", 4)
    ns = _times(index, 6)
    base = evaluate(index, set(), ns).timeline
    plan = make_plan("milp", index, ns, base.persistent_bytes + int(0.9 * base.step_peak_bytes), time_limit=60)
    assert plan.num_recomputed > 0
    assert plan.share_rebuilt and plan.meta["schedule"] == "shared"  # the rewrite holds rebuilt values
    schedule = plan.schedule(index)
    assert simulate_schedule(index, schedule).peak_bytes == plan.predicted_peak_bytes
    gm = rewrite(index, schedule).gm
    eager_model, eager_opt = twin(spec.model, opt)

    def remat_step(batch):
        return run_captured(tg, gm, spec.model, flat_inputs(tg, spec.model, opt, batch))

    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, remat_step, spec.batch, steps=2)
    assert result.match, result.summary()


def test_shared_schedule_competes_on_a_chain(tmp_path):
    """x → a → sin → b → sin → c (tests/test_planners.py's Chain), mm 2 s, mm_1 4 s, other nodes 1 s.
    Every dropped set, per block / shared (peak above the 1792 persistent bytes, seconds):
    {mm, sin} 12420 5 s / 12420 3 s is the only set under 13000 bytes that costs less than
    6 s, and sharing rebuilds mm once for both its blocks. At 15000 {sin} (1 s) fits and
    sharing saves nothing: the per-block plan is kept."""
    from tests.test_planners import CHAIN_PERSISTENT, Chain, build, seconds

    index = build(Chain)
    ns = seconds(index, mm=2.0, mm_1=4.0)
    plan = make_plan("milp", index, ns, CHAIN_PERSISTENT + 13000)
    assert plan.share_rebuilt and plan.meta["schedule"] == "shared"
    assert sorted(plan.keys) == ["mm", "sin"] and plan.predicted_overhead_seconds == pytest.approx(3.0)
    assert plan.predicted_peak_bytes == CHAIN_PERSISTENT + 12420
    assert plan.meta["other_schedule"]["schedule"] == "per-block"
    assert plan.meta["other_schedule"]["predicted_overhead_seconds"] == pytest.approx(5.0)
    # Proven over both schedules; each program's run is in the meta.
    assert plan.meta["milp_status"] == "optimal" and plan.meta["milp_schedules"] == "per-block,shared"
    assert plan.meta["milp_lower_bound"] == pytest.approx(3.0) and plan.meta["milp_gap_seconds"] == pytest.approx(0.0)
    assert plan.meta["milp_per_block"]["best_seconds"] == pytest.approx(5.0)
    assert plan.meta["milp_shared"]["best_seconds"] == pytest.approx(3.0)
    assert simulate_schedule(index, plan.schedule(index)).peak_bytes == plan.predicted_peak_bytes
    again = Plan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert again.share_rebuilt and again.meta == plan.meta
    # The brute-force optimum over both schedules at this budget.
    best = min(c for policy in RebuildPolicy for _, p, c in _brute_force(index, milp_planner_candidates(index), ns, policy)
               if p <= CHAIN_PERSISTENT + 13000)
    assert plan.predicted_overhead_seconds == pytest.approx(best)
    # Without the competition: the per-block optimum.
    alone = make_plan("milp", index, ns, CHAIN_PERSISTENT + 13000, compete_shared=False)
    assert not alone.share_rebuilt and alone.predicted_overhead_seconds == pytest.approx(5.0) and "other_schedule" not in alone.meta
    plan = make_plan("milp", index, ns, CHAIN_PERSISTENT + 15000)
    assert not plan.share_rebuilt and plan.keys == ["sin"] and plan.predicted_overhead_seconds == pytest.approx(1.0)
    assert plan.meta["other_schedule"] == {"schedule": "shared", "predicted_overhead_seconds": 1.0, "predicted_peak_bytes": 16260, "num_recomputed": 1}


def milp_planner_candidates(index):
    return [t.id for t in index.analysis.activations() if index.candidate_problem(t.id) is None]
