"""The optimizer's state as graph inputs (its first-step state made ahead of the trace:
first_step_state): its tensors, and the Python numbers it keeps (`state["step"] += 1`) as
slots read at every call; the optimizer pointed at the traced tensors while tracing, a state
tensor its step replaces written into the one it replaces; and the update GradScaler skips
on an overflow held in the graph (its writes masked), with what eager's skipped step leaves
in Python done after each run."""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from collections import defaultdict
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.optim.optimizer import _default_to_fused_or_foreach

from remat.errors import CaptureError
from remat.capture.optim.first_step_state import drop_made_ahead, init_optimizer_state, torchs
from remat.capture.optim.hyperparams import GroupCount, GroupSet, is_number
from remat.capture.state.read_numbers import Reading
from remat.capture.state.kept_tensors import check_writable, memory_of
from remat.capture.state.slots import MISSING, Slot
from remat.capture.optimizers import Optimizers, each, innermost
from remat.ops.masked_writes import masked_writes

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
    for opt in each(optimizer):
        held = [k for k, v in opt.state.items() if not isinstance(k, torch.Tensor) and pytree.tree_any(lambda x: isinstance(x, torch.Tensor), v)]
        if held:
            raise CaptureError(
                f"{type(opt).__name__} keeps tensors in its state under {held[0]!r}, not under a parameter; remat takes an "
                "optimizer's state tensors parameter by parameter, as graph inputs. Train this optimizer without remat."
            )
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        st = optimizer.state.get(p)
        if not st or id(p) not in in_groups:  # the state of a parameter taken out of its group: no update reads it
            continue
        for key, value in st.items():
            if not isinstance(value, torch.Tensor) and not is_number(value) and value is not None:
                raise CaptureError(
                    f"{type(optimizer).__name__}'s state {name}[{key!r}] is a {type(value).__name__}: remat captures "
                    "optimizers whose state holds tensors and numbers (a number is read at every call, and what the step "
                    "adds to it added again after each run). Keep other values elsewhere (in the optimizer itself, "
                    "outside the state), or train this optimizer without remat."
                )
        states[name] = {key: value for key, value in sorted(st.items()) if isinstance(value, torch.Tensor)}
    return states


def number_slots(optimizer: "torch.optim.Optimizer | Optimizers | None", params: dict[str, torch.Tensor]) -> list[tuple[Slot, Any]]:
    """Where each number an optimizer's state holds lives (`state["step"]`, a count kept as
    a Python int), with the number: read_numbers reads them at every call, and adds again
    after each run what the step added. Each is found through the optimizer, its state
    table and the parameter, so that a state loaded since (`load_state_dict`, which makes
    new dicts) is the one read. `params`: the model's, by name."""
    names = {id(p): n for n, p in params.items()}
    out: list[tuple[Slot, Any]] = []
    for opt in each(optimizer):
        table = Slot(f"{type(opt).__name__}.state", opt, "state")
        for p, st in opt.state.items():
            if isinstance(st, dict) and id(p) in names:
                held = Slot(f"{table.name}[{names[id(p)]}]", table, p)
                out += [(Slot(f"{held.name}[{key!r}]", held, key), value) for key, value in st.items() if is_number(value)]
    return out


@contextlib.contextmanager
def optimizer_on(
    optimizer: "torch.optim.Optimizer | Optimizers",
    real_to_name: dict[int, str],
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    inputs: tuple[Any, ...],
) -> Iterator[None]:
    """Point the optimizer (each of them) at the traced parameters and state for the
    duration of the trace. Each parameter's state is its own dict, holding the traced
    tensors (`states`) in place of its own while the trace runs, so that the numbers it
    holds (`state["step"] += 1`) are where read_numbers reads them; a state tensor the
    step replaces (`state["m"] = state["m"] * b + g`) is written into the memory of the
    one it replaces right after the step (`inputs`: the graph's, none of whose memory the
    new value may be)."""
    with contextlib.ExitStack() as stack:
        for opt in each(optimizer):
            stack.enter_context(_one_on(opt, real_to_name, params, states, inputs))
        yield


_ABSENT = object()  # a param group without a "foreach" entry


class _TracedTable(defaultdict):  # type: ignore[type-arg]
    """The optimizer's state table while the step is traced: keyed by the traced parameters,
    as the step looks its state up; `get` by a real parameter finds that parameter's state
    too, so that the slots of its numbers (number_slots) lead to it while it is traced."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.traced_of: dict[int, torch.Tensor] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self.traced_of.get(id(key), key), default)


@contextlib.contextmanager
def _one_on(
    optimizer: torch.optim.Optimizer,
    real_to_name: dict[int, str],
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    inputs: tuple[Any, ...],
) -> Iterator[None]:
    saved_state = optimizer.state
    saved = [(g["params"], g.get("foreach", _ABSENT)) for g in optimizer.param_groups]
    traced_state = _TracedTable(dict)
    swapped: list[tuple[str, dict[str, Any], dict[str, Any]]] = []  # (parameter, its state dict, the dict's items as they were)
    for group in optimizer.param_groups:
        # foreach=None lets the optimizer pick: the multi-tensor kernels for CUDA tensors,
        # the per-parameter loop on CPU. Fake tensors may pick differently, and the two
        # round differently (Adam on CUDA, in the last bits): pin what eager picks for the
        # real parameters.
        # An optimizer without the setting (Muon) keeps its groups as they are, and so does
        # another's (a library's), which picks by its own rule (pytorch_optimizer's: foreach on any device).
        if "foreach" in group and group["foreach"] is None and torchs(optimizer):
            group["foreach"] = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)[1]
        for p in group["params"]:
            name = real_to_name[id(p)]
            if name in states:
                own = saved_state[p]
                swapped.append((name, own, dict(own)))
                own.update(states[name])
                traced_state[params[name]] = own
                traced_state.traced_of[id(p)] = params[name]
        group["params"] = [params[real_to_name[id(p)]] for p in group["params"]]
    # State kept under another key than a parameter (a step count under "step"): seen as it is, and refused if the step changes it.
    table_entries = {k: (v, copy.copy(v) if isinstance(v, (dict, list)) else None) for k, v in saved_state.items() if not isinstance(k, torch.Tensor)}
    traced_state.update((k, v) for k, (v, _) in table_entries.items())
    optimizer.state = traced_state
    hook = optimizer.register_step_post_hook(lambda *_: _write_replaced(optimizer, params, swapped, states, inputs, table_entries))
    try:
        yield
    finally:
        hook.remove()
        optimizer.state = saved_state
        for _, own, items in swapped:
            own.clear()
            own.update(items)
        for group, (ps, foreach) in zip(optimizer.param_groups, saved):
            group["params"] = ps
            if foreach is not _ABSENT:
                group["foreach"] = foreach


def _held_as_it_was(now: Any, was: tuple[Any, Any]) -> bool:
    """`now` is the object `was` held (with a copy of its items, where a dict or list), holding the same items."""
    obj, items = was
    if now is not obj:
        return False
    if isinstance(obj, dict):
        return obj.keys() == items.keys() and all(obj[k] is items[k] for k in obj)
    return not isinstance(obj, list) or (len(obj) == len(items) and all(a is b for a, b in zip(obj, items)))


def _write_replaced(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], swapped: list[tuple[str, dict[str, Any], dict[str, Any]]],
    states: dict[str, dict[str, torch.Tensor]], inputs: tuple[Any, ...], table_entries: dict[Any, Any],
) -> None:  # fmt: skip
    """After the traced step: each state tensor it replaced, written into the memory of the
    one it replaced (the state's dict then holds that one again, as the next step finds it
    in the real dict); a state tensor it deleted, or replaced by something else, and state
    it made anew (a dict of its own), refused."""
    names = {id(t): n for n, t in params.items()}
    held = {name: own for name, own, _ in swapped}
    for key, st in optimizer.state.items():
        if not isinstance(key, torch.Tensor):
            if key not in table_entries or not _held_as_it_was(st, table_entries[key]):
                raise CaptureError(
                    f"{type(optimizer).__name__} keeps state under {key!r}, not under a parameter, and its step changes it "
                    f"({type(st).__name__}); remat takes an optimizer's state parameter by parameter, and the graph would hold "
                    "what the step left there at capture. Train this optimizer without remat."
                )
            continue
        name = names.get(id(key), "a tensor that is not a parameter")
        if (not isinstance(st, dict) or st) and held.get(name) is not st:
            what = ", ".join(map(repr, st)) if isinstance(st, dict) else f"a {type(st).__name__}"
            raise CaptureError(
                f"{type(optimizer).__name__}'s step made new state for {name} ({what}), which remat had "
                "not made ahead of the trace; the graph would make it at every step. Run one eager training step before "
                "remat.compile, so that the state exists, or train this optimizer without remat."
            )
    memory = None
    for name, own, items in swapped:
        unset = [k for k, v in items.items() if v is None and own.get(k, MISSING) is not None]
        if unset:  # state the optimizer keeps unset (a buffer only some settings use)
            raise CaptureError(
                f"{type(optimizer).__name__}'s step sets its state {name}[{unset[0]!r}], which held None, to "
                f"{type(own.get(unset[0], MISSING)).__name__ if unset[0] in own else 'nothing'}; the graph cannot make that change "
                "at every step. Run one eager training step before remat.compile, or train this optimizer without remat."
            )
        for key, came_in in states[name].items():
            now = own.get(key, MISSING)
            if now is came_in:
                continue
            what = f"{type(optimizer).__name__}'s state {name}[{key!r}]"
            if not isinstance(now, torch.Tensor):
                raise CaptureError(
                    f"{what} is a tensor, and the optimizer's step {'deletes it' if now is MISSING else f'sets it to {type(now).__name__}'}; "
                    "remat runs the step as one graph, which can write a new value into a state tensor but not remove it. "
                    "Train this optimizer without remat, or change it to keep a tensor there."
                )
            memory = memory if memory is not None else memory_of(inputs)  # once, where a tensor was replaced
            check_writable(came_in, now, what, memory)
            with torch.no_grad():
                came_in.copy_(now)
            own[key] = came_in


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


def kept_by_step(numbers: Reading, in_groups: list[tuple[GroupCount | GroupSet, list[Any]]], skips: dict[int, Any]) -> list[tuple[Any, list[Any]]]:
    """What the step did to the numbers read at every call (`numbers`: the optimizer's among
    them) and to the numbers in the optimizer's param groups (`in_groups`: counted up or
    set, hyperparams.symbolic's), to do again after each run, each with its traced values. Refused where GradScaler may skip an update (`skips`:
    skipped_in_graph's) whose optimizer's step changes such numbers: a skipped step would change them still."""
    kept = numbers.kept() + in_groups

    def changed_by_update(u: Any) -> bool:
        if isinstance(u, GroupSet):  # a rate set before `scaler.step(optimizer)` is set whether or not it skips, as in eager
            return u.by_update
        return isinstance(u, GroupCount) or u.slot.name in numbers.set_by_step

    by_optimizer = [u.where() for u, _ in kept if changed_by_update(u)]
    if skips and by_optimizer:
        raise CaptureError(
            f"torch.amp.GradScaler may skip this optimizer's update, and it keeps Python numbers its step changes ({by_optimizer[0]}), "
            "which remat sets after each run whether or not the update was skipped. Train in bfloat16 without a GradScaler, or "
            "use an optimizer whose state is all tensors (torch.optim.AdamW, Adam, SGD, ...)."
        )
    return kept


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
    inf. Yields each masked optimizer's skip (by the optimizer's id) as the trace makes it.
    A trace that fails midway leaves each scaler it unscaled with no step under way, as
    `update()` leaves it between steps, for the next trace to start from."""
    skips: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
    scalers: dict[int, torch.amp.GradScaler] = {}
    unscale = torch.amp.GradScaler.unscale_

    def unscaling(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        scalers[id(scaler)] = scaler
        return unscale(scaler, optimizer)

    def masked_step(scaler: torch.amp.GradScaler, optimizer: Any, per_optimizer: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        found = list(per_optimizer["found_inf_per_device"].values())
        skip = sum((f.to(found[0].device) for f in found[1:]), found[0]) != 0  # eager: `if not sum(f.item() ...)`
        inner = innermost(optimizer)
        skips[id(inner)] = (inner, skip)
        with masked_writes(skip):
            return optimizer.step(*args, **kwargs)

    original = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step, torch.amp.GradScaler.unscale_ = masked_step, unscaling
    try:
        yield skips
    except BaseException:
        for scaler in scalers.values():
            scaler._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
        raise
    finally:
        torch.amp.GradScaler._maybe_opt_step, torch.amp.GradScaler.unscale_ = original, unscale
