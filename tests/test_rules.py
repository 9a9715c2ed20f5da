"""Each rule of the memory model is defined once (graph_index.GraphIndex), and the schedule,
the lower bound and the exact planner are all built from that one definition: changing
the rule there changes all three, consistently.

The rule changed here is how long a block may read a copy that an earlier block left
(`GraphIndex.shared_until`): narrowed to the value's own last reader after the forward
pass, instead of the last reader of any value on its storage: a rule under which the
schedule rebuilds some values again, so every dropped set's cost and blocks change."""

from __future__ import annotations

import itertools
import random

import pytest
from scipy.optimize import Bounds, milp

from remat.errors import PlanError
from remat.models import build_model, make_optimizer, make_train_step
from remat.memory.analysis import analyze
from remat.capture.capture import capture
from remat.memory.graph_index import GraphIndex, RebuildPolicy
from remat.planners.bound import PeakLowerBound
from remat.planners.evaluate import evaluate
from remat.planners.milp import MilpModel


def _index() -> GraphIndex:
    spec = build_model("mlp-deep", 512)
    opt = make_optimizer("sgd", spec.model.parameters())
    tg = capture(make_train_step(spec.loss_fn, zero_grad_first=True), spec.model, opt, spec.batch)
    return GraphIndex.build(tg, analyze(tg))


def _truth(index: GraphIndex, ns: dict[str, float], policy: RebuildPolicy) -> dict[frozenset[int], tuple[int, float, list]]:
    """(simulated peak, overhead, blocks) of every legal dropped set, from the schedule."""
    out = {}
    cands = index.candidates()
    for k in range(len(cands) + 1):
        for sub in itertools.combinations(cands, k):
            try:
                ev = evaluate(index, set(sub), ns, policy)
            except PlanError:
                continue
            out[frozenset(sub)] = (ev.peak_bytes, ev.overhead_seconds, _schedule_blocks(index, ev.schedule))
    return out


def _schedule_blocks(index: GraphIndex, schedule) -> list[tuple[int, set[str]]]:
    """(rank of the node a block runs before, the ops it copies) of a built schedule."""
    blocks, pending = [], set()
    for step in schedule.steps:
        if step.copy:
            pending.add(step.node)
        elif pending:
            blocks.append((index.rank[step.node], pending))
            pending = set()
    return blocks


def _program_cost(model: MilpModel, dropped: frozenset[int]) -> float:
    lower, upper = model.lower.copy(), model.upper.copy()
    for g, members in enumerate(model.groups):
        lower[g] = upper[g] = 1.0 if set(members) <= dropped else 0.0
    res = milp(model.cost, integrality=model.integrality, bounds=Bounds(lower, upper), constraints=[model.structure.constraint(model.ncols)])
    assert res.status == 0
    return float(res.fun)


def _own_last_reader(self: GraphIndex, a: str) -> int:
    return self.last_late_reader.get(a, -1)


@pytest.mark.parametrize("policy", list(RebuildPolicy), ids=lambda p: p.value)
def test_a_rule_changed_in_its_one_place_reaches_schedule_bound_and_program(monkeypatch, policy):
    rng = random.Random(0)
    index = _index()
    ns = {n: 1e-4 * (1 + 9 * rng.random()) for n in index.order}
    before = _truth(index, ns, policy)
    program_before = MilpModel.build(index, ns, policy=policy)

    monkeypatch.setattr(GraphIndex, "shared_until", _own_last_reader)
    after = _truth(index, ns, policy)
    changed = [d for d in before if d in after and after[d][1] > before[d][1] + 1e-12]
    assert changed, "the narrower rule should make the schedule rebuild some values again"

    # The exact program follows: with the binaries fixed it prices every set as the
    # schedule now does, and the program built under the old rule does not.
    program = MilpModel.build(index, ns, policy=policy)
    for d, (_, cost, _) in after.items():
        assert _program_cost(program, d) == pytest.approx(cost, rel=1e-9, abs=1e-12), sorted(d)
    assert any(_program_cost(program_before, d) != pytest.approx(after[d][1], rel=1e-9) for d in changed)

    # The bound follows: it finds the schedule's blocks, and stays below every simulated peak.
    bound = PeakLowerBound(index, evaluate(index, set(), ns).timeline, policy)
    for d, (peak, _, blocks) in after.items():
        found, _ = bound._blocks(d)
        assert sorted((r, sorted(ops)) for r, ops in found) == sorted((r, sorted(ops)) for r, ops in blocks), sorted(d)
        assert bound(d) <= peak
