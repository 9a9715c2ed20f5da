"""The optimizer's state as graph inputs: its first-step state made ahead of the trace,
the optimizer pointed at the traced tensors while tracing, state no update reads undone,
and the update GradScaler skips on an overflow held in the graph (its writes masked), with
what eager's skipped step leaves in Python done after each run."""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass
from collections import defaultdict
from typing import Any, Iterator

import torch
import torch.fx
from torch.optim.optimizer import _default_to_fused_or_foreach

from remat.errors import CaptureError
from remat.capture.optimizers import Optimizers, each, innermost
from remat.ops.masked_writes import masked_writes

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


# Per optimizer: the (parameter, state) entries made here ahead of the step that uses them,
# until a run has stepped it (`made_ahead_used`), or skipped it (`drop_made_ahead`).
_MADE_AHEAD: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[torch.Tensor, dict[str, Any]]]]" = weakref.WeakKeyDictionary()


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
        for p, st in _MADE_AHEAD.pop(opt, []):
            if opt.state.get(p) is st:
                del opt.state[p]


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
                raise CaptureError(
                    f"{type(optimizer).__name__} has no state yet and remat can create the first-step state only of "
                    "torch's own optimizers (through their _init_group). Run one eager training step before "
                    "capturing (remat then takes the state it made, if it is all tensors), or use one of torch's "
                    "optimizers (torch.optim.AdamW, Adam, SGD, ...)."
                )
            if st := optimizer.state.get(p):
                _MADE_AHEAD.setdefault(optimizer, []).append((p, st))


def _init_by_the_optimizer(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """Make `p`'s first-step state with the optimizer's own `_init_group` (torch's optimizers
    make it lazily there, at their first step: RMSprop, Adamax, NAdam, RAdam, Adadelta,
    ASGD, Rprop, ...), given a zero gradient for the call (it reads only its shape and
    kind); False for an optimizer without one. Every argument after `group` is a list the
    method fills."""
    init = getattr(optimizer, "_init_group", None)
    if init is None or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
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


# torch's optimizers whose step cannot be one graph, with why and what to do instead.
_NOT_CAPTURABLE = {
    torch.optim.LBFGS: (
        "its step calls the closure again and again, and stops when the loss and gradients are small enough: "
        "how many forward and backward passes a step runs depends on their values",
        "train with an optimizer whose step is one update (SGD, Adam, AdamW, ...) under remat, or run LBFGS eagerly",
    ),
    torch.optim.SparseAdam: (
        "it updates sparse gradients, whose number of rows depends on the batch's values, and counts its steps in Python ints",
        "give the embedding a dense gradient (nn.Embedding(..., sparse=False)) and train it with Adam or AdamW: "
        "remat runs its update as soon as its gradient is final, which frees that gradient",
    ),
}


def _check_capturable(optimizer: torch.optim.Optimizer) -> None:
    for kind, (why, instead) in _NOT_CAPTURABLE.items():
        if isinstance(optimizer, kind):
            raise CaptureError(f"{type(optimizer).__name__} cannot be captured as one graph: {why}. Instead: {instead}.")


def optimizer_states(
    optimizer: "torch.optim.Optimizer | Optimizers | None", params: dict[str, torch.Tensor], only: set[int] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    if optimizer is None:
        return {}
    for opt in each(optimizer):
        _check_capturable(opt)
    known = {id(p) for p in params.values()}
    in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not in_groups <= known:
        raise CaptureError("the optimizer holds a tensor that is not a parameter of the model; build the optimizer from model.parameters()")
    init_optimizer_state(optimizer, only)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        st = optimizer.state.get(p)
        if not st or id(p) not in in_groups:  # the state of a parameter taken out of its group: no update reads it
            continue
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                raise CaptureError(
                    f"{type(optimizer).__name__}'s state {name}.{key} is a {type(value).__name__}, not a tensor: "
                    "remat can only capture optimizers whose state is all tensors (a Python number there, such as a "
                    "step count the update computes from, would be read once, at capture). Use one of torch's "
                    "optimizers (torch.optim.AdamW, Adam, SGD, ...), whose state is tensors, or train this one without remat."
                )
        states[name] = dict(sorted(st.items()))
    return states


@contextlib.contextmanager
def optimizer_on(
    optimizer: "torch.optim.Optimizer | Optimizers",
    real_to_name: dict[int, str],
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
) -> Iterator[None]:
    """Point the optimizer (each of them) at the traced parameters and state for the duration of the trace."""
    with contextlib.ExitStack() as stack:
        for opt in each(optimizer):
            stack.enter_context(_one_on(opt, real_to_name, params, states))
        yield


_ABSENT = object()  # a param group without a "foreach" entry


@contextlib.contextmanager
def _one_on(
    optimizer: torch.optim.Optimizer,
    real_to_name: dict[int, str],
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
) -> Iterator[None]:
    saved_state = optimizer.state
    saved = [(g["params"], g.get("foreach", _ABSENT)) for g in optimizer.param_groups]
    traced_state: defaultdict = defaultdict(dict)
    traced_name = {id(t): n for n, t in params.items()}
    for group in optimizer.param_groups:
        # foreach=None lets the optimizer pick: the multi-tensor kernels for CUDA tensors,
        # the per-parameter loop on CPU. Fake tensors may pick differently, and the two
        # round differently (Adam on CUDA, in the last bits): pin what eager picks for the
        # real parameters.
        # An optimizer without the setting (Muon) keeps its groups as they are.
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)[1]
        group["params"] = [params[real_to_name[id(p)]] for p in group["params"]]
        for p in group["params"]:
            if traced_name[id(p)] in states:
                traced_state[p] = states[traced_name[id(p)]]
    optimizer.state = traced_state
    try:
        yield
    finally:
        optimizer.state = saved_state
        for group, (ps, foreach) in zip(optimizer.param_groups, saved):
            group["params"] = ps
            if foreach is not _ABSENT:
                group["foreach"] = foreach


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


@dataclass(frozen=True)
class SkippedSteps:
    """After each run, what follows from the skips the graph computed, as it follows in eager:
    an optimizer whose first update was skipped has no state (the state made ahead of the
    run is taken out: drop_made_ahead), and a library's flag of a skipped
    step is set (Accelerate's `AcceleratedOptimizer.step_was_skipped`, which its scheduler
    and Hugging Face's Trainer read to skip the learning-rate step). The trace ran every
    update, so it left each flag unset."""

    optimizers: tuple[torch.optim.Optimizer, ...]  # one per value: the optimizer whose update it skips
    flags: tuple[tuple[Any, str] | None, ...]  # for each: (the wrapper, the attribute) it keeps the skip in
    keyed = True  # it holds no slot of the user's state

    @property
    def count(self) -> int:
        return len(self.optimizers)

    def where(self) -> str:
        return "skipped updates of " + ", ".join(type(o).__name__ for o in self.optimizers)

    def replay(self, values: list[Any]) -> None:
        for optimizer, flag, skipped in zip(self.optimizers, self.flags, values, strict=True):
            if bool(skipped):
                drop_made_ahead(optimizer)
            if flag is not None:
                setattr(flag[0], flag[1], bool(skipped))


def _overflow_flag(wrapper: Any) -> str | None:
    """The attribute in which a library's optimizer wrapper keeps whether the scaler skipped its update."""
    accelerate = sys.modules.get("accelerate.optimizer")
    if accelerate is not None and isinstance(wrapper, accelerate.AcceleratedOptimizer):
        return "_is_overflow"
    return None


def skipped_steps(passed: Any, skips: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]]) -> tuple[list[SkippedSteps], list[list[torch.Tensor]]]:
    """The state update for the skips the trace recorded (by the id of the optimizer whose
    update was masked), with the values it takes from the graph; the wrappers' flags are
    looked for among the optimizers `passed` to the step (one, or a list)."""
    if not skips:
        return [], []
    wrappers = {id(innermost(w)): w for w in (passed if isinstance(passed, (list, tuple)) else [passed])}
    flags = []
    for key in skips:
        wrapper = wrappers.get(key)
        attr = _overflow_flag(wrapper) if wrapper is not None else None
        flags.append((wrapper, attr) if attr is not None else None)
    return [SkippedSteps(tuple(o for o, _ in skips.values()), tuple(flags))], [[skip for _, skip in skips.values()]]


@contextlib.contextmanager
def skipped_in_graph() -> Iterator[dict[int, tuple[torch.optim.Optimizer, torch.Tensor]]]:
    """While the step is traced: the update `torch.amp.GradScaler.step` skips when a
    gradient overflows (`if not sum(v.item() for v in found_inf_per_device.values())`, a
    Python branch on tensor values that one graph cannot hold; a fused optimizer is handed
    the check instead) runs under `masked_writes`, its writes kept where the check found an
    inf. Yields each masked optimizer's skip (by the optimizer's id) as the trace makes it."""
    skips: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]] = {}

    def masked_step(scaler: torch.amp.GradScaler, optimizer: Any, per_optimizer: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        found = list(per_optimizer["found_inf_per_device"].values())
        skip = sum((f.to(found[0].device) for f in found[1:]), found[0]) != 0  # eager: `if not sum(f.item() ...)`
        inner = innermost(optimizer)
        skips[id(inner)] = (inner, skip)
        with masked_writes(skip):
            return optimizer.step(*args, **kwargs)

    original = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = masked_step
    try:
        yield skips
    finally:
        torch.amp.GradScaler._maybe_opt_step = original
