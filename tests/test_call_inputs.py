"""The quick gather of a call's inputs (capture/call_inputs.py): while nothing the full
gather checks has changed, a call reuses what the last one read; each change below, made
between two calls that took the quick way, must be seen: trained like eager where the
full gather follows it, refused with the full gather's own error where it does not."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any, Callable

import pytest
import torch

import remat
from remat.errors import CaptureError
from remat.measurement.check import compare_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    return loss


def _pair() -> tuple[Any, ...]:
    model = _model()
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    batches = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    step = remat.compile(_train_step, model, opt, batches[0], memory_budget=None, profile_runs=1)
    for batch in batches[:2]:  # the second call gathers the quick way
        assert torch.equal(step(batch), _train_step(eager, eager_opt, batch))
    return step, model, opt, eager, eager_opt, batches


def _first_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return opt.state[opt.param_groups[0]["params"][0]]


def _reloaded(opt: torch.optim.Optimizer) -> None:
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # every state tensor a new one


def _doubled(g: torch.Tensor) -> torch.Tensor:
    return g * 2


FOLLOWED: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], Any]] = {
    "a state tensor replaced": lambda m, o: _first_state(o).__setitem__("exp_avg", _first_state(o)["exp_avg"] * 0.5),
    "the optimizer's state reloaded": lambda m, o: _reloaded(o),
    "the optimizer's state cleared": lambda m, o: o.state.clear(),
    "a buffer replaced": lambda m, o: setattr(m[1], "running_mean", m[1].running_mean + 1),
    "a parameter changed in place": lambda m, o: m[0].weight.data.mul_(0.5),
    "the learning rate changed": lambda m, o: o.param_groups[0].__setitem__("lr", 5e-3),
    # Compiled again (errors.ChangedSinceCompiled), with a warning.
    "a parameter frozen": lambda m, o: m[0].weight.requires_grad_(False),
    "a group's list of parameters replaced": lambda m, o: o.param_groups[0].__setitem__("params", o.param_groups[0]["params"][1:]),
    "the same parameters in another order": lambda m, o: o.param_groups[0]["params"].reverse(),
    "an optimizer flag changed": lambda m, o: o.param_groups[0].__setitem__("maximize", True),
    "weight decay set to zero": lambda m, o: o.param_groups[0].__setitem__("weight_decay", 0.0),
    "a gradient hook added": lambda m, o: m[3].bias.register_hook(_doubled),
}


@pytest.mark.parametrize("change", list(FOLLOWED))
def test_a_change_between_quick_calls_trains_like_eager(change: str) -> None:
    step, model, opt, eager, eager_opt, batches = _pair()
    FOLLOWED[change](model, opt)
    FOLLOWED[change](eager, eager_opt)
    for batch in batches[2:]:
        assert torch.equal(step(batch), _train_step(eager, eager_opt, batch))
    assert compare_state(eager, eager_opt, model, opt) == []


REFUSED: dict[str, tuple[Callable[[torch.nn.Module, torch.optim.Optimizer], Any], str]] = {
    "the model put in eval mode": (lambda m, o: m.eval(), "train/eval mode"),
    "a parameter replaced": (lambda m, o: setattr(m[0], "bias", torch.nn.Parameter(torch.zeros(16))), "not a parameter of the model"),
    "a layer replaced": (lambda m, o: m.__setitem__(3, torch.nn.Linear(16, 4)), "not a parameter of the model"),
}


@pytest.mark.parametrize("change", list(REFUSED))
def test_a_change_between_quick_calls_is_refused_as_the_full_gather_refuses_it(change: str) -> None:
    step, model, opt, *_, batches = _pair()
    make, message = REFUSED[change]
    make(model, opt)
    with pytest.raises(CaptureError, match=message):
        step(batches[2])


def test_calls_that_change_nothing_reuse_what_the_last_one_read() -> None:
    step, model, opt, eager, eager_opt, batches = _pair()
    last = step.compiled_for(batches[2]).call_inputs.last
    for batch in batches[2:]:
        step(batch)
    assert step.compiled_for(batches[2]).call_inputs.last is last
    opt.param_groups[0]["params"].reverse()  # the same parameters in another order: the full gather again, and a new graph
    with pytest.warns(UserWarning, match="holds other parameters than when the step was compiled"):
        step(batches[2])


def test_two_batch_shapes_in_turn_each_take_the_quick_way() -> None:
    """A graph's first gather does not make the other graphs gather in full again; a change
    does (their last inputs may hold what the user let go)."""
    step, model, opt, eager, eager_opt, batches = _pair()
    short = [b[:4] for b in batches]
    for batch in [short[0], batches[2], short[1], batches[3]]:
        assert torch.equal(step(batch), _train_step(eager, eager_opt, batch))
    lasts = [step.compiled_for(b).call_inputs.last for b in (short[0], batches[0])]
    for batch in [short[2], batches[2], short[3], batches[3]]:
        assert torch.equal(step(batch), _train_step(eager, eager_opt, batch))
    assert all(step.compiled_for(b).call_inputs.last is last for b, last in zip((short[0], batches[0]), lasts))
    _reloaded(opt)
    _reloaded(eager_opt)
    step(batches[0])  # gathered in full again: the other shape's last inputs are let go
    _train_step(eager, eager_opt, batches[0])
    assert step.compiled_for(short[0]).call_inputs is None
    assert torch.equal(step(short[1]), _train_step(eager, eager_opt, short[1]))
    assert compare_state(eager, eager_opt, model, opt) == []


def test_gradients_left_as_zeros_are_not_kept_alive_by_remat() -> None:
    """A step that ends with zero_grad(set_to_none=False) leaves zeros, which the next call
    knows as its own; once the user drops them they are freed."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    batch = torch.randn(6, 8)
    step = remat.compile(train_step, model, opt, batch, memory_budget=None, profile_runs=1)
    step(batch)
    left = weakref.ref(model[0].weight.grad)
    step(batch)  # the zeros it finds are those it left: no look at their values
    assert left() is None or left() is not model[0].weight.grad
    left = weakref.ref(model[0].weight.grad)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert left() is None
    model[0].weight.grad = torch.ones_like(model[0].weight)  # as an eager backward would leave it
    with pytest.raises(CaptureError, match="nonzero gradient"):
        step(batch)
