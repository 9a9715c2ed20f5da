"""Optimizer in backward: each parameter's update moved to just after its gradient is final,
so that the gradient dies there instead of living to the end of the backward pass.

A pass with one job: it reorders the captured graph's nodes and changes nothing else, so
every op runs as captured (the step leaves bitwise what eager leaves) and every memory
rule, the simulator and every planner apply to the reordered graph as they are.

An update moves when it is *private*: its ops read and write only one parameter, its
gradient and its own optimizer state (and hyperparameters). It goes right after the last
op outside it that it must follow:
- the ops it reads from (the gradient, finished by the last backward pass);
- every other op that writes a storage it reads or writes (an accumulated gradient,
  `clip_grad_norm_` scaling it in place);
- every other op that reads a storage it writes (the backward ops that read the old
  value of the parameter, also through a view or a tied use);
- every check on a tensor's value (ops.value_checks), so that a step whose check
  fails has updated nothing; a check after `optimizer.step()` began keeps every update
  in place.
Ops of the update that read several parameters' tensors together (a norm over all
gradients) keep those parameters' updates at the end. A multi-tensor `_foreach` kernel is
split per parameter first and its updates moved in buckets (update_buckets). Scalar ops
the update needs (learning rate arithmetic) go right before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx

from remat.ops.known_values import SIZE_CHECK_OP
from remat.ops.value_checks import VALUE_CHECK_OP
from remat.memory.analysis import GraphAnalysis, reordered_analysis
from remat.passes import update_buckets
from remat.memory.graph_index import GraphIndex
from remat.capture.train_graph import InputKind, Phase, TrainGraph


@dataclass
class UpdatePlacement:
    """Where each parameter's update runs once moved into the backward pass."""

    moved: dict[str, str] = field(default_factory=dict)  # parameter -> the node its update now follows
    held: dict[str, str] = field(default_factory=dict)  # parameter -> why its update stays at the end
    # Multi-tensor updates (update_buckets): the moved parameters in buckets, each bucket's
    # update one op per multi-tensor op, run after its last member's gradient; [] otherwise.
    buckets: list[list[str]] = field(default_factory=list)

    @property
    def applies(self) -> bool:
        return bool(self.moved)

    def summary(self) -> str:
        """One line: how many updates moved, and why the others did not."""
        if not self.moved and not self.held:
            return "the step has no optimizer update"
        parts = [f"{len(self.moved)} of {len(self.moved) + len(self.held)} parameter updates run in the backward pass"]
        if self.buckets and max(map(len, self.buckets)) == 1:
            parts[0] += ", each in multi-tensor ops of its own"
        elif self.buckets:
            parts[0] += f", in {len(self.buckets)} buckets of multi-tensor ops"
        if self.held:
            name, why = next(iter(self.held.items()))
            more = f" (and {len(self.held) - 1} more)" if len(self.held) > 1 else ""
            parts.append(f"{name}{more} stays at the end: {why}")
        return "; ".join(parts)


def _owners_of_inputs(tg: TrainGraph, analysis: GraphAnalysis) -> dict[int, str]:
    """Storage -> the parameter it belongs to: the parameter, its optimizer state, its gradient."""
    placeholders = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    params = {spec.name for spec in tg.inputs if spec.kind is InputKind.PARAMETER}
    owner: dict[int, str] = {}
    for node, spec in zip(placeholders, tg.inputs):
        name = None
        if spec.kind is InputKind.PARAMETER:
            name = spec.name
        elif spec.kind is InputKind.OPTIMIZER_STATE:  # "<param>.<state key>": the longest parameter prefix
            parts = spec.name.split(".")
            name = next((p for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)) if p in params), None)
        if name is not None:
            for s in analysis.node_storages.get(node.name, []):
                owner[s] = name
    for param, grad in tg.grad_nodes.items():
        for s in analysis.node_storages.get(grad, []):
            owner.setdefault(s, param)
    return owner


def place_updates(tg: TrainGraph, analysis: GraphAnalysis, writes: dict[str, list[int]]) -> tuple[list[str], UpdatePlacement]:
    """The op nodes in the order that runs each private update right after its gradient is
    final (the captured order where nothing moves), and what moved. `writes`: per op node,
    the storages it writes in place (GraphIndex.writes)."""
    return placed_order(UpdateFacts(tg, analysis, writes))


def placed_order(facts: UpdateFacts) -> tuple[list[str], UpdatePlacement]:
    """place_updates on the facts of one graph."""
    placement = UpdatePlacement(held=dict(facts.shared))
    slots: dict[str, int] = {}
    for param in facts.groups:
        if param in placement.held:
            continue
        slot, why = facts.slot(param)
        if why is not None:
            placement.held[param] = why
        else:
            slots[param] = slot
            placement.moved[param] = facts.order[slot]
    return facts.order_with(slots), placement


class UpdateFacts:
    """The update ops of one graph, by parameter, with the storages they touch."""

    def __init__(self, tg: TrainGraph, analysis: GraphAnalysis, writes: dict[str, list[int]]) -> None:
        ops = tg.op_nodes()
        self.order = [n.name for n in ops]
        self.rank = {n: i for i, n in enumerate(self.order)}
        self.node_map = {n.name: n for n in ops}
        self.storages = analysis.node_storages
        self.writes = writes
        update = [n for n in ops if tg.phase[n.name] is Phase.OPTIMIZER]
        self.in_update = {n.name for n in update}
        self.last_outside = max((r for r, n in enumerate(self.order) if n not in self.in_update), default=-1)
        # No update runs before a check on a tensor's value (ops.value_checks): a step
        # whose check fails leaves the parameters as eager leaves them.
        self.last_check = max((r for r, n in enumerate(ops) if n.target in (VALUE_CHECK_OP, SIZE_CHECK_OP) and n.name not in self.in_update), default=-1)
        self.readers: dict[int, list[int]] = {}
        self.writers: dict[int, list[int]] = {}
        for r, (n, read) in enumerate(zip(self.order, analysis.uses)):
            for sid in read:
                self.readers.setdefault(sid, []).append(r)
            for sid in writes[n]:
                self.writers.setdefault(sid, []).append(r)
        self._assign(update, _owners_of_inputs(tg, analysis))
        late_check = next((n for n in update if n.target is VALUE_CHECK_OP), None)
        for param in self.groups if late_check is not None else ():
            # A check after optimizer.step() began sees every update eager ran before it, and no other.
            self.shared.setdefault(param, f"{late_check.name} checks a tensor's value after the update began")

    def _assign(self, update: list[torch.fx.Node], owner: dict[int, str]) -> None:
        """Each update op's parameter, by what it reads (through other update ops): one
        parameter's group, several (`shared`: those stay at the end), or none (`free`:
        scalar arithmetic on hyperparameters); and the latest op outside the update it reads."""
        owners: dict[str, set[str]] = {}
        self.outside_dep: dict[str, int] = {}
        self.groups: dict[str, list[str]] = {}
        self.shared: dict[str, str] = {}
        free: list[str] = []
        for n in update:
            mine: set[str] = set()
            dep = -1
            for a in n.all_input_nodes:
                if a.name in self.in_update:
                    mine |= owners[a.name]
                    dep = max(dep, self.outside_dep[a.name])
                    continue
                mine |= {owner[sid] for sid in self.storages.get(a.name, []) if sid in owner}
                if a.op == "call_function":
                    dep = max(dep, self.rank[a.name])
            owners[n.name], self.outside_dep[n.name] = mine, dep
            if len(mine) > 1:
                for p in mine:
                    self.shared.setdefault(p, f"{n.name} ({n.target}) reads the tensors of several parameters together")
            elif mine:
                self.groups.setdefault(next(iter(mine)), []).append(n.name)
            else:
                free.append(n.name)
        self.free = set(free)
        self.writing_free = {f for f in free if self.writes[f]}

    def helpers(self, names: list[str]) -> list[str]:
        """The free ops that the ops `names` read, transitively, in captured order."""
        seen: set[str] = set()
        todo = [a.name for n in names for a in self.node_map[n].all_input_nodes if a.name in self.free]
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                todo.extend(a.name for a in self.node_map[f].all_input_nodes if a.name in self.free)
        return sorted(seen, key=self.rank.__getitem__)

    def slot(self, param: str) -> tuple[int, str | None]:
        """The rank of the last op outside `param`'s update that it must follow (see the
        module docstring), and why it cannot move (None if it can)."""
        names = self.groups[param]
        helpers = self.helpers(names)
        writing = sorted(self.writing_free & set(helpers))
        if writing:
            return -1, f"it needs {writing[0]}, which writes in place"
        read = {sid for n in names for a in self.node_map[n].all_input_nodes for sid in self.storages.get(a.name, [])}
        written = {sid for n in names for sid in self.writes[n]}
        slot = max(self.last_check, *(self.outside_dep[n] for n in [*names, *helpers]))
        members = set(names)
        for sid in read | written:
            for r in self.writers.get(sid, []) + (self.readers.get(sid, []) if sid in written else []):
                other = self.order[r]
                if other in members:
                    continue
                if other in self.in_update and other not in self.free:
                    return -1, f"its tensors are also used by {other}, an update of another parameter"
                if other not in self.in_update:
                    slot = max(slot, r)
        if slot >= self.last_outside:
            return slot, f"it must follow {self.order[slot]}, the last op of the backward pass"
        return slot, None

    def order_with(self, slots: dict[str, int]) -> list[str]:
        """The captured order with each update of `slots` (and the free ops it needs) right
        after the op of its slot; every other update op at the end, in captured order."""
        after: dict[int, list[str]] = {}
        for p in sorted(slots, key=lambda p: self.rank[self.groups[p][0]]):
            after.setdefault(slots[p], []).append(p)
        order: list[str] = []
        emitted: set[str] = set()
        for n in self.order:
            if n in self.in_update:
                continue
            order.append(n)
            for p in after.get(self.rank[n], []):
                for op in [*self.helpers(self.groups[p]), *self.groups[p]]:
                    if op not in emitted:
                        emitted.add(op)
                        order.append(op)
        order.extend(n for n in self.order if n in self.in_update and n not in emitted)
        assert sorted(order) == sorted(self.order)
        return order


def reorder(tg: TrainGraph, order: list[str]) -> TrainGraph:
    """`tg` with its op nodes run in `order`: the same module and nodes (copying a large
    graph takes a good part of a second), the order kept beside them (`TrainGraph.order`)."""
    if tg.order is not None:
        raise ValueError("reorder takes a graph in its own order")
    ops = {n.name: n for n in tg.op_nodes()}
    rank = {name: r for r, name in enumerate(order)}
    if len(rank) != len(order) or rank.keys() != ops.keys():
        raise ValueError("reorder needs every op node of the graph exactly once")
    late = next((n for n in order if any(rank.get(a.name, -1) >= rank[n] for a in ops[n].all_input_nodes)), None)
    if late is not None:
        raise ValueError(f"reorder would run {late} before one of its inputs")
    return dataclasses.replace(tg, order=list(order), meta={**tg.meta, "updates_in_backward": True})


def moved_index(index: GraphIndex, in_buckets: bool = True) -> tuple[GraphIndex | None, UpdatePlacement]:
    """`index`'s graph with each private optimizer update moved to just after its gradient
    is final, indexed; None where no update can move. A multi-tensor update is split and
    moved in buckets (update_buckets), or with `in_buckets=False` one parameter to a
    bucket: more kernels, and no gradient kept waiting for a bucket. Computed once."""
    if index.updates_moved:
        return None, UpdatePlacement()

    def derive() -> tuple[GraphIndex | None, UpdatePlacement]:
        split = update_buckets.split_foreach(index.tg)
        if split is not None:
            return _in_buckets(index, *split, in_buckets)
        if not in_buckets:
            return moved_index(index)
        order, placement = place_updates(index.tg, index.analysis, index.writes)
        if not placement.applies:
            return None, placement
        moved = index.indexed(tg := reorder(index.tg, order), reordered_analysis(tg, index.analysis))
        moved.updates_moved, moved.lean_ops = True, index.lean_ops
        return moved, placement

    return index.derived("_updates_in_backward" if in_buckets else "_updates_in_backward_one_each", derive)


def _in_buckets(
    index: GraphIndex, split_tg: TrainGraph, origin: dict[str, tuple[str, int]], in_buckets: bool
) -> tuple[GraphIndex | None, UpdatePlacement]:
    """The multi-tensor update of `index`'s graph placed per parameter on its split graph,
    then run in buckets (update_buckets.bucketed)."""
    split = index.indexed(split_tg, same_nodes=False)
    facts = UpdateFacts(split_tg, split.analysis, split.writes)
    order, placement = placed_order(facts)
    if not placement.applies:
        return None, placement
    rank = {n: r for r, n in enumerate(order)}
    # A gradient's bytes are its parameter's.
    grad_bytes = {i.name: update_buckets.nbytes(i.shape, i.dtype) for i in index.tg.inputs if i.kind is InputKind.PARAMETER}
    cap = update_buckets.bucket_cap_bytes(grad_bytes) if in_buckets else 0
    placement.buckets = update_buckets.buckets(order, placement.moved, grad_bytes, cap)
    placed: dict[str, list[list[str]]] = {}
    for members in placement.buckets:
        placed.setdefault(max((placement.moved[p] for p in members), key=rank.__getitem__), []).append(members)
    helpers = {p: facts.helpers(ops) for p, ops in facts.groups.items()}
    tg, made = update_buckets.bucketed(split_tg, origin, order, facts.groups, helpers, placed)
    moved = index.indexed(tg, same_nodes=False)
    moved.updates_moved, moved.lean_ops, moved.scratch_like = True, index.lean_ops, made
    return moved, placement
