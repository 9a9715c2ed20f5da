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
  value of the parameter, also through a view or a tied use).
Ops of the update that read several parameters' tensors together (a multi-tensor
`_foreach` kernel, a norm over all gradients) keep those parameters' updates at the end.
Scalar ops the update needs (learning rate arithmetic) go right before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx

from remat.pipeline import op_facts
from remat.pipeline.analysis import GraphAnalysis
from remat.pipeline.train_graph import InputKind, Phase, TrainGraph


@dataclass
class UpdatePlacement:
    """Where each parameter's update runs once moved into the backward pass."""

    moved: dict[str, str] = field(default_factory=dict)  # parameter -> the node its update now follows
    held: dict[str, str] = field(default_factory=dict)  # parameter -> why its update stays at the end

    @property
    def applies(self) -> bool:
        return bool(self.moved)

    def summary(self) -> str:
        """One line: how many updates moved, and why the others did not."""
        if not self.moved and not self.held:
            return "the step has no optimizer update"
        parts = [f"{len(self.moved)} of {len(self.moved) + len(self.held)} parameter updates run in the backward pass"]
        if self.held:
            name, why = next(iter(self.held.items()))
            more = f" (and {len(self.held) - 1} more)" if len(self.held) > 1 else ""
            parts.append(f"{name}{more} stays at the end: {why}")
        return "; ".join(parts)


def _owners_of_inputs(tg: TrainGraph, analysis: GraphAnalysis) -> dict[int, str]:
    """Storage -> the parameter it belongs to: the parameter, its optimizer state, its gradient."""
    placeholders = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    params = [spec.name for spec in tg.inputs if spec.kind is InputKind.PARAMETER]
    owner: dict[int, str] = {}
    for node, spec in zip(placeholders, tg.inputs):
        name = None
        if spec.kind is InputKind.PARAMETER:
            name = spec.name
        elif spec.kind is InputKind.OPTIMIZER_STATE:
            name = max((p for p in params if spec.name.startswith(p + ".")), key=len, default=None)
        if name is not None:
            for s in analysis.node_storages.get(node.name, []):
                owner[s] = name
    for param, grad in tg.grad_nodes.items():
        for s in analysis.node_storages.get(grad, []):
            owner.setdefault(s, param)
    return owner


def place_updates(tg: TrainGraph, analysis: GraphAnalysis) -> tuple[list[str], UpdatePlacement]:
    """The op nodes in the order that runs each private update right after its gradient is
    final (the captured order where nothing moves), and what moved."""
    ops = tg.op_nodes()
    order = [n.name for n in ops]
    rank = {n: i for i, n in enumerate(order)}
    update = [n for n in ops if tg.phase[n.name] is Phase.OPTIMIZER]
    placement = UpdatePlacement()
    if not update:
        return order, placement
    storages = analysis.node_storages
    owner = _owners_of_inputs(tg, analysis)
    in_update = {n.name for n in update}

    # Who each update op belongs to, by what it reads (through other update ops).
    owners: dict[str, set[str]] = {}
    outside_deps: dict[str, int] = {}  # update op -> latest op outside the update it reads
    for n in update:
        mine: set[str] = set()
        dep = -1
        for a in n.all_input_nodes:
            if a.name in in_update:
                mine |= owners[a.name]
                dep = max(dep, outside_deps[a.name])
                continue
            mine |= {owner[s] for s in storages.get(a.name, []) if s in owner}
            if a.op == "call_function":
                dep = max(dep, rank[a.name])
        owners[n.name], outside_deps[n.name] = mine, dep

    groups: dict[str, list[str]] = {}
    free: list[str] = []  # scalar ops of no parameter (hyperparameter arithmetic)
    for n in update:
        mine = owners[n.name]
        if len(mine) > 1:
            for p in mine:
                placement.held.setdefault(p, f"{n.name} ({n.target}) reads the tensors of several parameters together")
        elif mine:
            groups.setdefault(next(iter(mine)), []).append(n.name)
        else:
            free.append(n.name)
    node_map = {n.name: n for n in ops}
    free_set = set(free)
    writing_free = {f for f in free if op_facts.written_args(node_map[f])}

    def needed_free(names: list[str]) -> list[str]:
        seen: set[str] = set()
        todo = [a.name for n in names for a in node_map[n].all_input_nodes if a.name in free_set]
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                todo.extend(a.name for a in node_map[f].all_input_nodes if a.name in free_set)
        return sorted(seen, key=rank.__getitem__)

    readers: dict[int, list[int]] = {}
    writers: dict[int, list[int]] = {}
    for r, n in enumerate(ops):
        for a in n.all_input_nodes:
            for s in storages.get(a.name, []):
                readers.setdefault(s, []).append(r)
        for a in op_facts.written_args(n):
            for s in storages.get(a.name, []):
                writers.setdefault(s, []).append(r)
    last_outside = max(r for r, n in enumerate(order) if n not in in_update)

    slot_of: dict[str, int] = {}
    for p, names in groups.items():
        if p in placement.held:
            continue
        members = set(names)
        helpers = needed_free(names)
        if writing_free & set(helpers):
            placement.held[p] = f"it needs {sorted(writing_free & set(helpers))[0]}, which writes in place"
            continue
        read = {s for n in names for a in node_map[n].all_input_nodes for s in storages.get(a.name, [])}
        written = {s for n in names for a in op_facts.written_args(node_map[n]) for s in storages.get(a.name, [])}
        slot = max((outside_deps[n] for n in [*names, *helpers]), default=-1)
        clash = None
        for s in read | written:
            for r in writers.get(s, []) + (readers.get(s, []) if s in written else []):
                other = order[r]
                if other in members:
                    continue
                if other in in_update and other not in free_set:
                    clash = other
                elif r > slot and other not in in_update:
                    slot = r
        if clash is not None:
            placement.held[p] = f"its tensors are also used by {clash}, an update of another parameter"
        elif slot >= last_outside:
            placement.held[p] = f"it must follow {order[slot]}, the last op of the backward pass"
        else:
            slot_of[p] = slot
            placement.moved[p] = order[slot]

    moved_ops = {n for p in slot_of for n in groups[p]}
    after: dict[int, list[str]] = {}
    for p in sorted(slot_of, key=lambda p: rank[groups[p][0]]):
        after.setdefault(slot_of[p], []).append(p)
    new_order: list[str] = []
    emitted: set[str] = set()
    for n in order:
        if n in in_update:
            continue
        new_order.append(n)
        for p in after.get(rank[n], []):
            for f in needed_free(groups[p]):
                if f not in emitted:
                    emitted.add(f)
                    new_order.append(f)
            new_order.extend(groups[p])
    new_order.extend(n for n in order if n in in_update and n not in moved_ops and n not in emitted)
    assert sorted(new_order) == sorted(order)
    return new_order, placement


def reorder(tg: TrainGraph, order: list[str]) -> TrainGraph:
    """A copy of `tg` whose op nodes run in `order` (placeholders first, output last)."""
    old = {n.name: n for n in tg.gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for node in tg.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    for name in order:
        env[name] = graph.node_copy(old[name], lambda a: env[a.name])
    output = next(n for n in tg.gm.graph.nodes if n.op == "output")
    graph.node_copy(output, lambda a: env[a.name])
    graph.lint()
    return dataclasses.replace(tg, gm=torch.fx.GraphModule(tg.gm, graph), meta={**tg.meta, "updates_in_backward": True})
