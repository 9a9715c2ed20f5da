"""What every schedule, the bound and the exact planner need to know about one graph,
computed once, and the memory model's rules about rebuilt copies, each defined here once:

- what may be recomputed (`candidates`);
- which forward ops a rebuild block copies (`block_ops`), and which of them later blocks
  may read instead of rebuilding (`block_targets`, up to `shared_until`);
- how long a rebuilt copy lives (`copy_spans`);
- which storages live the same under every plan that keeps them (`kept_intervals`).

`schedule.build_schedule`, `planners.bound.PeakLowerBound` and the exact planner's
program are built from these; change a rule here and all three follow.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from remat.ops import op_facts
from remat.ops import rng_replay
from remat.memory.analysis import GraphAnalysis, analyze
from remat.memory.spans import merge_spans
from remat.capture.train_graph import Phase, TrainGraph


class RebuildPolicy(str, enum.Enum):
    """Which rebuilt values a block leaves for later blocks to read.

    PER_BLOCK: only the block's targets (the values its node reads); intermediates die in
    the block and a later block that needs them rebuilds them (μ-TWO's cost model).
    SHARED: every rebuilt value a later node reads is held for it (Chen's segments:
    rebuilt once, held until its backward pass is done): less time, more memory held.
    """

    PER_BLOCK = "per-block"
    SHARED = "shared"

    @property
    def shares(self) -> bool:
        return self is RebuildPolicy.SHARED


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
    replayable: set[str]  # random ops whose generator state a rebuild can replay (rng_replay)
    writes: dict[str, list[int]]  # op node -> storages it writes in place
    written_by: dict[int, list[int]]  # storage -> ranks of the ops writing it
    output_inputs: list[str]
    activation: set[int] = field(default_factory=set)
    persistent: set[int] = field(default_factory=set)
    node_map: dict[str, torch.fx.Node] = field(default_factory=dict)
    last_late_reader: dict[str, int] = field(default_factory=dict)  # forward value -> last rank after the forward that reads it
    first_late_reader: dict[str, int] = field(default_factory=dict)  # forward value -> first rank after the forward that reads it
    # Measured kernel scratch per node (Profile.scratch_by_node()), set by whoever has a
    # profile: the plan simulator then predicts what the allocator will see.
    scratch: dict[str, int] = field(default_factory=dict)
    # The index of the graph as captured, where this one derives from it (`lean_ops.lean_index`,
    # `update_placement.moved_index`); None for the captured graph itself.
    captured: "GraphIndex | None" = None
    updates_moved: bool = False  # private optimizer updates run in the backward pass
    replay_off: str | None = None  # why no random op of this graph is replayed (forbid_replay); None: replay as rng_replay allows
    lean_ops: list[str] = field(default_factory=list)  # nodes that write into a dying input (lean_ops)
    # Ops a pass made from others (update_buckets merges split multi-tensor ops): the
    # captured op whose measured kernel scratch each is taken to need.
    scratch_like: dict[str, str] = field(default_factory=dict)
    # reads_of_copy per node, filled as asked: the planners ask it millions of times.
    _copy_reads: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, tg: TrainGraph, analysis: GraphAnalysis, like: "GraphIndex | None" = None) -> "GraphIndex":  # like: same nodes, facts per node shared
        nodes = list(tg.gm.graph.nodes)
        ops = tg.op_nodes()
        order = [n.name for n in ops]
        assert order == analysis.node_names, "analysis does not belong to this graph"
        inputs = like.inputs if like else {n.name: list(dict.fromkeys(a.name for a in n.all_input_nodes)) for n in ops}
        users: dict[str, list[str]] = {n: [] for n in order}
        for n in order:
            for a in inputs[n]:
                if a in users:
                    users[a].append(n)
        writes = {n.name: sorted({s for a in tg.written_args(n) for s in analysis.node_storages.get(a.name, [])}) for n in ops}
        written_by: dict[int, list[int]] = {}
        for r, n in enumerate(order):
            for s in writes[n]:
                written_by.setdefault(s, []).append(r)
        random = like.random if like else {n.name for n in ops if op_facts.is_random(n)}
        node_map = like.node_map if like else {n.name: n for n in nodes}
        rank = {n: i for i, n in enumerate(order)}
        forward = {n for n in order if tg.phase[n] is Phase.FORWARD}
        first_late, last_late = {}, {}  # forward value -> first and last rank after the forward pass that reads it
        for n in forward:
            late = [rank[u] for u in users[n] if u not in forward]
            if late:
                first_late[n], last_late[n] = min(late), max(late)
        return cls(
            tg=tg,
            analysis=analysis,
            order=order,
            rank=rank,
            forward=forward,
            inputs=inputs,
            users=users,
            storages=analysis.node_storages,
            random=random,
            replayable=like.replayable if like else {n for n in random if rng_replay.replay_problem(node_map[n]) is None},
            writes=writes,
            written_by=written_by,
            output_inputs=list(dict.fromkeys(a.name for a in next(n for n in nodes if n.op == "output").all_input_nodes)),
            activation={t.id for t in analysis.tensors if t.is_activation},
            persistent={t.id for t in analysis.tensors if t.persistent},
            node_map=node_map,
            last_late_reader=last_late,
            first_late_reader=first_late,
        )

    def indexed(self, tg: TrainGraph, analysis: GraphAnalysis | None = None, same_nodes: bool = True) -> "GraphIndex":
        """The index of a graph derived from this one (with the same nodes, unless
        `same_nodes` is False), analysed as `analysis` where given."""
        derived = GraphIndex.build(tg, analysis or analyze(tg), like=self if same_nodes else None)
        derived.captured = self.captured or self
        if self.replay_off is not None:
            derived.forbid_replay(self.replay_off)
        return derived

    def forbid_replay(self, why: str) -> None:
        """No random op of this graph, or of one derived from it later, is replayed (`why`):
        plans keep their outputs. Called before any plan is made (derived indices are cached)."""
        self.replay_off = why
        self.replayable = set()

    def derived(self, key: str, derive: Callable[[], tuple]) -> tuple:
        """`derive()` computed once and cached under `key`; the derived index shares this
        one's kernel scratch, which whoever has a profile may set after the first call."""
        cached = self.__dict__.get(key)
        if cached is None:
            cached = self.__dict__[key] = derive()
        if cached[0] is not None:
            cached[0].take_scratch(self.scratch)
        return cached

    def take_scratch(self, scratch: dict[str, int]) -> None:
        """`scratch` (the graph's it derives from) as this graph's, with its made ops'
        (`scratch_like`); the same dict for the same `scratch`, which caches key on."""
        if not self.scratch_like:
            self.scratch = scratch
            return
        memo = self.__dict__.get("_scratch_taken")
        if memo is None or memo[0] is not scratch:
            made = {new: scratch[old] for new, old in self.scratch_like.items() if old in scratch}
            memo = self.__dict__["_scratch_taken"] = (scratch, {**scratch, **made})
        self.scratch = memo[1]

    # ------------------------------------------------------------------ the rules of rebuilding

    def rebuild_closure(self, values: list[str], rebuilt_here: Callable[[str], bool]) -> list[str]:
        """The forward ops that rebuild `values`, in execution order: each of them and,
        transitively, every value a copy reads that must be rebuilt too (`rebuilt_here`).
        The one traversal behind every block and every plan entry's ops."""
        seen: set[str] = set()
        todo = list(values)
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            todo.extend(a for a in self.reads_of_copy(c) if a not in seen and rebuilt_here(a))
        return sorted(seen, key=self.rank.__getitem__)

    def block_ops(self, u: str, rebuilt_here: Callable[[str], bool]) -> list[str]:
        """The forward ops the block before node `u` copies: the closure of the inputs of u
        that must be rebuilt there. `rebuilt_here(a)` says whether value a must be: the
        schedule knows (a is not available under the dropped set, and no earlier block left
        a copy of it that is still shared, see `block_targets`); the bound asks with the
        same facts, and the exact planner with every value that could be."""
        return self.rebuild_closure([a for a in self.inputs[u] if rebuilt_here(a)], rebuilt_here)

    def block_targets(self, u: str, block: list[str], policy: RebuildPolicy) -> list[str]:
        """The values of the block before `u` that later blocks read instead of rebuilding
        them (while their rank is at most `shared_until`): the inputs of u it rebuilt and,
        under the shared policy, every value in it that a node after the forward pass reads."""
        if policy.shares:
            return [c for c in block if c in self.last_late_reader]
        inputs = set(self.inputs[u])
        return [c for c in block if c in inputs]

    def shared_until(self, a: str) -> int:
        """The last rank at which a block may read a copy of `a` that an earlier block left
        (`block_targets`): the last read after the forward pass of any value on a's
        storages, as long as the original would have lived, so that sharing the copy holds
        no memory the original would not have held. Views count (autograd's `detach` of a
        saved value), not only a's own readers."""
        return self.storage_last_read(a)

    def kept_intervals(self) -> dict[int, tuple[int, int]]:
        """The rank span [lo, hi] of each storage that lives the same in every schedule that
        keeps it: every storage made after the forward pass (its readers all come after the
        forward pass and read it directly), and every activation read alone
        (`activations_read_alone`; dropped, it lives over its `copy_spans` instead)."""
        cache = self.__dict__.get("_kept_intervals")
        if cache is None:
            tensors, n = self.analysis.tensors, len(self.order)
            cache = {}
            for t in tensors:
                if not t.persistent and t.created >= 0 and self.order[t.created] not in self.forward:
                    cache[t.id] = (t.created, min(t.last_use, n - 1))
            for s in sorted(self.activations_read_alone()):
                cache[s] = (tensors[s].created, min(tensors[s].last_use, n - 1))
            self.__dict__["_kept_intervals"] = cache
        return cache

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
        """Whether a value can be read in the backward pass without being rebuilt (placeholders,
        constants and values made after the forward pass always can)."""
        return name not in self.unavailable(dropped)

    def forward_readers(self, name: str) -> int:
        """How many forward nodes read forward value `name`, the graph's output counting as one."""
        cache = self.__dict__.get("_forward_readers")
        if cache is None:
            cache = {n: 0 for n in self.forward}
            for u in self.forward:
                for a in self.inputs[u]:
                    if a in cache:
                        cache[a] += 1
            for a in self.output_inputs:
                if a in cache:
                    cache[a] += 1
            self.__dict__["_forward_readers"] = cache
        return cache[name]

    def unavailable(self, dropped: frozenset[int] | set[int]) -> set[str]:
        """The forward values that cannot be read in the backward pass without being rebuilt
        under `dropped`: those on a dropped storage, and those on a storage never kept
        (neither an activation nor persistent). The one definition of availability; the
        last set's answer is kept, as callers ask about one set many times over."""
        last = self.__dict__.get("_last_unavailable")
        if last is not None and (last[0] is dropped or last[0] == dropped):
            return last[1]
        cache = self.__dict__.get("_values_on")
        if cache is None:
            values_on: dict[int, list[str]] = {}
            never: set[str] = set()
            for a in self.forward:
                for sid in self.storages.get(a, []):
                    if sid in self.activation:
                        values_on.setdefault(sid, []).append(a)
                    elif sid not in self.persistent:
                        never.add(a)
            cache = self.__dict__["_values_on"] = (values_on, frozenset(never))
        values_on, never = cache
        out = set(never)
        for sid in dropped:
            out.update(values_on.get(sid, ()))
        # Kept as the caller's own set where it is frozen, so that its next call matches by identity.
        self.__dict__["_last_unavailable"] = (dropped if isinstance(dropped, frozenset) else frozenset(dropped), out)
        return out

    def reads_of_copy(self, name: str) -> list[str]:
        """Inputs a copy of `name` reads (BatchNorm's twin does not read running stats)."""
        found = self._copy_reads.get(name)
        if found is None:
            reads = op_facts.copy_reads(self.node_map[name])
            found = self._copy_reads[name] = self.inputs[name] if reads is None else reads
        return found

    def closure(self, needed: list[str], dropped: frozenset[int] | set[int]) -> list[str]:
        """Forward nodes to copy (in execution order) so that every `needed` value exists
        when the storages in `dropped` are recomputed."""
        return self.rebuild_closure(needed, lambda a: not self.available(a, dropped))

    def replay_state_bytes(self, name: str) -> int:
        """Bytes of the generator state kept for a rebuild of random op `name` to replay: saved
        before the original runs, held until its last copy (0 where it lives off the device
        measured: a CUDA generator's state is a host tensor)."""
        return rng_replay.held_bytes(self.tg.device) if name in self.replayable else 0

    def replay_state_reserve(self, candidates: list[int]) -> int:
        """The most generator-state bytes a schedule dropping some of `candidates` holds for
        replay: the saved state of every random op a rebuild of them may copy (the closure
        with all of them dropped holds every other's), and the state set aside while one
        copy runs."""
        dropped = frozenset(candidates)
        readers = [a for s in candidates for a in self.backward_readers(s)]
        sizes = [self.replay_state_bytes(n) for n in self.closure(readers, dropped) if n in self.replayable]
        return sum(sizes) + max(sizes, default=0)

    def check_copy(self, name: str, copied: set[str], dropped: frozenset[int] | set[int], before_rank: int) -> str | None:
        """Why `name` cannot be copied into the backward pass (None if it can)."""
        if name in self._always_copyable():
            return None
        if name in self.random and name not in self.replayable:
            why = rng_replay.replay_problem(self.node_map[name]) or self.replay_off
            return f"{name} is a random op that cannot be replayed ({why}): its output must be kept"
        node = self.node_map[name]
        if node.target not in op_facts.STATE_FREE_TWINS:
            for s in self.writes[name]:
                owners_copied = any(
                    a in copied for a in self.inputs[name] if s in self.storages.get(a, []) and not self.available(a, dropped)
                )
                if not owners_copied:
                    return f"{name} writes in place into a tensor that is not rebuilt with it"
        r = self.rank[name]
        written_before, next_write = self._writes_around(name)
        if not written_before and next_write >= before_rank:
            return None  # no write the checks below could object to
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

    def _writes_around(self, name: str) -> tuple[bool, int]:
        """Whether another node writes in place into a storage a copy of `name` reads before
        `name` runs, and the rank of the first such write after it (the graph's length where
        none): what `check_copy` needs to know of most ops to pass them."""
        cache = self.__dict__.setdefault("_writes_around_copy", {})
        if name not in cache:
            r = self.rank[name]
            writes = [w for a in self.reads_of_copy(name) for s in self.storages.get(a, []) for w in self.written_by.get(s, []) if w != r]
            cache[name] = (any(w < r for w in writes), min((w for w in writes if w > r), default=len(self.order)))
        return cache[name]

    def _always_copyable(self) -> set[str]:
        """Forward ops `check_copy` passes whatever is dropped (most; the others it checks each time)."""
        if "_always_copyable_ops" not in self.__dict__:
            self.__dict__["_always_copyable_ops"] = {
                n for n in self.forward
                if not (n in self.random and n not in self.replayable)
                and (not self.writes[n] or self.node_map[n].target in op_facts.STATE_FREE_TWINS)
                and self._writes_around(n) == (False, len(self.order))
            }  # fmt: skip
        return self.__dict__["_always_copyable_ops"]

    def stale_read(self, sid: int, writers: list[str]) -> str | None:
        """A read of storage `sid` through a value made before an in-place write that precedes
        the read (a view written in place, its base read later), or None. A rebuild replays
        the writes on the way to the value it rebuilds (the closure goes through each in-place
        result), so only values made after the writes they were read after can be rebuilt."""
        for w in writers:
            r_w = self.rank[w]
            for a in self.analysis.tensors[sid].aliases:
                if self.rank.get(a, len(self.order)) >= r_w:
                    continue
                late = [u for u in self.users.get(a, []) if self.rank[u] > r_w]
                if late:
                    return f"{late[0]} reads it through {a}, made before {w} wrote it in place"
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
        random = [n for n in [self.analysis.tensors[sid].node, *writers] if n in self.random and n not in self.replayable]
        if random:
            return f"made by a random op that cannot be replayed ({random[0]}): its value must be kept"
        late = [w for w in writers if w not in self.forward]
        if late:
            return f"written in place after the forward pass (by {late[0]})"
        stale = self.stale_read(sid, writers)
        if stale is not None:
            return stale
        readers = self.backward_readers(sid)
        dropped = frozenset([sid])
        first = min((self.rank[u] for a in readers for u in self.users[a] if u not in self.forward), default=len(self.order))
        copied: set[str] = set()
        for c in self.closure(readers, dropped):
            why = self.check_copy(c, copied, dropped, first)
            if why is not None:
                return why
            copied.add(c)
        return None

