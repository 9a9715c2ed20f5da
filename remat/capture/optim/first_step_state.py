"""The optimizer's first-step state, made ahead of the trace so that every step runs one
graph: torch's optimizers through their own `_init_group`, any other by its own step run on
a copy of each parameter (the first value it sets under each key); undone where the run it
was made for never stepped the optimizer."""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from typing import Any

import torch

from remat.errors import CaptureError
from remat.capture.optimizers import Optimizers, each


def init_optimizer_state(optimizer: "torch.optim.Optimizer | Optimizers", only: set[int] | None = None) -> None:
    """Create the state the first `step()` would create, so that every step runs one graph.

    The values are exactly what the optimizer's first step makes (zeros; Adam's step 0;
    the others' through their own `_init_group`),
    so the captured step updates bitwise as the eager first step does. SGD's first step
    copies the gradient into a fresh momentum buffer; `0 * momentum + grad` gives the same.
    `only`: ids of the parameters to create state for (default: all).
    """
    for opt in each(optimizer):
        _init_one(opt, only)


# Per optimizer: the entries made here ahead of the step that uses them, as (where, key,
# value): a parameter's state in the state table, or a number a param group gets at the
# first step; until a run has stepped it (`made_ahead_used`), or skipped it (`drop_made_ahead`).
_MADE_AHEAD: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[dict[Any, Any], Any, Any]]]" = weakref.WeakKeyDictionary()


def made_ahead_used(optimizer: "torch.optim.Optimizer | Optimizers | None") -> None:
    """After a run: the state made ahead of it is the optimizer's own now, as eager's first step would have made it."""
    for opt in each(optimizer):
        _MADE_AHEAD.pop(opt, None)


def drop_made_ahead(optimizer: "torch.optim.Optimizer | Optimizers | None") -> None:
    """After a run whose update of `optimizer` was skipped (by torch.amp.GradScaler, on an
    overflow), or a capture traced again: the state made ahead of it is taken out again, as
    eager's skipped step never made it (the next run, or capture, makes it again, with the
    same values)."""
    for opt in each(optimizer):
        for where, key, value in _MADE_AHEAD.pop(opt, []):
            if where.get(key) is value:
                del where[key]


def _init_one(optimizer: torch.optim.Optimizer, only: set[int] | None) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p) or (only is not None and id(p) not in only):
                continue
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"] != 0:
                    optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                if group.get("fused") or group.get("capturable"):
                    step = torch.zeros((), dtype=torch.float32, device=p.device)
                else:
                    step = torch.tensor(0.0, dtype=torch.float32)
                state = {
                    "step": step,
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                optimizer.state[p] = state
            elif not _init_by_the_optimizer(optimizer, group, p):
                _init_by_a_step(optimizer, group, p)
            if st := optimizer.state.get(p):
                _MADE_AHEAD.setdefault(optimizer, []).append((optimizer.state, p, st))


def _init_by_the_optimizer(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """Make `p`'s first-step state with the optimizer's own `_init_group` (torch's optimizers
    make it lazily there, at their first step: RMSprop, Adamax, NAdam, RAdam, Adadelta,
    ASGD, Rprop, ...), given a zero gradient for the call (it reads only its shape and
    kind); False for an optimizer without one. Every argument after `group` is a list the
    method fills."""
    init = getattr(optimizer, "_init_group", None)
    if init is None or not torchs(optimizer):
        return False
    names = list(inspect.signature(init).parameters)
    if not names or names[0] != "group":
        return False
    one = {**group, "params": [p]}
    saved = p.grad
    p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
    try:
        init(one, *([] for _ in names[1:]))
    finally:
        p.grad = saved
    return bool(optimizer.state.get(p))


def torchs(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch's own optimizers (torch.optim's)."""
    return type(optimizer).__module__.split(".")[:2] == ["torch", "optim"]


def _init_by_a_step(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    """Make `p`'s first-step state as another optimizer's first step makes it (a library's or
    the user's, which make it lazily in step()): its step run on a copy of `p` alone, with a
    state table that keeps the first value set under each key (`state["step"] = 0`,
    `state["exp_avg"] = torch.zeros_like(p)`), before the step changes it. Run twice, with
    two gradients: state that differs was made from the gradient (`state["m"] =
    grad.clone()`), which remat cannot know ahead, and is refused."""
    runs = [_first_values(optimizer, group, p, fill) for fill in (0.0, 0.5)]
    if any(moved for _, _, moved in runs):
        raise CaptureError(
            f"{type(optimizer).__name__}'s first step changes the parameter before it makes its state (a first step that "
            "also rescales the weights), which remat cannot do ahead of the graph: the graph runs every step alike. Run one "
            "eager training step before remat.compile, so that the state exists, or train this optimizer without remat."
        )
    made = [{**state, **{("group", k): v for k, v in added.items()}} for state, added, _ in runs]
    if made[0].keys() != made[1].keys() or not all(_same_value(made[0][k], made[1][k]) for k in made[0]):
        differ = [k[1] if isinstance(k, tuple) else k for k in made[0] if k not in made[1] or not _same_value(made[0][k], made[1][k])] or list(made[1])
        raise CaptureError(
            f"{type(optimizer).__name__}'s first step makes its state ({differ[0]!r}) from the gradient, so remat cannot make "
            "it ahead of the step, as it must: the graph runs every step alike. Run one eager training step before "
            "remat.compile, so that the state exists, or use one of torch's optimizers (torch.optim.AdamW, Adam, SGD, ...)."
        )
    state, added, _ = runs[0]
    if state:
        optimizer.state[p] = state
    for key, value in added.items():  # a count the step keeps in the group (`group["step"] = 0` at its first step)
        group[key] = value
        _MADE_AHEAD.setdefault(optimizer, []).append((group, key, value))


def _first_values(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor, fill: float) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The first value the optimizer's step sets under each key of a parameter's state, and
    under each key it adds to the param group, on a copy of `p` whose gradient is `fill`
    everywhere (a copy of the optimizer, without its hooks, steps a copy of the group:
    nothing of the user's changes); and whether the copy had changed by its first state."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(vars(optimizer))
    copy = p.detach().clone()
    copy = torch.nn.Parameter(copy, requires_grad=p.requires_grad) if isinstance(p, torch.nn.Parameter) else copy
    copy.grad = torch.full_like(p, fill)
    shadow.param_groups = [_FirstValues({**group, "params": [copy]})]
    shadow.state = _FirstValuesTable((copy, p))
    shadow._optimizer_step_pre_hooks, shadow._optimizer_step_post_hooks = {}, {}
    try:
        type(optimizer).step(shadow)
    except Exception as e:  # noqa: BLE001 - said in the error, with what to do
        raise CaptureError(
            f"{type(optimizer).__name__} has no state yet, and its step, run by remat on a copy of one parameter to make "
            f"the state its first step makes, failed ({type(e).__name__}: {e}). Run one eager training step before "
            "remat.compile, so that the state exists, or use one of torch's optimizers (torch.optim.AdamW, Adam, SGD, ...)."
        ) from e
    st = dict.get(shadow.state, copy)
    added = {k: v for k, v in shadow.param_groups[0].first.items() if k not in group}
    return (dict(st.first) if st is not None else {}), added, bool(st is not None and st.moved_first)


def _same_value(a: Any, b: Any) -> bool:
    """Tensors of the same kind and values; containers item by item; anything else by `==`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, dict) and type(a) is type(b):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if not isinstance(a, (int, float, complex, str, bytes, type(None))):  # another object (a deque): its kind is judged later
        return type(a) is type(b)
    return type(a) is type(b) and a == b


def _kept_first(value: Any) -> Any:
    """A value as set, kept from what the step does to it after: tensors copied, containers of them too."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return type(value)(map(_kept_first, value))
    if type(value) is dict:
        return {k: _kept_first(v) for k, v in value.items()}
    return value


class _FirstValues(dict):  # type: ignore[type-arg]
    """A parameter's state while _first_values steps it (or its group): the first value set
    under each key (`first`), and whether the parameter copy differed from the parameter
    (`watched`) when the first was set (`moved_first`)."""

    def __init__(self, *args: Any, watched: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(*args)
        self.watched, self.moved_first = watched, None
        self.first = {k: _kept_first(v) for k, v in self.items()}
        if self.first:
            self._first_set()

    def _first_set(self) -> None:
        if self.watched is not None and self.moved_first is None:
            self.moved_first = not torch.equal(self.watched[0].detach(), self.watched[1].detach())

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self.first:
            self._first_set()
            self.first[key] = _kept_first(value)
        super().__setitem__(key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class _FirstValuesTable(defaultdict):  # type: ignore[type-arg]
    """The state table while _first_values steps: a parameter's dict set whole (`self.state[p] = {...}`) is recorded too."""

    def __init__(self, watched: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(lambda: _FirstValues(watched=watched))
        self.watched = watched

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, dict) and not isinstance(value, _FirstValues):
            value = _FirstValues(value, watched=self.watched)
        super().__setitem__(key, value)


def check_first_step_state(optimizer: "torch.optim.Optimizer | Optimizers", had_state: set[int], updated: set[int]) -> None:
    """SGD's first step copies the gradient into the momentum buffer; the zero buffer remat
    creates gives the same only without dampening (`0 * m + (1 - dampening) * g`)."""
    groups = [g for opt in each(optimizer) if isinstance(opt, torch.optim.SGD) for g in opt.param_groups]
    for group in groups:
        if group["momentum"] != 0 and group["dampening"] != 0:
            if any(id(p) in updated and id(p) not in had_state for p in group["params"]):
                raise CaptureError(
                    "SGD with momentum and dampening copies the first gradient into its momentum buffer undamped; "
                    "remat cannot create that state ahead of the step. Run one eager training step before "
                    "remat.compile, or set dampening=0."
                )
