"""Exact planner: a mixed-integer program over which activations to drop (issue 6).

The decision is one binary per candidate activation, d_s = 1 if it is dropped; the
schedule (schedule.py) fixes everything else, and the program models that schedule:

- x[u, c] = 1 if forward op c is copied into the block before backward node u. A value
  u reads is rebuilt at its first late reader when it is unavailable (one of its storages
  is dropped, or is a forward temporary); the block is the closure through unavailable
  values that are not a shared target still alive at u. Both are lower bounds on x
  (x[u, c] >= U(c) for a needed input, x[u, c] >= x[u, c'] + U(c) - 1 along an edge
  c' reads c), and the objective pays for every copy, so at the optimum x is the block.
- rm[n] = 1 if forward op n is removed (only copies read it): rm[n] <= copies of n,
  rm[n] <= rm[f] for each forward reader f, rm[n] <= U(n); the objective gains its time.
- objective: sum of copy times minus removed times = schedule.recompute_seconds.
- memory: at each backward node, PeakLowerBound's linear form (kept activations live over
  their interval, dropped ones over the span of their late readers, storages made after
  the forward pass as they are) plus the node's kernel scratch; and at each copy c of a
  block, what is live over the whole block plus c's new bytes, its scratch and its inputs
  rebuilt in the block. Every term is a lower bound on what the simulator counts, so
  the program is a relaxation: its optimum (or HiGHS's dual bound) is a lower bound on
  the best true cost.

The truth is build_schedule + simulate_schedule. Each solution of the program is run
through them; whatever it is, a no-good cut then excludes it, and the program is solved
again, until its bound reaches the best fitting plan found (proven optimal), the program
has no solution left, or the time limit. The returned plan carries the proven gap
(best true cost - lower bound) in its meta.

Coarsening: with `group_size` k > 1 (or automatically above `max_binaries` candidates),
candidates are grouped k at a time in creation order and a group is dropped or kept as
a whole; the bound is then a bound over grouped plans only, and the meta says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from remat.errors import BudgetError, PlanError
from remat.plan import Evaluation, Plan, PeakLowerBound, assemble_plan, evaluate
from remat.schedule import GraphIndex

DEFAULT_TIME_LIMIT = 60.0
MAX_BINARIES = 400  # above this many candidates, group them (coarsening)
REL_TOL = 1e-6


class _Rows:
    """Sparse constraint rows lo <= a.x <= hi, built row by row."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        i = len(self.lo)
        for col, val in terms:
            if val != 0:
                self.r.append(i)
                self.c.append(col)
                self.v.append(float(val))
        self.lo.append(lo)
        self.hi.append(hi)

    def extend(self, other: "_Rows") -> "_Rows":
        out = _Rows()
        out.r = self.r + [i + len(self.lo) for i in other.r]
        out.c = self.c + other.c
        out.v = self.v + other.v
        out.lo = self.lo + other.lo
        out.hi = self.hi + other.hi
        return out

    def constraint(self, ncols: int) -> LinearConstraint:
        a = sp.csr_array((self.v, (self.r, self.c)), shape=(len(self.lo), ncols))
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))


@dataclass
class MilpModel:
    """The budget-independent part of the program for one graph and one set of node times."""

    index: GraphIndex
    node_seconds: dict[str, float]
    candidates: list[int]
    groups: list[list[int]]  # d column -> the candidates it drops together
    ncols: int
    cost: np.ndarray
    integrality: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    structure: _Rows  # closure, removal and pattern definitions: no budget in them
    at_const: np.ndarray  # per memory pattern row: the largest constant over its steps
    at_terms: list[list[tuple[int, float]]]
    block_rows: list[tuple[int, float, list[tuple[int, float]], float]]  # (w col, const, x terms, max of w)
    persistent: int
    num_x: int
    build_seconds: float
    stats: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ building

    @classmethod
    def build(cls, index: GraphIndex, node_seconds: dict[str, float], candidates: list[int] | None = None, group_size: int = 1) -> "MilpModel":
        t0 = time.perf_counter()
        tensors = index.analysis.tensors
        if candidates is None:
            candidates = [t.id for t in index.analysis.activations() if index.candidate_problem(t.id) is None]
        candidates = sorted(set(candidates), key=lambda s: (tensors[s].created, s))
        cand_set = set(candidates)
        groups = [candidates[i : i + group_size] for i in range(0, len(candidates), max(1, group_size))]
        col_of: dict[int, int] = {s: g for g, members in enumerate(groups) for s in members}
        ncols = len(groups)
        cost: list[float] = [0.0] * ncols
        integ: list[int] = [1] * ncols
        lower: list[float] = [0.0] * ncols
        upper: list[float] = [1.0] * ncols

        def new_var(c: float = 0.0, lo: float = 0.0, hi: float = 1.0) -> int:
            cost.append(c)
            integ.append(0)
            lower.append(lo)
            upper.append(hi)
            return len(cost) - 1

        rows = _Rows()
        forward = index.forward

        # U(a): whether forward value a is unavailable in the backward pass.
        unavail: dict[str, tuple[bool, list[int]]] = {}  # value -> (forced, d columns)
        for a in forward:
            forced, cols = False, set()
            for s in index.storages.get(a, []):
                if s in index.persistent:
                    continue
                if s in index.activation:
                    if s in cand_set:
                        cols.add(col_of[s])
                else:
                    forced = True
            if forced or cols:
                unavail[a] = (forced, sorted(cols))
        u_col: dict[str, int] = {}  # a column equal to (or bounding from above) U(a), when not forced

        def u_term(a: str) -> int:
            col = u_col.get(a)
            if col is None:
                forced, cols = unavail[a]
                assert not forced
                if len(cols) == 1:
                    col = cols[0]
                else:  # OR of several: v >= each (a lower bound; copies only push it up)
                    col = new_var()
                    for d in cols:
                        rows.add([(col, 1.0), (d, -1.0)], 0.0, math.inf)
                u_col[a] = col
            return col

        first_late: dict[str, int] = {}
        for a in forward:
            late = [index.rank[u] for u in index.users.get(a, []) if u not in forward]
            if late:
                first_late[a] = min(late)

        def alive(a: str, r: int) -> bool:
            return a in first_late and first_late[a] < r <= index.last_late_reader[a]

        def new_storages(c: str) -> list[int]:
            read = {s for a in index.reads_of_copy(c) for s in index.storages.get(a, [])}
            return [s for s in dict.fromkeys(index.storages.get(c, [])) if s not in read]

        new_bytes: dict[str, int] = {}
        tail = [n for n in index.order if n not in forward]
        x_col: dict[tuple[int, str], int] = {}
        x_of_node: dict[str, list[int]] = {}
        block_nodes: list[list[str]] = []
        for j, u in enumerate(tail):
            r = index.rank[u]
            needed = [a for a in index.inputs[u] if a in unavail and not alive(a, r)]
            seen: set[str] = set()
            todo = list(needed)
            while todo:
                c = todo.pop()
                if c in seen:
                    continue
                seen.add(c)
                todo.extend(a for a in index.reads_of_copy(c) if a in unavail and a not in seen and not alive(a, r))
            members = sorted(seen, key=index.rank.__getitem__)
            block_nodes.append(members)
            for c in members:
                col = new_var(float(node_seconds[c]))
                x_col[(j, c)] = col
                x_of_node.setdefault(c, []).append(col)
                if c not in new_bytes:
                    new_bytes[c] = sum(tensors[s].nbytes for s in new_storages(c))
            for a in dict.fromkeys(needed):
                forced, _ = unavail[a]
                if forced:
                    lower[x_col[(j, a)]] = 1.0
                else:
                    rows.add([(x_col[(j, a)], 1.0), (u_term(a), -1.0)], 0.0, math.inf)
            for c in members:
                for a in index.reads_of_copy(c):
                    if a in seen:
                        forced, _ = unavail[a]
                        if forced:
                            rows.add([(x_col[(j, a)], 1.0), (x_col[(j, c)], -1.0)], 0.0, math.inf)
                        else:
                            rows.add([(x_col[(j, a)], 1.0), (x_col[(j, c)], -1.0), (u_term(a), -1.0)], -1.0, math.inf)
        num_x = len(x_col)

        # Removal of forward ops that only copies read (the greatest such set, as build_schedule).
        outputs = set(index.output_inputs)
        removable: set[str] = set()
        for n in reversed([m for m in index.order if m in forward]):
            if n not in x_of_node or n in index.random or index.writes[n] or n in outputs:
                continue
            if all(f in removable for f in index.users.get(n, []) if f in forward):
                removable.add(n)
        rm_col: dict[str, int] = {n: new_var(-float(node_seconds[n])) for n in removable}
        for n, col in rm_col.items():
            rows.add([(col, 1.0)] + [(x, -1.0) for x in x_of_node[n]], -math.inf, 0.0)
            for f in index.users.get(n, []):
                if f in forward:
                    rows.add([(col, 1.0), (rm_col[f], -1.0)], -math.inf, 0.0)
            forced, cols = unavail[n]
            if not forced:
                rows.add([(col, 1.0)] + [(d, -1.0) for d in cols], -math.inf, 0.0)

        # Memory: the linear form of PeakLowerBound at each backward step, and over each block.
        baseline = evaluate(index, set(), node_seconds)
        # The same accounting as plan.PeakLowerBound (which tests check against the simulator).
        safe = PeakLowerBound._safe_activations(index)
        spans = PeakLowerBound._tail_read_spans(index)
        n = len(index.order)
        tr = np.array([index.rank[u] for u in tail], dtype=np.int64)
        rp = np.concatenate([[tr[0] - 1], tr[:-1]]) if len(tr) else tr
        items: list[tuple[int, int, int]] = []
        for t in tensors:
            if not t.persistent and t.created >= 0 and index.order[t.created] not in forward:
                items.append((t.created, min(t.last_use, n - 1), t.nbytes))
        for s in safe:
            t = tensors[s]
            items.append((t.created, min(t.last_use, n - 1), t.nbytes))
        at_const = np.zeros(len(tr), dtype=np.float64)
        both_const = np.zeros(len(tr), dtype=np.float64)
        for start, end, nb in items:
            at_const += nb * ((start <= tr) & (tr <= end))
            both_const += nb * ((start <= rp) & (end >= tr))
        at_const += np.array([index.scratch.get(u, 0) for u in tail], dtype=np.float64)
        at = np.zeros((len(tr), ncols), dtype=np.float64)
        both = np.zeros((len(tr), ncols), dtype=np.float64)
        for s in candidates:
            t = tensors[s]
            g = col_of[s]
            if s in safe:
                end = min(t.last_use, n - 1)
                at[:, g] -= t.nbytes * ((t.created <= tr) & (tr <= end))
                both[:, g] -= t.nbytes * ((t.created <= rp) & (end >= tr))
            for lo, hi in spans.get(s, ()):
                at[:, g] += t.nbytes * ((lo <= tr) & (tr <= hi))
                both[:, g] += t.nbytes * ((lo <= rp) & (hi >= tr))
        # One row per distinct pattern of coefficients (steps between events share one).
        patterns: dict[bytes, int] = {}
        at_rows_const: list[float] = []
        at_terms: list[list[tuple[int, float]]] = []
        for j in range(len(tr)):
            key = at[j].tobytes()
            p = patterns.get(key)
            if p is None:
                patterns[key] = p = len(at_terms)
                at_terms.append([(int(c), float(at[j, c])) for c in np.flatnonzero(at[j])])
                at_rows_const.append(at_const[j])
            else:
                at_rows_const[p] = max(at_rows_const[p], at_const[j])
        w_of: dict[bytes, tuple[int, float]] = {}
        block_rows: list[tuple[int, float, list[tuple[int, float]], float]] = []
        for j, members in enumerate(block_nodes):
            if not members:
                continue
            key = both[j].tobytes()
            if key not in w_of:
                nz = np.flatnonzero(both[j])
                col = new_var(0.0, -math.inf, math.inf)
                rows.add([(col, 1.0)] + [(int(c), -float(both[j, c])) for c in nz], 0.0, 0.0)
                w_of[key] = (col, float(both[j][both[j] > 0].sum()))
            wcol, wmax = w_of[key]
            mset = set(members)
            r, r_prev = int(tr[j]), int(rp[j])
            for c in members:
                # Live while c's copy runs: its new storages and scratch, the storages of its
                # inputs rebuilt in this block, and those of its kept inputs that the form
                # above does not already count over the whole block (sources kept alive
                # for the rebuild).
                own = new_storages(c)
                xcoef = float(sum(tensors[s].nbytes for s in own) + index.scratch.get(c, 0))
                terms: list[tuple[int, float]] = []
                counted = set(own)
                for a in index.reads_of_copy(c):
                    for s in index.storages.get(a, []):
                        if s in counted or s in index.persistent:
                            continue
                        counted.add(s)
                        nb = float(tensors[s].nbytes)
                        if a in mset:
                            terms.append((x_col[(j, a)], nb))
                        else:
                            # Read in place (not rebuilt): always, or exactly when its one storage is kept.
                            always = a not in unavail
                            kept_if = not always and not unavail[a][0] and index.storages.get(a, []) == [s] and s in col_of
                            t = tensors[s]
                            covered = s in safe and t.created <= r_prev and min(t.last_use, n - 1) >= r
                            if covered or s not in index.activation or not (always or kept_if):
                                continue
                            xcoef += nb
                            if kept_if:
                                terms.append((col_of[s], -nb))
                block_rows.append((wcol, float(both_const[j]), [(x_col[(j, c)], xcoef)] + terms, wmax))
        model = cls(
            index=index,
            node_seconds=node_seconds,
            candidates=candidates,
            groups=groups,
            ncols=len(cost),
            cost=np.array(cost),
            integrality=np.array(integ),
            lower=np.array(lower),
            upper=np.array(upper),
            structure=rows,
            at_const=np.array(at_rows_const),
            at_terms=at_terms,
            block_rows=block_rows,
            persistent=int(baseline.timeline.persistent_bytes),
            num_x=num_x,
            build_seconds=time.perf_counter() - t0,
        )
        model.stats = {"binaries": ncols, "copy_vars": num_x, "removable": len(removable), "memory_patterns": len(at_terms), "block_rows": len(block_rows)}
        return model

    # ------------------------------------------------------------------ one budget

    def memory_rows(self, budget_bytes: int) -> tuple[_Rows, int | None]:
        """Rows for a budget, and (if the relaxation alone proves nothing fits) its least peak."""
        cap = float(budget_bytes - self.persistent)
        rows = _Rows()
        for const, terms in zip(self.at_const, self.at_terms):
            most = const + sum(v for _, v in terms if v > 0)
            if most <= cap:
                continue
            least = const + sum(v for _, v in terms if v < 0)
            if least > cap:
                return rows, int(least) + self.persistent
            rows.add(terms, -math.inf, cap - const)
        for wcol, const, terms, wmax in self.block_rows:
            xcol, xval = terms[0]
            rest = sum(v for _, v in terms[1:] if v > 0)
            if const + wmax + xval + rest <= cap:
                continue
            big = max(0.0, const + wmax + rest - cap)
            rows.add([(wcol, 1.0), (xcol, xval + big)] + terms[1:], -math.inf, cap + big - const)
        return rows, None

    def dropped_of(self, x: np.ndarray) -> frozenset[int]:
        return frozenset(s for g, members in enumerate(self.groups) if x[g] > 0.5 for s in members)


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

    @property
    def gap_seconds(self) -> float | None:
        if self.evaluation is None:
            return None
        return max(0.0, self.evaluation.overhead_seconds - self.lower_bound)


def solve(model: MilpModel, budget_bytes: int, time_limit: float = DEFAULT_TIME_LIMIT) -> MilpResult:
    """The lazy loop: solve the relaxation, check its plan with the schedule, cut, repeat."""
    t0 = time.perf_counter()
    index, ns = model.index, model.node_seconds
    mem, least = model.memory_rows(budget_bytes)
    base = model.structure.extend(mem)
    nd = len(model.groups)
    cuts = _Rows()
    best: tuple[float, frozenset[int], Evaluation, float] | None = None
    bound = -math.inf
    status = "time_limit"
    iterations = rejected = over = 0
    smallest: int | None = least
    log: list[dict[str, Any]] = []
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
            ev = evaluate(index, dropped, ns)
        except PlanError as e:
            rejected += 1
            entry["rejected"] = str(e)
            ev = None
        if ev is not None:
            entry.update(peak=int(ev.peak_bytes), cost=float(ev.overhead_seconds))
            smallest = ev.peak_bytes if smallest is None else min(smallest, ev.peak_bytes)
            if ev.peak_bytes <= budget_bytes:
                if best is None or ev.overhead_seconds < best[0]:
                    best = (float(ev.overhead_seconds), dropped, ev, float(res.fun))
            else:
                over += 1
        log.append(entry)
        if best is not None and best[0] <= level + max(1e-12, REL_TOL * abs(best[0])):
            status = "optimal"
            bound = min(best[0], level)
            break
        if res.status == 1:  # stopped by the time limit: the bound is all we have
            break
        # No-good cut: exclude exactly this choice of d.
        on = [g for g in range(nd) if res.x[g] > 0.5]
        off = [g for g in range(nd) if res.x[g] <= 0.5]
        cuts.add([(g, -1.0) for g in on] + [(g, 1.0) for g in off], 1.0 - len(on), math.inf)
    seconds = time.perf_counter() - t0
    if best is None:
        return MilpResult(None, None, bound, status if status != "optimal" else "infeasible", iterations, seconds, None, cuts_count(cuts), rejected, over, smallest, log)
    return MilpResult(best[1], best[2], bound, status, iterations, seconds, best[3], cuts_count(cuts), rejected, over, smallest, log)


def cuts_count(rows: _Rows) -> int:
    return len(rows.lo)


# ---------------------------------------------------------------------- the interface

_CACHE: dict[tuple, MilpModel] = {}


def model_for(index: GraphIndex, node_seconds: dict[str, float], candidates: list[int] | None, group_size: int) -> MilpModel:
    """The program's structure, built once per graph, node times and grouping (frontiers reuse it)."""
    key = (id(index), id(node_seconds), tuple(candidates) if candidates is not None else None, group_size, tuple(sorted(index.scratch.items())))
    model = _CACHE.get(key)
    if model is None or model.index is not index:
        _CACHE.clear()
        model = _CACHE[key] = MilpModel.build(index, node_seconds, candidates, group_size)
    return model


def plan(
    index: GraphIndex,
    node_seconds: dict[str, float],
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    candidates: list[int] | None = None,
    group_size: int | None = None,
    max_binaries: int = MAX_BINARIES,
    **meta: Any,
) -> Plan:
    """The planner interface (remat.planners.make_plan); `time_limit` in seconds."""
    t0 = time.perf_counter()
    extra = dict(meta.pop("meta", None) or {})
    baseline = evaluate(index, set(), node_seconds)
    if baseline.peak_bytes <= budget_bytes:
        extra.update(milp_status="optimal", milp_lower_bound=0.0, milp_gap_seconds=0.0, milp_iterations=0, milp_solver_seconds=0.0)
        return assemble_plan("milp", index, node_seconds, budget_bytes, [], baseline, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
    if candidates is None:
        candidates = [t.id for t in index.analysis.activations() if index.candidate_problem(t.id) is None]
    if group_size is None:
        group_size = max(1, math.ceil(len(candidates) / max_binaries))
    model = model_for(index, node_seconds, candidates, group_size)
    result = solve(model, budget_bytes, time_limit=max(0.1, time_limit - (time.perf_counter() - t0)))
    if result.evaluation is None or result.dropped is None:
        if result.status == "infeasible":
            from remat.budget import format_bytes

            least = result.smallest_peak or baseline.peak_bytes
            raise BudgetError(
                f"no milp plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): the exact planner "
                f"proved that no choice among the {len(candidates)} activations that may be recomputed reaches it "
                f"(the peak stays at or above {format_bytes(least)} ({least} bytes) on its lower bound; "
                f"{format_bytes(baseline.peak_bytes)} without recomputation). Raise the budget, or lower the batch size."
            )
        raise BudgetError(
            f"the milp planner found no plan within the budget of {budget_bytes} bytes in its time limit of "
            f"{time_limit:g} s ({result.iterations} solutions tried, {result.over_budget} over the budget, "
            f"{result.rejected} refused by the schedule); raise --time-limit, or use the mutwo planner"
        )
    ev = result.evaluation
    extra.update(
        milp_status=result.status,
        milp_lower_bound=result.lower_bound,
        milp_gap_seconds=result.gap_seconds,
        milp_model_cost=result.model_objective,
        milp_iterations=result.iterations,
        milp_cuts=result.cuts,
        milp_over_budget=result.over_budget,
        milp_rejected=result.rejected,
        milp_solver_seconds=result.solver_seconds,
        milp_build_seconds=model.build_seconds,
        milp_group_size=group_size,
        milp_time_limit=time_limit,
        candidates=len(candidates),
        **{f"milp_{k}": v for k, v in model.stats.items()},
    )
    picks = sorted(result.dropped, key=lambda s: (index.analysis.tensors[s].created, s))
    return assemble_plan("milp", index, node_seconds, budget_bytes, picks, ev, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
