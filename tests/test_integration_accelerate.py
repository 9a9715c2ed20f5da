"""A plain Accelerate loop through remat.compile: the prepared (wrapped) optimizer,
scheduler and dataloader, accelerator.backward and clip_grad_norm_, bitwise like the same
loop in eager; gradient accumulation as micro-batches inside the step, across calls by hand, or with
`accelerator.accumulate` inside the step or around it, bitwise like eager's
`accelerator.accumulate`."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

import remat  # noqa: E402
from remat.errors import CaptureError  # noqa: E402

_CONFIG = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=300, num_labels=3)


def _batches(n: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 300, (8, 64), generator=g), "labels": torch.randint(0, 3, (8,), generator=g)} for _ in range(n)]


def _prepared(accumulation_steps: int = 1):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation_steps)
    torch.manual_seed(0)
    model = BertForSequenceClassification(_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def _state(model, optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for s in optimizer.state.values() for t in s.values()]


def _loop(compiled: bool):
    accelerator, model, optimizer, loader, scheduler = _prepared()

    def train_step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach(), norm

    # An example batch made apart: iterating the loader draws from the global generator (dropout's).
    step = remat.compile(train_step, model, optimizer, _batches(1)[0], memory_budget=0.6) if compiled else None
    seen = []
    for batch in loader:
        seen.append(step(batch) if compiled else train_step(model, optimizer, batch))
        scheduler.step()
    return seen, _state(model, optimizer), step


def test_accelerate_loop_bitwise():
    eager, eager_state, _ = _loop(False)
    ran, state, step = _loop(True)
    assert type(step.optimizer).__name__ == "AcceleratedOptimizer"
    assert step.report.num_recomputed > 0 and len(step._graphs) == 1
    assert all(torch.equal(a, b) for x, y in zip(eager, ran) for a, b in zip(x, y))
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


def _accumulated_as_documented() -> list[torch.Tensor]:
    accelerator, model, optimizer, loader, scheduler = _prepared(accumulation_steps=2)
    for batch in loader:  # eager, as Accelerate's docs write it
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return _state(model, optimizer)


def test_accumulation_inside_the_step_matches_accumulate():
    eager_state = _accumulated_as_documented()

    accelerator, model, optimizer, loader, scheduler = _prepared(accumulation_steps=2)

    def train_step(model, optimizer, micro_batches):
        losses = []
        for batch in micro_batches:
            losses.append(model(**batch).loss)
            accelerator.backward(losses[-1])  # divides by gradient_accumulation_steps
        optimizer.step()
        optimizer.zero_grad()
        return [loss.detach() for loss in losses]

    batches = list(loader)
    pairs = [batches[i : i + 2] for i in range(0, len(batches), 2)]
    step = remat.compile(train_step, model, optimizer, pairs[0], memory_budget=0.8)
    for pair in pairs:
        step(pair)
        scheduler.step()
    state = _state(model, optimizer)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


def _accumulating_step(accelerator, inside: bool = True):
    """A step as Accelerate's docs write one, inside `accumulate` (or not: the loop enters it)."""

    def train_step(model, optimizer, batch):
        with accelerator.accumulate(model) if inside else contextlib.nullcontext():
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()

    return train_step


def test_accumulation_across_calls_by_hand_matches_accumulate():
    """The micro-step compiled alone (accelerator.backward divides by the accumulation
    steps), the prepared optimizer and scheduler stepped every second call by the loop."""
    eager_state = _accumulated_as_documented()
    accelerator, model, optimizer, loader, scheduler = _prepared(accumulation_steps=2)

    def micro_step(model, optimizer, batch):
        loss = model(**batch).loss
        accelerator.backward(loss)
        return loss.detach()

    step = remat.compile(micro_step, model, optimizer, _batches(1)[0], memory_budget=0.6)
    for i, batch in enumerate(loader):
        step(batch)
        if i % 2 == 1:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    state = _state(model, optimizer)
    assert len(step._graphs) == 2 and all(g.report.measured_peak_bytes == g.report.predicted_peak_bytes for g in step._graphs.values())
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


@pytest.mark.parametrize("where", ["inside the step", "around the step"])
def test_accumulate_as_documented_matches_eager(where):
    """`accumulate()` as Accelerate's docs write it, inside the compiled step or around it in
    the loop, with a prepared loader of 6 batches and 4 accumulation steps over 2 epochs: the
    optimizer steps at the 4th call, and at the loader's last batch, where the count starts
    again. Which branch a call takes is in the key (inside: the count's branch; around: the
    `sync_gradients` flag the trace read), so each branch has its graph, bitwise like eager,
    the count and the scheduler as eager leaves them."""

    def run(compiled: bool):
        accelerator, model, optimizer, loader, scheduler = _prepared(accumulation_steps=4)
        inside = where == "inside the step"
        body = _accumulating_step(accelerator, inside)

        def train_step(model, optimizer, batch):
            loss = body(model, optimizer, batch)
            if accelerator.sync_gradients:
                scheduler.step()
            return loss

        step = remat.compile(train_step, model, optimizer, _batches(1)[0], memory_budget=0.8) if compiled else None
        losses, counts = [], []
        for _ in range(2):
            for batch in loader:
                with contextlib.nullcontext() if inside else accelerator.accumulate(model):
                    losses.append(step(batch) if compiled else train_step(model, optimizer, batch))
                counts.append(accelerator.step)
        return losses, counts, _state(model, optimizer), scheduler.scheduler.state_dict(), step

    eager, eager_counts, eager_state, eager_scheduler, _ = run(False)
    ran, counts, state, scheduler, step = run(True)
    assert counts == eager_counts == [1, 2, 3, 4, 5, 0] * 2
    assert all(torch.equal(a, b) for a, b in zip(ran, eager)) and len(ran) == len(eager) == 12
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert scheduler == eager_scheduler
    # Accumulating with no gradients found (calls 1, 5) and with some (2, 3); stepping with some (4, and 6: the reset).
    # Around the step, compile() captured one more: stepping with none, as the flag was before the first accumulate().
    ran_graphs = [g for g in step._graphs.values() if g.report.measured_peak_bytes is not None]
    assert len(step._graphs) == (3 if where == "inside the step" else 4) and len(ran_graphs) == 3
    assert all(g.report.measured_peak_bytes == g.report.predicted_peak_bytes for g in ran_graphs)
    # The attribute lookups wrapped to record the trace's reads are the classes' own again.
    assert not {"__getattribute__", "__setattr__"} & (vars(GradientState).keys() | vars(Accelerator).keys())


def test_accumulate_of_one_step_inside_the_step_counts_as_eager_does():
    """Accelerate's examples wrap each step in `accelerator.accumulate(model)` even without
    accumulation: it counts the calls in `accelerator.step` (a library's number the step
    changes). Traced as this step and the next find it, the graph is the same, so remat adds
    to it after each run as eager's step does."""

    def run(compiled: bool):
        accelerator, model, optimizer, loader, scheduler = _prepared(accumulation_steps=1)
        train_step = _accumulating_step(accelerator)
        step = remat.compile(train_step, model, optimizer, _batches(1)[0], memory_budget=0.8) if compiled else None
        assert accelerator.step == 0  # compiling left the count as it was
        losses = []
        for batch in _batches():  # not the prepared loader: its last batch resets the count (see docs/limits.md)
            losses.append(step(batch) if compiled else train_step(model, optimizer, batch))
            scheduler.step()
        return losses, _state(model, optimizer), accelerator.step

    eager, eager_state, eager_count = run(False)
    ran, state, count = run(True)
    assert count == eager_count == len(eager)
    assert all(torch.equal(a, b) for a, b in zip(ran, eager))
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


def test_a_count_that_moves_otherwise_than_remat_knows_is_refused(monkeypatch):
    """remat predicts accumulate()'s branch from Accelerate's code: a version that counts
    otherwise is refused at capture, not followed wrongly."""
    from remat.capture.state import library_objects
    from remat.integrations import accelerate as integration

    monkeypatch.setitem(library_objects._COUNTED_BRANCHES, (Accelerator, "step"), lambda a: (a.step + 2, integration.next_sync(a)[1]))
    accelerator, model, optimizer, _, _ = _prepared(accumulation_steps=2)
    with pytest.raises(CaptureError, match=r"moves accelerator .*step, a count Accelerator keeps, from 0 to 1, where remat expected 2.*counts otherwise"):
        remat.compile(_accumulating_step(accelerator), model, optimizer, _batches(1)[0], memory_budget=0.8)(_batches(1)[0])
    assert accelerator.step == 0


def test_the_prepared_schedulers_rate_stepped_and_read_in_the_step_is_eagers():
    """Accelerate's loop with the prepared scheduler stepped inside the step and its rate
    printed with `accelerator.print` and returned: read through Accelerate's wrapper after
    the step's scheduler step, as eager reads it, bitwise."""

    def run(compiled: bool):
        accelerator, model, optimizer, loader, scheduler = _prepared()

        def train_step(model, optimizer, batch):
            optimizer.zero_grad()
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            accelerator.print("lr", scheduler.get_last_lr()[0])
            return {"loss": loss.detach(), "lr": scheduler.get_last_lr()[0]}

        step = remat.compile(train_step, model, optimizer, _batches(1)[0], memory_budget=0.8) if compiled else None
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            seen = [step(batch) if compiled else train_step(model, optimizer, batch) for batch in loader]
        return seen, printed.getvalue(), _state(model, optimizer), step

    eager, eager_printed, eager_state, _ = run(False)
    ran, printed, state, step = run(True)
    assert [r["lr"] for r in ran] == [e["lr"] for e in eager] and ran[0]["lr"] != ran[-1]["lr"]
    assert printed == eager_printed and printed.count("lr") == 6
    assert all(torch.equal(r["loss"], e["loss"]) for r, e in zip(ran, eager)) and len(step._graphs) == 1
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))
