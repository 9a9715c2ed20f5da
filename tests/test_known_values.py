"""Sizes made from the batch's values (a mask's nonzero, indexing by a boolean mask, unique)
are fixed at the example batch's and checked first thing at every call: the step trains
bitwise like eager on batches that give the same size, and one that gives another is
refused before anything changes. A size from values the batch alone does not make (the
model's outputs, a random draw, a batch tensor written in place) is refused as before, but
for a bincount given its minlength (a metric's class counts): its bins are fixed there and
every call checks that no value reaches it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.errors import CaptureError
from remat.errors import BatchValueChanged
from remat.ops.known_values import SIZE_CHECK_OP
from tests.support.architectures import run_model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 5))


def _selected_loss_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    kept = batch["y"] != -100  # a loss over the labelled rows only, selected by a mask
    loss = nn.functional.cross_entropy(logits[kept], batch["y"][kept])
    loss.backward()
    optimizer.step()
    return loss


def _batch(seed: int, unlabelled: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (32,), generator=g)
    y[unlabelled] = -100
    return {"x": torch.randn(32, 16, generator=g), "y": y}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [v.clone() for s in optimizer.state.values() for v in s.values()]


def test_a_selection_by_a_batch_mask_trains_bitwise_and_a_changed_count_is_refused_before_any_change() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    eager_opt.load_state_dict(optimizer.state_dict())
    batches = [_batch(s, [1, 7, 20]) for s in range(4)]  # other rows unlabelled, the same count
    step = remat.compile(_selected_loss_step, model, optimizer, batches[0], memory_budget=0.9)
    for b in batches:
        torch.manual_seed(1)
        ours = step(b)
        torch.manual_seed(1)
        theirs = _selected_loss_step(eager_model, eager_opt, b)
        assert torch.equal(ours, theirs)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes

    before, rng = _state(model, optimizer), torch.get_rng_state()
    with pytest.raises(BatchValueChanged, match=r"test_known_values.py, line \d+: loss = .*makes 28 elements .* holds 29.*before it changed anything"):
        step(_batch(9, [2, 3, 4, 5]))
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer)))
    assert torch.equal(rng, torch.get_rng_state())


def test_the_size_check_runs_before_the_forward_pass() -> None:
    from remat.capture.capture import capture

    model = _model()
    tg = capture(_selected_loss_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0, [3]))
    ops = [n for n in tg.gm.graph.nodes if n.op == "call_function"]
    checks = [i for i, n in enumerate(ops) if n.target is SIZE_CHECK_OP]
    assert checks and all(c.args[3] is True for c in (ops[i] for i in checks))
    first_matmul = next(i for i, n in enumerate(ops) if "mm" in str(n.target))
    assert max(checks) < first_matmul


def _size_from_outputs_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    confident = logits.max(1).values > 0  # the model's values, not the batch's
    loss = logits[confident].sum() + logits.sum()
    loss.backward()
    optimizer.step()
    return loss


def _size_after_write_step(model, optimizer, batch):
    optimizer.zero_grad()
    out = model(batch["x"])
    y = batch["y"].clone().float()
    y.add_(out.detach()[:, 0])  # written in place with the model's values: no longer the batch's alone
    loss = out[(y > 0).nonzero()[:, 0]].sum()
    loss.backward()
    optimizer.step()
    return loss


def _size_from_random_step(model, optimizer, batch):
    optimizer.zero_grad()
    keep = torch.rand(32) > 0.5
    loss = model(batch["x"])[keep].sum()
    loss.backward()
    optimizer.step()
    return loss


def _size_after_known_write_step(model, optimizer, batch):
    optimizer.zero_grad()
    y = batch["y"].clone()
    y[y == -100] = 0  # a write of known values: made on the real tensor too
    y.add_(1)
    loss = model(batch["x"])[(y > 1).nonzero()[:, 0]].sum()
    loss.backward()
    optimizer.step()
    return loss


def test_a_write_in_place_of_known_values_is_followed() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    batch = _batch(0, [3, 4])
    step = remat.compile(_size_after_known_write_step, model, optimizer, batch, memory_budget=None)
    torch.manual_seed(1)
    ours = step(batch)
    torch.manual_seed(1)
    assert torch.equal(ours, _size_after_known_write_step(eager_model, eager_opt, batch))
    assert torch.equal(batch["y"], _batch(0, [3, 4])["y"])  # the user's batch is not written


@pytest.mark.parametrize("step_fn", [_size_from_outputs_step, _size_after_write_step, _size_from_random_step])
def test_a_size_the_batch_alone_does_not_make_is_refused_naming_its_line(step_fn) -> None:
    model = _model()
    with pytest.raises(CaptureError, match=r"shape that depends on tensor values.*test_known_values.py, line \d+"):
        remat.compile(step_fn, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0, [3]), memory_budget=None)


def test_barts_classifier_pools_at_its_end_of_sequence_tokens_bitwise() -> None:
    # BART checks with unique_consecutive that every row has as many <eos>, then takes the
    # hidden state at each (`hidden_states[eos_mask, :]`): two sizes from the batch's values.
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(0)
    config = BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, num_labels=3, eos_token_id=2, pad_token_id=1,
                        attn_implementation="eager")
    model = BartForSequenceClassification(config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 16), generator=g)
    ids[:, -1] = 2
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 3, (4,), generator=g)}
    row = run_model("bart", model, batch, "tiny", budget=0.5, steps=3, pairs=0, profile_runs=1)
    assert row.status == "ok" and row.grads_match, row.error
    assert row.measured_peak_bytes == row.predicted_peak_bytes


class _MultiCropWrapper(nn.Module):
    """DINO's: the crops grouped by size with unique_consecutive of a constant, then a list
    sliced by its counts, each group through the backbone at once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


def _crops_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(batch["crops"]).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_a_constant_the_step_makes_sizes_its_ops_and_slices_a_list_as_in_eager() -> None:
    model = _MultiCropWrapper()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    batches = [{"crops": [torch.randn(2, 3, 32, 32, generator=g) for _ in range(2)] + [torch.randn(2, 3, 16, 16, generator=g) for _ in range(4)]} for g in gens]
    step = remat.compile(_crops_step, model, optimizer, batches[0], memory_budget=None)
    for b in batches:
        assert torch.equal(step(b), _crops_step(eager_model, eager_opt, b))
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    assert not any(n.target is SIZE_CHECK_OP for n in step._last.gm.graph.nodes)  # constants need no check


def _class_balanced_step(model, optimizer, batch):
    optimizer.zero_grad()
    counts = torch.bincount(batch["y"], minlength=5)  # the batch's own class counts weigh its loss
    weight = counts.sum() / (counts.clamp_min(1) * counts.numel())
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], weight=weight.float())
    loss.backward()
    optimizer.step()
    return loss


def test_a_bincount_of_the_batchs_labels_is_fixed_at_its_bins_and_a_label_past_them_is_refused_first() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    batches = [_batch(s, []) for s in range(4)]
    step = remat.compile(_class_balanced_step, model, optimizer, batches[0], memory_budget=0.9)
    for b in batches:
        torch.manual_seed(1)
        ours = step(b)
        torch.manual_seed(1)
        assert torch.equal(ours, _class_balanced_step(eager_model, eager_opt, b))
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    checks = [n for n in step._last.gm.graph.nodes if n.target is SIZE_CHECK_OP]
    assert checks and all(n.args[3] is True for n in checks)  # on the batch alone: first thing
    before = _state(model, optimizer)
    wider = _batch(9, [])
    wider["y"][3] = 6  # eager would count 7 classes
    with pytest.raises(BatchValueChanged, match=r"test_known_values.py, line \d+: counts = .*makes 7 elements .* holds 5.*before it changed anything"):
        step(wider)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer)))


def _predicted_class_counts_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = nn.functional.cross_entropy(logits, batch["y"])
    loss.backward()
    optimizer.step()
    predicted = torch.bincount(logits.argmax(1), minlength=5)  # values the model makes: bins fixed at minlength
    return loss, predicted


def test_a_bincount_of_the_models_predictions_holds_minlength_bins_and_a_value_past_them_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    batches = [_batch(s, []) for s in range(3)]
    step = remat.compile(_predicted_class_counts_step, model, optimizer, batches[0], memory_budget=None)
    for b in batches:
        torch.manual_seed(1)
        ours = step(b)
        torch.manual_seed(1)
        theirs = _predicted_class_counts_step(eager_model, eager_opt, b)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))

    def too_few_bins(model, optimizer, batch):
        loss, _ = _predicted_class_counts_step(model, optimizer, batch)
        return loss, torch.bincount(model(batch["x"]).argmax(1), minlength=2)  # 5 classes, 2 bins asked

    with pytest.raises(BatchValueChanged, match=r"line \d+: return loss, torch.bincount.* makes 5 elements, where the compiled step holds 2\. .*minlength, 2, .*a value of 2 or more did"):
        few = remat.compile(too_few_bins, model, optimizer, batches[0], memory_budget=None)  # its profile runs the step
        for b in batches:
            few(b)


def _branching_step(model, optimizer, batch):
    optimizer.zero_grad()
    out = model(batch["x"])
    if (batch["w"] > 0).any().item():  # a branch on the batch's values that goes on either way
        out = out * batch["w"].unsqueeze(1)
    loss = out.pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_a_branch_the_batch_decides_takes_its_side_and_another_side_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(32, 16, generator=g), "w": torch.rand(32, generator=g)} for _ in range(3)]
    step = remat.compile(_branching_step, model, optimizer, batches[0], memory_budget=None)
    for b in batches:
        torch.manual_seed(1)
        ours = step(b)
        torch.manual_seed(1)
        assert torch.equal(ours, _branching_step(eager_model, eager_opt, b))
    before = _state(model, optimizer)
    with pytest.raises(BatchValueChanged, match=r"on a value of the batch, at test_known_values.py, line \d+: if \(batch\[.w.\] > 0\).*; it was True for the batch the step was compiled with"):
        step({"x": torch.randn(32, 16), "w": -torch.rand(32)})
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer)))


def test_longformers_global_attention_branch_is_taken_as_the_batch_decides(monkeypatch) -> None:
    # `is_global_attn = is_index_global_attn.flatten().any().item()`, then `if is_global_attn:`
    # in every layer: none is global in a masked-LM batch without a global attention mask.
    # Each layer branches at the same four lines: decided in the first layer, the second's
    # are held the same way without tracing both sides again.
    from transformers import LongformerConfig, LongformerForMaskedLM

    from tests.support.traces import counted

    traces = counted(monkeypatch)

    torch.manual_seed(0)
    config = LongformerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=80, attention_window=[8, 8], pad_token_id=1, attn_implementation="eager")
    model = LongformerForMaskedLM(config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 32), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(3, 100, (2, 32), generator=g)}
    row = run_model("longformer", model, batch, "tiny", budget=0.5, steps=3, pairs=0, profile_runs=1)
    assert row.status == "ok" and row.grads_match, row.error
    assert row.measured_peak_bytes == row.predicted_peak_bytes
    assert len(traces) <= 10, len(traces)  # each side of each layer's four branches: 17
