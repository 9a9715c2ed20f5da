"""Optimizer hyperparameters as graph inputs, read again at every step.

A value read from Python while tracing is a constant in the graph, so a learning rate
set by a scheduler after capture would be silently ignored. Instead, every float in
`optimizer.param_groups` (lr, weight_decay, momentum, dampening, betas, eps, ...) is a
0-dim float64 graph input, filled from the param groups at each call. Inside the trace
it is turned back into a Python scalar (`.item()`, a symbolic float), so the update's
arithmetic stays eager's: the same Python double operations, then the same kernels with
a scalar argument, bitwise.

What cannot be an input is fixed at capture and checked at every call, with an error
that names it when it changed: flags (nesterov, amsgrad, maximize, ...), which
parameters each group holds, for a float the update branches on (`if
weight_decay != 0`, RMSprop's `if momentum > 0`), its sign: negative, zero or positive,
and for a number it branches on otherwise (Muon's `ns_steps`, a count of iterations),
its value. A fused kernel (`fused=True`) takes its settings as fixed numbers but for the
learning rate, which it reads from a tensor: the step's code reads a number there as
elsewhere, and for the optimizer's step alone the rate is the graph input itself (or a
tensor made from the number the step set), read at every call; the other floats are fixed. An int the optimizer's step
counts up in its group (`group["step"] += 1`: a library's step count) is read the same
way and counted up again after each run (`GroupCount`); a number the step sets in a
group (a warm-up's rate, computed from a count the step keeps) is set again after each
run (`GroupSet`), and in a fused group it is made the tensor the kernel reads while traced.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import sympy
import torch

from remat.errors import CaptureError, ChangedSinceCompiled
from remat.capture.optimizers import group_name
from remat.capture.state.slots import MISSING, rounds_in_python

# Floats that torch.optim's optimizers compare with zero before using them. Their sign is
# fixed from the start; others are found when a trace trips on one.
BRANCHED_KEYS = frozenset({"weight_decay", "momentum"})
FIXED = 2  # in place of a sign: an int's value itself is fixed (a count the update loops over)


@dataclass(frozen=True)
class GroupSpec:
    """What the captured update assumes about one param group."""

    params: tuple[str, ...]  # names of the parameters in the group, in order
    flags: tuple[tuple[str, str], ...]  # (key, repr(value)) of every non-float entry
    signs: tuple[tuple[str, int], ...]  # (float key, its sign: -1, 0, 1) where the update branches on it
    fixed: tuple[tuple[str, float], ...] = ()  # (key, its value) where the update depends on more than the sign


def sign(value: float) -> int:
    return int(value > 0) - int(value < 0)


_SIGN_WORDS = {-1: "negative", 0: "zero", 1: "positive"}


def is_number(value: Any) -> bool:
    # Ints too: torch.optim's defaults are often int 0 (weight_decay, momentum), which a
    # user or scheduler later sets to a float.
    return type(value) in (float, int)


def is_setting_number(value: Any) -> bool:
    """A number of a param group read at every call: also numpy's float64 (a schedule kept as
    an array, `lr_schedule[it]`), whose arithmetic is a Python float's."""
    return is_number(value) or type(value) is np.float64


def float_entries(group: dict[str, Any]) -> dict[str, float]:
    """The group's numbers by key: "lr", and "betas[0]" for the items of a tuple of numbers
    (an int kept an int: only a count may have its value fixed, `FIXED`)."""
    out: dict[str, float] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if is_setting_number(value):
            out[key] = value
        elif isinstance(value, (tuple, list)) and value and all(is_setting_number(v) for v in value):
            out.update({f"{key}[{i}]": v for i, v in enumerate(value)})
    return out


def _flags(group: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    floats = {k.split("[")[0] for k in float_entries(group)}
    out = []
    for key, value in group.items():
        if key == "params" or key in floats:
            continue
        rounded = [v for v in (value if isinstance(value, (tuple, list)) else [value]) if rounds_in_python(v)]
        if rounded:
            raise CaptureError(
                f"{where}[{key!r}] is {value!r}: the update's arithmetic on a numpy {rounded[0].dtype} rounds to its "
                "precision, which remat's graph does not reproduce (it computes with Python floats). Set "
                f"float(...) there (group[{key!r}] = float(value)): eager then computes as remat does, and the step "
                "reads it at every call."
            )
        if isinstance(value, torch.Tensor):
            raise CaptureError(
                f"{where}[{key!r}] is a tensor; remat reads the param groups' settings as Python numbers at every "
                "call. Pass a float (a scheduler may still change it between steps); where the optimizer keeps a tensor "
                "there itself (D-Adaptation's estimates), train it without remat."
            )
        out.append((key, repr(value)))
    return tuple(sorted(out))


def check_readable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before tracing, a param group entry remat cannot read at every call."""
    for gi, group in enumerate(optimizer.param_groups):
        _flags(group, group_name(optimizer, gi))


def input_name(gi: int, key: str) -> str:
    return f"param_groups[{gi}].{key}"


def parse_input_name(name: str) -> tuple[int, str]:
    head, key = name.split(".", 1)
    return int(head[len("param_groups[") : -1]), key


def _set(group: dict[str, Any], key: str, value: Any) -> None:
    if "[" in key:
        base, i = key[:-1].split("[")
        items = list(group[base])
        items[int(i)] = value
        group[base] = type(group[base])(items)
    else:
        group[key] = value


def _get(group: dict[str, Any], key: str) -> Any:
    if "[" in key:
        base, i = key[:-1].split("[")
        return group[base][int(i)]
    return group[key]


@contextlib.contextmanager
def symbolic(
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    sign_facts: dict[str, int],
    symbols: dict[str, str],
    kept: list[tuple[GroupCount | GroupSet, list[Any]]],
) -> Iterator[None]:
    """While tracing: each float of the param groups is the `.item()` of its graph input.

    `tensors`: input name -> the traced 0-dim tensor. `sign_facts`: input name -> its sign
    (-1, 0, 1), for the floats the update may branch on. `symbols` is filled with the
    symbol of each float -> its input name, to name a branch the trace trips on. An int
    the step counts up (`group["step"] += 1`, as many libraries' optimizers keep their
    step) goes into `kept`, to be counted again after each run, and a number the step sets
    (a warm-up's `group["lr"] = base * min(1, step / warmup)`), to be set again, each with
    the traced numbers it takes from the graph.
    """
    saved = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    placed: dict[str, Any] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for key in float_entries(group):
            name = input_name(gi, key)
            if sign_facts.get(name) == FIXED:
                continue  # the group's own value, a constant of the graph
            value = traced_number(tensors[name], name, sign_facts.get(name), symbols)
            _set(group, key, value)
            placed[name] = value
    # Per optimizer step entered (a subclass's step calls its base's, each hooked): the numbers
    # before it, and the fused groups' rates made tensors for it; the outermost one counts.
    entered: list[tuple[dict[tuple[int, str], Any], dict[int, tuple[Any, torch.Tensor]]]] = []
    by_update: set[tuple[int, str]] = set()  # numbers the optimizer's own step set (a skipped update would not)

    def update_begins(*_: Any) -> None:
        numbers = _numbers_of(optimizer)
        entered.append((numbers, _fused_rates_as_tensors(optimizer, tensors, placed) if not entered else {}))

    def update_ended(*_: Any) -> None:
        before, rates = entered.pop()
        for gi, (rate, made) in rates.items():  # the step's code after the update reads the number again, as in eager
            if optimizer.param_groups[gi]["lr"] is made:
                optimizer.param_groups[gi]["lr"] = rate
        if not entered:
            by_update.update(at for at, value in _numbers_of(optimizer).items() if before.get(at, MISSING) is not value)

    hooks = [optimizer.register_step_pre_hook(update_begins), optimizer.register_step_post_hook(update_ended)]
    try:
        yield
        # Every number, placed or a constant of the graph (a count fixed by value, or zero by its sign).
        for gi, key in [(gi, key) for gi, values in enumerate(saved) for key in float_entries(values)]:
            came_in = placed.get(input_name(gi, key), _get(saved[gi], key))
            now = _get(optimizer.param_groups[gi], key)
            if now is came_in:
                continue
            added = added_to(now, came_in) if type(_get(saved[gi], key)) is int else None
            if added is not None:
                kept.append((GroupCount(optimizer, gi, key, added), []))
            elif isinstance(now, (torch.SymFloat, torch.SymInt)):  # computed from the graph's inputs
                kept.append((GroupSet(optimizer, gi, key, None, 1, (gi, key) in by_update), [now]))
            elif is_setting_number(now):
                kept.append((GroupSet(optimizer, gi, key, now, 0, (gi, key) in by_update), []))
            else:
                raise CaptureError(
                    f"train_step set {group_name(optimizer, gi)}[{key.split('[')[0]!r}] to {type(now).__name__} while it "
                    "ran; remat reads the param groups' settings as Python numbers. Set a float there, or change it "
                    "between steps, outside train_step."
                )
        added = [(gi, k) for gi, (group, values) in enumerate(zip(optimizer.param_groups, saved)) for k in group if k != "params" and k not in values]
        if added:
            raise CaptureError(
                f"train_step's optimizer step adds {added[0][1]!r} to {group_name(optimizer, added[0][0])}, which remat "
                "could not make ahead of the step; the graph would hold the value it set there at capture. Run one eager "
                "training step before remat.compile, so that the group holds it, or train this optimizer without remat."
            )
    finally:
        for hook in hooks:
            hook.remove()
        for group, values in zip(optimizer.param_groups, saved):
            for key in [k for k in group if k != "params" and k not in values]:
                del group[key]
            group.update(values)


def _numbers_of(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], Any]:
    """Each number of the param groups, and a fused group's rate tensor, by group and key."""
    out = {}
    for gi, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            for k, v in enumerate(value) if isinstance(value, tuple) else [(None, value)]:
                out[(gi, key if k is None else f"{key}[{k}]")] = v
    return out


def _fused_rates_as_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], placed: dict[str, Any]) -> dict[int, tuple[Any, torch.Tensor]]:
    """Before a traced step of the optimizer: each fused group's learning rate made the 0-dim
    tensor the kernel's tensor-lr form reads (a number there would be fixed in the graph):
    its graph input itself where it is the number placed, else (a warm-up's rate the step
    set) one made from the number. By group: the number and the tensor that stands for it."""
    out = {}
    for gi, group in enumerate(optimizer.param_groups):
        rate, name = group.get("lr"), input_name(gi, "lr")
        if group.get("fused") and (is_setting_number(rate) or isinstance(rate, torch.SymFloat)):
            like = tensors[name]
            group["lr"] = like if rate is placed.get(name) else torch.scalar_tensor(rate, dtype=like.dtype, device=like.device)
            out[gi] = (rate, group["lr"])
    return out


def added_to(now: Any, came_in: Any) -> int | None:
    """What the traced step added to a number (`group["step"] += 1`: 1), where adding a
    whole number is all it did to it: `came_in` the number as the trace began, its symbol
    or the constant the graph holds for it; None for any other change."""
    expr = lambda x: x.node.expr if isinstance(x, (torch.SymInt, torch.SymFloat)) else sympy.sympify(x) if is_number(x) else None  # noqa: E731
    if expr(now) is None or expr(came_in) is None:
        return None
    added = sympy.expand(expr(now) - expr(came_in))
    return int(added) if added.is_number and float(added).is_integer() else None


@dataclass(frozen=True)
class GroupCount:
    """An int of a param group the step counts up, counted up again after each run (an
    update of TrainGraph.call.state_updates); the group is looked up at each run."""

    optimizer: torch.optim.Optimizer
    group: int
    key: str
    added: int
    count = 0  # of the graph's number outputs
    keyed = True  # it holds no slot of the user's state

    def where(self) -> str:
        return f"counted in {group_name(self.optimizer, self.group)}[{self.key!r}]"

    def replay(self, values: list[Any]) -> None:
        group = self.optimizer.param_groups[self.group]
        _set(group, self.key, _get(group, self.key) + self.added)


@dataclass(frozen=True)
class GroupSet:
    """A number of a param group the step sets, set again after each run: to the graph's
    number output where the trace computed it from the step's inputs (`count` 1: a rate
    from the loop's count), else to the constant it set."""

    optimizer: torch.optim.Optimizer
    group: int
    key: str
    value: Any  # the constant, where `count` is 0
    count: int  # of the graph's number outputs
    by_update: bool  # set by the optimizer's step itself, not by the code around it
    keyed = True  # it holds no slot of the user's state

    def where(self) -> str:
        return f"set in {group_name(self.optimizer, self.group)}[{self.key!r}]"

    def replay(self, values: list[Any]) -> None:
        _set(self.optimizer.param_groups[self.group], self.key, values[0] if self.count else self.value)


def traced_number(tensor: torch.Tensor, name: str, known_sign: int | None, symbols: dict[str, str]) -> Any:
    """While tracing: the `.item()` of a 0-dim graph input, a symbolic float (or int, of an
    int64 input), recorded in `symbols` under `name` (to name a branch the trace trips on)
    and told its sign where one is known (-1, 0, 1)."""
    value = tensor.item()
    symbols[str(value.node.expr)] = name
    if known_sign is not None:
        torch._check(value > 0 if known_sign > 0 else value < 0 if known_sign < 0 else value == 0)
    return value


@contextlib.contextmanager
def quiet_structured_trace() -> Iterator[None]:
    """While tracing: torch's structured trace log (`torch.__trace`, what TORCH_TRACE writes
    for tlparse) without its handlers, unless TORCH_TRACE names a folder. It logs a record
    with a stack for each symbolic float the trace specializes, which its own handler then
    drops; a handler another tool attached (pytest's log capture) formats every one, which
    doubled a trace's time."""
    log = logging.getLogger("torch.__trace")
    if os.environ.get("TORCH_TRACE"):
        yield
        return
    handlers = list(log.handlers)
    for handler in handlers:
        log.removeHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            log.addHandler(handler)


def fixed_by_fused_kernels(optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """The floats a fused kernel takes as fixed numbers (betas, eps, weight_decay: every
    float of a `fused=True` group but the learning rate, which its tensor-lr form reads
    at every call): constants of the graph, a change refused at the call (`FIXED`)."""
    if optimizer is None:
        return {}
    return {
        input_name(gi, key): FIXED
        for gi, group in enumerate(optimizer.param_groups)
        if group.get("fused")
        for key in float_entries(group)
        if key != "lr"
    }


def group_specs(optimizer: torch.optim.Optimizer, names: dict[int, str], sign_facts: dict[str, int]) -> list[GroupSpec]:
    specs = []
    for gi, group in enumerate(optimizer.param_groups):
        facts = {key: sign_facts[input_name(gi, key)] for key, value in float_entries(group).items() if input_name(gi, key) in sign_facts}
        signs = tuple(sorted((key, fact) for key, fact in facts.items() if fact != FIXED))
        fixed = tuple(sorted((key, float_entries(group)[key]) for key, fact in facts.items() if fact == FIXED))
        specs.append(GroupSpec(tuple(names[id(p)] for p in group["params"]), _flags(group, group_name(optimizer, gi)), signs, fixed))
    return specs


def check_unchanged(optimizer: torch.optim.Optimizer, specs: list[GroupSpec], names: dict[int, str]) -> None:
    """Refuse a change the captured update cannot follow, naming it."""
    groups = optimizer.param_groups
    if len(groups) != len(specs):
        raise ChangedSinceCompiled(f"the optimizer has {len(groups)} param groups, but the step was compiled with {len(specs)}")
    for gi, (group, spec) in enumerate(zip(groups, specs)):
        params = tuple(names.get(id(p), "<not a parameter of the model>") for p in group["params"])
        if params != spec.params:
            raise ChangedSinceCompiled(f"{group_name(optimizer, gi)} holds other parameters than when the step was compiled")
    check_settings(optimizer, groups, specs)


def check_settings(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], specs: list[GroupSpec]) -> None:
    """A setting of `groups` (the optimizer's, as many as `specs`) changed in a way the
    captured update cannot follow (a flag, a fixed number, a sign it branches on): the step
    is compiled again for it (ChangedSinceCompiled, which names it)."""
    for gi, (group, spec) in enumerate(zip(groups, specs)):
        where = group_name(optimizer, gi)
        flags = dict(_flags(group, where))
        floats = float_entries(group)
        for key, was in spec.flags:
            now = flags.get(key, repr(floats.get(key, "<missing>")))
            if now != was:
                raise ChangedSinceCompiled(f"{where}[{key!r}] changed from {was} to {now} since the step was compiled, and the captured update depends on it")
        for key, was in spec.fixed:
            if floats.get(key) != was:
                raise ChangedSinceCompiled(
                    f"{where}[{key!r}] changed from {was!r} to {floats.get(key, '<missing>')!r}, which the captured update takes as a "
                    "fixed number (a count it loops over, a threshold, a setting of a fused kernel: foreach=True reads every setting at every call)"
                )
        for key, was in spec.signs:
            now = floats.get(key, "<not a float>")
            if key not in floats or sign(floats[key]) != was:
                raise ChangedSinceCompiled(
                    f"{where}[{key!r}] changed from {_SIGN_WORDS[was]} to {now!r}, and the update skips or runs a whole term on whether it is {_SIGN_WORDS[was]}"
                )


def _not_a_float(where: str, group: dict[str, Any], key: str) -> ChangedSinceCompiled:
    """A number the step read at every call is now of another type: compiled again, where it
    is taken by value (or refused, as at any capture)."""
    return ChangedSinceCompiled(
        f"{where}[{key!r}] is now {_get(group, key)!r} since the step was compiled, not a Python float: the update's "
        "arithmetic on it is its type's, so the step holds its value"
    )


def values(optimizer: torch.optim.Optimizer, names: list[str]) -> list[torch.Tensor]:
    """The graph inputs for these hyperparameters, from the param groups as they are now."""
    groups = optimizer.param_groups
    out = []
    for name in names:
        gi, key = parse_input_name(name)
        out.append(torch.scalar_tensor(read(optimizer, groups, gi, key), dtype=torch.float64))
    return out


def read(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], gi: int, key: str) -> float:
    """The float `groups[gi][key]` now (`groups`: the optimizer's param groups)."""
    try:
        value = _get(groups[gi], key)
    except (KeyError, IndexError) as e:
        raise CaptureError(f"{group_name(optimizer, gi)} has no {key!r} any more; compile a new step") from e
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _not_a_float(group_name(optimizer, gi), groups[gi], key)
    return float(value)
