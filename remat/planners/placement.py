"""Which graph a planner plans, chosen together with what is recomputed.

- Lean operator variants (`lean_ops.lean_index`): the graph with them and the graph
  without are both planned, and the cheaper plan kept.
- Where the optimizer updates run is chosen: every planner plans the graph in its
  captured order and with its private updates moved into the backward pass
  (`update_placement.moved_index`; a multi-tensor update in buckets, or one parameter to
  a bucket where no plan with buckets fits), and the plan that fits at the least predicted time
  is kept (at equal time, the lower predicted peak). When neither fits, the error with the
  smaller reachable peak is raised: the floor with updates in backward. A planner with a
  local search plans the captured order only where it holds less under the picks of the
  plan with the updates moved (`_holds_no_less`).

The baseline a plan is measured against is always the step as captured."""

from __future__ import annotations

from typing import Callable

from remat.budget import format_bytes
from remat.errors import BudgetError, PlanError
from remat.memory.graph_index import GraphIndex
from remat.memory.schedule import build_schedule
from remat.memory.simulator import simulate, simulate_schedule
from remat.planners.plan import Plan
from remat.passes.lean_ops import lean_index
from remat.passes.update_placement import moved_index


def planned_graphs(index: GraphIndex, *, allow_moving: bool = True, lean_ops: bool = True, local_search: bool = False) -> list[GraphIndex]:
    """The graphs a planner is run on for `index` as captured: with its lean operator
    variants (where any apply and `lean_ops` allows) and without, each in its captured
    order and with its updates moved (where any can move and `allow_moving` allows).
    `local_search`: those a planner with a local search runs on where the first graph has
    a plan (`plan_with_placement`)."""
    out = []
    bases = _bases(index, lean_ops)[0]
    for base in bases[:1] if local_search else bases:
        moved = moved_index(base)[0] if allow_moving else None
        out.extend([moved, base] if moved is not None else [base])
    return out


def plan_with_placement(
    index: GraphIndex,
    run: Callable[[GraphIndex], Plan],
    *,
    allow_moving: bool = True,
    lean_ops: bool = True,
    improve: Callable[[GraphIndex, Plan], Plan] | None = None,
) -> Plan:
    """`run(index)` plans one graph; this runs it on the graphs allowed and keeps the better
    plan. The graph with lean operator variants holds no more bytes than the graph without
    under every drop set, at the same cost, so its best plan is never costlier. A heuristic
    planner alone may still land on a costlier plan there, so both graphs are planned; a
    planner with `improve(graph, plan)` (a local search that improves the kept plan on its
    own graph, done once as it is the costly part) plans the graph without the variants
    only where the lean graph has no plan."""
    captured = index
    bases, lean_note = _bases(captured, lean_ops)
    plans: list[tuple[Plan, GraphIndex]] = []
    errors: list[_NoPlan] = []
    for base in bases:
        try:
            plan, graph = _choose_placement(base, run, allow_moving, local_search=improve is not None)
        except _NoPlan as e:
            errors.append(e)
            continue
        plan.lean_ops = list(base.lean_ops)
        plans.append((plan, graph))
        if not plan.recomputed or improve is not None:
            break  # nothing recomputed: no plan can be cheaper; or the local search takes it from here
    if not plans:
        raise errors[0].error(captured)  # the lean graph's, where there is one: the lower floor
    plan, graph = min(plans, key=lambda pg: (pg[0].predicted_overhead_seconds, pg[0].predicted_peak_bytes))
    if improve is not None and plan.recomputed:
        better = improve(graph, plan)
        better.lean_ops, better.updates_in_backward, better.updates_note = plan.lean_ops, plan.updates_in_backward, plan.updates_note
        better.meta = {**plan.meta, **better.meta}
        plan = better
    if len(bases) > 1 and not plan.lean_ops:
        why = "no plan with them fits" if errors else "the plan without them is predicted cheaper"
        lean_note = f"lean operator variants not used: {why} ({lean_note})"
    plan.meta["lean_ops_note"] = lean_note
    # The baseline is the step as captured, whichever graph the plan runs.
    baseline = simulate(captured.analysis, scratch=captured.scratch)
    plan.baseline_peak_bytes, plan.baseline_step_peak_bytes = int(baseline.peak_bytes), int(baseline.step_peak_bytes)
    return plan


def _bases(index: GraphIndex, lean_ops: bool) -> tuple[list[GraphIndex], str]:
    """The graphs to plan before the updates are placed, the one with lean operator variants
    first (where allowed and any apply), and what the variants came to."""
    if not lean_ops:
        return [index], "lean operator variants were not allowed"
    lean, found = lean_index(index)
    return ([lean, index] if lean is not None else [index]), found.summary()


class _NoPlan(Exception):
    """No plan of one graph fits, in either placement of its updates (`errors`, keyed by
    whether they were moved). Which error to raise is worked out only if no other graph
    has a plan either: it needs each planner's smallest reachable peak, which can take
    seconds to pin down."""

    def __init__(self, errors: dict[bool, BudgetError]):
        super().__init__("no plan fits")
        self.errors = errors

    def error(self, captured: GraphIndex) -> BudgetError:
        """The error with the smaller reachable peak (the floor with updates in backward, where
        that is it, saying so)."""
        errors = self.errors
        smallest = min(errors, key=lambda k: errors[k].reach.best if errors[k].reach is not None else float("inf"))
        if smallest:
            peak = simulate(captured.analysis, scratch=captured.scratch).peak_bytes
            errors[True].add_note(
                f"remat: that peak runs each optimizer update as soon as its gradient is final; the step as captured "
                f"peaks at {format_bytes(peak)} without recomputation"
            )
        return errors[smallest]


def _choose_placement(
    index: GraphIndex, run: Callable[[GraphIndex], Plan], allow_moving: bool, local_search: bool = False
) -> tuple[Plan, GraphIndex]:
    """The better plan of `index` in its captured order and with its updates moved, and the
    graph it plans; _NoPlan where neither fits. `local_search`: a local search improves the
    plan kept, so the captured order is planned only where it may stop earlier
    (`_holds_no_less`)."""
    moved, placement = moved_index(index)
    if moved is None or not allow_moving:
        try:
            plan = run(index)
        except BudgetError as e:
            raise _NoPlan({False: e}) from None
        why = placement.summary() if moved is None else "updates in the backward pass were not allowed"
        plan.updates_note = f"updates stay at the end of the step ({why})"
        return plan, index
    results: dict[bool, Plan] = {}
    errors: dict[bool, BudgetError] = {}
    skipped: str | None = None
    for in_backward, idx in ((True, moved), (False, index)):
        if not in_backward and True in results:
            if not results[True].recomputed:
                break  # nothing recomputed with the updates moved: the captured order cannot be cheaper
            if local_search:
                skipped = _holds_no_less(index, results[True])
                if skipped is not None:
                    break
        try:
            results[in_backward] = run(idx)
        except BudgetError as e:
            errors[in_backward] = e
    if True in errors and placement.buckets:
        # No plan with the multi-tensor updates in buckets: one parameter to a bucket
        # keeps no gradient waiting for a bucket to fill.
        moved, placement = moved_index(index, in_buckets=False)
        try:
            results[True] = run(moved)
        except BudgetError:
            pass
        else:
            del errors[True]
            results[True].meta["update_buckets"] = False
    if not results:
        raise _NoPlan(errors)
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
        plan.meta["other_placement"] = {"updates_in_backward": other, "error": errors[other].brief()}
    elif skipped is not None:
        plan.meta["other_placement"] = {"updates_in_backward": other, "not_planned": skipped}
    return plan, (moved if chosen else index)


def _holds_no_less(captured: GraphIndex, moved_plan: Plan) -> str | None:
    """Why the captured order need not be planned after the plan with the updates moved, or
    None. Both orders give the greedy the same candidates, sizes and rebuild times, so it
    picks in the same order in both and stops at the first prefix that fits: the captured
    order's greedy stops earlier only if it holds less at an earlier prefix. This checks
    the prefix where the moved greedy stopped, one simulation instead of two greedy runs;
    the local search that follows starts from the plan kept."""
    dropped = moved_plan.dropped(captured, check_fingerprint=False)
    try:
        peak = simulate_schedule(captured, build_schedule(captured, dropped, moved_plan.policy)).peak_bytes
    except PlanError:
        return None
    if peak < moved_plan.predicted_peak_bytes:
        return None
    return f"the captured order holds no less under the same recomputation ({format_bytes(peak)})"


def _why_not(results: dict[bool, Plan], errors: dict[bool, BudgetError]) -> str:
    if True in errors:
        return "with them in the backward pass no plan fits"
    moved, kept = results[True], results[False]
    return (
        f"with them in the backward pass the plan is predicted no better ({moved.predicted_overhead_seconds * 1e3:.3f} ms "
        f"overhead, peak {moved.predicted_peak_bytes} bytes, against {kept.predicted_overhead_seconds * 1e3:.3f} ms, "
        f"{kept.predicted_peak_bytes} bytes)"
    )
