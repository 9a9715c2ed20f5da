"""Both rebuild policies, the cheaper kept: the one place that decides between them.

Neither policy is better everywhere (schedule.RebuildPolicy): on long chains at tight
budgets sharing saves rebuilding a prefix many times, elsewhere its held copies force
more drops. A planner runs per block first; then, where that is worth it, shared, told
the per-block cost so that it may stop once it cannot win. The shared plan is kept only
when it saves time beyond rounding (sums of the same node times in another order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from remat.errors import BudgetError
from remat.memory.schedule import RebuildPolicy

R = TypeVar("R")
SAME_COST = 1e-9  # relative: below this the shared plan does not count as cheaper


@dataclass
class Competition(Generic[R]):
    chosen: RebuildPolicy
    results: dict[RebuildPolicy, R]
    errors: dict[RebuildPolicy, BudgetError] = field(default_factory=dict)

    @property
    def winner(self) -> R:
        return self.results[self.chosen]

    @property
    def other(self) -> RebuildPolicy:
        return RebuildPolicy.SHARED if self.chosen is RebuildPolicy.PER_BLOCK else RebuildPolicy.PER_BLOCK


def compete_schedules(
    run: Callable[[RebuildPolicy, float], R],
    overhead: Callable[[R], float],
    *,
    compete: Callable[[R], bool] = lambda _: True,
) -> Competition[R]:
    """`run(policy, cutoff)` plans under one policy (`cutoff`: the cost to beat, inf for
    none); `overhead(result)` is its predicted overhead (inf when it found no plan).
    A BudgetError of the per-block run propagates (it alone decides what is reachable:
    the shared run's early stops depend on the budget); one of the shared run is kept
    in `errors`. `compete(per_block_result)`: whether the shared run is worth running."""
    per_block = run(RebuildPolicy.PER_BLOCK, math.inf)
    results: dict[RebuildPolicy, R] = {RebuildPolicy.PER_BLOCK: per_block}
    errors: dict[RebuildPolicy, BudgetError] = {}
    if compete(per_block):
        try:
            results[RebuildPolicy.SHARED] = run(RebuildPolicy.SHARED, overhead(per_block))
        except BudgetError as e:
            errors[RebuildPolicy.SHARED] = e
    shared = results.get(RebuildPolicy.SHARED)
    cheaper = shared is not None and overhead(shared) < overhead(per_block) * (1 - SAME_COST)
    chosen = RebuildPolicy.SHARED if cheaper else RebuildPolicy.PER_BLOCK
    return Competition(chosen, results, errors)


def other_schedule_meta(competition: Competition[Any], describe: Callable[[Any], dict[str, Any] | None]) -> dict[str, Any] | None:
    """What the policy not chosen reached (`describe(result)`, None when it has no plan),
    or its error: the plan's meta["other_schedule"]."""
    other = competition.other
    if other in competition.results:
        summary = describe(competition.results[other])
        return None if summary is None else {"schedule": other.value, **summary}
    if other in competition.errors:
        return {"schedule": other.value, "error": competition.errors[other].brief()}
    return None
