"""Optimizers that are not torch's (a library's, the user's own) train bitwise like eager:
the state their first step makes is made ahead by a step on a copy, a Python number the
state holds (a step count) is read at every call and counted after each run, and a state
tensor the step replaces is written into the one it replaces; what cannot be followed is
refused by name."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import remat
from remat.errors import CaptureError
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model, make_train_step
from tests.support.traces import counted


class _IntStepAdam(torch.optim.Optimizer):
    """Adam as many libraries write it: the step count a Python int, made at the first step,
    and a warm-up branch on it."""

    def __init__(self, params, lr=1e-2, warmup=3):
        super().__init__(params, {"lr": lr, "warmup": warmup})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                lr = group["lr"] if state["step"] > group["warmup"] else group["lr"] * 0.1
                correction = 1 - math.pow(0.9, state["step"])
                p.addcdiv_(state["m"], (state["v"] / (1 - 0.999 ** state["step"])).sqrt().add_(1e-8), value=-lr / correction)


class _EachParameter(torch.optim.Optimizer):
    """An optimizer whose step calls `update(state, p, lr)` for each parameter."""

    def __init__(self, params, update):
        super().__init__(params, {"lr": 0.05})
        self.update = update

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.update(self.state[p], p, group["lr"])


def _functional(state, p, lr):
    """Momentum written functionally: the state tensor replaced at every step; a buffer
    only another setting uses held as None."""
    if "m" not in state:
        state["m"] = torch.zeros_like(p)
        state["compensation"] = None
    state["m"] = state["m"] * 0.9 + p.grad
    p.add_(state["m"], alpha=-lr)


def _plain(state, p, lr):
    """No state at all."""
    p.add_(p.grad, alpha=-lr)


class _GroupStep(torch.optim.Optimizer):
    """SGD with a bias-corrected momentum whose step count is kept in the param group, made
    there at the first step, as pytorch_optimizer's and timm's optimizers keep it."""

    def __init__(self, params, lr=0.05, warmup=0):
        super().__init__(params, {"lr": lr})
        self.warmup = warmup

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = 0
            group["step"] += 1
            correction = 1 - 0.9 ** group["step"]
            if self.warmup and group["step"] <= self.warmup:  # a warm-up on the count
                correction *= 10
            for p in group["params"]:
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.add_(state["m"], alpha=-group["lr"] / correction)


def _trains_bitwise(make_optimizer, steps=6, budget=0.85, between=None):
    spec = build_model("mlp-deep", 16)
    step_fn = make_train_step(spec.loss_fn)
    # Each side builds its own optimizer, as a user would.
    eager_model, model = twin(spec.model, None)[0], twin(spec.model, None)[0]
    eager_opt, opt = make_optimizer(eager_model.parameters()), make_optimizer(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = remat.compile(step_fn, model, opt, spec.batch, memory_budget=budget, profile_runs=1)
        result = check_against_eager(step_fn, eager_model, eager_opt, model, opt, step, spec.batch, steps=steps, between_steps=between)
    assert result.match, result.summary()
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    said = [str(w.message) for w in caught if str(w.message).startswith("remat")]
    return step, opt, said


def test_an_int_step_count_is_read_at_every_call_and_counted_after_each_run(monkeypatch):
    """The state is made by remat (no eager step first); the count's warm-up branch costs a
    graph per side, not one per value, and a state loaded mid-run (new dicts) is the one read.
    Each parameter's count is branched on by the same line: the first trace to trip on one
    decides them all, so a capture traces a few times whatever the number of parameters (16 here)."""
    traces = counted(monkeypatch)

    def reload(i, model, opt):
        if i == 1:
            opt.load_state_dict(opt.state_dict())

    step, opt, said = _trains_bitwise(_IntStepAdam, steps=7, between=reload)
    assert len(step._graphs) == 2 and not said, said
    assert len(traces) <= 4 * len(step._graphs), len(traces)  # a trace per parameter would be 19 a graph
    assert {type(st["step"]) for st in opt.state.values()} == {int} and {st["step"] for st in opt.state.values()} == {7}


def test_a_state_tensor_the_step_replaces_is_written_into_the_one_it_replaces():
    step, opt, said = _trains_bitwise(lambda params: _EachParameter(params, _functional))
    assert len(step._graphs) == 1 and not said, said


def test_a_count_kept_in_the_param_group_is_counted_after_each_run():
    """Made at the first step, read as a hyperparameter is, and counted after each run. A
    branch on it fixes its value (a graph per value, as a count a loop runs over)."""
    step, opt, said = _trains_bitwise(_GroupStep)
    assert len(step._graphs) == 1 and not said, said
    assert opt.param_groups[0]["step"] == 6 and type(opt.param_groups[0]["step"]) is int
    step, opt, said = _trains_bitwise(lambda params: _GroupStep(params, warmup=2), steps=4)
    assert opt.param_groups[0]["step"] == 4 and any("param_groups[0]['step'] changed" in m for m in said), said


def test_an_optimizer_without_state_trains():
    step, opt, _ = _trains_bitwise(lambda params: _EachParameter(params, _plain))
    assert not opt.state and len(step._graphs) == 1


@pytest.mark.parametrize(
    "settings",
    [
        {"lr": 1e-3, "scale_parameter": False, "relative_step": False, "warmup_init": False},  # Hugging Face's Trainer's
        {"lr": None, "scale_parameter": False, "relative_step": True, "warmup_init": True, "beta1": 0.9},
    ],
    ids=["trainer", "relative-step-beta1"],
)
def test_transformers_adafactor_trains_bitwise(settings):
    """Adafactor makes its state at its first step: `step` and `RMS` Python ints, RMS then a
    tensor. The first graph reads RMS as a number and leaves a tensor there; the second takes
    it as state: two graphs, and the relative step's `min(1e-6 * step, 1 / sqrt(step))`
    follows the count (one side for all of these steps)."""
    optimization = pytest.importorskip("transformers.optimization")
    step, opt, said = _trains_bitwise(lambda params: optimization.Adafactor(params, **settings))
    assert len(step._graphs) == 2 and not said, said
    assert {type(st["RMS"]) for st in opt.state.values()} == {torch.Tensor}


def _from_the_gradient(state, p, lr):
    if "m" not in state:
        state["m"] = p.grad.clone()  # as SGD's first momentum: remat cannot make it ahead
    p.add_(state["m"], alpha=-lr)


def _reshaping(state, p, lr):
    state.setdefault("m", torch.zeros_like(p))
    state["m"] = p.grad.flatten()


def _deleting(state, p, lr):
    state.setdefault("m", torch.zeros_like(p))
    del state["m"]


@pytest.mark.parametrize(
    "update, said",
    [
        (_from_the_gradient, r"_EachParameter's first step makes its state \('m'\) from the gradient.*Run one eager training step"),
        (_reshaping, r"_EachParameter's state 0.weight\['m'\] of shape \(\d+, \d+\).* to one of shape \(\d+,\)"),
        (_deleting, r"_EachParameter's state 0.weight\['m'\] is a tensor, and the optimizer's step deletes it"),
    ],
    ids=["from-the-gradient", "reshaping", "deleting"],
)
def test_what_the_optimizers_state_cannot_do_is_refused_by_name(update, said):
    spec = build_model("mlp-deep", 8)
    with pytest.raises(CaptureError, match=said):
        remat.compile(make_train_step(spec.loss_fn), spec.model, _EachParameter(spec.model.parameters(), update), spec.batch, profile_runs=1)


def test_tensors_kept_under_another_key_than_a_parameter_are_refused():
    spec = build_model("mlp-deep", 8)
    opt = _EachParameter(spec.model.parameters(), lambda state, p, lr: p.add_(p.grad, alpha=-lr))
    opt.state["k"] = torch.zeros(())  # MADGRAD's step count
    with pytest.raises(CaptureError, match=r"_EachParameter keeps tensors in its state under 'k', not under a parameter"):
        remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1)


def test_adafactor_scaling_by_its_parameters_rms_is_refused_naming_the_line_and_the_settings_that_train():
    optimization = pytest.importorskip("transformers.optimization")
    spec = build_model("mlp-deep", 8)
    opt = optimization.Adafactor(spec.model.parameters(), lr=None)  # its defaults: scale_parameter=True
    with pytest.raises(CaptureError, match=r"branches on .*\(transformers/optimization.py, line \d+: param_scale = max\(.*scale_parameter=False and relative_step=False"):
        remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1)


def test_a_grad_scaler_with_numbers_in_the_optimizers_state_is_refused():
    spec = build_model("mlp-deep", 8)
    opt = _IntStepAdam(spec.model.parameters())
    scaler = torch.amp.GradScaler("cpu")

    def scaled(model, optimizer, batch):
        optimizer.zero_grad()
        loss = spec.loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    with pytest.raises(CaptureError, match=r"GradScaler may skip this optimizer's update, and it keeps Python numbers .*_IntStepAdam.state\["):
        remat.compile(scaled, spec.model, opt, spec.batch, profile_runs=1)


def test_a_twin_keeps_the_settings_an_optimizer_holds_as_attributes_but_not_a_wrapper_of_its_step():
    """`remat run --check` trains a twin in eager: a library optimizer's own attributes go with it."""
    model = torch.nn.Linear(4, 4)
    opt = _GroupStep(model.parameters(), warmup=2)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # wraps opt.step, bound to opt
    copied_model, copied = twin(model, opt)
    assert copied.warmup == 2 and "step" not in vars(copied)
    assert copied.param_groups[0]["params"][0] is next(copied_model.parameters())
