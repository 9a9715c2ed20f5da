"""What the schedule must know about single ops beyond their schemas: which ops draw
random numbers, which write an input in place without declaring it, and which have a
twin that computes the same outputs without their side effect on module state."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx

aten = torch.ops.aten


def _bn_twin(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    if not _updates_stats(args):
        return aten.native_batch_norm.default, args, kwargs
    return aten.native_batch_norm.default, (*args[:3], None, None, *args[5:]), kwargs


def _bn_legit_twin(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    # _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps)
    if not _updates_stats(args):
        return aten._native_batch_norm_legit.default, args, kwargs
    return aten._native_batch_norm_legit.no_stats, (*args[:3], *args[5:]), kwargs


def _updates_stats(args: tuple) -> bool:
    """Whether a BatchNorm call updates its running stats: in training mode, where it has
    them. In eval mode it reads them instead (a BatchNorm frozen for fine-tuning), and has
    no side effect to leave out."""
    return bool(args[5]) and args[3] is not None


# Ops that mutate module state as a side effect, with a twin that computes the same
# outputs (bitwise: same kernel) without the side effect. Copies use the twin.
STATE_FREE_TWINS: dict[Any, Callable[[tuple, dict], tuple[Any, tuple, dict]]] = {
    aten.native_batch_norm.default: _bn_twin,
    aten._native_batch_norm_legit.default: _bn_legit_twin,
}
# The argument positions a twin still reads (BatchNorm's twin does not read running stats).
TWIN_READS: dict[Any, tuple[int, ...]] = {aten.native_batch_norm.default: (0, 1, 2), aten._native_batch_norm_legit.default: (0, 1, 2)}

# Ops that write some inputs in place without saying so in their schema: argument positions.
# native_batch_norm updates running_mean / running_var in training mode (only: _updates_stats).
UNDECLARED_WRITES: dict[Any, tuple[int, ...]] = {
    aten.native_batch_norm.default: (3, 4),
    aten.cudnn_batch_norm.default: (3, 4),
    aten.miopen_batch_norm.default: (3, 4),
}


def is_random(node: torch.fx.Node) -> bool:
    """Whether the op draws from a random generator (its schema's `nondeterministic_seeded` tag)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and _seeded(target)


@functools.lru_cache(maxsize=None)
def _seeded(target: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in target.tags


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes whose storage this op writes in place (schema `Tensor(a!)`, and UNDECLARED_WRITES)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    undeclared = UNDECLARED_WRITES.get(target, ())
    undeclared = undeclared if undeclared and _updates_stats(tuple(node.args)) else ()
    out: list[torch.fx.Node] = [node.args[i] for i in undeclared if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]
    for i, name, kwarg_only in _written_arguments(target):
        value = node.args[i] if i < len(node.args) and not kwarg_only else node.kwargs.get(name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, torch.fx.Node):
                out.append(v)
    return out


@functools.lru_cache(maxsize=None)
def _written_arguments(target: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of each argument the schema marks as written (`Tensor(a!)`)."""
    return tuple(
        (i, arg.name, arg.kwarg_only)
        for i, arg in enumerate(target._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def copy_reads(node: torch.fx.Node) -> list[str] | None:
    """The input names a copy of `node` reads when it is a twin that reads fewer (None: all)."""
    keep = TWIN_READS.get(node.target)
    if keep is None or not _updates_stats(tuple(node.args)):
        return None
    wanted = [node.args[i] for i in keep if isinstance(node.args[i], torch.fx.Node)]
    return list(dict.fromkeys(a.name for a in wanted))


def copy_call(node: torch.fx.Node) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) for a rebuild of `node` (its state-free twin where it has one)."""
    twin = STATE_FREE_TWINS.get(node.target)
    if twin is not None:
        return twin(tuple(node.args), dict(node.kwargs))
    return node.target, tuple(node.args), dict(node.kwargs)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.target is operator.getitem


def viewed_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor `node` is, or is a view of (following views back)."""
    while node.op == "call_function" and (aliases_its_input(node) or _returns_view(node.target)) and node.args:
        base = node.args[0]
        if not isinstance(base, torch.fx.Node):
            break
        node = base
    return node


@functools.lru_cache(maxsize=None)
def _returns_view(target: Any) -> bool:
    """Whether the op's result is a view of its first argument (schema `-> Tensor(a)`)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns or not target._schema.arguments:
        return False
    ret, first = target._schema.returns[0].alias_info, target._schema.arguments[0].alias_info
    return ret is not None and not ret.is_write and first is not None and first.before_set == ret.before_set


def aliases_its_input(node: torch.fx.Node) -> bool:
    """Ops whose result is their input tensor itself, though fake propagation makes a new
    one: a collective's wait returns the tensor it was given."""
    return node.op == "call_function" and node.target is torch.ops._c10d_functional.wait_tensor.default


def is_pure(n: torch.fx.Node) -> bool:
    """An op that writes nothing and draws no random numbers (moving it changes nothing)."""
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in op.tags or op.namespace == "remat":
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def ops_read(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The ops `node` reads, directly or through others (the graph's placeholders left out)."""
    found: set[torch.fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.op != "placeholder" and n not in found:
            found.add(n)
            todo.extend(n.all_input_nodes)
    return found


def moved_after(after: torch.fx.Node, nodes: set[torch.fx.Node], last: torch.fx.Node) -> torch.fx.Node:
    """Move `nodes`, then `last`, to run right after `after`, in their order in the graph (those
    already before it stay); the node now last of them."""
    rank = {n: i for i, n in enumerate(after.graph.nodes)}
    for n in sorted(nodes, key=rank.__getitem__) + [last]:
        if rank[n] > rank[after]:
            after.append(n)
            after = n
    return after
