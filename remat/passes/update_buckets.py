"""Multi-tensor updates in the backward pass, in buckets.

A `foreach` optimizer updates every parameter with one `_foreach_*` kernel per step of its
rule (a fused one, `fused=True`, with one `_fused_*` kernel), each over the lists of all
parameters, gradients and states: one update reads every
gradient, so it cannot move into the backward pass (update_placement) and every gradient
lives to the end of the step. A `_foreach_*` op is elementwise per list position: its
result at position i reads only the tensors at position i. So it splits into one op per
position, and ops over any subset of the positions compute what the whole op computes
for them, bitwise (on CPU the kernel loops over the tensors; on CUDA each element's
arithmetic does not depend on how the lists are chunked).

Two passes, each from a graph to a graph:
- `split_foreach`: each multi-tensor op of the update becomes one op per position. On
  that graph each parameter's update is private where it was private but for the shared
  kernels, and update_placement finds where each can go.
- `bucketed`: parameters whose updates can move are grouped, in the order their
  gradients become final, into buckets of about `cap_bytes` of gradients; each bucket's
  update runs right after the latest of its members' places, as the update ops of the
  captured graph restricted to its members, each multi-tensor op once over the bucket's
  positions. Within a bucket the ops run in the captured order, as eager runs them, so a
  member's scalar arithmetic reads its step count after the bucket's increment, as in
  eager. The updates that cannot move run at the end, merged the same way.

A bucket holds its members' gradients from the first one's end to its update: larger
buckets launch fewer kernels and hold more. The planner plans the bucketed graph, and
the graph with one parameter to a bucket where no bucketed plan fits.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Any

import torch
import torch.fx

from remat.capture.train_graph import Phase, TrainGraph

# A bucket's gradients: about 1/BUCKETS_PER_STEP of all of them.
BUCKETS_PER_STEP = 8


def is_multi_tensor(node: torch.fx.Node) -> bool:
    """A `_foreach_*` op, or a fused optimizer kernel (`_fused_adamw_`, ...), over lists of
    more than one tensor."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.__name__.startswith(("_foreach_", "_fused_"))
        and positions(node) > 1
    )


def positions(node: torch.fx.Node) -> int:
    """The length of the op's lists (an empty list, such as a fused Adam's max_exp_avg_sqs
    without amsgrad, is a list of no position)."""
    lengths = {len(a) for a in [*node.args, *node.kwargs.values()] if isinstance(a, (list, tuple)) and a}
    return lengths.pop() if len(lengths) == 1 else 0


def _at(value: Any, positions: list[int], env: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    """An argument of a multi-tensor op for `positions` (lists sliced, the rest as they are)."""
    if isinstance(value, (list, tuple)):
        return [env[v] if isinstance(v, torch.fx.Node) else v for v in (value[i] for i in positions)] if value else []
    return env[value] if isinstance(value, torch.fx.Node) else value


def _copy_at(graph: torch.fx.Graph, node: torch.fx.Node, positions: list[int], env: dict, name: str) -> torch.fx.Node:
    new = graph.create_node(
        "call_function", node.target, tuple(_at(a, positions, env) for a in node.args),
        {k: _at(v, positions, env) for k, v in node.kwargs.items()}, name=name,
    )  # fmt: skip
    new.meta = dict(node.meta)
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        new.meta["val"] = [val[i] for i in positions]
    return new


def split_foreach(tg: TrainGraph) -> tuple[TrainGraph, dict[str, tuple[str, int]]] | None:
    """`tg` with each multi-tensor op of its update split into one op per list position,
    and each new op's (original op, position); None where the update has none."""
    if tg.order is not None:
        raise ValueError("split_foreach takes a graph in its own order")
    nodes = list(tg.gm.graph.nodes)
    if not any(tg.phase.get(n.name) is Phase.OPTIMIZER and is_multi_tensor(n) for n in nodes):
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    phase = dict(tg.phase)
    origin: dict[str, tuple[str, int]] = {}
    split: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in nodes:
        if tg.phase.get(node.name) is Phase.OPTIMIZER and is_multi_tensor(node):
            split[node] = []
            for i in range(positions(node)):
                part = _copy_at(graph, node, [i], env, f"{node.name}__at{i}")
                split[node].append(part)
                phase[part.name] = Phase.OPTIMIZER
                origin[part.name] = (node.name, i)
            env[node] = split[node][0]  # stands for the op where nothing but getitem reads it
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in split:
            part = split[node.args[0]][node.args[1]]
            env[node] = graph.create_node("call_function", operator.getitem, (part, 0), name=node.name)
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    for node in split:
        if any(u.target is not operator.getitem for u in node.users):
            return None  # a multi-tensor result read whole: the op cannot be split
        del phase[node.name]
    gm = torch.fx.GraphModule(tg.gm, graph)
    return dataclasses.replace(tg, gm=gm, phase=phase), origin


def bucket_cap_bytes(grad_bytes: dict[str, int]) -> int:
    """The gradient bytes of a bucket: about 1/BUCKETS_PER_STEP of all (a larger
    parameter is a bucket of its own)."""
    return math.ceil(sum(grad_bytes.values()) / BUCKETS_PER_STEP)


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of `shape` and `dtype` (as GraphInput names it: "float32")."""
    return math.prod(shape) * getattr(torch, dtype.replace("torch.", "")).itemsize


def buckets(order: list[str], moved: dict[str, str], grad_bytes: dict[str, int], cap_bytes: int) -> list[list[str]]:
    """The moved parameters, in the order their updates run (`moved`: parameter -> the op
    it follows, `order` the ops' order), in consecutive groups of at most `cap_bytes` of
    gradients (a parameter larger than that alone)."""
    rank = {n: r for r, n in enumerate(order)}
    out: list[list[str]] = []
    held = 0
    for p in sorted(moved, key=lambda p: rank[moved[p]]):
        if not out or held + grad_bytes[p] > cap_bytes:
            out.append([])
            held = 0
        out[-1].append(p)
        held += grad_bytes[p]
    return out


def bucketed(
    split_tg: TrainGraph,
    origin: dict[str, tuple[str, int]],
    order: list[str],
    groups: dict[str, list[str]],
    helpers: dict[str, list[str]],
    placed: dict[str, list[list[str]]],
) -> tuple[TrainGraph, dict[str, str]]:
    """The graph of `split_tg` (split_foreach's) that runs, after each op of `placed` (op
    name -> the buckets that follow it, each a list of parameters), each bucket's update,
    and the rest of the update at the end: the update ops in captured order, restricted to the bucket's
    members (`groups`: each parameter's ops; `helpers`: the shared ops they need), the
    split ops of one multi-tensor op merged into one over the bucket's positions. `order`:
    update_placement's order of `split_tg`'s ops (the backward's ops in it stay as they are).
    Also each merged op's multi-tensor op of the captured graph."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(split_tg.gm.graph.nodes)
    node_map = {n.name: n for n in nodes}
    captured_rank = {n.name: r for r, n in enumerate(nodes)}
    in_update = {n for n in order if split_tg.phase.get(n) is Phase.OPTIMIZER}
    emitted: set[str] = set()
    phase: dict[str, Phase] = {}
    made: dict[str, str] = {}  # merged op -> the multi-tensor op it runs part of
    count = [0]

    def emit_update(members: list[str]) -> None:
        emit({op for p in members for op in [*groups.get(p, []), *helpers.get(p, [])]})

    def emit(names: set[str]) -> None:
        """`names` not yet emitted, in captured order; the split ops of one multi-tensor op
        among them merged into one."""
        wanted = sorted(names - emitted, key=captured_rank.__getitem__)
        merged: dict[str, torch.fx.Node] = {}
        for name in wanted:
            node = node_map[name]
            if name in origin:
                first, _ = origin[name]
                if first not in merged:
                    parts = [n for n in wanted if origin.get(n, ("",))[0] == first]
                    merged[first] = _merge(graph, [node_map[n] for n in parts], env, bucket_name(first, count[0]))
                    phase[merged[first].name] = Phase.OPTIMIZER
                    made[merged[first].name] = first
                    for j, part in enumerate(parts):
                        for user in node_map[part].users:
                            env[user] = graph.create_node("call_function", operator.getitem, (merged[first], j), name=user.name)
                            env[user].meta = dict(user.meta)
                            phase[user.name] = Phase.OPTIMIZER
                            emitted.add(user.name)
                    count[0] += 1
                emitted.add(name)
            elif name not in emitted:
                env[node] = graph.node_copy(node, lambda a: env[a])
                phase[name] = split_tg.phase[name]
                emitted.add(name)

    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, lambda a: env[a])
    for name in order:
        if name in in_update:
            continue
        env[node_map[name]] = graph.node_copy(node_map[name], lambda a: env[a])
        phase[name] = split_tg.phase[name]
        for members in placed.get(name, []):
            emit_update(members)
    # The updates that stay at the end, and what no parameter's update holds (an EMA's
    # update of its own tensors), in captured order.
    emit({n for n in order if n in in_update})
    graph.node_copy(next(n for n in nodes if n.op == "output"), lambda a: env[a])
    gm = torch.fx.GraphModule(split_tg.gm, graph)
    return dataclasses.replace(split_tg, gm=gm, phase=phase, meta={**split_tg.meta, "updates_in_backward": True}), made


def bucket_name(op: str, bucket: int) -> str:
    """The name of the op that runs multi-tensor op `op` over one bucket's positions."""
    return f"{op}__bucket{bucket}"


def made_from(name: str) -> str:
    """The op of the captured graph a node of a bucketed graph runs (all or part of)."""
    return re.sub(r"__(bucket|at)\d+$", "", name)


def _merge(graph: torch.fx.Graph, parts: list[torch.fx.Node], env: dict, name: str) -> torch.fx.Node:
    """One op over the positions of `parts` (split ops of one multi-tensor op)."""
    first = parts[0]

    def joined(values: list[Any]) -> Any:
        if isinstance(values[0], (list, tuple)):
            return [env[v[0]] if isinstance(v[0], torch.fx.Node) else v[0] for v in values if v]
        return env[values[0]] if isinstance(values[0], torch.fx.Node) else values[0]

    args = tuple(joined([p.args[i] for p in parts]) for i in range(len(first.args)))
    kwargs = {k: joined([p.kwargs[k] for p in parts]) for k in first.kwargs}
    new = graph.create_node("call_function", first.target, args, kwargs, name=name)
    new.meta = dict(first.meta)
    vals = [p.meta.get("val") for p in parts]
    if all(isinstance(v, (list, tuple)) for v in vals):
        new.meta["val"] = [v[0] for v in vals]
    return new

