"""Several optimizers stepped in one training step, read as one.

A step may update its parameters with more than one optimizer: Muon for the weight
matrices and AdamW for the rest, or one optimizer per part of the model. The user passes
them as a list (`remat.compile(step, model, [muon, adamw], batch)`), and the step gets
that list as its `optimizer` argument, unchanged. remat reads them through `Optimizers`,
which offers what remat reads of one optimizer: the param groups of all of them in order,
each parameter's state kept by the optimizer that updates it, and a step hook on each.
Every parameter must belong to one optimizer at most.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from remat.errors import CaptureError


class Optimizers:
    """Optimizers stepped in one step, presented as one (module docstring)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self._owner: dict[int, torch.optim.Optimizer] = {}
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if self._owner.setdefault(id(p), opt) is not opt:
                        raise CaptureError(
                            f"a parameter of shape {tuple(p.shape)} is in two of the optimizers passed "
                            f"({type(self._owner[id(p)]).__name__} and {type(opt).__name__}); give each parameter to one optimizer"
                        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> "_State":
        return _State(self)

    def owner(self, p: Any) -> torch.optim.Optimizer | None:
        """The optimizer that updates `p` (None: none of them)."""
        return self._owner.get(id(p))

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> "_Handles":
        return _Handles([opt.register_step_pre_hook(hook) for opt in self.optimizers])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> "_Handles":
        return _Handles([opt.register_step_post_hook(hook) for opt in self.optimizers])


class _State(MutableMapping):
    """The optimizers' state dicts as one mapping: each parameter's in its owner's."""

    def __init__(self, optimizers: Optimizers):
        self._of = optimizers

    def _owner(self, p: Any) -> torch.optim.Optimizer:
        owner = self._of.owner(p)
        if owner is None:
            raise KeyError(p)
        return owner

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p: object) -> bool:
        owner = self._of.owner(p)
        return owner is not None and p in owner.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for opt in self._of.optimizers for p in list(opt.state))

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._of.optimizers)

    def get(self, p: Any, default: Any = None) -> Any:
        owner = self._of.owner(p)  # not self[p]: a torch optimizer's state is a defaultdict
        return default if owner is None else owner.state.get(p, default)


class _Handles:
    def __init__(self, handles: list[Any]):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def as_one(optimizer: Any) -> "torch.optim.Optimizer | Optimizers | None":
    """The step's optimizer argument as remat reads it: None, one optimizer, or a list or
    tuple of them as `Optimizers`; a CaptureError for anything else."""
    if optimizer is None or isinstance(optimizer, Optimizers):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer) or _wrapped(optimizer) is not None:
        return innermost(optimizer)
    if isinstance(optimizer, (list, tuple)) and optimizer and all(isinstance(innermost(o), torch.optim.Optimizer) for o in optimizer):
        inner = [innermost(o) for o in optimizer]
        if len({id(o) for o in inner}) != len(inner):
            raise CaptureError("the same optimizer is passed twice; pass each optimizer once")
        return inner[0] if len(inner) == 1 else Optimizers(inner)
    raise CaptureError(
        "optimizer must be a torch.optim.Optimizer, a list of them (one per group of parameters, all stepped in "
        f"train_step) or None, got {_describe(optimizer)}"
    )


def innermost(optimizer: Any) -> Any:
    """The torch optimizer inside a library's wrapper (Accelerate's `AcceleratedOptimizer`,
    Lightning's `LightningOptimizer`, opacus' `DPOptimizer`): the object whose state and
    param groups the wrapper shares and whose `step()` its own calls. remat reads and updates that one; the step
    still gets the wrapper, so what the wrapper does around the update is traced."""
    while (inner := _wrapped(optimizer)) is not None:
        optimizer = inner
    return optimizer


def _wrapped(optimizer: Any) -> "torch.optim.Optimizer | None":
    """The optimizer a wrapper holds as `optimizer` (or `_optimizer`) and shares its param
    groups with, or under another field and shares its state too (opacus' DPOptimizer:
    `original_optimizer`; SAM, which keeps a state of its own, is not a wrapper)."""
    fields = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
    for key, inner in fields.items():
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer and optimizer.param_groups is inner.param_groups:
            if key in ("optimizer", "_optimizer") or optimizer.state is inner.state:
                return inner
    return None


def group_name(optimizer: "torch.optim.Optimizer | Optimizers", gi: int) -> str:
    """How a message names param group `gi` (numbered over all of a list's optimizers, in order)."""
    if isinstance(optimizer, Optimizers):
        for k, opt in enumerate(optimizer.optimizers):
            if gi < len(opt.param_groups):
                return f"optimizer[{k}].param_groups[{gi}]"
            gi -= len(opt.param_groups)
    return f"optimizer.param_groups[{gi}]"


def each(optimizer: "torch.optim.Optimizer | Optimizers | None") -> list[torch.optim.Optimizer]:
    """The torch optimizers behind what `as_one` returned."""
    if optimizer is None:
        return []
    return optimizer.optimizers if isinstance(optimizer, Optimizers) else [optimizer]


@contextlib.contextmanager
def only_passed_step(passed: "torch.optim.Optimizer | Optimizers | None") -> Iterator[None]:
    """While the step is traced: an optimizer stepped that was not passed is refused by name."""

    def hook(opt, args, kwargs):  # type: ignore[no-untyped-def]
        if all(opt is not o for o in each(passed)):
            raise not_passed_error(opt, passed)

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def not_passed_error(stepped: torch.optim.Optimizer, passed: "torch.optim.Optimizer | Optimizers | None") -> CaptureError:
    """The error for a step that steps an optimizer remat was not given: remat would neither
    read its state and settings nor update them as the step does."""
    n = sum(len(g["params"]) for g in stepped.param_groups)
    wrapper = next((o for o in each(passed) if o.param_groups is stepped.param_groups), None)
    if wrapper is not None:  # the advice below would give one parameter to two optimizers
        return CaptureError(
            f"train_step steps the {type(stepped).__name__} that the {type(wrapper).__name__} passed holds and shares its "
            "param groups with: remat reads each parameter's state from one optimizer, and does not support an optimizer "
            "that steps another one over the same parameters (SAM, Lookahead). "
            f"Train with the {type(wrapper).__name__} without remat, or with one optimizer over each parameter."
        )
    listed = ", ".join(type(o).__name__ for o in [*each(passed), stepped])
    return CaptureError(
        f"train_step steps a {type(stepped).__name__} (over {n} parameters) that was not passed to remat.compile, so "
        f"remat cannot read or update its state. Pass every optimizer the step steps, as a list ({listed}): "
        "remat.compile(step, model, [opt_a, opt_b], batch); train_step then gets that list as its optimizer argument."
    )


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        if not value:
            return f"an empty {type(value).__name__}"
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds)}"
    return type(value).__name__
