"""The execution order of a graph in which some activations are dropped and recomputed.

This is the one place that decides *where* recomputation happens; the plan simulator and
the rewriter both read a `Schedule`, so what is simulated is what runs.

Rules (DESIGN.md, "Correctness"):
- A forward value is *available* in the backward pass if it is a graph input, a constant,
  not a tensor, or lives only in kept activation storages. Anything else a later node
  reads is rebuilt: its forward op is copied, with its inputs rebuilt the same way,
  so the sources of a rebuild are always kept activations, parameters and inputs.
- Copies go in a *block* just before the first node after the forward pass that needs
  them. A rebuilt activation that a later node reads (a *target*) lives until its last
  reader, which all read that one copy; the intermediates a block needs only to rebuild
  its targets die within the block, and a later block that needs them again rebuilds
  them again (μ-TWO's cost model: a source of several recomputed tensors is recomputed
  once for each). Within a block every value is rebuilt once and shared.
- Forward ops whose only readers now read the copy are removed from the forward pass
  (if they are pure), so an activation used only in the backward pass is computed there.
- Random ops are never copied. Mutating ops are copied only when everything they write
  was itself rebuilt in the same closure (e.g. `x += residual` on a rebuilt `x`); BatchNorm
  is copied as its stat-free twin, so running statistics are updated exactly once.
- A source must hold the same value at rebuild time as when the original op read it: no
  in-place write to it in between. A rebuilt storage must see every write the original
  saw before the read.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.fx

from remat.analysis import GraphAnalysis
from remat.capture import Phase, TrainGraph
from remat.errors import PlanError
from remat.simulator import Timeline, persistent_by_role, round_up, simulate_intervals

aten = torch.ops.aten


def _bn_twin(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return aten.native_batch_norm.default, (*args[:3], None, None, *args[5:]), kwargs


def _bn_legit_twin(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    # _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return aten._native_batch_norm_legit.no_stats, (*args[:3], *args[5:]), kwargs


# Ops that mutate module state as a side effect, with a twin that computes the same
# outputs (bitwise: same kernel) without the side effect. Copies use the twin.
STATE_FREE_TWINS: dict[Any, Callable[[tuple, dict], tuple[Any, tuple, dict]]] = {
    aten.native_batch_norm.default: _bn_twin,
    aten._native_batch_norm_legit.default: _bn_legit_twin,
}
_TWIN_READS = {aten.native_batch_norm.default: (0, 1, 2), aten._native_batch_norm_legit.default: (0, 1, 2)}


ORIGINAL = -1  # the instance number of a value computed by its original node


@dataclass(frozen=True)
class Step:
    node: str  # the original node this step runs
    instance: int = ORIGINAL  # >= 0: a rebuild placed in the backward pass, numbered

    @property
    def copy(self) -> bool:
        return self.instance != ORIGINAL


@dataclass
class Schedule:
    steps: list[Step]
    reads: list[list[tuple[str, int]]]  # per step: (node, instance) of each value it reads
    removed: list[str]  # forward nodes dropped because only rebuilt copies are read
    output_reads: list[tuple[str, int]]
    dropped: frozenset[int]  # the storages the schedule was built for

    @property
    def copies(self) -> list[str]:
        return [s.node for s in self.steps if s.copy]


def _is_random(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


# Ops that write some inputs in place without saying so in their schema: argument positions.
# native_batch_norm updates running_mean / running_var in training mode.
_UNDECLARED_WRITES: dict[Any, tuple[int, ...]] = {
    aten.native_batch_norm.default: (3, 4),
    aten.cudnn_batch_norm.default: (3, 4),
    aten.miopen_batch_norm.default: (3, 4),
}


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes whose storage this op writes in place (schema `Tensor(a!)`)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out: list[torch.fx.Node] = [
        node.args[i] for i in _UNDECLARED_WRITES.get(target, ()) if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)
    ]
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, torch.fx.Node):
                out.append(v)
    return out


@dataclass
class GraphIndex:
    """What schedules need to know about a graph, computed once and shared by every plan."""

    tg: TrainGraph
    analysis: GraphAnalysis
    order: list[str]  # op nodes in execution order
    rank: dict[str, int]
    forward: set[str]
    inputs: dict[str, list[str]]  # op node -> distinct input nodes, in argument order
    users: dict[str, list[str]]  # op node -> op nodes reading it
    storages: dict[str, list[int]]
    random: set[str]
    writes: dict[str, list[int]]  # op node -> storages it writes in place
    written_by: dict[int, list[int]]  # storage -> ranks of the ops writing it
    output_inputs: list[str]
    activation: set[int] = field(default_factory=set)
    persistent: set[int] = field(default_factory=set)
    node_map: dict[str, torch.fx.Node] = field(default_factory=dict)
    last_late_reader: dict[str, int] = field(default_factory=dict)  # forward value -> last rank after the forward that reads it
    # Measured kernel scratch per node (Profile.scratch_by_node()), set by whoever has a
    # profile: the plan simulator then predicts what the allocator will see.
    scratch: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, tg: TrainGraph, analysis: GraphAnalysis) -> "GraphIndex":
        nodes = list(tg.gm.graph.nodes)
        ops = [n for n in nodes if n.op == "call_function"]
        order = [n.name for n in ops]
        assert order == analysis.node_names, "analysis does not belong to this graph"
        inputs = {n.name: list(dict.fromkeys(a.name for a in n.all_input_nodes)) for n in ops}
        users: dict[str, list[str]] = {n: [] for n in order}
        for n in order:
            for a in inputs[n]:
                if a in users:
                    users[a].append(n)
        writes = {n.name: sorted({s for a in _written_args(n) for s in analysis.node_storages.get(a.name, [])}) for n in ops}
        written_by: dict[int, list[int]] = {}
        for r, n in enumerate(order):
            for s in writes[n]:
                written_by.setdefault(s, []).append(r)
        output = next(n for n in nodes if n.op == "output")
        rank = {n: i for i, n in enumerate(order)}
        forward = {n for n in order if tg.phase[n] is Phase.FORWARD}
        last_late: dict[str, int] = {}
        for n in forward:
            late = [rank[u] for u in users[n] if u not in forward]
            if late:
                last_late[n] = max(late)
        return cls(
            tg=tg,
            analysis=analysis,
            order=order,
            rank=rank,
            forward=forward,
            inputs=inputs,
            users=users,
            storages=analysis.node_storages,
            random={n.name for n in ops if _is_random(n)},
            writes=writes,
            written_by=written_by,
            output_inputs=list(dict.fromkeys(a.name for a in output.all_input_nodes)),
            activation={t.id for t in analysis.tensors if t.is_activation},
            persistent={t.id for t in analysis.tensors if t.persistent},
            node_map={n.name: n for n in nodes},
            last_late_reader=last_late,
        )

    def activations_read_alone(self) -> set[int]:
        """Activations that no node after the forward pass reads through a value holding
        other storages too (whether such a value is rebuilt depends on the others)."""
        unsafe: set[int] = set()
        for name in self.order:
            if name in self.forward:
                continue
            for a in self.inputs[name]:
                sids = self.storages.get(a, [])
                if a in self.forward and len(sids) > 1:
                    unsafe.update(sids)
        return {s for s in self.activation if s not in unsafe}

    def copy_spans(self) -> dict[str, dict[int, tuple[int, int]]]:
        """How long a rebuilt copy lives, the one rule every planner and the bound read:
        per forward value read after the forward pass, per storage of it (not persistent),
        the rank span [first, last] over which the copy those readers share is live: from
        its first to its last reader after the forward pass, and on to the last reader of
        every backward view of it (autograd's `detach` of a saved `detach`), which aliases
        the copy, or to the end for a graph output."""
        cache = self.__dict__.get("_copy_spans")
        if cache is None:
            cache = {}
            for a in self.forward:
                late = [u for u in self.users.get(a, []) if u not in self.forward]
                if not late:
                    continue
                lo = min(self.rank[u] for u in late)
                spans = cache.setdefault(a, {})
                for s in self.storages.get(a, []):
                    if s not in self.persistent:
                        spans[s] = (lo, self.copy_last_read(a, s))
            self.__dict__["_copy_spans"] = cache
        return cache

    def activation_copy_spans(self) -> dict[int, list[tuple[int, int]]]:
        """Per activation: the spans over which a copy of it is live once it is dropped
        (`copy_spans`, over all values on it, overlapping spans merged)."""
        by_storage: dict[int, list[tuple[int, int]]] = {}
        for value_spans in self.copy_spans().values():
            for s, span in value_spans.items():
                if s in self.activation:
                    by_storage.setdefault(s, []).append(span)
        return merge_spans(by_storage)

    def storage_last_read(self, name: str) -> int:
        """The last rank after the forward pass that reads any value on `name`'s storages."""
        cache = self.__dict__.setdefault("_storage_last_read", {})
        if not cache:
            for n, r in self.last_late_reader.items():
                for sid in self.storages.get(n, []):
                    cache[sid] = max(cache.get(sid, -1), r)
        return max((cache.get(sid, -1) for sid in self.storages.get(name, [])), default=-1)

    def available(self, name: str, dropped: frozenset[int] | set[int]) -> bool:
        """Whether a value can be read in the backward pass without being rebuilt."""
        if name not in self.rank or name not in self.forward:
            return True  # placeholders, constants, backward/optimizer values
        sids = self.storages.get(name, [])
        return all(s in self.persistent or (s in self.activation and s not in dropped) for s in sids)

    def reads_of_copy(self, name: str) -> list[str]:
        """Inputs a copy of `name` reads (BatchNorm's twin does not read running stats)."""
        node = self.node_map[name]
        keep = _TWIN_READS.get(node.target)
        if keep is None:
            return self.inputs[name]
        wanted = [node.args[i] for i in keep if isinstance(node.args[i], torch.fx.Node)]
        return list(dict.fromkeys(a.name for a in wanted))

    def closure(self, needed: list[str], dropped: frozenset[int] | set[int], done: set[str]) -> list[str]:
        """Forward nodes to copy (in execution order) so that every `needed` value exists."""
        todo = [n for n in needed if n not in done]
        seen: set[str] = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for a in self.reads_of_copy(n):
                if a not in seen and a not in done and not self.available(a, dropped):
                    todo.append(a)
        return sorted(seen, key=self.rank.__getitem__)

    def check_copy(self, name: str, copied: set[str], dropped: frozenset[int] | set[int], before_rank: int) -> str | None:
        """Why `name` cannot be copied into the backward pass (None if it can)."""
        if name in self.random:
            return f"{name} is a random op: its output must be kept, never recomputed"
        node = self.node_map[name]
        if node.target not in STATE_FREE_TWINS:
            for s in self.writes[name]:
                owners_copied = any(
                    a in copied for a in self.inputs[name] if s in self.storages.get(a, []) and not self.available(a, dropped)
                )
                if not owners_copied:
                    return f"{name} writes in place into a tensor that is not rebuilt with it"
        r = self.rank[name]
        for a in self.reads_of_copy(name):
            for s in self.storages.get(a, []):
                rebuilt = a in copied
                for w in self.written_by.get(s, []):
                    if w == r:
                        continue
                    if rebuilt and w < r and self.order[w] not in copied:
                        return f"{name} reads {a}, written in place by {self.order[w]}, which is not rebuilt"
                    if not rebuilt and r < w < before_rank:
                        return f"{name} reads {a}, which {self.order[w]} changes in place before the rebuild"
        return None


    def backward_readers(self, sid: int) -> list[str]:
        """Forward values on storage `sid` that nodes after the forward pass read."""
        tensor = self.analysis.tensors[sid]
        return [
            a for a in tensor.aliases
            if a in self.forward and any(u not in self.forward for u in self.users.get(a, []))
        ]

    def copy_last_read(self, a: str, sid: int) -> int:
        """The last rank at which storage `sid` of a rebuilt copy of forward value `a` is
        read: a's last reader after the forward pass, or later the last reader of a
        backward view of the copy (autograd's `detach` of a saved `detach` aliases it),
        transitively; the last rank for a graph output. The span a copy must live,
        whichever block made it (PeakLowerBound and the exact planner count it)."""
        late = [u for u in self.users.get(a, []) if u not in self.forward]
        hi = max((self.rank[u] for u in late), default=-1)
        outputs = set(self.output_inputs)
        todo = [u for u in late if sid in self.storages.get(u, [])]
        seen: set[str] = set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in outputs:
                hi = len(self.order) - 1
            for w in self.users.get(v, []):
                hi = max(hi, self.rank[w])
                if sid in self.storages.get(w, []):
                    todo.append(w)
        return hi

    def candidates(self) -> list[int]:
        """The activations that may be recomputed, in creation order: what every planner picks from."""
        cache = self.__dict__.get("_candidates")
        if cache is None:
            acts = [t for t in self.analysis.activations() if self.candidate_problem(t.id) is None]
            cache = self.__dict__["_candidates"] = [t.id for t in sorted(acts, key=lambda t: (t.created, t.id))]
        return list(cache)

    def candidate_problem(self, sid: int) -> str | None:
        """Why activation `sid` may not be recomputed on its own (None if it may)."""
        if sid not in self.activation:
            return "not an activation"
        if any(sid in self.storages.get(a, []) for a in self.output_inputs):
            return "a graph output"
        writers = [self.order[w] for w in self.written_by.get(sid, [])]
        random = [n for n in [self.analysis.tensors[sid].node, *writers] if n in self.random]
        if random:
            return f"made by a random op ({random[0]}): its value must be kept, never recomputed"
        if writers:
            return f"written in place after it is made (by {writers[0]})"
        dropped = frozenset([sid])
        readers = self.backward_readers(sid)
        first = min((self.rank[u] for a in readers for u in self.users[a] if u not in self.forward), default=len(self.order))
        copied: set[str] = set()
        for c in self.closure(readers, dropped, copied):
            why = self.check_copy(c, copied, dropped, first)
            if why is not None:
                return why
            copied.add(c)
        return None


def recompute_seconds(schedule: Schedule, node_seconds: dict[str, float]) -> float:
    """Predicted extra time of a schedule: the copies, less the forward ops it removed."""
    return sum(node_seconds[s.node] for s in schedule.steps if s.copy) - sum(node_seconds[n] for n in schedule.removed)


def build_schedule(index: GraphIndex, dropped: set[int] | frozenset[int], share_rebuilt: bool = False) -> Schedule:
    """The order the rewritten graph runs in when the storages in `dropped` are recomputed.

    `share_rebuilt`: every rebuilt value that later nodes read is kept for them, not only
    the block's targets (Chen's segments: a segment is recomputed once, then held until
    its backward pass is done), trading memory for not rebuilding chains again.
    """
    dropped = frozenset(dropped)
    bad = [s for s in dropped if s not in index.activation]
    if bad:
        keys = ", ".join(index.analysis.tensors[s].key for s in bad[:5])
        raise PlanError(f"only activations can be recomputed; not activations: {keys}")
    forward = [n for n in index.order if n in index.forward]

    # One pass in the captured order: forward nodes as they are, each later node preceded
    # by the block that rebuilds what it reads and is not available. Forward and backward
    # passes may alternate (micro-batches accumulating gradients in one step).
    all_steps: list[Step] = []
    all_reads: list[list[tuple[str, int]]] = []
    target: dict[str, int] = {}  # value -> instance of its rebuilt copy that later readers share
    next_instance = 0
    for u in index.order:
        if u in index.forward:
            all_steps.append(Step(u))
            all_reads.append([(a, ORIGINAL) for a in index.inputs[u]])
            continue
        r_u = index.rank[u]
        block: dict[str, int] = {}

        def resolve(a: str) -> int | None:
            """Which instance of `a` node u's block can read; None: it must be rebuilt here."""
            if index.available(a, dropped):
                return ORIGINAL
            if a in block:
                return block[a]
            if a in target and r_u <= index.storage_last_read(a):
                return target[a]  # the original would still be alive here: no extra memory
            return None

        needed = [a for a in index.inputs[u] if resolve(a) is None]
        if needed:
            todo, seen = list(needed), set()
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                todo.extend(a for a in index.reads_of_copy(n) if a not in seen and resolve(a) is None)
            for c in sorted(seen, key=index.rank.__getitem__):
                why = index.check_copy(c, block, dropped, r_u)
                if why is not None:
                    raise PlanError(f"cannot recompute what {u} needs: {why}")
                reads = [(a, resolve(a)) for a in index.reads_of_copy(c)]
                block[c] = next_instance
                all_steps.append(Step(c, next_instance))
                all_reads.append(reads)  # type: ignore[arg-type]
                next_instance += 1
            for a in needed:
                target[a] = block[a]
            if share_rebuilt:
                for c, instance in block.items():
                    if c in index.last_late_reader:
                        target[c] = instance
        all_steps.append(Step(u))
        all_reads.append([(a, resolve(a)) for a in index.inputs[u]])  # type: ignore[misc]
    output_reads = [(a, ORIGINAL) for a in index.output_inputs]
    if any(not index.available(a, dropped) for a in index.output_inputs):
        raise PlanError("a graph output cannot be recomputed")

    # Forward nodes that nothing reads any more (their readers now read copies) and that
    # have no side effect are removed: the value is then computed in the backward only.
    copied = {s.node for s in all_steps if s.copy}
    readers: dict[str, int] = {n: 0 for n in forward}
    for step, reads in zip(all_steps, all_reads):
        for a, instance in reads:
            if instance == ORIGINAL and a in readers:
                readers[a] += 1
    for a, _ in output_reads:
        if a in readers:
            readers[a] += 1
    removed: set[str] = set()
    for n in reversed(forward):
        if readers[n] == 0 and n not in index.random and not index.writes[n] and n in copied:
            removed.add(n)
            for a in index.inputs[n]:
                if a in readers:
                    readers[a] -= 1
    kept = [i for i, step in enumerate(all_steps) if step.copy or step.node not in removed]
    return Schedule(
        steps=[all_steps[i] for i in kept],
        reads=[all_reads[i] for i in kept],
        removed=sorted(removed, key=index.rank.__getitem__),
        output_reads=output_reads,
        dropped=dropped,
    )


def simulate_schedule(index: GraphIndex, schedule: Schedule, granularity: int = 1) -> Timeline:
    """The memory timeline of running `schedule` (see simulator.py for the conventions)."""
    tensors = index.analysis.tensors
    n_steps = len(schedule.steps)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    size: dict[int, int] = {}
    role: dict[int, str] = {}
    # An original storage is keyed by its id; each rebuilt instance's fresh storage gets a
    # new key. A view or in-place result shares the key of the input it aliases *as read
    # in this step*, so a backward view of a rebuilt value lives in the rebuilt storage.
    value_keys: dict[tuple[str, int], list[int]] = {}
    next_key = len(tensors)

    def keys(node: str, instance: int) -> list[int]:
        found = value_keys.get((node, instance))
        return found if found is not None else list(index.storages.get(node, []))

    for i, (step, reads) in enumerate(zip(schedule.steps, schedule.reads)):
        inherited: dict[int, int] = {}
        for a, instance in reads:
            for s, k in zip(index.storages.get(a, []), keys(a, instance)):
                inherited[s] = k
                if k in start:
                    end[k] = i
        own: list[int] = []
        for s in index.storages.get(step.node, []):
            k = inherited.get(s)
            if k is None:
                if step.copy:
                    k, next_key = next_key, next_key + 1
                else:
                    k = s
            own.append(k)
            if k not in start and (k >= len(tensors) or k not in index.persistent):
                start[k] = i
                size[k] = round_up(tensors[s].nbytes, granularity)
                role[k] = tensors[s].role.value
            if k in start:
                end[k] = max(end.get(k, i), i)
        value_keys[(step.node, step.instance)] = own
    for a, instance in schedule.output_reads:
        for k in keys(a, instance):
            if k in start:
                end[k] = n_steps
    ks = sorted(start)
    return simulate_intervals(
        n_steps,
        np.array([size[k] for k in ks], dtype=np.int64),
        np.array([start[k] for k in ks], dtype=np.int64),
        np.array([end[k] for k in ks], dtype=np.int64),
        [role[k] for k in ks],
        persistent_by_role(tensors, granularity),
        np.array([index.scratch.get(s.node, 0) for s in schedule.steps], dtype=np.int64) if index.scratch else None,
    )


def copy_call(node: torch.fx.Node) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) for a rebuild of `node` (its state-free twin where it has one)."""
    twin = STATE_FREE_TWINS.get(node.target)
    if twin is not None:
        return twin(tuple(node.args), dict(node.kwargs))
    return node.target, tuple(node.args), dict(node.kwargs)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.target is operator.getitem


def merge_spans(spans: dict[int, list[tuple[int, int]]]) -> dict[int, list[tuple[int, int]]]:
    """Each storage's rank spans, sorted, overlapping ones merged (storages without any left out)."""
    merged: dict[int, list[tuple[int, int]]] = {}
    for s, xs in spans.items():
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(xs):
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        if out:
            merged[s] = out
    return merged
