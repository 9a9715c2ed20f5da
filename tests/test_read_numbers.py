"""Floats the loop changes between steps: read at every call as graph inputs after their first
change (one more compile, then none), or constants of the graph where the step branches on
them (a compile per value, as before)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

import remat
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model, make_optimizer
from remat.capture.train_graph import InputKind


@dataclass
class _Settings:
    aux_weight: float = 0.0
    threshold: float = 0.0


SETTINGS = _Settings()


def _step_with(loss_of):
    """A training step on bert-tiny's masked-LM output whose loss is `loss_of(out)`."""

    def step(model, opt, batch):
        opt.zero_grad()
        loss = loss_of(model(**batch))
        loss.backward()
        opt.step()
        return loss

    return step


def _with_aux(out):
    """The loss plus an auxiliary term whose weight the loop anneals (a KL or a
    load-balancing weight), as a user writes it."""
    return out.loss + SETTINGS.aux_weight * out.logits.float().pow(2).mean()


def _switched(out):
    """An auxiliary term the loop switches off with a zero weight: a branch on the sign."""
    return _with_aux(out) if SETTINGS.aux_weight > 0 else out.loss


def _branching(out):
    # A branch on the float beyond its sign: the graph can only hold one side.
    return out.loss + out.logits.float().abs().mean() if SETTINGS.threshold > 0.15 else out.loss


def _as_tensor(out):
    return out.loss * torch.tensor(1.0 + SETTINGS.aux_weight)  # a use a symbol cannot take


_annealed_step = _step_with(_with_aux)
_switched_step = _step_with(_switched)
_branching_step = _step_with(_branching)
_as_tensor_step = _step_with(_as_tensor)


def _compiled(step, budget):
    spec = build_model("bert-tiny", 4)
    opt = make_optimizer("adamw", spec.model.parameters())
    model, o = twin(spec.model, opt)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, model, o, spec.batch, memory_budget=budget, profile_runs=1)
    return compiled, model, o, eager_model, eager_opt, spec.batch


@pytest.fixture(autouse=True)
def _settings_put_back():
    yield
    SETTINGS.aux_weight, SETTINGS.threshold = 0.0, 0.0


def test_a_weight_annealed_at_every_step_compiles_once_more_and_trains_bitwise_under_a_plan(monkeypatch):
    compiled, model, o, eager_model, eager_opt, batch = _compiled(_annealed_step, 0.5)
    assert compiled.report.num_recomputed > 0
    compiles = []
    original = compiled._compile
    monkeypatch.setattr(compiled, "_compile", lambda b: compiles.append(1) or original(b))

    def anneal(i, m, opt):
        SETTINGS.aux_weight = 0.01 * (i + 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile is announced: the weight is not a constant any more
        result = check_against_eager(_annealed_step, eager_model, eager_opt, model, o, compiled, batch, steps=5, between_steps=anneal)
    assert result.match, result.summary()
    assert len(compiles) == 1 and len(compiled._graphs) == 1
    tg = compiled._last.tg
    assert [i.name for i in tg.inputs if i.kind is InputKind.NUMBER] == ["global SETTINGS.aux_weight"]
    assert compiled.report.num_recomputed > 0
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes


def test_a_weight_compared_with_zero_keeps_its_sign_and_compiles_again_only_when_the_sign_changes(monkeypatch):
    compiled, model, o, eager_model, eager_opt, batch = _compiled(_switched_step, None)
    compiles = []
    original = compiled._compile
    monkeypatch.setattr(compiled, "_compile", lambda b: compiles.append(1) or original(b))

    def switch(i, m, opt):
        SETTINGS.aux_weight = [0.1, 0.2, 0.0, 0.3, 0.0, 0.0][i]  # the weight for step i + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = check_against_eager(_switched_step, eager_model, eager_opt, model, o, compiled, batch, steps=6, between_steps=switch)
    assert result.match, result.summary()
    # Positive (the first change: the weight becomes an input, its sign known), then zero
    # (a graph holding 0.0); 0.3 and the later zeros reuse those.
    assert len(compiles) == 2 and len(compiled._graphs) == 2
    assert compiled._signed == {"global SETTINGS.aux_weight"} and not compiled._constant


@pytest.mark.parametrize("step", [_branching_step, _as_tensor_step], ids=["branch", "torch.tensor"])
def test_a_float_the_step_branches_on_or_makes_a_tensor_of_stays_a_constant_compiled_per_value(step):
    compiled, model, o, eager_model, eager_opt, batch = _compiled(step, None)

    def change(i, m, opt):
        SETTINGS.threshold = SETTINGS.aux_weight = [0.2, 0.3, 0.2, 0.2][i]  # after step i

    with pytest.warns(UserWarning, match="changed since the step was compiled"):
        result = check_against_eager(step, eager_model, eager_opt, model, o, compiled, batch, steps=4, between_steps=change)
    assert result.match, result.summary()
    assert not compiled._last.tg.call.numbers and compiled._constant
    assert len(compiled._graphs) == 2  # 0.2 and 0.3 (0.0's was dropped when it was tried as an input); 0.2 again reuses its graph
