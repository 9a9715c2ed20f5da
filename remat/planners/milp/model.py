"""The exact program of one graph: its variables and its budget-free rows, in families.

Built by `MilpModel.build` from the memory model's rules (graph_index: `block_ops`,
`shared_until`, `copy_spans`, `kept_intervals`, `candidates`), one family of
constraints per method of `_Builder`:

- `unavailability`: U(a), whether a forward value cannot be read without a rebuild;
- `blocks`: x[u, c], the copies in the block before each node after the forward pass
  (and, under the shared policy, the copies held for later blocks);
- `removal`: rm[n], forward ops that only copies read;
- `memory_at_nodes` and `memory_in_blocks`: the budget rows' left-hand sides (the budget
  itself enters in `MilpModel.memory_rows`).

The module docstring of `remat.planners.milp` says what each family models and why the
program prices every dropped set as the schedule does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat.memory.schedule import GraphIndex, RebuildPolicy
from remat.planners.evaluate import baseline_of
from remat.planners.milp.rows import Rows

Terms = list[tuple[int, float]]


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
    structure: Rows  # closure, removal and pattern definitions: no budget in them
    at_const: np.ndarray  # per memory pattern row: the largest constant over its steps
    at_terms: list[Terms]
    block_rows: list[tuple[int, float, Terms, float]]  # (w col, const, x terms, max of w)
    persistent: int
    num_x: int
    build_seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    policy: RebuildPolicy = RebuildPolicy.PER_BLOCK  # the schedule it models (build_schedule's policy)

    @classmethod
    def build(
        cls,
        index: GraphIndex,
        node_seconds: dict[str, float],
        candidates: list[int] | None = None,
        group_size: int = 1,
        policy: RebuildPolicy = RebuildPolicy.PER_BLOCK,
    ) -> "MilpModel":
        """The program of build_schedule(index, dropped, policy) (module docstring): its
        cost of a dropped set is the schedule's, its memory rows lower bounds of its peak."""
        t0 = time.perf_counter()
        b = _Builder(index, node_seconds, candidates, group_size, policy)
        b.unavailability()
        b.blocks()
        b.removal()
        at_const, at_terms = b.memory_at_nodes()
        block_rows = b.memory_in_blocks()
        baseline = baseline_of(index)
        model = cls(
            index=index,
            node_seconds=node_seconds,
            candidates=b.candidates,
            groups=b.groups,
            ncols=len(b.cost),
            cost=np.array(b.cost),
            integrality=np.array(b.integ),
            lower=np.array(b.lower),
            upper=np.array(b.upper),
            structure=b.rows,
            at_const=np.array(at_const),
            at_terms=at_terms,
            block_rows=block_rows,
            persistent=int(baseline.timeline.persistent_bytes),
            num_x=b.num_x,
            build_seconds=time.perf_counter() - t0,
            policy=policy,
        )
        model.stats = {"binaries": len(b.groups), "copy_vars": b.num_x, "removable": len(b.rm_col),
                       "memory_patterns": len(at_terms), "block_rows": len(block_rows)}  # fmt: skip
        if policy.shares:
            model.stats["held_vars"] = b.held_vars
        return model

    def memory_rows(self, budget_bytes: int) -> tuple[Rows, int | None]:
        """Rows for a budget, and (if the relaxation alone proves nothing fits) its least peak."""
        cap = float(budget_bytes - self.persistent)
        rows = Rows()
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


class _Builder:
    """The columns and rows of one program, family by family (in this order)."""

    def __init__(
        self, index: GraphIndex, node_seconds: dict[str, float], candidates: list[int] | None, group_size: int, policy: RebuildPolicy
    ):
        self.index, self.node_seconds, self.policy = index, node_seconds, policy
        self.tensors = index.analysis.tensors
        if candidates is None:
            candidates = index.candidates()
        self.candidates = sorted(set(candidates), key=lambda s: (self.tensors[s].created, s))
        self.cand_set = set(self.candidates)
        self.groups = [self.candidates[i : i + group_size] for i in range(0, len(self.candidates), max(1, group_size))]
        self.col_of: dict[int, int] = {s: g for g, members in enumerate(self.groups) for s in members}
        ncols = len(self.groups)
        self.cost: list[float] = [0.0] * ncols
        self.integ: list[int] = [1] * ncols
        self.lower: list[float] = [0.0] * ncols
        self.upper: list[float] = [1.0] * ncols
        self.rows = Rows()
        self.tail = [n for n in index.order if n not in index.forward]
        self.tr = np.array([index.rank[u] for u in self.tail], dtype=np.int64)
        self.rp = np.concatenate([[self.tr[0] - 1], self.tr[:-1]]) if len(self.tr) else self.tr
        self.spans = index.activation_copy_spans()

    def new_var(self, c: float = 0.0, lo: float = 0.0, hi: float = 1.0) -> int:
        self.cost.append(c)
        self.integ.append(0)
        self.lower.append(lo)
        self.upper.append(hi)
        return len(self.cost) - 1

    # ------------------------------------------------------------------ U(a)

    def unavailability(self) -> None:
        """unavail[a] = (forced, d columns): a forward value is unavailable if a storage of
        it is a forward temporary (forced) or a dropped candidate (any of those columns)."""
        index = self.index
        self.unavail: dict[str, tuple[bool, list[int]]] = {}
        for a in index.forward:
            forced, cols = False, set()
            for s in index.storages.get(a, []):
                if s in index.persistent:
                    continue
                if s in index.activation:
                    if s in self.cand_set:
                        cols.add(self.col_of[s])
                else:
                    forced = True
            if forced or cols:
                self.unavail[a] = (forced, sorted(cols))
        self.u_col: dict[str, int] = {}

    def u_term(self, a: str) -> int:
        """A column equal to (or bounding from above) U(a), for a value not forced."""
        col = self.u_col.get(a)
        if col is None:
            forced, cols = self.unavail[a]
            assert not forced
            if len(cols) == 1:
                col = cols[0]
            else:  # OR of several: v >= each (copies only push it up), and v <= their sum
                col = self.new_var()
                for d in cols:
                    self.rows.add([(col, 1.0), (d, -1.0)], 0.0, math.inf)
                self.rows.add([(col, 1.0)] + [(d, -1.0) for d in cols], -math.inf, 0.0)
            self.u_col[a] = col
        return col

    def alive(self, a: str, r: int) -> bool:
        """Whether a copy of `a` made as a target is still shared at rank r (when U(a)).

        An unavailable value is first rebuilt at its first late reader (nothing makes it a
        target before: targets are values a block's node reads, or, shared, values the
        block rebuilt), and that copy serves every later block up to `shared_until(a)`, the
        schedule's rule; up to there a is never rebuilt again, so the window depends on the
        graph alone and not on d."""
        first = self.index.first_late_reader.get(a)
        return first is not None and first < r <= self.index.shared_until(a)

    # ------------------------------------------------------------------ x[u, c]

    def blocks(self) -> None:
        """x[u, c] for every op c that the block before node u could copy (block_ops with
        every value that could be unavailable), pushed up to the schedule's block by the
        closure rows; under the shared policy also pinned from above and tied to the
        held copies P_a."""
        index = self.index
        self.x_col: dict[tuple[int, str], int] = {}
        self.x_of_node: dict[str, list[int]] = {}
        self.block_nodes: list[list[str]] = []
        self.new_bytes: dict[str, int] = {}
        # Shared policy only: held[a] = the column of P_a, the number of copies of a made so
        # far in blocks up to shared_until(a), and early[a] = (rank, P_a column) after each
        # such block before a's first late reader (for the memory rows).
        self.held: dict[str, int] = {}
        self.early: dict[str, list[tuple[int, int]]] = {}
        self.held_vars = 0
        for j, u in enumerate(self.tail):
            r = index.rank[u]
            members = index.block_ops(u, lambda a: a in self.unavail and not self.alive(a, r))
            self.block_nodes.append(members)
            for c in members:
                col = self.new_var(float(self.node_seconds[c]))
                self.x_col[(j, c)] = col
                self.x_of_node.setdefault(c, []).append(col)
                if c not in self.new_bytes:
                    self.new_bytes[c] = sum(self.tensors[s].nbytes for s in self.new_storages(c))
            self._closure_rows(j, u, r, members)
            if self.policy.shares:
                self._shared_rows(j, u, r, members)
        self.num_x = len(self.x_col)

    def _hold(self, a: str, r: int) -> Terms:
        """Shared policy: + P_a, a copy of a made by an earlier block and still held at r.
        P_a counts those copies; the schedule makes at most one, so with P_a <= 1 it is
        the OR of them."""
        col = self.held.get(a) if self.policy.shares and a in self.index.first_late_reader and r <= self.index.shared_until(a) else None
        return [] if col is None else [(col, 1.0)]

    def _closure_rows(self, j: int, u: str, r: int, members: list[str]) -> None:
        """x[u, a] >= U(a) for a needed input; x[u, a] >= x[u, c] + U(a) - 1 along an edge."""
        index, rows, seen = self.index, self.rows, set(members)
        for a in dict.fromkeys(a for a in index.inputs[u] if a in seen):
            forced, _ = self.unavail[a]
            if forced and not self._hold(a, r):
                self.lower[self.x_col[(j, a)]] = 1.0
            elif forced:
                rows.add([(self.x_col[(j, a)], 1.0)] + self._hold(a, r), 1.0, math.inf)
            else:
                rows.add([(self.x_col[(j, a)], 1.0), (self.u_term(a), -1.0)] + self._hold(a, r), 0.0, math.inf)
        for c in members:
            for a in index.reads_of_copy(c):
                if a not in seen:
                    continue
                forced, _ = self.unavail[a]
                x_a, x_c = self.x_col[(j, a)], self.x_col[(j, c)]
                if forced:
                    rows.add([(x_a, 1.0), (x_c, -1.0)] + self._hold(a, r), 0.0, math.inf)
                else:
                    rows.add([(x_a, 1.0), (x_c, -1.0), (self.u_term(a), -1.0)] + self._hold(a, r), -1.0, math.inf)

    def _shared_rows(self, j: int, u: str, r: int, members: list[str]) -> None:
        """Copies only where the schedule needs them, and P_a for the copies held.

        Per block the objective alone keeps x at the block; shared, copying a value early
        (in a block that does not need it) would hold it for later blocks and could price
        a set below its schedule, so x is pinned from above: x <= U, x <= the copies
        reading it (unless u reads it). With d fixed the rows then admit exactly
        build_schedule's x. Every copy of a value with late readers is held up to
        shared_until: at most one copy of it in the blocks up to there, so P_a <= 1."""
        index, rows, seen = self.index, self.rows, set(members)
        direct = set(index.inputs[u])
        readers_in: dict[str, list[int]] = {}
        for c in members:
            for a in index.reads_of_copy(c):
                if a in seen:
                    readers_in.setdefault(a, []).append(self.x_col[(j, c)])
        for a in members:
            forced, _ = self.unavail[a]
            if not forced:
                rows.add([(self.x_col[(j, a)], 1.0), (self.u_term(a), -1.0)], -math.inf, 0.0)
            if a not in direct:
                rows.add([(self.x_col[(j, a)], 1.0)] + [(x, -1.0) for x in readers_in.get(a, [])], -math.inf, 0.0)
        for a in members:
            if a in index.first_late_reader and r <= index.shared_until(a):
                prev = self.held.get(a)
                col = self.new_var()
                rows.add([(col, 1.0), (self.x_col[(j, a)], -1.0)] + ([(prev, -1.0)] if prev is not None else []), 0.0, 0.0)
                self.held[a] = col
                self.held_vars += 1
                if r < index.first_late_reader[a]:
                    self.early.setdefault(a, []).append((r, col))

    def new_storages(self, c: str) -> list[int]:
        read = {s for a in self.index.reads_of_copy(c) for s in self.index.storages.get(a, [])}
        return [s for s in dict.fromkeys(self.index.storages.get(c, [])) if s not in read]

    # ------------------------------------------------------------------ rm[n]

    def removal(self) -> None:
        """rm[n] <= copies of n, rm[n] <= rm[f] for each forward reader f, rm[n] <= U(n): the
        greatest set of forward ops that only copies read, as build_schedule removes them."""
        index = self.index
        outputs = set(index.output_inputs)
        removable: set[str] = set()
        for n in reversed([m for m in index.order if m in index.forward]):
            if n not in self.x_of_node or n in index.random or index.writes[n] or n in outputs:
                continue
            if all(f in removable for f in index.users.get(n, []) if f in index.forward):
                removable.add(n)
        self.rm_col: dict[str, int] = {n: self.new_var(-float(self.node_seconds[n])) for n in removable}
        for n, col in self.rm_col.items():
            self.rows.add([(col, 1.0)] + [(x, -1.0) for x in self.x_of_node[n]], -math.inf, 0.0)
            for f in index.users.get(n, []):
                if f in index.forward:
                    self.rows.add([(col, 1.0), (self.rm_col[f], -1.0)], -math.inf, 0.0)
            forced, cols = self.unavail[n]
            if not forced:
                self.rows.add([(col, 1.0)] + [(d, -1.0) for d in cols], -math.inf, 0.0)

    # ------------------------------------------------------------------ memory

    def _interval_forms(self) -> None:
        """Per node after the forward pass: the bytes live at it (`at`) and across its block
        (`both`: live before the block and at the node), as a constant plus a term per d
        column: the kept intervals, less a dropped activation's own, plus its copy spans."""
        tr, rp, tensors = self.tr, self.rp, self.tensors
        kept = self.index.kept_intervals()
        self.at_const = np.zeros(len(tr), dtype=np.float64)
        self.both_const = np.zeros(len(tr), dtype=np.float64)
        for s, (start, end) in kept.items():
            nb = tensors[s].nbytes
            self.at_const += nb * ((start <= tr) & (tr <= end))
            self.both_const += nb * ((start <= rp) & (end >= tr))
        self.at_const += np.array([self.index.scratch.get(u, 0) for u in self.tail], dtype=np.float64)
        self.at = np.zeros((len(tr), len(self.groups)), dtype=np.float64)
        self.both = np.zeros((len(tr), len(self.groups)), dtype=np.float64)
        for s in self.candidates:
            t, g = tensors[s], self.col_of[s]
            if s in kept:
                start, end = kept[s]
                self.at[:, g] -= t.nbytes * ((start <= tr) & (tr <= end))
                self.both[:, g] -= t.nbytes * ((start <= rp) & (end >= tr))
            for lo, hi in self.spans.get(s, ()):
                self.at[:, g] += t.nbytes * ((lo <= tr) & (tr <= hi))
                self.both[:, g] += t.nbytes * ((lo <= rp) & (hi >= tr))

    def _held_terms(self) -> list[Terms]:
        """Shared policy: a copy of a made before a's first late reader is held from its block
        to that reader, a fresh storage for each of a's new storages. Only where no span of
        a dropped storage is counted already (a view of a rebuilt there may be that same
        copy), and at most one such copy exists at a time, so the sum P_a is it."""
        tr, index = self.tr, self.index
        terms: list[Terms] = [[] for _ in range(len(tr))]
        for a, entries in self.early.items():
            own = [s for s in self.new_storages(a) if s not in index.persistent]
            for i, (r0, col) in enumerate(entries):
                r1 = entries[i + 1][0] if i + 1 < len(entries) else index.first_late_reader[a]
                for k in range(int(np.searchsorted(tr, r0)), int(np.searchsorted(tr, r1))):
                    t_k = int(tr[k])
                    nb = sum(
                        self.tensors[s].nbytes for s in own
                        if not (s in self.cand_set and any(lo <= t_k <= hi for lo, hi in self.spans.get(s, ())))
                    )  # fmt: skip
                    if nb:
                        terms[k].append((col, float(nb)))
        return terms

    def memory_at_nodes(self) -> tuple[list[float], list[Terms]]:
        """The bound's linear form at each node after the forward pass: one row per distinct
        pattern of coefficients (nodes between events share one), with its largest constant."""
        self._interval_forms()
        held_terms = self._held_terms()
        patterns: dict[bytes, int] = {}
        consts: list[float] = []
        rows: list[Terms] = []
        for j in range(len(self.tr)):
            key = self.at[j].tobytes() + repr(held_terms[j]).encode()
            p = patterns.get(key)
            if p is None:
                patterns[key] = p = len(rows)
                rows.append([(int(c), float(self.at[j, c])) for c in np.flatnonzero(self.at[j])] + held_terms[j])
                consts.append(self.at_const[j])
            else:
                consts[p] = max(consts[p], self.at_const[j])
        return consts, rows

    def memory_in_blocks(self) -> list[tuple[int, float, Terms, float]]:
        """At each copy c of a block: what is live over the whole block (w, a column per
        distinct `both` pattern) plus c's new bytes and scratch and its inputs rebuilt in
        the block, and those of its kept inputs that the form does not already count over
        the whole block (sources kept alive for the rebuild)."""
        index, tensors = self.index, self.tensors
        kept = index.kept_intervals()
        w_of: dict[bytes, tuple[int, float]] = {}
        out: list[tuple[int, float, Terms, float]] = []
        for j, members in enumerate(self.block_nodes):
            if not members:
                continue
            key = self.both[j].tobytes()
            if key not in w_of:
                nz = np.flatnonzero(self.both[j])
                col = self.new_var(0.0, -math.inf, math.inf)
                self.rows.add([(col, 1.0)] + [(int(c), -float(self.both[j, c])) for c in nz], 0.0, 0.0)
                w_of[key] = (col, float(self.both[j][self.both[j] > 0].sum()))
            wcol, wmax = w_of[key]
            mset = set(members)
            r, r_prev = int(self.tr[j]), int(self.rp[j])
            for c in members:
                own = self.new_storages(c)
                xcoef = float(sum(tensors[s].nbytes for s in own) + index.scratch.get(c, 0))
                terms: Terms = []
                counted = set(own)
                for a in index.reads_of_copy(c):
                    for s in index.storages.get(a, []):
                        if s in counted or s in index.persistent:
                            continue
                        counted.add(s)
                        nb = float(tensors[s].nbytes)
                        if a in mset:
                            terms.append((self.x_col[(j, a)], nb))
                            continue
                        # Read in place (not rebuilt): always, or exactly when its one storage is kept.
                        always = a not in self.unavail
                        kept_if = not always and not self.unavail[a][0] and index.storages.get(a, []) == [s] and s in self.col_of
                        covered = s in kept and s in index.activation and kept[s][0] <= r_prev and kept[s][1] >= r
                        if covered or s not in index.activation or not (always or kept_if):
                            continue
                        xcoef += nb
                        if kept_if:
                            terms.append((self.col_of[s], -nb))
                out.append((wcol, float(self.both_const[j]), [(self.x_col[(j, c)], xcoef)] + terms, wmax))
        return out
