"""μ-TWO's plan, then the picks it no longer needs taken back.

The greedy never takes a pick back: a tensor chosen early for its ratio may be
unnecessary once later, larger picks are in, and the plan then lands well under the
budget at a cost it need not pay. This planner runs μ-TWO (`mutwo.plan`, both rebuild
policies) on every graph planned, and on the plan kept (`improve`, run once) tries to
drop each pick from the set, the one whose rebuild costs most first, keeping every
removal after which the plan still fits (the schedule and the plan simulator decide, as
for every planner) and costs no more. One pass, each pick tried once, so the result is
deterministic. The plan records μ-TWO's cost beside its own.
"""

from __future__ import annotations

import time

from remat.planners import mutwo
from remat.planners.bound import KeepOneMoreBound
from remat.planners.evaluate import Evaluator, assemble_plan, evaluate
from remat.planners.plan import Plan
from remat.pipeline.schedule import GraphIndex


def plan(index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, **meta) -> Plan:
    """The planner interface (remat.planners.make_plan): μ-TWO's plan of one graph."""
    first = mutwo.plan(index, node_seconds, budget_bytes, **meta)
    first.planner = "refined"
    first.meta["refined"] = {"removed": 0, "mutwo_overhead_seconds": first.predicted_overhead_seconds}
    return first


def improve(index: GraphIndex, first: Plan, node_seconds: dict[str, float], budget_bytes: int) -> Plan:
    """`first` (μ-TWO's plan of `index`) with every pick taken back that it can do without."""
    t0 = time.perf_counter()
    ev = Evaluator(index, node_seconds, budget_bytes, policy=first.policy)
    storage = index.analysis.storage_by_key()
    kept = {storage[r.key] for r in first.recomputed}
    best, cost = None, first.predicted_overhead_seconds
    bound, skipped = None, 0
    for entry in sorted(first.recomputed, key=lambda r: (-r.recompute_seconds, r.key)):
        if bound is None:
            now = best or evaluate(index, kept, node_seconds, first.policy)
            bound = KeepOneMoreBound(index, now.schedule, now.timeline)
        if bound(storage[entry.key]) > budget_bytes:
            skipped += 1
            continue
        trial = kept - {storage[entry.key]}
        fits, _, evaluation = ev.check(trial)
        if fits and evaluation is not None and evaluation.overhead_seconds <= cost:
            kept, best, cost, bound = trial, evaluation, evaluation.overhead_seconds, None
    if best is None:
        first.meta["refined"]["skipped_by_keep_bound"] = skipped
        return first
    meta = dict(first.meta)
    meta.update(
        refined={
            "removed": first.num_recomputed - len(kept),
            "mutwo_overhead_seconds": first.predicted_overhead_seconds,
            "mutwo_num_recomputed": first.num_recomputed,
            "skipped_by_keep_bound": skipped,
            "seconds": time.perf_counter() - t0,
        },
        **ev.stats(),
    )
    order = [storage[r.key] for r in first.recomputed if storage[r.key] in kept]
    return assemble_plan(
        "refined", index, node_seconds, budget_bytes, order, best, ev.baseline.timeline,
        first.planning_seconds + time.perf_counter() - t0, meta=meta, policy=first.policy,
        fingerprint=first.fingerprint, model=first.model, batch_size=first.batch_size, optimizer=first.optimizer,
        baseline_iteration_seconds=first.baseline_iteration_seconds,
    )  # fmt: skip
