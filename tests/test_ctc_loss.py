"""CTC loss with the lengths as tensors (nn.CTCLoss): traced with a shape the trace can
know (ops/ctc_loss.py), bitwise equal to eager's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.ops.ctc_loss import static_shapes


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_the_padded_op_gives_eagers_loss_and_gradient(reduction, zero_infinity):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, 12, generator=g, requires_grad=True)
    targets = torch.randint(1, 12, (4, 9), generator=g)
    input_lengths = torch.tensor([30, 25, 3, 30])  # the third cannot align its target: an infinite loss
    target_lengths = torch.tensor([6, 0, 5, 7])  # shorter than the padding

    def run():
        loss = nn.functional.ctc_loss(x.log_softmax(2), targets, input_lengths, target_lengths, reduction=reduction, zero_infinity=zero_infinity)
        return loss, torch.autograd.grad(loss.sum(), x)[0]

    eager = run()
    with static_shapes():
        padded = run()
    for a, b in zip(eager, padded):  # bitwise, NaN where eager has NaN (an infinite loss's gradient)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


class _Recognizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(8, 32, 3, padding=1), nn.GELU(), nn.Conv1d(32, 32, 3, padding=1), nn.GELU())
        self.head = nn.Linear(32, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).permute(2, 0, 1)).log_softmax(2)  # (time, batch, classes)


def test_a_model_trained_with_ctc_loss_runs_bitwise_under_remat():
    torch.manual_seed(0)
    model = _Recognizer()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(zero_infinity=True)

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        loss = ctc(model(batch["x"]), batch["targets"], batch["input_lengths"], batch["target_lengths"])
        loss.backward()
        optimizer.step()
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 8, 64, generator=g), "targets": torch.randint(1, 12, (16, 20), generator=g),
                "input_lengths": torch.randint(40, 65, (16,), generator=g), "target_lengths": torch.randint(1, 21, (16,), generator=g)}
               for _ in range(4)]  # fmt: skip
    batches[0]["target_lengths"][0] = 20  # the example batch's longest target fills the padding
    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=0.9)
    for b in batches:
        assert torch.equal(step(b), step_fn(ref, ref_opt, b))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes


def test_concatenated_targets_are_refused_saying_to_pad_them():
    from remat.errors import CaptureError

    model = _Recognizer()

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        lp = model(batch["x"])
        loss = nn.functional.ctc_loss(lp, batch["targets"].flatten(), torch.full((2,), lp.shape[0]), torch.tensor([5, 5]))
        loss.backward()
        optimizer.step()
        return loss

    batch = {"x": torch.randn(2, 8, 16), "targets": torch.randint(1, 12, (2, 5))}
    with pytest.raises(CaptureError, match=r"CTC loss on targets given as one concatenated 1-D tensor.*padded to \(batch, longest\)"):
        remat.compile(step_fn, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, memory_budget=None)


def _flattening_step(reduction, extra_read=False):
    """Hugging Face's CTC heads: labels padded with -100, flattened by their mask."""

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        labels = batch["labels"]
        mask = labels >= 0
        lp = model(batch["x"])
        loss = nn.functional.ctc_loss(lp, labels.masked_select(mask), batch["input_lengths"], mask.sum(-1) + batch["more"],
                                      reduction=reduction, zero_infinity=True)  # fmt: skip
        if extra_read == "labels":
            loss = loss + labels.masked_select(mask).float().mean()
        if extra_read == "log-probs":  # a float selection, with a gradient
            loss = loss + lp.masked_select(lp > -2).mean()
        loss.backward()
        optimizer.step()
        return loss

    return step_fn


def _labelled(g, lengths):
    labels = torch.randint(1, 12, (len(lengths), 20), generator=g)
    for row, n in enumerate(lengths):
        labels[row, n:] = -100
    return {"x": torch.randn(len(lengths), 8, 64, generator=g), "labels": labels, "input_lengths": torch.randint(40, 65, (len(lengths),), generator=g),
            "more": torch.zeros(len(lengths), dtype=torch.long)}  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_targets_flattened_by_a_mask_train_bitwise_under_remat(reduction):
    # masked_select's length is the mask's count, a value: traced through a static stand-in.
    torch.manual_seed(0)
    model = _Recognizer()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    batches = [_labelled(g, [20, 3, 0, 11]), _labelled(g, [5, 17, 9, 1]), _labelled(g, [2, 2, 2, 2])]
    step_fn = _flattening_step(reduction)
    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=0.9)
    for b in batches:
        assert torch.equal(step(b), step_fn(ref, ref_opt, b))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    more = _labelled(g, [4, 4, 4, 4])
    more["more"][1] = 1  # lengths that do not add up to the targets: eager's kernel raises, and so does the step
    with pytest.raises(RuntimeError):
        step_fn(ref, ref_opt, more)
    with pytest.raises(RuntimeError, match="sum of the target lengths"):
        step(more)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("read", ["labels", "log-probs"])
def test_a_masked_select_read_by_more_than_ctc_is_refused_naming_its_line(read):
    from remat.errors import CaptureError

    model = _Recognizer()
    batch = _labelled(torch.Generator().manual_seed(0), [3, 5, 7, 9])
    line = {"labels": r"loss = loss \+ labels.masked_select", "log-probs": r"loss = loss \+ lp.masked_select"}[read]
    with pytest.raises(CaptureError, match=r"aten.masked_select.default\), at test_ctc_loss.py, line \d+: " + line):
        remat.compile(_flattening_step("mean", extra_read=read), model, torch.optim.SGD(model.parameters(), lr=0.1), batch, memory_budget=None)
