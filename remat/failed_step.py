"""What a failed step had already changed in place, said in its error."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from remat.capture.train_graph import InputKind, TrainGraph
from remat.ops import op_facts


def note_changes(error: Exception, tg: TrainGraph, gm: torch.fx.GraphModule) -> None:
    """Add to `error` (raised while `gm`, a graph of `tg`'s step, ran) what the step had written."""
    _ChangedOnFailure.note(error, tg, gm)


class _ChangedOnFailure:
    """What a failed step had already changed in place, for its error.

    The step writes persistent state in place: buffers (BatchNorm running statistics) in
    the forward pass, parameters and optimizer state in the updates (at the end of the
    step or, moved into the backward pass, as soon as each gradient is final). As in eager,
    no second copy is kept to undo them: it would be memory the step holds beside the
    plan. What a failure came after is read from where it was raised: the line of the
    graph's code names the op, and the ops before it have run. Nothing is read before
    the step, so a call that succeeds pays nothing for this.
    """

    _NOTED = (InputKind.PARAMETER, InputKind.OPTIMIZER_STATE, InputKind.GRADIENT, InputKind.BUFFER, InputKind.OUTSIDE)

    @classmethod
    def note(cls, error: Exception, tg: TrainGraph, gm: torch.fx.GraphModule) -> None:
        ran = _ops_ran_before(error, gm)
        if ran is None:  # raised outside the graph's code: before it ran
            return
        inputs = tg.inputs
        changed = [inputs[i] for i in _inputs_written(gm, ran) if inputs[i].kind in cls._NOTED]
        buffers = [i.name for i in changed if i.kind is InputKind.BUFFER]
        outside = [i.name for i in changed if i.kind is InputKind.OUTSIDE]
        updated = [i.name for i in changed if i.kind in (InputKind.PARAMETER, InputKind.OPTIMIZER_STATE)]
        grads = [i.name for i in changed if i.kind is InputKind.GRADIENT]
        if grads:
            error.add_note(
                f"remat: the step failed after writing {len(grads)} gradients it found set in place (first: {grads[0]}.grad); "
                "they are not restored"
            )
        if outside:
            error.add_note(
                f"remat: the step failed after writing {len(outside)} tensors outside the model in place (first: "
                f"{outside[0]}); they are not restored"
            )
        if buffers:
            error.add_note(
                f"remat: the step failed after its forward pass had written {len(buffers)} buffers in place (first: "
                f"{buffers[0]}), as eager's forward writes them (BatchNorm's running statistics); they are not restored"
            )
        if updated:
            error.add_note(
                f"remat: the step failed after optimizer updates had begun; {len(updated)} parameters or optimizer "
                f"states (first: {updated[0]}) were already updated and are not restored"
            )


def _ops_ran_before(error: Exception, gm: Any) -> int | None:
    """How many of `gm`'s nodes had run when `error` was raised in its code (None: it was
    raised elsewhere). The traceback's line in the generated code maps to the node
    (GraphModule's line map, read as dynamo reads it)."""
    code = getattr(getattr(gm, "forward", None), "__code__", None)
    lines = getattr(gm, "_lineno_map", None)
    tb = error.__traceback__
    while tb is not None and (code is None or tb.tb_frame.f_code is not code):
        tb = tb.tb_next
    if tb is None or not lines:
        return None
    index = lines.get(tb.tb_lineno - code.co_firstlineno)
    return len(gm.graph.nodes) if index is None else index


def _inputs_written(gm: torch.fx.GraphModule, ran: int) -> list[int]:
    """Positions of the placeholders that the first `ran` nodes of `gm` wrote in place
    (through a view of one, too)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
    written: dict[int, None] = {}
    for node in nodes[:ran]:
        for arg in op_facts.written_args(node):
            base = op_facts.viewed_base(arg)
            if base in position:
                written[position[base]] = None
    return list(written)
