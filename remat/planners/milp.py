"""Exact planner: a mixed-integer program over which activations to drop.

The decision is one binary per candidate activation, d_s = 1 if it is dropped; the
schedule (schedule.py) fixes everything else, and the program models that schedule:

- x[u, c] = 1 if forward op c is copied into the block before backward node u. A value
  u reads is rebuilt at its first late reader when it is unavailable (one of its storages
  is dropped, or is a forward temporary); the block is the closure through unavailable
  values that are not a shared target still alive at u. Both are lower bounds on x
  (x[u, c] >= U(c) for a needed input, x[u, c] >= x[u, c'] + U(c) - 1 along an edge
  c' reads c), and the objective pays for every copy, so at the optimum x is the block.
- When a shared target is alive (the schedule's storage-level reuse): an unavailable
  value a read after the forward pass is rebuilt at its first late reader, and that copy
  serves every later block, as a needed input or as an intermediate of a closure, up to
  the last late read of *any* value on a's storages (GraphIndex.storage_last_read: views
  of a, such as the `detach` autograd saves, count), not only up to a's own last reader.
  The window is fixed by the graph (it starts where a is first read, and a is not rebuilt
  again inside it), so the blocks stay linear in d and the objective is exact.
- rm[n] = 1 if forward op n is removed (only copies read it): rm[n] <= copies of n,
  rm[n] <= rm[f] for each forward reader f, rm[n] <= U(n); the objective gains its time.
- objective: sum of copy times minus removed times = schedule.recompute_seconds of
  build_schedule(index, dropped) for every dropped set (tests check it on every subset of
  small candidate sets, binaries fixed).
- memory: at each backward node, PeakLowerBound's linear form (kept activations live over
  their interval, dropped ones over the span of their late readers, extended to the last
  reader of the backward views of the rebuilt copy (GraphIndex.copy_spans), storages made after
  the forward pass as they are) plus the node's kernel scratch; and at each copy c of a
  block, what is live over the whole block plus c's new bytes, its scratch and its inputs
  rebuilt in the block. Every term is a lower bound on what the simulator counts (a
  copy the schedule reuses past those spans is held longer still, which is not
  counted), so with the exact objective the program is a relaxation of the schedule:
  for every dropped set it costs what the schedule costs, and admits the set under any
  budget the simulated peak fits. Its optimum (or HiGHS's dual bound) is thus a lower
  bound on the best true cost.

The truth is build_schedule + simulate_schedule. Each solution of the program is run
through them; whatever it is, a no-good cut then excludes it, and the program is solved
again, until its bound reaches the best fitting plan found (proven optimal), the program
has no solution left, or the time limit. The returned plan carries the proven gap
(best true cost - lower bound) in its meta.

The shared schedule (build_schedule(..., share_rebuilt=True): every rebuilt value that a
later node reads is held for it up to its storage's last late read, not only the targets)
has a program of its own, the same with three changes:
- P_a = the copies of a made so far in the blocks up to storage_last_read(a), for each
  value a with late readers; P_a <= 1 (held, a is not copied again in that window). A
  block's rows for a subtract the P_a of the blocks before it: x[u, a] >= U(a) - P_a,
  x[u, a] >= x[u, c] + U(a) - 1 - P_a.
- Copies only where needed: x[u, a] <= U(a), and x[u, a] <= the copies in u's block that
  read a (unless u reads a itself). Per block the objective alone keeps x down, but
  shared, a copy made early (in a block that does not need it) is held for later blocks
  and would price a set below its schedule. With d fixed, block by block in order, these
  rows leave exactly build_schedule's copies, so this objective is exact too (tests check
  it as for the per-block program).
- memory: a copy of a made before a's first late reader is held until that reader: its
  new storages count at each backward node in between (P_a of the blocks up to there),
  except where a span of the same storage already counts it.

Both run (plan()): the per-block program first, then its fitting drop sets re-run under
the shared schedule (a plan in hand), then the shared program, cut off at the cheapest
plan in hand. The plan is the cheaper of the two schedules' best, and "optimal", the
bound and the gap hold over both (meta "milp_schedules"). The shared program's LP
relaxation is weaker (held copies are sums of fractional copies), so it branches more:
seconds on bert-tiny where the per-block one takes a tenth of that.

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
from remat.plan import Evaluation, Plan, assemble_plan, evaluate
from remat.planners.mutwo import SCHEDULE_NAMES
from remat.schedule import GraphIndex

DEFAULT_TIME_LIMIT = 60.0
SHARED_TRIES = 8  # fitting per-block plans re-run under the shared schedule, cheapest first (a plan in hand for its program)
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
    share_rebuilt: bool = False  # the schedule it models (build_schedule's policy)

    # ------------------------------------------------------------------ building

    @classmethod
    def build(
        cls, index: GraphIndex, node_seconds: dict[str, float], candidates: list[int] | None = None, group_size: int = 1, share_rebuilt: bool = False
    ) -> "MilpModel":
        """The program of build_schedule(index, dropped, share_rebuilt) (module docstring): its
        cost of a dropped set is the schedule's, its memory rows lower bounds of its peak."""
        t0 = time.perf_counter()
        tensors = index.analysis.tensors
        if candidates is None:
            candidates = index.candidates()
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
                else:  # OR of several: v >= each (copies only push it up), and v <= their sum
                    col = new_var()
                    for d in cols:
                        rows.add([(col, 1.0), (d, -1.0)], 0.0, math.inf)
                    rows.add([(col, 1.0)] + [(d, -1.0) for d in cols], -math.inf, 0.0)
                u_col[a] = col
            return col

        first_late: dict[str, int] = {}
        for a in forward:
            late = [index.rank[u] for u in index.users.get(a, []) if u not in forward]
            if late:
                first_late[a] = min(late)

        def alive(a: str, r: int) -> bool:
            """Whether a rebuilt copy of `a` is still a shared target at rank r (when U(a)).

            An unavailable value a is rebuilt at its first late reader (nothing can have made
            it a target before: build_schedule makes targets only of the inputs a node reads
            itself), and that copy serves every block up to the last late read of any value
            on a's storages (schedule.storage_last_read: the original storage would be alive
            that long, so holding the copy costs no memory). Up to that rank a is never
            rebuilt again, so the window depends on the graph alone and not on d. The
            window ends at the storage's last read, not a's own: e.g. a sigmoid output
            rebuilt for one mm is reused when the block of a later reader of its `detach`
            view rebuilds the view. Ending it at a's own last reader instead makes blocks
            rebuild what the schedule reuses, and the objective exceeds the true cost.
            """
            return a in first_late and first_late[a] < r <= index.storage_last_read(a)

        def new_storages(c: str) -> list[int]:
            read = {s for a in index.reads_of_copy(c) for s in index.storages.get(a, [])}
            return [s for s in dict.fromkeys(index.storages.get(c, [])) if s not in read]

        new_bytes: dict[str, int] = {}
        tail = [n for n in index.order if n not in forward]
        x_col: dict[tuple[int, str], int] = {}
        x_of_node: dict[str, list[int]] = {}
        block_nodes: list[list[str]] = []
        # Shared schedule only: held[a] = the column of P_a, the number of copies of a made so
        # far in blocks up to a's storage's last late read, and early[a] = (rank, P_a column)
        # after each such block before a's first late reader (for the memory rows).
        held: dict[str, int] = {}
        early: dict[str, list[tuple[int, int]]] = {}
        held_vars = 0
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

            def hold(a: str) -> list[tuple[int, float]]:
                """Shared schedule: + P_a, a copy of a made by an earlier block and still held
                here (its window (that rank, storage_last_read(a)] covers r, since r does). P_a
                counts those copies; the schedule makes at most one, so with P_a <= 1 it is
                the OR of them."""
                col = held.get(a) if share_rebuilt and a in first_late and r <= index.storage_last_read(a) else None
                return [] if col is None else [(col, 1.0)]

            for a in dict.fromkeys(needed):
                forced, _ = unavail[a]
                if forced and not hold(a):
                    lower[x_col[(j, a)]] = 1.0
                elif forced:
                    rows.add([(x_col[(j, a)], 1.0)] + hold(a), 1.0, math.inf)
                else:
                    rows.add([(x_col[(j, a)], 1.0), (u_term(a), -1.0)] + hold(a), 0.0, math.inf)
            for c in members:
                for a in index.reads_of_copy(c):
                    if a in seen:
                        forced, _ = unavail[a]
                        if forced:
                            rows.add([(x_col[(j, a)], 1.0), (x_col[(j, c)], -1.0)] + hold(a), 0.0, math.inf)
                        else:
                            rows.add([(x_col[(j, a)], 1.0), (x_col[(j, c)], -1.0), (u_term(a), -1.0)] + hold(a), -1.0, math.inf)
            if share_rebuilt:
                # Copies are made only where the schedule needs them: an unavailable value read
                # by u, or by another copy in the block. Per block the objective alone keeps x
                # at that; shared, copying a value early (in a block that does not need it)
                # would hold it for later blocks and could price a set below its schedule, so
                # x is pinned from above too: x <= U, x <= the copies reading it (+1 when u
                # reads it). With d fixed, the rows then admit exactly build_schedule's x.
                direct = set(index.inputs[u])
                readers_in: dict[str, list[int]] = {}
                for c in members:
                    for a in index.reads_of_copy(c):
                        if a in seen:
                            readers_in.setdefault(a, []).append(x_col[(j, c)])
                for a in members:
                    forced, _ = unavail[a]
                    if not forced:
                        rows.add([(x_col[(j, a)], 1.0), (u_term(a), -1.0)], -math.inf, 0.0)
                    if a not in direct:
                        rows.add([(x_col[(j, a)], 1.0)] + [(x, -1.0) for x in readers_in.get(a, [])], -math.inf, 0.0)
                # Every copy of a value with late readers is held up to its storage's last late
                # read (build_schedule's share_rebuilt): at most one copy of it in the blocks up
                # to there, so P_a <= 1.
                for a in members:
                    if a in first_late and r <= index.storage_last_read(a):
                        prev = held.get(a)
                        col = new_var()
                        rows.add([(col, 1.0), (x_col[(j, a)], -1.0)] + ([(prev, -1.0)] if prev is not None else []), 0.0, 0.0)
                        held[a] = col
                        held_vars += 1
                        if r < first_late[a]:
                            early.setdefault(a, []).append((r, col))
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
        # The accounting of plan.PeakLowerBound, with the spans of dropped storages carried
        # through backward views (GraphIndex.copy_spans).
        safe = index.activations_read_alone()
        spans = index.activation_copy_spans()
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
        # Shared schedule: a copy of a made before a's first late reader is held from its block
        # to that reader (which reads it), a fresh storage for each of a's new storages. Only
        # where no span of a dropped storage is counted already (a view of a rebuilt there may
        # be that same copy), and at most one such copy exists at a time, so the sum P_a is it.
        held_terms: list[list[tuple[int, float]]] = [[] for _ in range(len(tr))]
        for a, entries in early.items():
            own = [s for s in new_storages(a) if s not in index.persistent]
            for i, (r0, col) in enumerate(entries):
                r1 = entries[i + 1][0] if i + 1 < len(entries) else first_late[a]
                for k in range(int(np.searchsorted(tr, r0)), int(np.searchsorted(tr, r1))):
                    t_k = int(tr[k])
                    nb = sum(
                        tensors[s].nbytes for s in own
                        if not (s in cand_set and any(lo <= t_k <= hi for lo, hi in spans.get(s, ())))
                    )
                    if nb:
                        held_terms[k].append((col, float(nb)))
        # One row per distinct pattern of coefficients (steps between events share one).
        patterns: dict[bytes, int] = {}
        at_rows_const: list[float] = []
        at_terms: list[list[tuple[int, float]]] = []
        for j in range(len(tr)):
            key = at[j].tobytes() + repr(held_terms[j]).encode()
            p = patterns.get(key)
            if p is None:
                patterns[key] = p = len(at_terms)
                at_terms.append([(int(c), float(at[j, c])) for c in np.flatnonzero(at[j])] + held_terms[j])
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
            share_rebuilt=share_rebuilt,
        )
        model.stats = {"binaries": ncols, "copy_vars": num_x, "removable": len(removable), "memory_patterns": len(at_terms), "block_rows": len(block_rows)}
        if share_rebuilt:
            model.stats["held_vars"] = held_vars
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
    fitting: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # (true cost, set) of every solution that fit, cheapest first

    @property
    def gap_seconds(self) -> float | None:
        if self.evaluation is None:
            return None
        return max(0.0, self.evaluation.overhead_seconds - self.lower_bound)


def solve(model: MilpModel, budget_bytes: int, time_limit: float = DEFAULT_TIME_LIMIT, cutoff: float = math.inf) -> MilpResult:
    """The lazy loop: solve the relaxation, check its plan with the schedule, cut, repeat.

    Plans are checked with the schedule the model is of (model.share_rebuilt). `cutoff`:
    the cost of a plan already in hand (from the other schedule); the loop also ends once
    its bound reaches it, with status "cutoff" if it found nothing cheaper: then no plan
    of this schedule costs less than `cutoff`.
    """
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
            ev = evaluate(index, dropped, ns, share_rebuilt=model.share_rebuilt)
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


def cuts_count(rows: _Rows) -> int:
    return len(rows.lo)


# ---------------------------------------------------------------------- the interface

_CACHE: dict[tuple, MilpModel] = {}
_CACHE_SIZE = 4  # the two schedules' programs of a graph, and room for a second grouping


def model_for(
    index: GraphIndex, node_seconds: dict[str, float], candidates: list[int] | None, group_size: int, share_rebuilt: bool = False
) -> MilpModel:
    """The program's structure, built once per graph, node times, grouping and schedule (frontiers reuse it)."""
    key = (id(index), id(node_seconds), tuple(candidates) if candidates is not None else None, group_size,
           tuple(sorted(index.scratch.items())), share_rebuilt)  # fmt: skip
    model = _CACHE.get(key)
    if model is None or model.index is not index or model.node_seconds is not node_seconds:
        # Keys hold ids: a model of another graph (or a collected one whose id came back) goes.
        for k in [k for k, m in _CACHE.items() if m.index is not index or m.node_seconds is not node_seconds]:
            del _CACHE[k]
        while len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        model = _CACHE[key] = MilpModel.build(index, node_seconds, candidates, group_size, share_rebuilt=share_rebuilt)
    return model


PROVEN = ("optimal", "infeasible", "cutoff")  # a run's statuses that prove its part of the bound


def plan(
    index: GraphIndex,
    node_seconds: dict[str, float],
    budget_bytes: int,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    candidates: list[int] | None = None,
    group_size: int | None = None,
    max_binaries: int = MAX_BINARIES,
    compete_shared: bool = True,
    **meta: Any,
) -> Plan:
    """The planner interface (remat.planners.make_plan); `time_limit` in seconds.

    One program per rebuild schedule of build_schedule, as μ-TWO's plan() runs its greedy
    under both: per block (share_rebuilt=False) first, with up to half the time limit;
    the fitting drop sets its cut loop found are then run under the shared schedule
    (SHARED_TRIES, cheapest first: a plan in hand), and the shared program runs with the
    rest of the time, cut off at the cheapest plan in hand (it only has to prove that no
    shared plan is cheaper). The plan is the cheapest over both (per block on a tie,
    beyond rounding); `meta["schedule"]` says which, `meta["other_schedule"]` what the
    other reached. "optimal", `milp_lower_bound` and `milp_gap_seconds` hold over the
    schedules in `meta["milp_schedules"]`; `meta["milp_per_block"]` and
    `meta["milp_shared"]` hold each program's own run. `compete_shared=False`: the
    per-block program alone, with the whole time limit.
    """
    t0 = time.perf_counter()
    if index.tg.backward_passes > 1:
        raise PlanError(
            f"the exact planner models one forward and one backward pass; this step runs {index.tg.backward_passes} "
            "(micro-batches accumulating gradients). Use --planner mutwo or chen."
        )
    extra = dict(meta.pop("meta", None) or {})
    baseline = evaluate(index, set(), node_seconds)
    families = [False, True] if compete_shared else [False]
    schedules = ",".join(SCHEDULE_NAMES[f] for f in families)
    if baseline.peak_bytes <= budget_bytes:
        extra.update(milp_status="optimal", milp_lower_bound=0.0, milp_gap_seconds=0.0, milp_iterations=0, milp_solver_seconds=0.0)
        extra.update(schedule=SCHEDULE_NAMES[False], milp_schedules=schedules)
        return assemble_plan("milp", index, node_seconds, budget_bytes, [], baseline, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
    if candidates is None:
        candidates = index.candidates()
    if group_size is None:
        group_size = max(1, math.ceil(len(candidates) / max_binaries))
    deadline = t0 + time_limit
    models: dict[bool, MilpModel] = {}
    runs: dict[bool, MilpResult] = {}
    # Per schedule: (cost, dropped, evaluation, the program's cost or None for a re-run seed).
    found: dict[bool, tuple[float, frozenset[int], Evaluation, float | None]] = {}

    def keep(share: bool, dropped: frozenset[int] | None, ev: Evaluation | None, model_cost: float | None) -> None:
        if dropped is not None and ev is not None and (share not in found or ev.overhead_seconds < found[share][0]):
            found[share] = (float(ev.overhead_seconds), dropped, ev, model_cost)

    models[False] = model_for(index, node_seconds, candidates, group_size)
    left = deadline - time.perf_counter()
    runs[False] = solve(models[False], budget_bytes, time_limit=max(0.1, left / 2 if compete_shared else left))
    keep(False, runs[False].dropped, runs[False].evaluation, runs[False].model_objective)
    tried = 0
    if compete_shared:
        seed, tried = _best_shared(index, node_seconds, budget_bytes, runs[False].fitting, deadline)
        if seed is not None:
            keep(True, seed[0], seed[1], None)
        models[True] = model_for(index, node_seconds, candidates, group_size, share_rebuilt=True)
        cutoff = min((f[0] for f in found.values()), default=math.inf)
        runs[True] = solve(models[True], budget_bytes, time_limit=max(0.1, deadline - time.perf_counter()), cutoff=cutoff)
        keep(True, runs[True].dropped, runs[True].evaluation, runs[True].model_objective)
    if not found:
        if all(r.status == "infeasible" for r in runs.values()):
            from remat.budget import format_bytes

            least = min((r.smallest_peak for r in runs.values() if r.smallest_peak is not None), default=baseline.peak_bytes)
            raise BudgetError(
                f"no milp plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): the exact planner "
                f"proved that no choice among the {len(candidates)} activations that may be recomputed reaches it "
                f"under the {' or the '.join(SCHEDULE_NAMES[f] for f in families)} rebuild schedule "
                f"(the peak stays at or above {format_bytes(least)} ({least} bytes) on its lower bound; "
                f"{format_bytes(baseline.peak_bytes)} without recomputation). Raise the budget, or lower the batch size."
            )
        raise BudgetError(
            f"the milp planner found no plan within the budget of {budget_bytes} bytes in its time limit of "
            f"{time_limit:g} s ({sum(r.iterations for r in runs.values())} solutions tried, "
            f"{sum(r.over_budget for r in runs.values())} over the budget, {sum(r.rejected for r in runs.values())} "
            "refused by the schedule); raise --time-limit, or use the mutwo planner"
        )
    # Shared only when it saves time beyond rounding (sums of the same node times in another order).
    use_shared = True in found and (False not in found or found[True][0] < found[False][0] * (1 - 1e-9))
    cost, dropped, ev, model_cost = found[use_shared]
    other = not use_shared
    if other in found:
        extra["other_schedule"] = {
            "schedule": SCHEDULE_NAMES[other],
            "predicted_overhead_seconds": found[other][0],
            "predicted_peak_bytes": int(found[other][2].peak_bytes),
            "num_recomputed": len(found[other][1]),
        }
    # The bound over both schedules: each run's bound holds over its schedule's plans (a
    # run cut off at a plan's cost proves none of its plans is cheaper than that plan).
    lower = min(r.lower_bound for r in runs.values())
    for share, r in runs.items():
        extra[f"milp_{SCHEDULE_NAMES[share].replace('-', '_')}"] = {
            "status": r.status, "lower_bound": _finite(r.lower_bound), "iterations": r.iterations, "cuts": r.cuts,
            "over_budget": r.over_budget, "rejected": r.rejected, "solver_seconds": r.solver_seconds,
            "build_seconds": models[share].build_seconds, "best_seconds": found[share][0] if share in found else None,
            **models[share].stats,
        }  # fmt: skip
    extra.update(
        schedule=SCHEDULE_NAMES[use_shared],
        milp_schedules=schedules,
        milp_status="optimal" if all(r.status in PROVEN for r in runs.values()) else "time_limit",
        # None where a run stopped before any bound (JSON has no infinities).
        milp_lower_bound=_finite(lower),
        milp_gap_seconds=_finite(max(0.0, cost - lower)),
        milp_model_cost=model_cost,
        milp_iterations=sum(r.iterations for r in runs.values()),
        milp_cuts=sum(r.cuts for r in runs.values()),
        milp_over_budget=sum(r.over_budget for r in runs.values()),
        milp_rejected=sum(r.rejected for r in runs.values()),
        milp_solver_seconds=sum(r.solver_seconds for r in runs.values()),
        milp_build_seconds=sum(m.build_seconds for m in models.values()),
        milp_shared_tried=tried,
        milp_group_size=group_size,
        milp_time_limit=time_limit,
        candidates=len(candidates),
        **{f"milp_{k}": v for k, v in models[False].stats.items()},
    )
    picks = sorted(dropped, key=lambda s: (index.analysis.tensors[s].created, s))
    return assemble_plan(
        "milp", index, node_seconds, budget_bytes, picks, ev, baseline.timeline, time.perf_counter() - t0, meta=extra, share_rebuilt=use_shared, **meta
    )


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _best_shared(
    index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, fitting: list[tuple[float, frozenset[int]]], deadline: float
) -> tuple[tuple[frozenset[int], Evaluation] | None, int]:
    """The cheapest of `fitting` (per-block-fitting drop sets, cheapest first) that fits under
    the shared schedule, and how many were tried. The shared schedule holds every rebuilt
    value for its later readers: fewer rebuilds, more memory held, so a set that fits per
    block may not fit shared. The per-block optimum is always tried, the others while the
    time limit lasts. Cheap (a few simulations), and a plan in hand for the shared program."""
    best: tuple[frozenset[int], Evaluation] | None = None
    tried = 0
    for _, dropped in fitting[:SHARED_TRIES]:
        if tried and time.perf_counter() > deadline:
            break
        tried += 1
        try:
            ev = evaluate(index, dropped, node_seconds, share_rebuilt=True)
        except PlanError:
            continue
        if ev.peak_bytes <= budget_bytes and (best is None or ev.overhead_seconds < best[1].overhead_seconds):
            best = (dropped, ev)
    return best, tried
