"""Gradient accumulation across calls: a step that only adds its gradients to those it
finds set, with the loop stepping the optimizer every few calls (the `(i + 1) % accum`
loop). Each call's graph is the one for the gradients set then: none (the first call,
and after zero_grad()), or all (which it takes as inputs and adds to in place)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.capture.train_graph import InputKind
from remat.errors import RematError
from remat.measurement.check import twin
from remat.models import build_model

ACCUMULATE = 3


def _micro_step(model, optimizer, batch):
    loss = model(**batch).loss / ACCUMULATE
    loss.backward()
    return loss.detach()


def _micro_step_of(loss_fn):
    """A step of a built model's loss that only runs backward (half of an update's gradient)."""

    def micro_step(model, optimizer, batch):
        loss = loss_fn(model, batch) / 2
        loss.backward()
        return loss.detach()

    return micro_step


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [build_model("bert-tiny", 8, seed=s).batch for s in range(n)]


def _train(step, model, optimizer, batches, set_to_none: bool = True) -> list[torch.Tensor]:
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(i)  # dropout: the same masks on both sides
        losses.append(step(batch))
        if (i + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return losses


def _same(a: torch.nn.Module, a_opt, b: torch.nn.Module, b_opt) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    for sa, sb in zip(a_opt.state.values(), b_opt.state.values()):
        assert all(torch.equal(x, y) for x, y in zip(sa.values(), sb.values()))


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad", "zero_grad(set_to_none=False)"])
def test_accumulating_over_calls_is_bitwise_with_recomputation_and_the_predicted_peak(set_to_none):
    spec = build_model("bert-tiny", 8)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    (eager, eager_opt), (model, o) = twin(spec.model, opt), twin(spec.model, opt)
    batches = _batches(2 * ACCUMULATE + 1)  # two updates, and gradients left set at the end
    step = remat.compile(_micro_step, model, o, batches[0], memory_budget=0.4)
    losses = _train(step, model, o, batches, set_to_none)
    eager_losses = _train(lambda b: _micro_step(eager, eager_opt, b), eager, eager_opt, batches, set_to_none)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    _same(model, o, eager, eager_opt)
    graphs = list(step._graphs.values())
    assert len(graphs) == 2  # none set, all set: whatever the loop does, two graphs
    taking = [sum(i.kind is InputKind.GRADIENT for i in g.tg.inputs) for g in graphs]
    assert taking == [0, len(list(model.parameters()))]
    for g in graphs:
        report = g.report
        assert report.num_recomputed > 0
        assert report.measured_peak_bytes == report.predicted_peak_bytes <= report.budget_bytes
    # The gradients held from call to call are counted before the step starts.
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert graphs[1].report.persistent_bytes == graphs[0].report.persistent_bytes + grad_bytes


def test_a_step_compiled_after_an_eager_micro_step_takes_the_gradients_that_one_left():
    spec = build_model("bert-tiny", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9)
    (eager, eager_opt), (model, o) = twin(spec.model, opt), twin(spec.model, opt)
    batches = _batches(ACCUMULATE + 1)
    for m, optimizer in ((eager, eager_opt), (model, o)):
        torch.manual_seed(100)
        _micro_step(m, optimizer, batches[0])  # the loop's first micro-step, eager
    step = remat.compile(_micro_step, model, o, batches[1])
    assert step.report is not None and len(step._graphs) == 1
    assert not o.state  # traced twice (the second time with the gradients it finds): no state made ahead left
    assert sum(i.kind is InputKind.GRADIENT for i in next(iter(step._graphs.values())).tg.inputs) > 0
    _train(step, model, o, batches[1:])
    _train(lambda b: _micro_step(eager, eager_opt, b), eager, eager_opt, batches[1:])
    _same(model, o, eager, eager_opt)


def test_a_cuda_graph_of_an_accumulating_step_is_refused_with_what_to_do():
    spec = build_model("bert-tiny", 4)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    with pytest.raises(RematError, match="gradient accumulation across calls.*loop over the micro-batches inside"):
        remat.compile(_micro_step, spec.model, opt, spec.batch, cuda_graph=True)


def _last_micro_step(model, optimizer, batch):
    loss = _micro_step(model, optimizer, batch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_step_that_updates_after_micro_steps_compiled_apart_adds_to_their_gradients():
    """The update in a step of its own, called at every ACCUMULATE-th micro-batch: it ends
    with zero_grad(), so it never leaves gradients for itself, but it finds the micro-steps'
    and adds to them, as eager's does (a graph of its own for that call)."""
    spec = build_model("bert-tiny", 8)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    (eager, eager_opt), (model, o) = twin(spec.model, opt), twin(spec.model, opt)
    batches = _batches(2 * ACCUMULATE)
    micro = remat.compile(_micro_step, model, o, batches[0], memory_budget=0.5)
    last = remat.compile(_last_micro_step, model, o, batches[0], memory_budget=0.5)

    def run(micro, last):
        losses = []
        for i, batch in enumerate(batches):
            torch.manual_seed(i)
            losses.append((last if (i + 1) % ACCUMULATE == 0 else micro)(batch))
        return losses

    losses = run(micro, last)
    eager_losses = run(*(lambda b, f=f: f(eager, eager_opt, b) for f in (_micro_step, _last_micro_step)))
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    _same(model, o, eager, eager_opt)
    assert last.report.measured_peak_bytes == last.report.predicted_peak_bytes
    assert sum(i.kind is InputKind.GRADIENT for i in last._last.tg.inputs) == len(list(model.parameters()))


def test_a_call_whose_held_gradients_put_its_floor_over_the_budget_says_so():
    """A budget in bytes that the first graph just meets: the graph for a call that finds
    the gradients set holds them from its start, so its floor is higher; its error says why."""
    spec = build_model("mlp-deep", 32)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.01)

    micro_step = _micro_step_of(spec.loss_fn)
    with pytest.raises(remat.BudgetError) as refused:
        remat.compile(micro_step, spec.model, opt, spec.batch, memory_budget=0.5)
    step = remat.compile(micro_step, spec.model, opt, spec.batch, memory_budget=refused.value.reach.best)
    step(spec.batch)
    with pytest.raises(remat.BudgetError) as error:
        step(spec.batch)
    grads = sum(1 for p in spec.model.parameters())
    assert any(f"finds {grads} gradients set" in note and "holds them from its start" in note for note in error.value.__notes__)


def test_timing_the_calls_of_an_accumulating_step_times_one_graph():
    """`remat run --check` times a step's call with a stand-in for its graph; each call must
    find the gradients as the first did, or another graph runs (or is compiled) instead."""
    from remat.measurement.call_time import measure_call_time

    spec = build_model("mlp", 16)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.01)

    micro_step = _micro_step_of(spec.loss_fn)
    step = remat.compile(micro_step, spec.model, opt, spec.batch)
    timed = measure_call_time(step, spec.batch, calls=3, steps=2)
    assert len(step._graphs) == 1 and timed.warm_host_seconds > 0 and timed.step_seconds > 0


def test_the_tools_that_measure_one_graph_refuse_a_step_that_accumulates():
    """`remat frontier` and `remat bench` plan or measure one graph over repeated steps."""
    from remat.capture.capture import capture
    from remat.measurement.check import check_one_graph

    spec = build_model("mlp", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.01)

    micro_step = _micro_step_of(spec.loss_fn)
    with pytest.raises(RematError, match="gradient accumulation across calls.*the frontier measures one.*clears the gradients first"):
        check_one_graph(capture(micro_step, spec.model, opt, spec.batch), "the frontier")
    check_one_graph(capture(lambda m, o, b: opt.zero_grad() or micro_step(m, o, b), spec.model, opt, spec.batch), "the frontier")
