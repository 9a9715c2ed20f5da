"""What a user would otherwise pick: the training steps remat is compared with.

Every baseline prepares *its own copy* of the model (it may patch the model's forward)
and gives back a training step with the signature of `remat.models.make_train_step`'s:
`train_step(model, optimizer, batch) -> loss` (DESIGN.md, "Baselines a user would
otherwise pick"). A model a baseline cannot handle raises `NotSupported` with the reason,
which the benchmark records as a result rather than a crash.

- `hf`: Hugging Face `gradient_checkpointing_enable()`: `torch.utils.checkpoint` around
  every block (use_reentrant=False);
- `sequential`: `torch.utils.checkpoint.checkpoint_sequential` with √n segments over the
  model's block sequence (`block_sequence`);
- `compile`: `torch.compile` (inductor) with
  `torch._functorch.config.activation_memory_budget`; its times include kernel fusion
  (at budget 1: torch.compile without checkpointing);
- `hf-compile`: Hugging Face's per-block checkpointing under `torch.compile`.

(`remat-inductor` in a bench's list is remat itself with `backend="inductor"`, at each budget.)
"""

from __future__ import annotations

import itertools
import math
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from remat.errors import RematError
from remat.models import LossFn, make_train_step

TrainStep = Callable[[nn.Module, Any, Any], torch.Tensor]

BASELINES: tuple[str, ...] = ("hf", "sequential", "compile", "hf-compile", "remat-inductor")


class NotSupported(RematError):
    """This baseline does not apply to this model; the message says why."""


# ---------------------------------------------------------------------- HF per block


def hf_checkpointing(model: nn.Module, loss_fn: LossFn) -> TrainStep:
    """Enable Hugging Face's per-block checkpointing on `model` (in place)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise NotSupported(f"{type(model).__name__} is not a Hugging Face model (no gradient_checkpointing_enable())")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):  # what transformers does itself under checkpointing, saying so at every run
        config.use_cache = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except ValueError as e:  # "ResNetForImageClassification does not support activation checkpointing."
        raise NotSupported(f"gradient_checkpointing_enable() refused: {e}") from None
    return make_train_step(loss_fn)


# ---------------------------------------------------------------------- √n segments


class _Bound(nn.Module):
    """One block with its extra arguments bound, so it takes and returns one tensor."""

    def __init__(self, block: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.block = block
        self.args, self.kwargs = args, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def block_sequence(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The model's chain of blocks, and where it is: what checkpoint_sequential runs over.

    BERT: the encoder layers. ResNet: the bottleneck layers of all stages, flattened.
    An nn.Sequential (mlp, mlp-deep): its own children.
    """
    if isinstance(model, nn.Sequential):
        return list(model), "the model's nn.Sequential"
    bert = getattr(model, "bert", None)
    if bert is not None and hasattr(getattr(bert, "encoder", None), "layer"):
        return list(bert.encoder.layer), "bert.encoder.layer"
    resnet = getattr(model, "resnet", None)
    if resnet is not None and hasattr(getattr(resnet, "encoder", None), "stages"):
        return [layer for stage in resnet.encoder.stages for layer in stage.layers], "resnet.encoder.stages[*].layers"
    raise NotSupported(f"no block sequence known for {type(model).__name__}: block_sequence() knows nn.Sequential, BERT and ResNet")


def sqrt_segments(n: int) -> int:
    return max(1, min(n, round(math.sqrt(n))))


def sequential_checkpointing(model: nn.Module, loss_fn: LossFn, segments: int | None = None) -> TrainStep:
    """Run the model's block sequence under checkpoint_sequential (√n segments by default).

    Patches the forward of the module that owns the sequence (on this copy of the model
    only): the rest of the model (embeddings, head, loss) runs as before.
    """
    blocks, where = block_sequence(model)
    k = segments or sqrt_segments(len(blocks))

    def run(x: torch.Tensor, bound: list[nn.Module]) -> torch.Tensor:
        return checkpoint_sequential(nn.Sequential(*bound), k, x, use_reentrant=False)

    if isinstance(model, nn.Sequential):
        model.forward = types.MethodType(lambda self, x: run(x, blocks), model)  # type: ignore[method-assign]
    elif where == "bert.encoder.layer":
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        def bert_encoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None, use_cache=None, **kwargs):  # noqa: E501
            bound = [
                _Bound(layer, (attention_mask, encoder_hidden_states), dict(encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values, **kwargs))
                for layer in blocks
            ]
            return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=run(hidden_states, bound))

        model.bert.encoder.forward = types.MethodType(bert_encoder_forward, model.bert.encoder)
    else:  # ResNet
        from transformers.modeling_outputs import BaseModelOutputWithNoAttention

        def resnet_encoder_forward(self, hidden_state, output_hidden_states=False, return_dict=True):
            if output_hidden_states:
                raise NotSupported("checkpoint_sequential baseline: output_hidden_states is not supported")
            out = run(hidden_state, blocks)
            return BaseModelOutputWithNoAttention(last_hidden_state=out) if return_dict else (out,)

        model.resnet.encoder.forward = types.MethodType(resnet_encoder_forward, model.resnet.encoder)
    step = make_train_step(loss_fn)
    step.segments = k  # type: ignore[attr-defined]
    step.blocks = len(blocks)  # type: ignore[attr-defined]
    return step


# ---------------------------------------------------------------------- torch.compile

_fresh = itertools.count()


def compiled_checkpointing(model: nn.Module, loss_fn: LossFn, budget: float, backend: str = "inductor", fullgraph: bool = True) -> TrainStep:
    """torch.compile the forward + loss, with AOTAutograd's partitioner at `budget`.

    The budget is read when the graph is partitioned, i.e. at the first call, so every
    call runs under it. Each variant compiles a function with its *own* code object:
    dynamo caches compiled code per code object, and two variants at different budgets
    would otherwise share (and pick) each other's entries. fullgraph=True by default, so a
    graph break is an error (recorded) rather than silently shared resumed frames.
    """
    import torch._functorch.config as functorch_config

    if not (0 < budget <= 1):
        raise ValueError(f"activation_memory_budget must be in (0, 1], got {budget}")
    ns: dict[str, Any] = {"_loss_fn": loss_fn}
    name = f"compiled_loss_{next(_fresh)}"
    exec(f"def {name}(model, batch):\n    return _loss_fn(model, batch)\n", ns)  # noqa: S102 - a fresh code object
    compiled = torch.compile(ns[name], backend=backend, fullgraph=fullgraph)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any) -> torch.Tensor:
        with functorch_config.patch(activation_memory_budget=budget):
            loss = compiled(model, batch)
            loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        return loss

    return train_step


def make_baseline(name: str, model: nn.Module, loss_fn: LossFn, budget: float | None = None, **kw: Any) -> TrainStep:
    """The baseline `name` on `model` (prepared in place): "hf", "sequential" or "compile"."""
    if name == "hf":
        return hf_checkpointing(model, loss_fn)
    if name == "sequential":
        return sequential_checkpointing(model, loss_fn, **kw)
    if name == "compile":
        if budget is None:
            raise ValueError("the compile baseline needs a budget fraction")
        return compiled_checkpointing(model, loss_fn, budget, **kw)
    if name == "hf-compile":  # graph breaks allowed: Hugging Face's code logs a warning inside
        hf_checkpointing(model, loss_fn)
        return compiled_checkpointing(model, loss_fn, 1.0, fullgraph=False, **kw)
    raise ValueError(f"unknown baseline {name!r}; available baselines: {', '.join(BASELINES)}")
