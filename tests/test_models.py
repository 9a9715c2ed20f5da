"""remat.models: every builder gives a trainable model, deterministically, and bad names fail clearly."""

import math
import time

import pytest
import torch
from torch import nn

from remat.models import (
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    ModelSpec,
    build_model,
    make_optimizer,
    make_train_step,
)

TINY = ("mlp", "mlp-deep", "bert-tiny", "resnet-tiny")


def _leaves(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [batch[k] for k in sorted(batch)]
    return list(batch)


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_one_step(name: str) -> None:
    spec = build_model(name, batch_size=2)
    assert isinstance(spec, ModelSpec) and spec.name == name
    assert spec.model.training and all(m.training for m in spec.model.modules())
    loss = spec.loss_fn(spec.model, spec.batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in spec.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["bert-tiny", "resnet-tiny", "mlp"])
def test_batch_size_one_works(name: str) -> None:
    # resnet-tiny: training-mode BatchNorm needs > 1 value per channel in the last stage.
    spec = build_model(name, batch_size=1)
    spec.loss_fn(spec.model, spec.batch).backward()


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_weights_and_batch(name: str) -> None:
    a, b = build_model(name, 3, seed=7), build_model(name, 3, seed=7)
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    for ta, tb in zip(_leaves(a.batch), _leaves(b.batch), strict=True):
        assert torch.equal(ta, tb)
    c = build_model(name, 3, seed=8)
    assert any(not torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))


def test_batch_shapes_follow_batch_size() -> None:
    x, y = build_model("mlp", 5).batch
    assert x.shape == (5, 1024) and y.shape == (5, 1024)
    bert = build_model("bert-tiny", 4).batch
    assert set(bert) == {"input_ids", "labels"} and bert["input_ids"].shape == (4, 32)
    res = build_model("resnet-tiny", 3).batch
    assert res["pixel_values"].shape[0] == 3 and res["labels"].shape == (3,)


def test_building_does_not_disturb_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model("mlp-deep", 2, seed=5)
    assert torch.equal(torch.rand(4), expected)


def test_bert_uses_eager_attention() -> None:
    assert build_model("bert-tiny", 1).model.config._attn_implementation == "eager"


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt9'.*available models: mlp, mlp-deep, bert"):
        build_model("gpt9", 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_batch_size_rejected(bad) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        build_model("mlp", bad)


def test_missing_cuda_device_rejected() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="not available.*use device='cpu'"):
        build_model("mlp", 2, device="cuda")


def test_optimizers() -> None:
    params = list(nn.Linear(2, 2).parameters())
    sgd = make_optimizer("sgd", params)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.defaults["lr"] == 0.01 and sgd.defaults["momentum"] == 0.9
    adamw = make_optimizer("adamw", params, lr=0.5)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["lr"] == 0.5
    assert make_optimizer("none", params) is None
    assert OPTIMIZER_NAMES == ("sgd", "adamw", "none")


def test_unknown_optimizer_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'adam'.*available optimizers: sgd, adamw, none"):
        make_optimizer("adam", [])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "none"])
def test_train_step_updates_and_clears(opt_name: str) -> None:
    spec = build_model("mlp-deep", 4)
    before = [p.detach().clone() for p in spec.model.parameters()]
    opt = make_optimizer(opt_name, spec.model.parameters())
    loss = make_train_step(spec.loss_fn)(spec.model, opt, spec.batch)
    assert loss.dim() == 0
    changed = any(not torch.equal(b, p) for b, p in zip(before, spec.model.parameters()))
    if opt is None:
        assert not changed and all(p.grad is not None for p in spec.model.parameters())
    else:
        assert changed and all(p.grad is None for p in spec.model.parameters())


def test_zero_grad_first_keeps_this_steps_gradients() -> None:
    spec = build_model("mlp-deep", 4)
    ref = build_model("mlp-deep", 4).model
    spec.loss_fn(ref, spec.batch).backward()  # this iteration's gradients, from a twin
    # lr=0: the step leaves the weights as they are, so every step's gradients equal ref's.
    opt = make_optimizer("sgd", spec.model.parameters(), lr=0.0)
    step = make_train_step(spec.loss_fn, zero_grad_first=True)
    for _ in range(2):  # the second step must not accumulate onto the first's
        step(spec.model, opt, spec.batch)
        for p, r in zip(spec.model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, r.grad)


def test_zero_grad_first_without_optimizer() -> None:
    spec = build_model("mlp", 2)
    step = make_train_step(spec.loss_fn, zero_grad_first=True)
    step(spec.model, None, spec.batch)
    first = [p.grad.clone() for p in spec.model.parameters()]
    step(spec.model, None, spec.batch)
    assert all(torch.equal(a, p.grad) for a, p in zip(first, spec.model.parameters()))


def test_model_names() -> None:
    from remat.cli.common import MODEL_HELP

    assert set(TINY) | {"bert", "resnet152", "gpt-narrow-6", "gpt-narrow-20", "gpt-narrow-60"} == set(MODEL_NAMES)
    assert all(name in MODEL_HELP for name in MODEL_NAMES)


@pytest.mark.parametrize("layers", [6, 20, 60])
def test_gpt_narrow_family_is_deep_and_narrow(layers: int) -> None:
    """The family for measuring planning at scale: depth as named, width 64, one token
    sequence of 64 per sample, and a step that trains."""
    spec = build_model(f"gpt-narrow-{layers}", 2)
    assert len(spec.model.transformer.h) == layers and spec.model.config.n_embd == 64
    assert spec.batch["input_ids"].shape == (2, 64)
    loss = make_train_step(spec.loss_fn)(spec.model, None, spec.batch)
    assert torch.isfinite(loss) and all(p.grad is not None for p in spec.model.parameters())


def test_bert_base_builds() -> None:
    """The full-size BERT is built from its config alone (no download); skip if slow here."""
    start = time.perf_counter()
    spec = build_model("bert", 1)
    if time.perf_counter() - start > 10:
        pytest.skip("building BERT-base took over 10 s on this machine")
    n_params = sum(p.numel() for p in spec.model.parameters())
    assert 105e6 < n_params < 115e6  # BERT-base MLM: ~110M with tied embeddings
    assert spec.batch["input_ids"].shape == (1, 128)
