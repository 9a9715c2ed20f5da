"""How remat calls the user's step: `train_step(model, optimizer, batch)`, or
`train_step(batch)` for a step that reaches its model and optimizer itself (globals, a
closure, a trainer's fields), as many training scripts write it. The model and optimizer
passed to `remat.compile` are then the objects the step reaches: remat traces them the
same way, as they are the same objects."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from remat.errors import CaptureError


def _takes_batch_only(train_step: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(train_step).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: called as documented
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    if len(positional) >= 3 and required <= 3:
        return False
    if positional and required <= 1:  # train_step(batch), or train_step(batch, scale=1.0)
        return True
    what = f"it needs {required} arguments" if required > 3 else f"it takes {len(positional)} arguments"
    raise CaptureError(_said(train_step, positional, what))


def _said(train_step: Callable[..., Any], positional: list[inspect.Parameter], what: str) -> str:
    name = getattr(train_step, "__name__", None) or type(train_step).__name__
    return (
        f"remat calls the training step as train_step(model, optimizer, batch), or as train_step(batch) when the step "
        f"reaches its model and optimizer itself; {name}({', '.join(p.name for p in positional)}) does not fit, as {what}. "
        "Give it those three parameters, or only the batch (other values as defaults, globals or fields of an object)."
    )


def call(train_step: Callable[..., Any], model: Any, optimizer: Any, batch: Any) -> Any:
    """Run the step as its signature asks: with the model, optimizer and batch, or the batch alone."""
    return train_step(batch) if _takes_batch_only(train_step) else train_step(model, optimizer, batch)
