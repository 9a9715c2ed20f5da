"""A scheduler's rates read inside train_step (`scheduler.get_last_lr()`): returned, printed
and logged as eager reads them, after the step's own scheduler steps; other uses refused."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.errors import CaptureError


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _updated(model, opt, batch, sched):
    """A step's loss, its update made and its scheduler stepped after it."""
    opt.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    sched.step()
    return loss


def _run(make_step, steps: int = 5, compiled: bool = True, outside: bool = False):
    """Each step's return value and printed text, the list it logs to, the parameters,
    and the number of graphs: eager's step, or remat's compiled from it."""
    model, opt, sched = _setup()
    logged: list[float] = []
    step = make_step(sched, logged)
    call = step
    if compiled:
        remat_step = remat.compile(step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
        call = lambda m, o, b: remat_step(b)  # noqa: E731
    results = []
    for i in range(steps):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out = call(model, opt, _batch(i))
        results.append((out, printed.getvalue()))
        if outside:
            sched.step()
    graphs = len(remat_step._graphs) if compiled else 0
    return results, logged, [p.detach().clone() for p in model.parameters()], graphs


def _stepped_after_update(sched, logged):
    def train_step(model, opt, batch):
        loss = _updated(model, opt, batch, sched)
        lr = sched.get_last_lr()[0]
        print("lr", lr)
        logged.append(lr)
        return {"loss": loss.detach(), "lr": lr, "rates": sched.get_last_lr()}

    return train_step


def _assert_same(make_step, outside: bool = False):
    got, got_logged, got_params, graphs = _run(make_step, outside=outside)
    want, want_logged, want_params, _ = _run(make_step, compiled=False, outside=outside)
    for (out, printed), (eager_out, eager_printed) in zip(got, want):
        assert torch.equal(out["loss"], eager_out["loss"])
        assert out["lr"] == eager_out["lr"] and type(out["lr"]) is float
        assert out.get("rates") == eager_out.get("rates")
        assert printed == eager_printed
    assert got_logged == want_logged
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    assert graphs == 1
    return [out["lr"] for out, _ in got]


def test_a_rate_read_after_the_schedulers_step_in_the_step_is_the_next_one_returned_printed_and_logged():
    rates = _assert_same(_stepped_after_update)
    assert rates[:3] == pytest.approx([0.2 / 3, 0.1, 0.1])  # the warm-up's next rates, not the traced one


def test_a_rate_read_in_the_step_of_a_scheduler_the_loop_steps_is_the_one_at_each_call():
    def make_step(sched, logged):
        def train_step(model, opt, batch):
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            return {"loss": loss.detach(), "lr": sched.get_last_lr()[0]}

        return train_step

    assert _assert_same(make_step, outside=True)[:3] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1])


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_a_rate_read_after_a_scheduler_step_before_the_update_is_the_one_the_update_used():
    def make_step(sched, logged):
        def train_step(model, opt, batch):
            opt.zero_grad()
            sched.step()
            lr = sched.get_last_lr()[0]
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            logged.append(lr)
            return {"loss": loss.detach(), "lr": lr}

        return train_step

    _assert_same(make_step)


@pytest.mark.parametrize(
    "use, match",
    [
        (lambda loss, lr: loss.detach() * lr, r"uses LambdaLR.get_last_lr\(\)\[0\] \(rmul\)"),
        (lambda loss, lr: print(f"lr {lr:.3e}"), r"uses LambdaLR.get_last_lr\(\)\[0\] \(format\).*pass it to print"),
        (lambda loss, lr: loss.detach() if lr > 0.05 else loss.detach() * 2, r"\(gt\)"),
    ],
    ids=["arithmetic", "formatted", "compared"],
)
def test_another_use_of_a_rate_is_refused_naming_it(use, match):
    model, opt, sched = _setup()

    def train_step(model, opt, batch):
        loss = _updated(model, opt, batch, sched)
        return use(loss, sched.get_last_lr()[0])

    before = copy.deepcopy(sched.state_dict())
    with pytest.raises(CaptureError, match=match):
        remat.compile(train_step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert sched.state_dict() == before  # the scheduler was not stepped by the trace


def test_a_rate_read_between_two_steps_of_its_scheduler_is_refused():
    model, opt, sched = _setup()

    def train_step(model, opt, batch):
        opt.zero_grad()
        sched.step()
        lr = sched.get_last_lr()[0]
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        sched.step()
        return {"loss": loss.detach(), "lr": lr}

    with pytest.raises(CaptureError, match=r"reads LambdaLR.get_last_lr\(\)\[0\] after 1 of its 2 scheduler.step\(\) calls"):
        remat.compile(train_step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)


def test_a_schedulers_count_read_after_its_step_is_the_next_one_and_a_branch_on_it_refused():
    def make_step(sched, logged):
        def train_step(model, opt, batch):
            loss = _updated(model, opt, batch, sched)
            print("epoch", sched.last_epoch)
            logged.append(sched.last_epoch)
            return {"loss": loss.detach(), "lr": sched.get_last_lr()[0], "epoch": sched.last_epoch}

        return train_step

    _assert_same(make_step)
    got, logged, _, _ = _run(make_step)
    assert [out["epoch"] for out, _ in got] == logged == [1, 2, 3, 4, 5] and got[0][1] == "epoch 1\n"

    model, opt, sched = _setup()

    def branches(model, opt, batch):
        loss = _loss(model, batch)
        return loss * 2 if sched.last_epoch % 2 == 0 else loss

    with pytest.raises(CaptureError, match=r"uses LambdaLR.last_epoch \(mod\).*a count the step keeps itself"):
        remat.compile(branches, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
