"""Example models with random weights, their example batches and losses.

Every model is built from a config, never downloaded, so the same code runs on a
machine with no network. Each builder is deterministic in (name, batch_size, seed):
the weights and the batch come from a seeded RNG, inside `torch.random.fork_rng`, so
building a model neither depends on nor disturbs the caller's global RNG stream.
Models come back in training mode (dropout and BatchNorm statistics active), because
that is what remat captures: a training iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MODEL_NAMES",
    "OPTIMIZER_NAMES",
    "Batch",
    "LossFn",
    "ModelSpec",
    "build_model",
    "hf_loss",
    "make_optimizer",
    "make_train_step",
    "mse_loss",
]

Batch = Union[Tensor, tuple, dict[str, Tensor]]
LossFn = Callable[[nn.Module, Any], Tensor]

MODEL_NAMES: tuple[str, ...] = (
    "mlp",
    "mlp-deep",
    "bert",
    "bert-tiny",
    "resnet152",
    "resnet-tiny",
    "gpt-narrow-6",
    "gpt-narrow-20",
    "gpt-narrow-60",
)

OPTIMIZER_NAMES: tuple[str, ...] = ("sgd", "adamw", "none")


@dataclass
class ModelSpec:
    """A model ready to train: the module, one example batch and how to get a loss."""

    name: str
    model: nn.Module
    batch: Batch
    loss_fn: LossFn


# --- losses: module-level functions so specs stay picklable and readable in traces ---


def mse_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Regression loss for the MLPs: batch is (inputs, targets)."""
    x, y = batch
    return F.mse_loss(model(x), y)


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Hugging Face models compute their own loss when `labels` is in the batch."""
    return model(**batch).loss


# --- builders ---------------------------------------------------------------------


def _mlp(widths: list[int]) -> nn.Sequential:
    """Linear layers with a sigmoid between consecutive ones (none after the last).

    An `nn.Sequential`, so that `torch.utils.checkpoint.checkpoint_sequential` (a
    baseline) applies to it directly.
    """
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i > 0:
            layers.append(nn.Sigmoid())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def _build_mlp(widths: list[int], batch_size: int, gen: torch.Generator) -> tuple[nn.Module, Batch, LossFn]:
    model = _mlp(widths)
    x = torch.randn(batch_size, widths[0], generator=gen)
    y = torch.randn(batch_size, widths[-1], generator=gen)
    return model, (x, y), mse_loss


def _build_bert(config_kwargs: dict[str, Any], seq_len: int, batch_size: int, gen: torch.Generator) -> tuple[nn.Module, Batch, LossFn]:
    from transformers import BertConfig, BertForMaskedLM

    # "eager" attention rather than the default "sdpa": it is plain aten ops on every
    # device (matmul, softmax, dropout), so the attention probabilities are an ordinary
    # tensor in the captured graph that the planner can see, size and keep or recompute.
    # With sdpa, what runs depends on device and mode: on CPU in training (dropout > 0)
    # it takes the math path (_safe_softmax + bernoulli_), but in eval mode it runs the
    # fused _scaled_dot_product_flash_attention_for_cpu, and on CUDA fused kernels with
    # their own RNG for dropout and their own saved state (logsumexp, not the probs).
    config = BertConfig(attn_implementation="eager", **config_kwargs)
    model = BertForMaskedLM(config)
    shape = (batch_size, seq_len)
    input_ids = torch.randint(0, config.vocab_size, shape, generator=gen)
    # Every position is a prediction target: simplest, and the loss touches every token.
    labels = torch.randint(0, config.vocab_size, shape, generator=gen)
    return model, {"input_ids": input_ids, "labels": labels}, hf_loss


def _build_gpt_narrow(layers: int, batch_size: int, gen: torch.Generator) -> tuple[nn.Module, Batch, LossFn]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(attn_implementation="eager", **_GPT_NARROW, n_layer=layers)  # eager: see _build_bert
    model = GPT2LMHeadModel(config)
    input_ids = torch.randint(0, config.vocab_size, (batch_size, config.n_positions), generator=gen)
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}, hf_loss


def _build_resnet(config_kwargs: dict[str, Any], image_size: int, batch_size: int, gen: torch.Generator) -> tuple[nn.Module, Batch, LossFn]:
    from transformers import ResNetConfig, ResNetForImageClassification

    # problem_type set up front: otherwise the first forward infers it from the labels'
    # dtype and writes it into the config (a side effect inside the traced step).
    config = ResNetConfig(layer_type="bottleneck", problem_type="single_label_classification", **config_kwargs)
    model = ResNetForImageClassification(config)
    pixel_values = torch.randn(batch_size, config.num_channels, image_size, image_size, generator=gen)
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=gen)
    return model, {"pixel_values": pixel_values, "labels": labels}, hf_loss


_BERT_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=128,
)

# ResNet-152 (He et al. 2016): bottleneck blocks [3, 8, 36, 3], stage widths
# 256..2048, a 64-channel stem. ResNetConfig's defaults already have those widths,
# the stem and bottleneck layers (they are ResNet-50: depths [3, 4, 6, 3]); they are
# spelled out here so that the model does not change if the defaults do.
_RESNET152 = dict(depths=[3, 8, 36, 3], hidden_sizes=[256, 512, 1024, 2048], embedding_size=64, num_labels=1000)
_RESNET_TINY = dict(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=16, num_labels=10)
# The network downsamples by 32: 32×32 images would leave 1×1 maps in the last stage,
# where training-mode BatchNorm fails at batch size 1 (one value per channel). 64×64
# leaves 2×2.
_RESNET_TINY_IMAGE = 64

# Deep, narrow decoders (GPT-2 blocks of width 64): graphs of real-model size, about 500
# nodes per layer with AdamW (6 layers: 3,100 nodes; 20: 9,900; 60: 29,200), whose
# iterations take milliseconds on a CPU. For measuring what planning costs at scale.
_GPT_NARROW = dict(n_embd=64, n_head=2, n_inner=128, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)

_BUILDERS: dict[str, Callable[[int, torch.Generator], tuple[nn.Module, Batch, LossFn]]] = {
    # The μ-TWO course project's example: Linear(1024, 4096) → sigmoid → Linear(4096, 1024).
    "mlp": lambda b, g: _build_mlp([1024, 4096, 1024], b, g),
    # A longer chain of small layers: many candidates for recomputation, cheap to run.
    "mlp-deep": lambda b, g: _build_mlp([256] * 9, b, g),
    "bert": lambda b, g: _build_bert({}, 128, b, g),
    "bert-tiny": lambda b, g: _build_bert(_BERT_TINY, 32, b, g),
    "resnet152": lambda b, g: _build_resnet(_RESNET152, 224, b, g),
    "resnet-tiny": lambda b, g: _build_resnet(_RESNET_TINY, _RESNET_TINY_IMAGE, b, g),
    "gpt-narrow-6": lambda b, g: _build_gpt_narrow(6, b, g),
    "gpt-narrow-20": lambda b, g: _build_gpt_narrow(20, b, g),
    "gpt-narrow-60": lambda b, g: _build_gpt_narrow(60, b, g),
}
assert tuple(_BUILDERS) == MODEL_NAMES


def _check_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} is not available on this machine (no CUDA GPU found); use device='cpu'")
    return dev


def build_model(name: str, batch_size: int, seed: int = 0, device: str | torch.device = "cpu") -> ModelSpec:
    """Build model `name` with random weights, in training mode, and a batch of `batch_size`.

    The same (name, batch_size, seed) always gives the same weights and batch.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(MODEL_NAMES)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    dev = _check_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # weight init (nn.init, Hugging Face) uses the global RNG
        gen = torch.Generator().manual_seed(seed)
        model, batch, loss_fn = _BUILDERS[name](batch_size, gen)
    model.to(dev).train()
    return ModelSpec(name=name, model=model, batch=_to_device(batch, dev), loss_fn=loss_fn)


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


# --- training step and optimizers ---------------------------------------------------


def make_train_step(loss_fn: LossFn, zero_grad_first: bool = False) -> Callable[[nn.Module, "torch.optim.Optimizer | None", Batch], Tensor]:
    """The plain training step remat captures: forward, backward, optimizer step.

    By default gradients are cleared after the step, as in a usual loop. With
    `zero_grad_first=True` they are cleared before the forward instead, so after the
    step each parameter's `.grad` holds this iteration's gradient and tests can compare
    it. With no optimizer the model's own `zero_grad()` always runs first: the step
    leaves this iteration's gradients for the caller, never adds to the last ones.
    """

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Batch) -> Tensor:
        if zero_grad_first or optimizer is None:
            if optimizer is not None:
                optimizer.zero_grad()
            else:
                model.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            if not zero_grad_first:
                optimizer.zero_grad()
        return loss

    return train_step


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer | None]] = {
    "sgd": lambda params, **kw: torch.optim.SGD(params, **{"lr": 0.01, "momentum": 0.9, **kw}),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **{"lr": 1e-3, **kw}),
    "none": lambda params, **kw: None,
}
assert tuple(_OPTIMIZERS) == OPTIMIZER_NAMES


def make_optimizer(name: str, params: Iterable[Tensor] | Iterable[dict], **kw: Any) -> torch.optim.Optimizer | None:
    """Optimizer by name: "sgd" (lr 0.01, momentum 0.9), "adamw" (lr 1e-3), "none".

    Keyword arguments override the defaults. "none" gives None (forward and backward only).
    """
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; available optimizers: {', '.join(OPTIMIZER_NAMES)}")
    return _OPTIMIZERS[name](params, **kw)
