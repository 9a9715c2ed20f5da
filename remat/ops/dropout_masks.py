"""A dropout's mask held for the backward pass as booleans, a quarter of its bytes.

On a CPU, `F.dropout` in training runs as `mask = empty_like(x).bernoulli_(1 - p)`, then
`mask.div_(1 - p)` and `x * mask`; the scaled mask is what its backward reads, a float
tensor as large as the activation, held from the forward pass to the backward (eager's
autograd holds it so too). Its values are 0 and 1 / (1 - p), decided by the draw's 0s and
1s. `held_as_bool` keeps the draw as booleans (`draw.to(torch.bool)`, one byte an
element) for the backward pass, which makes its own scaled mask from them just before its
first use: the same division on the same 0.0s and 1.0s in the same dtype (`_to_copy`, then
`div_`), so the same bits. The forward pass scales the draw in place as before and its
float mask dies there. A conversion in the forward pass and two elementwise ops in the
backward buy three bytes an element of every dropout's activation, held from its forward
to its backward; the planner, which may drop the booleans too, rebuilds them by replaying
the draw. A mask something writes, or makes a view of, is left as it is.
"""

from __future__ import annotations

import torch
import torch.fx

from remat.ops import op_facts

aten = torch.ops.aten
# The in-place division by a number (`Tensor` when Python code calls `mask.div_(keep)`).
_DIVISIONS = (aten.div_.Scalar, aten.div_.Tensor)
KEPT = "dropout_kept"  # the booleans' nodes: dropout_kept, dropout_kept_1, ...
_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


def _scaled_draw(division: torch.fx.Node) -> torch.fx.Node | None:
    """The `bernoulli_` whose 0s and 1s `division` scales in place, where nothing else reads
    the draw or the buffer it was drawn into (one the step made: not an input)."""
    draw = division.args[0]
    if not (isinstance(draw, torch.fx.Node) and draw.target is aten.bernoulli_.float and len(draw.users) == 1):
        return None
    buffer = draw.args[0]
    if not isinstance(buffer, torch.fx.Node) or buffer.op != "call_function" or len(buffer.users) != 1:
        return None
    value = division.meta.get("val")
    if not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
        return None
    return draw if all(_only_reads(user, division) for user in division.users) else None


def _only_reads(user: torch.fx.Node, mask: torch.fx.Node) -> bool:
    """Whether `user` reads `mask` without writing it or making a view of it: a write
    through a view would change what the backward reads, which the mask made from the
    booleans would not see."""
    if user.op == "output":
        return True
    if user.op != "call_function" or mask in op_facts.written_args(user):
        return False
    return not (op_facts.viewed_base(user) is mask and user is not mask)


def _node(graph: torch.fx.Graph, op: torch._ops.OpOverload, args: tuple, kwargs: dict, like: torch.fx.Node, fake_mode: object, name: str) -> torch.fx.Node:
    node = graph.create_node("call_function", op, args, kwargs, name=name)
    with fake_mode:  # type: ignore[attr-defined]
        node.meta["val"] = op(*torch.fx.map_arg(args, lambda n: n.meta["val"]), **kwargs)
    node.meta.update({k: like.meta[k] for k in _META if k in like.meta})
    return node


def held_as_bool(gm: torch.fx.GraphModule, phase: dict[str, str]) -> torch.fx.GraphModule:
    """`gm` with each dropout mask the backward pass reads held as booleans (see the
    module's docstring); `phase` (node name -> "forward", "backward", ...: the capture's
    phases) is given the new nodes' phases."""
    from torch._guards import detect_fake_mode

    graph = gm.graph
    changed = False
    for division in list(graph.nodes):
        if division.target not in _DIVISIONS or isinstance(division.args[1], torch.fx.Node) or phase.get(division.name) != "forward":
            continue
        draw = _scaled_draw(division)
        backward = [u for u in division.users if phase.get(u.name) == "backward"]
        if draw is None or not backward:
            continue
        fake_mode = detect_fake_mode([draw.meta["val"]]) or torch._subclasses.FakeTensorMode()
        dtype = division.meta["val"].dtype
        with graph.inserting_before(division):
            kept = _node(graph, aten._to_copy.default, (draw,), {"dtype": torch.bool}, division, fake_mode, KEPT)
        first = next(n for n in _after(division) if n in backward)
        with graph.inserting_before(first):
            ones = _node(graph, aten._to_copy.default, (kept,), {"dtype": dtype}, division, fake_mode, "dropout_ones")
            mask = _node(graph, division.target, (ones, *division.args[1:]), {}, division, fake_mode, "dropout_mask")
        phase[kept.name], phase[ones.name], phase[mask.name] = phase[division.name], phase[first.name], phase[first.name]
        for user in backward:
            user.replace_input_with(division, mask)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def held(gm: torch.fx.GraphModule) -> int:
    """How many dropout masks `gm` holds as booleans: where any, its memory is not eager's."""
    return sum(1 for n in gm.graph.nodes if n.name.startswith(KEPT))


def _after(node: torch.fx.Node):  # noqa: ANN202 - the nodes after `node`, in the graph's order
    while node.next.op != "root":
        node = node.next
        yield node
