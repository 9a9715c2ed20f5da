"""The model's train/eval flags, and its parameters' requires_grad, around a captured step.

Dropout and BatchNorm are traced in the mode each module is in, so a step runs only in
the modes it was traced in. Two things keep that from refusing ordinary loops: each
module's flag is put back as it was after a trace (a BatchNorm kept in eval mode inside a
model in training mode stays so), and the train()/eval() calls train_step makes itself are
recorded while it is traced and made again after each run. When the first of them sets
the whole model's mode before any forward (`model.train()` first thing in train_step), the
mode the loop left does not matter.

A step may set requires_grad itself: a GAN's generator turn freezes the discriminator
(`set_requires_grad(netD, False)`), which the next turn thaws. The trace follows that on
its stand-ins for the parameters; the flags it leaves other than it found are set on the
parameters after each run, as eager leaves them. The flags a step starts from are checked
at each call as any loop's (a change compiles the step again).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from remat.errors import CaptureError
from remat.capture.train_graph import TrainGraph


def check_mode(modules: list[torch.nn.Module], tg: TrainGraph) -> None:
    """Refuse a step whose modules (the model's, in order) are not in the modes it was
    traced in (unless it sets them itself)."""
    training = tuple(m.training for m in modules)
    if training != tg.call.training and not tg.call.sets_mode_first:
        mode = "training" if tg.call.training and tg.call.training[0] else "eval"
        raise CaptureError(
            f"the model's train/eval mode differs from when the step was compiled (in {mode} mode): dropout and "
            f"BatchNorm behave as they did then. Call model.{'train' if mode == 'training' else 'eval'}() before "
            "the step (e.g. after evaluating; or first thing in train_step), or compile a step for the other mode."
        )


def make_mode_calls(model: torch.nn.Module, tg: TrainGraph) -> None:
    """After a run: the flags train_step's own train()/eval() calls leave, as in eager."""
    for name, mode in tg.call.mode_calls:
        model.get_submodule(name).train(mode)


def traced_modes(model: torch.nn.Module, calls: list[tuple[str, bool, bool]]) -> tuple[tuple[bool, ...], tuple[tuple[str, bool], ...], bool]:
    """What a TrainGraph records: each module's flag the step was traced from, its own calls
    as (module name, mode), and whether the first sets the whole model's mode before any forward."""
    training = tuple(m.training for m in model.modules())
    return training, tuple((name, mode) for name, mode, _ in calls), bool(calls) and calls[0][0] == "" and calls[0][2]


def requires_grad_set(traced_params: dict[str, torch.Tensor], trainable: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """After the step's code has run on the traced parameters (their flags set from
    `trainable` before it): the flags it changed, as (name, flag)."""
    return tuple((n, p.requires_grad) for n, p in traced_params.items() if p.requires_grad != (n in trainable))


def set_requires_grad(params: dict[str, torch.Tensor], tg: TrainGraph) -> None:
    """After a run: the requires_grad flags train_step's own code leaves, as in eager."""
    for name, flag in tg.call.requires_grad_set:
        params[name].requires_grad_(flag)


def put_back_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Each module's train/eval flag as it was (not model.train(flag), which would set one
    flag on all: a BatchNorm kept in eval mode in a model in training mode stays so)."""
    for module, training in modes:
        module.training = training


@contextlib.contextmanager
def recorded_mode_calls(model: torch.nn.Module, calls: list[tuple[str, bool, bool]]) -> Iterator[None]:
    """While train_step is traced: each train()/eval() call it makes on the model or one of its
    modules, as (module name, mode, whether no forward ran before it). The outermost call only:
    train() sets the submodules' flags by calling their train() in turn."""
    names = {id(m): n for n, m in model.named_modules()}
    real_train = torch.nn.Module.train
    state = {"depth": 0, "forwards": 0}
    calls.clear()

    def train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        if state["depth"] == 0 and id(self) in names:
            calls.append((names[id(self)], bool(mode), state["forwards"] == 0))
        state["depth"] += 1
        try:
            return real_train(self, mode)
        finally:
            state["depth"] -= 1

    def count_forward(module: torch.nn.Module, args: Any) -> None:
        state["forwards"] += 1

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count_forward)
    torch.nn.Module.train = train  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.train = real_train  # type: ignore[method-assign]
        hook.remove()
