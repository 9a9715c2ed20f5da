"""The exact planner: on graphs small enough to enumerate every dropped set, it finds the
optimum that brute force finds (through the same schedule and simulator), proves it,
and its plans run like any other."""

from __future__ import annotations

import itertools
import random

import pytest

from remat.analysis import analyze
from remat.capture import capture, flat_inputs, run_captured
from remat.check import check_against_eager, twin
from remat.errors import BudgetError, PlanError
from remat.models import build_model, make_optimizer, make_train_step
from remat.plan import evaluate
from remat.planners import PLANNERS, make_plan
from remat.planners import milp as milp_planner
from remat.rewriter import rewrite
from remat.schedule import GraphIndex, build_schedule, simulate_schedule


def _graph(model_name: str, batch_size: int):
    spec = build_model(model_name, batch_size)
    opt = make_optimizer("sgd", spec.model.parameters())
    step = make_train_step(spec.loss_fn, zero_grad_first=True)
    tg = capture(step, spec.model, opt, spec.batch)
    analysis = analyze(tg)
    index = GraphIndex.build(tg, analysis)
    candidates = [t.id for t in analysis.activations() if index.candidate_problem(t.id) is None]
    return spec, opt, step, tg, index, candidates


def _times(index: GraphIndex, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    return {n: 1e-4 * (1 + 9 * rng.random()) for n in index.order}


def _brute_force(index, candidates, node_seconds):
    """(peak, overhead) of every legal dropped set of `candidates`."""
    out = []
    for k in range(len(candidates) + 1):
        for sub in itertools.combinations(candidates, k):
            try:
                ev = evaluate(index, set(sub), node_seconds)
            except PlanError:
                continue
            out.append((ev.peak_bytes, ev.overhead_seconds))
    return out


CASES = [
    # (model, batch, how many candidates to enumerate over (None: all), seed of the node times)
    ("mlp-deep", 512, None, 0),
    ("bert-tiny", 4, 9, 1),
    ("resnet-tiny", 4, 9, 2),
]


@pytest.mark.parametrize("model_name,batch_size,k,seed", CASES)
def test_exact_planner_finds_the_brute_force_optimum(model_name, batch_size, k, seed):
    spec, opt, step, tg, index, candidates = _graph(model_name, batch_size)
    rng = random.Random(seed)
    if k is not None and len(candidates) > k:
        candidates = sorted(rng.sample(candidates, k))
    ns = _times(index, seed)
    results = _brute_force(index, candidates, ns)
    baseline_peak = results[0][0]
    lowest = min(p for p, _ in results)
    assert lowest < baseline_peak, "the enumeration must be able to lower the peak"
    peaks = sorted({p for p, _ in results if p < baseline_peak})
    budgets = sorted({peaks[0], peaks[len(peaks) // 3], peaks[(2 * len(peaks)) // 3], peaks[-1]})
    for budget in budgets:
        optimum = min(c for p, c in results if p <= budget)
        plan = make_plan("milp", index, ns, int(budget), candidates=candidates, time_limit=60)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_overhead_seconds == pytest.approx(optimum, rel=1e-9, abs=1e-12), (budget, plan.meta)
        assert plan.meta["milp_status"] == "optimal"
        assert plan.meta["milp_lower_bound"] <= plan.predicted_overhead_seconds + 1e-12
        assert plan.meta["milp_gap_seconds"] == pytest.approx(0.0, abs=1e-9)
        # The plan is what the schedule says it is.
        ev = evaluate(index, plan.dropped(index), ns)
        assert ev.peak_bytes == plan.predicted_peak_bytes
        assert ev.overhead_seconds == pytest.approx(plan.predicted_overhead_seconds)
    # Below the least reachable peak there is no plan, and the exact planner says so.
    with pytest.raises(BudgetError, match="no milp plan fits"):
        make_plan("milp", index, ns, int(lowest) - 1, candidates=candidates, time_limit=60)


def test_exact_planner_is_registered_and_never_worse_than_greedy():
    assert "milp" in PLANNERS
    spec, opt, step, tg, index, candidates = _graph("bert-tiny", 8)
    ns = _times(index, 3)
    base = evaluate(index, set(), ns).timeline
    for fraction in (0.7, 0.85, 0.95):
        budget = base.persistent_bytes + int(fraction * base.step_peak_bytes)
        try:
            greedy = make_plan("mutwo", index, ns, budget)
        except BudgetError:
            continue
        exact = make_plan("milp", index, ns, budget, time_limit=60)
        assert exact.predicted_peak_bytes <= budget
        assert exact.predicted_overhead_seconds <= greedy.predicted_overhead_seconds + 1e-12
        assert exact.meta["milp_lower_bound"] <= exact.predicted_overhead_seconds + 1e-12


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
    real_evaluate = milp_planner.evaluate
    calls = []

    def picky_evaluate(index_, dropped, node_seconds):
        ev = real_evaluate(index_, dropped, node_seconds)
        calls.append(frozenset(dropped))
        if frozenset(dropped) == best_set:  # pretend the optimum does not fit
            ev.timeline.during = ev.timeline.during + (budget + 1)
        return ev

    monkeypatch.setattr(milp_planner, "evaluate", picky_evaluate)
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
    schedule = build_schedule(index, plan.dropped(index))
    assert simulate_schedule(index, schedule).peak_bytes == plan.predicted_peak_bytes
    gm = rewrite(index, schedule).gm
    eager_model, eager_opt = twin(spec.model, opt)

    def remat_step(batch):
        return run_captured(tg, gm, spec.model, flat_inputs(tg, spec.model, opt, batch))

    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, remat_step, spec.batch, steps=2)
    assert result.match, result.summary()
