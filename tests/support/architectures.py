"""Real `transformers` architectures (and plain PyTorch recurrent and convolutional
networks) for remat's checks, built from small configs with
random weights (nothing is downloaded; attention forced to "eager", so attention is
plain aten ops): `build` gives a model and a batch, `run_one` compiles one, checks it
bitwise against eager over a few steps and, optionally, times it. Used by the tests and
benchmarks/architectures.py.
"""

from __future__ import annotations

import re
import traceback
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

import remat
from remat.budget import format_bytes
from remat.errors import BudgetError, RematError
from remat.measurement.check import check_against_eager, time_alternating, twin
from remat.models import hf_loss, make_train_step


@dataclass(frozen=True)
class Arch:
    name: str
    kind: str  # what it stands for
    build: Callable[[str, torch.Generator], tuple[torch.nn.Module, dict[str, torch.Tensor], str]]


# Sizes: "small" for the table (activations dominate the peak, so 0.5 is meaningful);
# "tiny" for the fast test (seconds).
SIZES = {
    "small": dict(batch=4, seq=128, hidden=128, layers=4, heads=4, ffn=512, vocab=512, image=64, target=64),
    "tiny": dict(batch=2, seq=32, hidden=32, layers=2, heads=2, ffn=64, vocab=64, image=32, target=16),
}


def _lm_batch(s: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _seq2seq_batch(s: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen),
        "labels": torch.randint(0, s["vocab"], (s["batch"], s["target"]), generator=gen),
    }


def _gpt2(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    s = SIZES[size]
    config = GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], n_inner=s["ffn"], vocab_size=s["vocab"],
                        n_positions=s["seq"], attn_implementation="eager")
    desc = f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}; batch {s['batch']}×{s['seq']} tokens"
    return GPT2LMHeadModel(config), _lm_batch(s, gen), desc


def _llama(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["heads"] // 2, vocab_size=s["vocab"],
                         max_position_embeddings=s["seq"], attn_implementation="eager")
    desc = (f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads ({s['heads'] // 2} KV), vocab {s['vocab']}; "
            f"batch {s['batch']}×{s['seq']} tokens")
    return LlamaForCausalLM(config), _lm_batch(s, gen), desc


def _mixtral(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig, MixtralForCausalLM

    s = SIZES[size]
    # The experts' matrix products are aten._grouped_mm (transformers' default), whose
    # shape function refuses float32 though the CPU kernel runs it.
    config = MixtralConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=s["heads"] // 2, vocab_size=s["vocab"],
                           max_position_embeddings=s["seq"], num_local_experts=4, num_experts_per_tok=2,
                           attn_implementation="eager")
    desc = (f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads, 4 experts (top 2, grouped_mm), vocab {s['vocab']}; "
            f"batch {s['batch']}×{s['seq']} tokens")
    return MixtralForCausalLM(config), _lm_batch(s, gen), desc


def _wav2vec2(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    s = SIZES[size]
    # LayerDrop and SpecAugment off: both draw at random in Python (torch.rand decides a
    # branch; numpy draws the masks), which remat refuses by name.
    config = Wav2Vec2Config(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            intermediate_size=s["ffn"], vocab_size=s["vocab"], conv_dim=(16, 32), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                            layerdrop=0.0, mask_time_prob=0.0, attn_implementation="eager")
    samples = 25 * s["seq"] * 2
    labels = torch.randint(1, s["vocab"], (s["batch"], s["target"]), generator=gen)
    for row in range(s["batch"]):  # padded with -100 after each row's length, as a data collator pads
        labels[row, torch.randint(1, s["target"] + 1, (), generator=gen):] = -100
    desc = (f"{s['layers']} layers, d {s['hidden']}, 2 convolutions, CTC over {s['vocab']} symbols; "
            f"batch {s['batch']}×{samples} samples, targets of at most {s['target']}")
    return Wav2Vec2ForCTC(config), {"input_values": torch.randn(s["batch"], samples, generator=gen), "labels": labels}, desc


def _vit(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import ViTConfig, ViTForImageClassification

    s = SIZES[size]
    # problem_type set up front: otherwise the first forward writes it into the config.
    config = ViTConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       intermediate_size=s["ffn"], image_size=s["image"], patch_size=8, num_labels=10,
                       problem_type="single_label_classification", attn_implementation="eager")
    batch = {
        "pixel_values": torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen),
        "labels": torch.randint(0, 10, (s["batch"],), generator=gen),
    }
    desc = f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads, patch 8; batch {s['batch']}×3×{s['image']}×{s['image']}"
    return ViTForImageClassification(config), batch, desc


def _t5(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import T5Config, T5ForConditionalGeneration

    s = SIZES[size]
    # transformers 5.23's T5Config has no decoder_start_token_id by default, and the
    # model needs it to shift the labels right (eager fails without it too).
    config = T5Config(d_model=s["hidden"], d_ff=s["ffn"], num_layers=s["layers"] // 2, num_decoder_layers=s["layers"] // 2,
                      num_heads=s["heads"], d_kv=s["hidden"] // s["heads"], vocab_size=s["vocab"],
                      decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    desc = (f"{s['layers'] // 2}+{s['layers'] // 2} layers, d {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}; "
            f"batch {s['batch']}×{s['seq']} → {s['target']} tokens")
    return T5ForConditionalGeneration(config), _seq2seq_batch(s, gen), desc


def _bart(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import BartConfig, BartForConditionalGeneration

    s = SIZES[size]
    n = s["layers"] // 2
    config = BartConfig(d_model=s["hidden"], encoder_layers=n, decoder_layers=n, encoder_attention_heads=s["heads"],
                        decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"],
                        vocab_size=s["vocab"], max_position_embeddings=s["seq"], attn_implementation="eager")
    desc = f"{n}+{n} layers, d {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}; batch {s['batch']}×{s['seq']} → {s['target']} tokens"
    return BartForConditionalGeneration(config), _seq2seq_batch(s, gen), desc


class _WithLoss(torch.nn.Module):
    """A plain PyTorch network trained on a cross-entropy loss, called as transformers' models
    are (`model(**batch).loss`), so that every architecture here runs the same step."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.body(inputs)
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten()))


class _Recurrent(torch.nn.Module):
    def __init__(self, cell: type[torch.nn.RNNBase], s: dict) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(s["vocab"], s["hidden"])
        self.rnn = cell(s["hidden"], s["hidden"], num_layers=2, batch_first=True, dropout=0.1, bidirectional=True)
        self.head = torch.nn.Linear(2 * s["hidden"], s["vocab"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


def _recurrent(cell: type[torch.nn.RNNBase]):  # type: ignore[no-untyped-def]
    def build(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
        s = SIZES[size]
        seq = s["seq"] // 4  # a recurrent layer runs its steps one by one: a GRU's are ops of the graph
        ids = torch.randint(0, s["vocab"], (s["batch"], seq), generator=gen)
        desc = f"2 bidirectional layers, d {s['hidden']}, dropout 0.1, vocab {s['vocab']}; batch {s['batch']}×{seq} tokens"
        return _WithLoss(_Recurrent(cell, s)), {"inputs": ids, "labels": torch.roll(ids, -1, 1)}, desc

    return build


def _conv_net(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    s = SIZES[size]
    c = s["hidden"] // 4
    block = lambda i, o, stride: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(i, o, 3, stride=stride, padding=1), torch.nn.GroupNorm(4, o), torch.nn.SiLU(), torch.nn.Dropout2d(0.1))
    body = torch.nn.Sequential(
        block(3, c, 1), block(c, 2 * c, 2), block(2 * c, 4 * c, 2),
        torch.nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), torch.nn.InstanceNorm2d(2 * c, affine=True, track_running_stats=True),
        torch.nn.Mish(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * c, 10),
    )
    images = torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen)
    desc = f"3 conv blocks (GroupNorm, SiLU, Dropout2d), ConvTranspose2d, InstanceNorm2d, width {c}–{4 * c}; batch {s['batch']}×3×{s['image']}×{s['image']}"
    return _WithLoss(body), {"inputs": images, "labels": torch.randint(0, 10, (s["batch"],), generator=gen)}, desc


ARCHITECTURES: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("gpt2", "GPT2LMHeadModel: decoder-only LM", _gpt2),
        Arch("llama", "LlamaForCausalLM: decoder-only LM (RMSNorm, RoPE, SwiGLU, GQA)", _llama),
        Arch("mixtral", "MixtralForCausalLM: mixture of experts (the experts' products one grouped_mm each)", _mixtral),
        Arch("vit", "ViTForImageClassification: vision transformer", _vit),
        Arch("wav2vec2", "Wav2Vec2ForCTC: speech recognition (convolutions, CTC loss on targets flattened by a mask)", _wav2vec2),
        Arch("t5", "T5ForConditionalGeneration: encoder-decoder", _t5),
        Arch("bart", "BartForConditionalGeneration: encoder-decoder", _bart),
        Arch("lstm", "nn.LSTM language model (oneDNN's layer on CPU)", _recurrent(torch.nn.LSTM)),
        Arch("gru", "nn.GRU language model", _recurrent(torch.nn.GRU)),
        Arch("convnet", "convolutions with group and instance norms, a transposed convolution", _conv_net),
    ]
}


def build(name: str, size: str = "small", seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """Model (training mode, random weights) and batch; the same for the same (name, size, seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, batch, desc = ARCHITECTURES[name].build(size, torch.Generator().manual_seed(seed))
    return model.train(), batch, desc


@dataclass
class Row:
    architecture: str
    config: str
    status: str  # "ok", or the error's class
    budget: str = ""  # what was asked, and what ran if it was refused
    grads_match: bool | None = None
    baseline_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    num_recomputed: int | None = None
    overhead_ratio: float | None = None  # median remat / eager step time
    overhead_spread: tuple[float, float] | None = None
    compile_seconds: float | None = None
    error: str = ""
    notes: list[str] = field(default_factory=list)


_REACHABLE = re.compile(r"smallest peak it could reach is .*?\((\d+) bytes\)")


def run_one(name: str, size: str = "small", budget: float = 0.5, steps: int = 3, pairs: int = 7,
            profile_runs: int = 3) -> Row:
    model, batch, desc = build(name, size)
    return run_model(name, model, batch, desc, budget, steps, pairs, profile_runs)


def run_model(name: str, model: torch.nn.Module, batch: dict[str, torch.Tensor], desc: str, budget: float = 0.5,
              steps: int = 3, pairs: int = 7, profile_runs: int = 3) -> Row:
    """`model(**batch).loss` trained with AdamW: compiled at `budget` (or, where the planner
    refuses it, at the smallest peak it says it reaches), checked bitwise against eager over
    `steps` steps and, with `pairs`, timed."""
    row = Row(name, desc, "ok", budget=f"{budget:g}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = make_train_step(hf_loss, zero_grad_first=True)
    eager_model, eager_opt = twin(model, opt)
    try:
        try:
            step = remat.compile(step_fn, model, opt, batch, memory_budget=budget, profile_runs=profile_runs)
        except BudgetError as e:
            m = _REACHABLE.search(str(e))
            if m is None:
                raise
            reachable = int(m.group(1))
            row.budget = f"{budget:g} refused; ran at the reachable minimum {format_bytes(reachable)}"
            row.notes.append(str(e))
            step = remat.compile(step_fn, model, opt, batch, memory_budget=reachable, profile_runs=profile_runs)
    except RematError as e:
        row.status, row.error = type(e).__name__, str(e)
        return row
    except Exception as e:  # noqa: BLE001 - not remat's own error: record where it came from
        row.status = type(e).__name__
        where = traceback.extract_tb(e.__traceback__)[-1]
        row.error = f"{e} (not a remat error; raised at {where.filename}:{where.lineno})"
        return row
    report = step.report
    result = check_against_eager(step_fn, eager_model, eager_opt, model, opt, step, batch, steps=steps)
    row.grads_match = result.match
    if not result.match:
        row.error = result.summary()
    row.baseline_peak_bytes = report.baseline_peak_bytes
    row.predicted_peak_bytes = report.predicted_peak_bytes
    row.measured_peak_bytes = report.measured_peak_bytes
    row.num_recomputed = report.num_recomputed
    row.compile_seconds = round(report.compile_seconds, 1)
    if pairs > 0:
        timing = time_alternating(lambda: step_fn(eager_model, eager_opt, batch), lambda: step(batch), pairs=pairs)
        row.overhead_ratio = round(timing.ratio, 3)
        row.overhead_spread = (round(timing.ratio_spread[0], 3), round(timing.ratio_spread[1], 3))
    return row
