"""What the user keeps on parameters (and buffers) that the traced step must see as eager
does: hooks registered on them, and Python attributes set on them.

`p.register_hook(fn)` changes a parameter's gradient before it is added to `.grad`
(clamping, scaling, noise); `p.register_post_accumulate_grad_hook(fn)` runs once it has
been (a gradient rescaled in place, a count). The graph runs without autograd, so the
hooks the real parameters hold never fire there: the trace registers the same functions
on the parameters' stand-ins, and what they do becomes part of the graph. A hook added
or removed after the capture would not be, so the step refuses it until compiled again.

A Python attribute on a parameter (`p.no_decay = True`, read by a custom optimizer or a
regularizer in the step) is watched as the model's fields are (python_state), so a step is
compiled again when one changes between steps; its stand-in holds it while the step is
traced (state/kept_tensors.attributes_on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import ChangedSinceCompiled


@dataclass(frozen=True)
class ParamHooks:
    """One parameter's hooks, in the order autograd runs them."""

    on_gradient: tuple[Callable[..., Any], ...]  # register_hook: gradient -> gradient or None
    after_accumulation: tuple[Callable[..., Any], ...]  # register_post_accumulate_grad_hook: parameter -> None


def of(params: dict[str, torch.Tensor]) -> dict[str, ParamHooks]:
    """The hooks of each parameter that has any, by name."""
    out = {}
    for name, p in params.items():
        hooks = ParamHooks(tuple((p._backward_hooks or {}).values()), tuple((p._post_accumulate_grad_hooks or {}).values()))
        if hooks.on_gradient or hooks.after_accumulation:
            out[name] = hooks
    return out


def functions(model: torch.nn.Module) -> list[Callable[..., Any]]:
    """Every hook function on the model's parameters (their globals and closures are the
    user's state the step reads, as the step's own are)."""
    hooks = of(dict(model.named_parameters()))
    return [fn for h in hooks.values() for fn in (*h.on_gradient, *h.after_accumulation)]


def register_on(hooks: dict[str, ParamHooks], stand_ins: dict[str, torch.Tensor]) -> None:
    """Give each traced stand-in its parameter's hooks. A frozen parameter's never fire,
    in eager as here."""
    for name, h in hooks.items():
        t = stand_ins[name]
        if not t.requires_grad:
            continue
        for fn in h.on_gradient:
            t.register_hook(fn)
        for fn in h.after_accumulation:
            t.register_post_accumulate_grad_hook(fn)


def check_unchanged(params: dict[str, torch.Tensor], captured: dict[str, ParamHooks]) -> None:
    """A step whose parameters' hooks differ from those traced into its graph is compiled
    again (ChangedSinceCompiled): the graph runs the hooks registered when it was traced."""
    now = of(params)
    changed = sorted(n for n in set(now) | set(captured) if now.get(n) != captured.get(n))
    if changed:
        raise ChangedSinceCompiled(
            f"the gradient hooks on {len(changed)} parameter{'s' if len(changed) > 1 else ''} changed since the step was compiled "
            f"(first: {changed[0]})"
        )


def attributes(t: torch.Tensor) -> dict[str, Any]:
    """The Python attributes the user set on a real parameter or buffer (none on a traced
    stand-in: kept_tensors.attributes_on looks after those)."""
    if isinstance(t, FakeTensor):
        return {}
    return {k: v for k, v in vars(t).items() if not k.startswith("__")}
