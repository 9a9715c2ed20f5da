"""Where the optimizer updates run, chosen together with what is recomputed: every planner
plans the graph in its captured order and with its private updates moved into the
backward pass (`GraphIndex.updates_in_backward`), and the plan that fits at the least
predicted time is kept (at equal time, the lower predicted peak). When neither fits, the
error with the smaller reachable peak is raised: the floor with updates in backward."""

from __future__ import annotations

from typing import Callable

from remat.budget import format_bytes
from remat.errors import BudgetError
from remat.pipeline.graph_index import GraphIndex
from remat.pipeline.schedule import build_schedule
from remat.pipeline.simulator import simulate_schedule
from remat.planners.plan import Plan


def plan_with_placement(index: GraphIndex, run: Callable[[GraphIndex], Plan], *, allow_moving: bool = True) -> Plan:
    """`run(index)` plans one order; this runs it on both and keeps the better plan."""
    moved, placement = index.updates_in_backward()
    if moved is None or not allow_moving:
        plan = run(index)
        why = placement.summary() if moved is None else "updates in the backward pass were not allowed"
        plan.updates_note = f"updates stay at the end of the step ({why})"
        return plan
    results: dict[bool, Plan] = {}
    errors: dict[bool, BudgetError] = {}
    for in_backward, idx in ((True, moved), (False, index)):
        if not in_backward and True in results and not results[True].recomputed:
            break  # nothing recomputed with the updates moved: the captured order cannot be cheaper
        try:
            results[in_backward] = run(idx)
        except BudgetError as e:
            errors[in_backward] = e
    if not results:
        smallest = min(errors, key=lambda k: errors[k].reach.best if errors[k].reach is not None else float("inf"))
        if smallest:
            captured = simulate_schedule(index, build_schedule(index, set())).peak_bytes
            errors[True].add_note(
                f"remat: that peak runs each optimizer update as soon as its gradient is final; the step as captured "
                f"peaks at {format_bytes(captured)} without recomputation"
            )
        raise errors[smallest]
    chosen = min(results, key=lambda k: (results[k].predicted_overhead_seconds, results[k].predicted_peak_bytes, not k))
    plan = results[chosen]
    plan.updates_in_backward = chosen
    plan.updates_note = placement.summary() if chosen else f"updates stay at the end of the step: {_why_not(results, errors)}"
    other = not chosen
    if other in results:
        plan.meta["other_placement"] = {
            "updates_in_backward": other,
            "predicted_overhead_seconds": results[other].predicted_overhead_seconds,
            "predicted_peak_bytes": results[other].predicted_peak_bytes,
        }
    elif other in errors:
        plan.meta["other_placement"] = {"updates_in_backward": other, "error": str(errors[other]).splitlines()[0]}
    # The baseline is the step as captured, whichever order the plan runs in.
    baseline = simulate_schedule(index, build_schedule(index, set()))
    plan.baseline_peak_bytes, plan.baseline_step_peak_bytes = int(baseline.peak_bytes), int(baseline.step_peak_bytes)
    return plan


def _why_not(results: dict[bool, Plan], errors: dict[bool, BudgetError]) -> str:
    if True in errors:
        return "with them in the backward pass no plan fits"
    moved, kept = results[True], results[False]
    return (
        f"with them in the backward pass the plan is predicted no better ({moved.predicted_overhead_seconds * 1e3:.3f} ms "
        f"overhead, peak {moved.predicted_peak_bytes} bytes, against {kept.predicted_overhead_seconds * 1e3:.3f} ms, "
        f"{kept.predicted_peak_bytes} bytes)"
    )
