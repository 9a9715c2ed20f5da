"""μ-TWO's plan, then the picks it no longer needs taken back.

The greedy never takes a pick back: a tensor chosen early for its ratio may be
unnecessary once later, larger picks are in, and the plan then lands well under the
budget at a cost it need not pay. This planner runs μ-TWO (`mutwo.plan`, both rebuild
policies), then tries to drop each pick from the set, the one whose rebuild costs most
first, keeping every removal after which the plan still fits (the schedule and the plan
simulator decide, as for every planner) and costs no more. One pass, each pick tried
once, so the result is deterministic. The plan records μ-TWO's cost beside its own.
"""

from __future__ import annotations

import time

from remat.planners import mutwo
from remat.planners.evaluate import Evaluator, assemble_plan
from remat.planners.plan import Plan
from remat.pipeline.schedule import GraphIndex


def plan(index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, **meta) -> Plan:
    """The planner interface (remat.planners.make_plan)."""
    t0 = time.perf_counter()
    first = mutwo.plan(index, node_seconds, budget_bytes, **meta)
    first.planner = "refined"
    first.meta["refined"] = {"removed": 0, "mutwo_overhead_seconds": first.predicted_overhead_seconds}
    if not first.recomputed:
        return first
    ev = Evaluator(index, node_seconds, budget_bytes, policy=first.policy)
    storage = index.analysis.storage_by_key()
    kept = {storage[r.key] for r in first.recomputed}
    best, cost = None, first.predicted_overhead_seconds
    for entry in sorted(first.recomputed, key=lambda r: (-r.recompute_seconds, r.key)):
        trial = kept - {storage[entry.key]}
        fits, _, evaluation = ev.check(trial)
        if fits and evaluation is not None and evaluation.overhead_seconds <= cost:
            kept, best, cost = trial, evaluation, evaluation.overhead_seconds
    if best is None:
        return first
    rest = {k: v for k, v in meta.items() if k != "meta"}
    extra = dict(meta.get("meta") or {})
    extra.update(
        schedule=first.policy.value,
        refined={
            "removed": first.num_recomputed - len(kept),
            "mutwo_overhead_seconds": first.predicted_overhead_seconds,
            "mutwo_num_recomputed": first.num_recomputed,
        },
        **ev.stats(),
    )
    order = [storage[r.key] for r in first.recomputed if storage[r.key] in kept]
    return assemble_plan(
        "refined", index, node_seconds, budget_bytes, order, best, ev.baseline.timeline, time.perf_counter() - t0, meta=extra, policy=first.policy, **rest
    )
