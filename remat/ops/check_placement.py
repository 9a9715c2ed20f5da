"""Where a step's value checks run (ops/value_checks.py): as early as what they read
allows (`hoisted`), and a check of a branch on small state tensors first of all
(`state_checks_first`), so that where it fails the step has changed nothing and can be
compiled again. Each is a pass: a graph in, the same graph with its checks moved out."""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from remat.ops import op_facts
from remat.ops.value_checks import VALUE_CHECK_OP, ValueCheck

# Elements of a graph input a check's copy of the ops before it may clone (a step count, a flag).
_MOST_SHADOWED = 16


def state_checks_first(gm: torch.fx.GraphModule, checks: list[ValueCheck]) -> torch.fx.GraphModule:
    """`gm` with each check of a branch on small state tensors (`ValueCheck.state`), and the ops
    it reads, run first, where the values it reads are those it read where it was: the ops
    are pure and nothing before the check writes what they read; or, where the step writes
    that state in place before the check (a count moved on, then branched on), copies of the
    ops on copies of the state (`_shadowed_state`). Such a check is marked `first`: where it
    fails, the step has changed nothing and may be compiled again."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return gm
    after, moved = placeholders[-1], False
    # What each op writes, found once: this pass moves checks and pure ops, never a write.
    rank = {n: i for i, n in enumerate(graph.nodes)}
    writers = {n: roots for n in graph.nodes if n.op == "call_function" and (roots := {_storage_root(w) for w in op_facts.written_args(n)})}
    copied: tuple[set[torch.fx.Node], set[torch.fx.Node], list[torch.fx.Node]] = (set(), set(), [])  # shared by every check copied
    for check in [n for n in graph.nodes if n.target is VALUE_CHECK_OP and checks[n.args[2]].state]:
        chain = op_facts.ops_read(check)
        read = {a for m in [*chain, check] for a in m.all_input_nodes if a.op == "placeholder"}
        writes = {n: roots for n, roots in writers.items() if rank[n] < rank[check]}
        written = set().union(*writes.values())
        if all(_movable(n) for n in chain) and not read & written:
            after = op_facts.moved_after(after, chain, check)
        elif (ahead := _shadowed_state(chain, writes, read)) is not None:
            copied[0].update(ahead[0])
            copied[1].update(ahead[1])
            copied[2].append(check)
        else:
            continue
        checks[check.args[2]].first = moved = True
    if copied[2]:
        _copied_first(graph, after, *copied)
    if moved:
        graph.lint()
        gm.recompile()
    return gm


def _shadowed_state(
    chain: set[torch.fx.Node], writes: dict[torch.fx.Node, set[torch.fx.Node]], read: set[torch.fx.Node]
) -> tuple[set[torch.fx.Node], set[torch.fx.Node]] | None:
    """Where a check reads small state the step writes before it (`step_t += 1`, then `if rho_t
    > 5.0:`, or foreach's `_foreach_add_(steps, 1)`) by in-place ops on that state alone, which
    read nothing the step has changed: those ops with the check's (`chain` and them, with the
    ops they read), and the graph inputs they write. Copies of the ops, on copies of those
    inputs, give the check its values before the step changes anything. None where it cannot.
    `writes`: each op before the check that writes in place, with the graph inputs it writes."""
    copied, needed = set(chain), set(read)
    while True:
        shadowed = set().union(*(writes[n] for n in copied if n in writes))
        more = {w for w, roots in writes.items() if w not in copied and roots & (needed | shadowed)}
        if not more:
            break
        for w in more:
            copied |= {w} | op_facts.ops_read(w)
        needed |= {a for n in copied for a in n.all_input_nodes if a.op == "placeholder"}
    for n in copied:
        if _movable(n) or n.op == "get_attr":
            continue
        roots = writes.get(n)
        if not roots or op_facts.is_random(n) or n.target.namespace == "remat" or not all(_small_input(r) for r in roots):
            return None
    return (copied, shadowed) if shadowed else None


def _small_input(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    return n.op == "placeholder" and isinstance(val, torch.Tensor) and val.numel() <= _MOST_SHADOWED


def _copied_first(
    graph: torch.fx.Graph, after: torch.fx.Node, chain: set[torch.fx.Node], shadowed: set[torch.fx.Node], checks: list[torch.fx.Node]
) -> None:
    """Copies of `chain` and `checks` run right after `after`, in graph order, on one clone of
    each `shadowed` input, in the checks' place; the originals the step no longer reads are
    dropped."""
    rank = {n: i for i, n in enumerate(graph.nodes)}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in sorted(chain, key=rank.__getitem__):
        if n.op == "get_attr" and rank[n] > rank[after]:  # a constant: moved, not copied (the memory model counts each node's)
            after.append(n)
            after = n
    for state in sorted(shadowed, key=rank.__getitem__):
        with graph.inserting_after(after):
            after = copies[state] = graph.call_function(torch.ops.aten.clone.default, (state,))
        after.meta["val"] = state.meta["val"]
        _fresh_value(after)
    for n in sorted(chain | set(checks), key=rank.__getitem__):
        if n.op == "get_attr":
            continue
        with graph.inserting_after(after):
            after = copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
        _fresh_value(after)
    for check in checks:
        graph.erase_node(check)
    for n in sorted(chain, key=rank.__getitem__, reverse=True):
        if not n.users and _movable(n):
            graph.erase_node(n)


def _fresh_value(copy: torch.fx.Node) -> None:
    """A copied op's tensors made again from its inputs' (the memory model tells storages
    apart by them: a copy that kept the original's would share its storage)."""
    val = copy.meta.get("val")
    tensors = [t for t in pytree.tree_leaves(val) if isinstance(t, FakeTensor)]
    if not tensors or not isinstance(copy.target, torch._ops.OpOverload):
        return
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (copy.args, copy.kwargs))
    with tensors[0].fake_mode:
        copy.meta["val"] = copy.target(*args, **kwargs)


def _movable(n: torch.fx.Node) -> bool:
    """An op that writes nothing and draws nothing: a pure tensor op, or arithmetic on Python numbers."""
    return op_facts.is_pure(n) or op_facts.is_getitem(n) or (n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "math", "builtins"))


def hoisted(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with each value check run as soon as what it reads is computed: the check and
    the pure ops only it reads (`torch.isfinite(loss)` after backward()) move to right after
    their inputs, but never before an op that changes the user's state or draws random
    numbers, so that a check on the loss comes before the backward pass and leaves the
    updates free to move into it (update_placement keeps them after every check). The
    `.item()` each check's trace began with, read by nothing, is dropped."""
    graph = gm.graph
    checks = [n for n in graph.nodes if n.target is VALUE_CHECK_OP]
    if not checks:
        return gm
    for c in checks:
        for user in list(c.args[0].users):
            if user.target is torch.ops.aten._local_scalar_dense.default and not user.users:
                graph.erase_node(user)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for c in checks:
        rank = {n: i for i, n in enumerate(graph.nodes)}
        chain = {c}
        todo = list(c.all_input_nodes)
        while todo:
            n = todo.pop()
            if n in chain or not op_facts.is_pure(n) or any(u not in chain for u in n.users):
                continue
            chain.add(n)
            todo.extend(n.all_input_nodes)
        # A node whose users were not all in the chain when first seen may join later: once more.
        for n in sorted({a for m in chain for a in m.all_input_nodes} - chain, key=rank.__getitem__, reverse=True):
            if op_facts.is_pure(n) and all(u in chain for u in n.users):
                chain.add(n)
        outside = {a for m in chain for a in m.all_input_nodes} - chain
        # Never before the check that came before it: two checks of one value (a comparison,
        # then a test for NaN) fail in eager's order.
        after = max([last_placeholder, *outside, *checks[: checks.index(c)][-1:]], key=rank.__getitem__)
        # Not before an op that changes the user's state (writes a parameter, a buffer, the
        # optimizer's state in place) or draws random numbers: where the check fails, the
        # step has done what eager's had when it raised, and reads what eager's read.
        for n in list(graph.nodes)[rank[after] + 1 : rank[c]]:
            if op_facts.is_random(n) or any(_storage_root(w).op == "placeholder" for w in op_facts.written_args(n)):
                after = n
        after = _past_getitems(after)
        for n in sorted(chain, key=rank.__getitem__):
            if rank[n] > rank[after]:
                after.append(n)
                after = n
    graph.lint()
    gm.recompile()
    return gm


def _storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node that made the storage `node` is: back through views and in-place ops (whose
    result is their first argument, as `param.mul_(...)` then `.addcdiv_(...)`)."""
    while True:
        node = op_facts.viewed_base(node)
        target = node.target
        if not (node.op == "call_function" and op_facts.written_args(node) and isinstance(target, torch._ops.OpOverload)):
            return node
        ret, first = target._schema.returns[0].alias_info if target._schema.returns else None, target._schema.arguments[0].alias_info
        if ret is None or first is None or ret.before_set != first.before_set or not isinstance(node.args[0], torch.fx.Node):
            return node
        node = node.args[0]


def _past_getitems(after: torch.fx.Node) -> torch.fx.Node:
    """`after`, or the last of the getitems right after it that read the same tuple: a check
    placed between two of them would cut a multi-output op's tuple off from its getitems."""
    tuple_node = after.args[0] if after.target is operator.getitem else after
    while after.next.op == "call_function" and after.next.target is operator.getitem and after.next.args[0] is tuple_node:
        after = after.next
    return after
