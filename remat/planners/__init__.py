"""Planners: each takes a graph, its node times and a budget, and returns a Plan.

One interface (`make_plan`), one registry line per planner: a new planner is one new
module exposing `plan(index, node_seconds, budget_bytes, **meta) -> Plan` and one line
in `_MODULES`. A module may also expose `improve(index, plan, node_seconds, budget_bytes)
-> Plan`, run once on the plan kept over every graph planned (`plan_with_placement`).
"""

from __future__ import annotations

import importlib
from typing import Any

from remat.gc_pause import gc_paused
from remat.defaults import DEFAULT_PLANNER
from remat.errors import PlanError
from remat.planners.placement import plan_with_placement, planned_graphs
from remat.planners.plan import Plan, check_node_seconds
from remat.memory.schedule import GraphIndex

_MODULES: dict[str, str] = {
    "mutwo": "remat.planners.mutwo",
    "chen": "remat.planners.chen",
    "milp": "remat.planners.milp",
    "refined": "remat.planners.refined",
}
PLANNERS: tuple[str, ...] = tuple(_MODULES)
assert DEFAULT_PLANNER in PLANNERS


def check_planner(planner: str) -> None:
    if planner not in _MODULES:
        raise PlanError(f"unknown planner {planner!r}; available planners: {', '.join(PLANNERS)}")


@gc_paused()
def make_plan(
    planner: str, index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, *,
    updates_in_backward: bool = True, lean_ops: bool = True, **meta: Any
) -> Plan:
    """Plan with `planner` under a cap of `budget_bytes` on the whole peak.

    The planner plans both the captured order and, where `updates_in_backward` allows and
    some optimizer updates can move, the order with them in the backward pass; the plan
    that fits at the least predicted time is kept (`placement.plan_with_placement`). Where
    `lean_ops` allows, the graph with its lean operator variants (passes.lean_ops) is
    planned too.

    `meta` is passed to the Plan: model, batch_size, optimizer, fingerprint (the
    profile's), baseline_iteration_seconds, meta. Raises BudgetError when no plan fits,
    with the smallest peak the planner reached.
    """
    check_planner(planner)
    check_node_seconds(index, node_seconds)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        from remat.errors import BudgetError

        raise BudgetError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}; use remat.budget.parse_budget")
    module = importlib.import_module(_MODULES[planner])
    if "time_limit" in meta:  # the limit holds for every graph planned together
        graphs = planned_graphs(index, allow_moving=updates_in_backward, lean_ops=lean_ops)
        meta = {**meta, "time_limit": meta["time_limit"] / len(graphs)}
    improve = getattr(module, "improve", None)
    return plan_with_placement(
        index,
        lambda idx: module.plan(idx, node_seconds, budget_bytes, **meta),
        allow_moving=updates_in_backward,
        lean_ops=lean_ops,
        improve=(lambda idx, first: improve(idx, first, node_seconds, budget_bytes)) if improve else None,
    )
