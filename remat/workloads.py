"""What every command trains: a model, its optimizer, an example batch and a train_step.

`--model` takes three forms, all resolved here:
- a built-in name (`bert`, `resnet152`, ...; see `remat.models`);
- `package.module:function`, the user's own factory. It is called as
  `function(batch_size=B)` (with `device=` and `seed=` too where it accepts them) and
  returns `(model, optimizer, batch, train_step)`, or a dict with those keys;
- `hf:<model_type>`, any Hugging Face `transformers` architecture, built offline from
  its default config with random weights, e.g. `hf:gpt2`. Config fields may follow,
  `hf:llama:num_hidden_layers=2,hidden_size=256`, for architectures whose defaults
  are too large for the machine.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from remat.errors import CaptureError, UsageError
from remat.models import MODEL_NAMES, OPTIMIZER_NAMES, Batch, LossFn, build_model, hf_loss, make_optimizer, make_train_step
from remat.capture.optimizers import as_one


def check_device(device: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UsageError(f"unknown device {device!r}; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("CUDA was requested but no CUDA device is present; use --device cpu")
    return device


def check_positive(value: int, what: str) -> int:
    if value < 1:
        raise UsageError(f"{what} must be at least 1, got {value}")
    return value


def check_names(model: str, optimizer: str) -> None:
    """Refuse an unknown --model or --optimizer, naming what there is."""
    try:
        check_name(model)
    except WorkloadError as e:
        raise UsageError(str(e)) from None
    if optimizer not in OPTIMIZER_NAMES:
        raise UsageError(f"unknown optimizer {optimizer!r}; available optimizers: {', '.join(OPTIMIZER_NAMES)}")


def check_arguments(model: str, batch_size: int, optimizer: str, device: str) -> None:
    """Refuse bad names and sizes in a blink, before a large model is built."""
    check_names(model, optimizer)
    check_positive(batch_size, "batch size")
    check_device(device)


class WorkloadError(ValueError):
    """A --model that cannot be loaded; the message says why and what to do."""


@dataclass
class Workload:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    batch: Batch
    train_step: Callable[[nn.Module, Any, Any], Any]
    # The loss alone, for baselines that rebuild the step around it (HF checkpointing,
    # checkpoint_sequential); None for a factory, whose step is the user's own.
    loss_fn: LossFn | None


def is_factory(name: str) -> bool:
    return ":" in name and not name.startswith("hf:")


def check_name(name: str) -> None:
    """Refuse a --model that has none of the three forms, before anything is built."""
    if name in MODEL_NAMES or name.startswith("hf:") or re.fullmatch(r"[\w.]+:\w+", name):
        return
    raise WorkloadError(
        f"unknown model {name!r}; use one of {', '.join(MODEL_NAMES)}, hf:<model_type> (a transformers "
        "architecture, e.g. hf:gpt2), or package.module:function (your own factory)"
    )


def load(
    name: str,
    batch_size: int,
    optimizer: str = "sgd",
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    zero_grad_first: bool = False,
) -> Workload:
    """The workload `--model name` stands for. `optimizer` and `zero_grad_first` apply to
    built-in and hf: models; a factory brings its own optimizer and step."""
    check_name(name)
    if is_factory(name):
        return _from_factory(name, batch_size, seed, device)
    if name.startswith("hf:"):
        model, batch = build_hf(name[3:], batch_size, seed=seed, device=device)
        loss_fn: LossFn = hf_loss
    else:
        spec = build_model(name, batch_size, seed=seed, device=device)
        model, batch, loss_fn = spec.model, spec.batch, spec.loss_fn
    opt = make_optimizer(optimizer, model.parameters())
    return Workload(name, model, opt, batch, make_train_step(loss_fn, zero_grad_first=zero_grad_first), loss_fn)


# ---------------------------------------------------------------------- factories


def _from_factory(name: str, batch_size: int, seed: int, device: str | torch.device) -> Workload:
    module_name, func_name = name.rsplit(":", 1)
    if os.getcwd() not in sys.path:  # as `python -m` would: a factory next to the user is found
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise WorkloadError(f"cannot import {module_name!r} for --model {name}: {type(e).__name__}: {e}") from e
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise WorkloadError(f"{module_name} has no function {func_name!r} (--model {name})")
    accepted = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = {"batch_size": batch_size}
    kwargs.update({k: v for k, v in (("device", str(device)), ("seed", seed)) if k in accepted})
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            made = factory(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"the factory {name} failed: {type(e).__name__}: {e}") from e
    keys = ("model", "optimizer", "batch", "train_step")
    if isinstance(made, dict):
        missing = [k for k in keys if k not in made]
        if missing:
            raise WorkloadError(f"the factory {name} returned a dict without {', '.join(missing)}; it must hold {', '.join(keys)}")
        made = tuple(made[k] for k in keys)
    if not isinstance(made, (tuple, list)) or len(made) != 4:
        raise WorkloadError(f"the factory {name} must return (model, optimizer, batch, train_step) or a dict with those keys, got {type(made).__name__}")
    model, opt, batch, step = made
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"the factory {name} returned a {type(model).__name__} as the model, not a torch.nn.Module")
    try:
        as_one(opt)  # one optimizer, a list of them, or None
    except CaptureError as e:
        raise WorkloadError(f"the factory {name} returned an optimizer remat cannot take: {e}") from None
    if not callable(step):
        raise WorkloadError(f"the factory {name} returned a {type(step).__name__} as train_step, not a function")
    return Workload(name, model, opt, batch, step, None)


# ---------------------------------------------------------------------- transformers

# Heads tried in order: the first whose mapping knows the model type gives the model
# and the kind of batch it trains on.
_HEADS = (
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked"),  # first: encoders (bert) also have a causal head
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "classify"),
)
_SEQ_LEN = 128


def _fields(text: str) -> list[str]:
    """`text` split at the commas outside brackets: `depths=[1,1],hidden_sizes=[32,64]`."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [item for item in (*items, text[start:]) if item]


def _config_value(text: str) -> Any:
    """One field's value: a number, true/false, a list in brackets of such values (quotes
    optional: `attn_layers=[local,lsh]`), or else the text itself."""
    text = text.strip()
    if text[:1] in "[(":
        if text[-1:] != {"[": "]", "(": ")"}[text[0]]:
            raise ValueError(text)
        items = [_config_value(item) for item in _fields(text[1:-1])]
        return items if text[0] == "[" else tuple(items)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _config_overrides(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in _fields(text):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise WorkloadError(f"config fields are key=value,key=value (a list in brackets: depths=[1,1]); got {item!r}")
        try:
            out[key] = _config_value(value)
        except ValueError:
            raise WorkloadError(f"config field {key}: {value!r} has an unclosed bracket; a list is written [1,1] or [local,lsh]") from None
    return out


def build_hf(spec: str, batch_size: int, *, seed: int = 0, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A transformers model of type `spec` ("gpt2", "llama:num_hidden_layers=2") with
    random weights, in training mode, and a random batch with labels."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    model_type, _, fields = spec.partition(":")
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        close = [t for t in configuration_auto.CONFIG_MAPPING_NAMES if model_type and model_type in t][:8]
        raise WorkloadError(
            f"transformers {transformers.__version__} has no model type {model_type!r}"
            + (f"; did you mean one of {', '.join(close)}?" if close else "; e.g. hf:gpt2, hf:bert, hf:vit, hf:t5")
        )
    for mapping, kind in _HEADS:
        class_name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(class_name, (tuple, list)):  # several heads of one kind (DeiT's with and without its teacher)
            class_name = class_name[0] if class_name else None
        if class_name:
            break
    else:
        raise WorkloadError(f"{model_type} has no causal-LM, masked-LM, seq2seq, image- or sequence-classification head to train")
    # "eager" attention: plain aten ops on every device (see remat.models._build_bert).
    # Mixture-of-experts layers as batched matmuls: the default grouped matmul's shape
    # function accepts only bfloat16 (as its CUDA kernel), so a float32 model on a GPU
    # could not be traced with it.
    kwargs: dict[str, Any] = {"attn_implementation": "eager", "experts_implementation": "batched_mm"}
    if kind in ("image", "classify"):
        # Set up front: otherwise the first forward writes it into the config, inside the step.
        kwargs["problem_type"] = "single_label_classification"
    kwargs.update(_config_overrides(fields))
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # noqa: BLE001 - a field's value the config refuses
        raise WorkloadError(f"transformers could not build a {model_type} config from these fields ({type(e).__name__}: {e})") from e
    if kind == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0  # needed to shift the labels right
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, class_name)(config)
        batch = _hf_batch(config, kind, batch_size, gen)
    except Exception as e:  # noqa: BLE001 - the config's fields are the user's: say which model they broke
        raise WorkloadError(
            f"transformers could not build {class_name} from this config ({type(e).__name__}: {e}); check the config "
            f"fields given after hf:{model_type}: (sizes that must divide each other, token ids within vocab_size)"
        ) from e
    dev = torch.device(device)
    model.to(dev).train()
    return model, {k: v.to(dev) for k, v in batch.items()}


_IMAGE_SIZE = 224


def _hf_batch(config: Any, kind: str, batch_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if kind == "image":
        vision = getattr(config, "vision_config", None) or config  # a model of two towers (CLIP, SigLIP): its image tower's
        size = getattr(vision, "image_size", _IMAGE_SIZE)  # a model that takes any size has none (SegFormer)
        size = size if isinstance(size, int) else size[0]
        return {
            "pixel_values": torch.randn(batch_size, vision.num_channels, size, size, generator=gen),
            "labels": torch.randint(0, config.num_labels, (batch_size,), generator=gen),
        }
    vocab = config.vocab_size
    # A limit of -1 or 0 means none (XLNet).
    limit = min((v for v in (getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")) if isinstance(v, int) and v > 0), default=_SEQ_LEN)
    seq = min(_SEQ_LEN, limit)
    ids = torch.randint(1, vocab, (batch_size, seq), generator=gen)
    if kind == "classify":
        return {"input_ids": ids, "labels": torch.randint(0, config.num_labels, (batch_size,), generator=gen)}
    labels = ids.clone() if kind == "causal" else torch.randint(0, vocab, (batch_size, seq), generator=gen)
    return {"input_ids": ids, "labels": labels}
