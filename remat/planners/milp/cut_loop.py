"""The exact program's lazy loop: solve, check the solution with the schedule, cut, repeat."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import Bounds, milp

from remat.errors import PlanError
from remat.planners.evaluate import Evaluation, evaluate
from remat.planners.milp.model import MilpModel
from remat.planners.milp.rows import Rows

DEFAULT_TIME_LIMIT = 60.0
REL_TOL = 1e-6


@dataclass
class MilpResult:
    dropped: frozenset[int] | None
    evaluation: Evaluation | None
    lower_bound: float  # on the true overhead of any plan (in the grouped space when grouped)
    status: str  # "optimal", "time_limit", "infeasible"
    iterations: int
    solver_seconds: float
    model_objective: float | None  # the program's cost of the returned plan
    cuts: int
    rejected: int  # solutions the schedule refused (PlanError)
    over_budget: int  # solutions whose simulated peak was over the budget
    smallest_peak: int | None = None
    log: list[dict[str, Any]] = field(default_factory=list)
    fitting: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # (true cost, set) of every solution that fit, cheapest first

    @property
    def gap_seconds(self) -> float | None:
        if self.evaluation is None:
            return None
        return max(0.0, self.evaluation.overhead_seconds - self.lower_bound)


def solve(model: MilpModel, budget_bytes: int, time_limit: float = DEFAULT_TIME_LIMIT, cutoff: float = math.inf) -> MilpResult:
    """The lazy loop: solve the relaxation, check its plan with the schedule, cut, repeat.

    Plans are checked with the schedule the model is of (model.policy). `cutoff`:
    the cost of a plan already in hand (from the other schedule); the loop also ends once
    its bound reaches it, with status "cutoff" if it found nothing cheaper: then no plan
    of this schedule costs less than `cutoff`.
    """
    t0 = time.perf_counter()
    index, ns = model.index, model.node_seconds
    # The program does not price the generator states kept to replay random ops (a few
    # KiB each on CPU); it plans under the budget less the most they can take.
    mem, least = model.memory_rows(budget_bytes - index.replay_state_reserve(model.candidates))
    base = model.structure.extend(mem)
    nd = len(model.groups)
    cuts = Rows()
    best: tuple[float, frozenset[int], Evaluation, float] | None = None
    bound = -math.inf
    status = "time_limit"
    iterations = rejected = over = 0
    smallest: int | None = least
    log: list[dict[str, Any]] = []
    fitting: dict[frozenset[int], float] = {}
    if least is not None:
        return MilpResult(None, None, math.inf, "infeasible", 0, time.perf_counter() - t0, None, 0, 0, 0, least)
    while True:
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05:
            break
        rows = base.extend(cuts)
        res = milp(
            model.cost,
            integrality=model.integrality,
            bounds=Bounds(model.lower, model.upper),
            constraints=[rows.constraint(model.ncols)] if rows.lo else [],
            options={"time_limit": max(left, 0.1), "mip_rel_gap": 0.0, "disp": False},
        )
        iterations += 1
        if res.status == 2:  # no solution left: the best plan found is optimal
            status = "optimal" if best is not None else "infeasible"
            bound = best[0] if best is not None else math.inf
            break
        if res.x is None:  # time limit before any solution
            dual = getattr(res, "mip_dual_bound", None)
            if dual is not None and np.isfinite(dual):
                bound = float(dual)
            break
        dual = getattr(res, "mip_dual_bound", None)
        level = float(dual) if (res.status == 1 and dual is not None and np.isfinite(dual)) else float(res.fun)
        bound = level if best is None else min(best[0], level)
        dropped = model.dropped_of(res.x)
        entry: dict[str, Any] = {"model_cost": float(res.fun), "bound": level, "dropped": len(dropped)}
        try:
            ev = evaluate(index, dropped, ns, model.policy)
        except PlanError as e:
            rejected += 1
            entry["rejected"] = str(e)
            ev = None
        if ev is not None:
            entry.update(peak=int(ev.peak_bytes), cost=float(ev.overhead_seconds))
            smallest = ev.peak_bytes if smallest is None else min(smallest, ev.peak_bytes)
            if ev.peak_bytes <= budget_bytes:
                fitting[dropped] = float(ev.overhead_seconds)
                if best is None or ev.overhead_seconds < best[0]:
                    best = (float(ev.overhead_seconds), dropped, ev, float(res.fun))
            else:
                over += 1
        log.append(entry)
        if best is not None and best[0] <= level + max(1e-12, REL_TOL * abs(best[0])):
            status = "optimal"
            bound = min(best[0], level)
            break
        if cutoff < math.inf and cutoff <= level + max(1e-12, REL_TOL * abs(cutoff)):
            status = "optimal" if best is not None else "cutoff"
            bound = level if best is None else min(best[0], level)
            break
        if res.status == 1:  # stopped by the time limit: the bound is all we have
            break
        # No-good cut: exclude exactly this choice of d.
        on = [g for g in range(nd) if res.x[g] > 0.5]
        off = [g for g in range(nd) if res.x[g] <= 0.5]
        cuts.add([(g, -1.0) for g in on] + [(g, 1.0) for g in off], 1.0 - len(on), math.inf)
    seconds = time.perf_counter() - t0
    found = sorted(((c, d) for d, c in fitting.items()), key=lambda x: (x[0], len(x[1]), sorted(x[1])))
    if best is None:
        status = "infeasible" if status == "optimal" else status
        return MilpResult(None, None, bound, status, iterations, seconds, None, cuts_count(cuts), rejected, over, smallest, log, found)
    return MilpResult(best[1], best[2], bound, status, iterations, seconds, best[3], cuts_count(cuts), rejected, over, smallest, log, found)


def cuts_count(rows: Rows) -> int:
    return len(rows.lo)
