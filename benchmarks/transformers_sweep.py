"""Held-out model coverage: every architecture `transformers` builds for a task, trained
through remat beside eager. Bitwise, refused by name, or neither (a bug).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.transformers_sweep --jobs 2 --out docs/transformers-sweep

For each model type of a task's auto class (`--tasks`, by default all of `AUTO_CLASSES`:
language modelling, classification of sequences, tokens and images, question answering,
multiple choice, segmentation, speech recognition), a config is made small from the
type's defaults (each size its `__init__` takes set to a small value: 2 layers, width 64,
4 heads, vocab 256, images 32×32, 4,000 audio samples), with random weights and attention "eager". A type whose model cannot be built so,
or whose eager step fails on the batch, is counted as such: that is the generic config's
failing, not remat's. Each other model: `run_model` (tests/support/architectures.py),
AdamW, `remat.compile` at budget 0.5 (or the smallest peak the planner says it reaches),
3 steps compared bitwise with eager, predicted against measured peak. Each model runs in
a process of its own, with `--timeout` seconds and 8 GiB of address space. Writes
`transformers_sweep.json` (a row per model) and `transformers_sweep.md` under --out after
each model, keeping the rows already there (same versions) of models this run does not check.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

# Sizes any config's __init__ may take, set where it does.
SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=256, max_position_embeddings=128, d_model=64, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_ctx=128,
    max_seq_len=128, n_heads=4, n_layers=2, ffn_dim=128, encoder_layers=1, decoder_layers=1, num_layers=2, n_inner=128,
    rotary_dim=8, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, d_ff=128, d_kv=16, num_heads=4, sliding_window=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    state_size=8, expand=2, conv_kernel=4, time_step_rank=8, num_decoder_layers=1, decoder_start_token_id=0,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2,
    image_size=32, patch_size=4, num_channels=3, embedding_size=16, embed_dim=16, d_inner=128, d_head=16, d_latents=64,
    num_latents=16, num_self_attends_per_block=2,
    # LayerDrop branches on a random draw, which remat refuses by name, advising a rate of 0.
    layerdrop=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
    # SpecAugment draws its masks with numpy, which remat refuses by name, advising this.
    mask_time_prob=0.0, mask_feature_prob=0.0,
)
VOCAB, SEQ, BATCH, IMAGE, AUDIO = 256, 64, 4, 32, 4000


def _out_of_memory(error_class: str, said: str) -> bool:
    """Whether a failure is the 8 GiB each model's process has running out."""
    return error_class == "MemoryError" or "MemoryError" in said or "can't allocate memory" in said


def _small_list(key: str, value: list[Any]) -> list[Any]:
    """A per-stage list (a convolutional or hierarchical model's depths, widths, heads) cut
    to two stages, each small."""
    first = value[:2]
    if all(isinstance(v, str) for v in value):  # a kind per layer (a hybrid's attention and recurrent layers): one of each
        kinds = list(dict.fromkeys(value))[:2]
        return kinds + kinds[:1] * (2 - len(kinds))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in first):
        return first
    if "depth" in key or "layers" in key or "blocks" in key or key == "block_sizes":  # Funnel's block_sizes: layers per block
        return [1 for _ in first]
    if "head" in key:
        return [min(v, 2) for v in first]
    if any(w in key for w in ("size", "dim", "channel", "width", "hidden")):
        return [16 * 2**i for i in range(len(first))]
    return first


def make_config(model_type: str, per_stage: bool = True) -> Any:
    """`model_type`'s config made small; `per_stage`: its per-stage lists cut too."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    defaults = cls()
    kwargs: dict[str, Any] = {}
    for key in params:
        value = getattr(defaults, key, None)
        if isinstance(value, (list, tuple)) and value:
            if per_stage:
                kwargs[key] = _small_list(key, value)
        elif key in SMALL and not isinstance(value, (list, tuple, dict)):
            kwargs[key] = SMALL[key]
    if "qk_rope_head_dim" in params:  # multi-head latent attention: its own head size, a key and value per head
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = SMALL["num_attention_heads"]
    config = cls(**kwargs)
    config.num_labels = 10
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= VOCAB or isinstance(value, list):
            setattr(config, key, 1)
    if getattr(config, "pad_token_id", 0) is None:  # a decoder's sequence classifier finds each row's last token by it
        config.pad_token_id = 1
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:  # T5's: the labels shifted right start with it
        config.decoder_start_token_id = 0
    return config


def _ids(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=gen)


def _labels(gen: torch.Generator, *shape: int, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, shape, generator=gen)


def _audio(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, AUDIO, generator=gen)


# What a task's model takes: the batch, made from a seeded generator.
BATCHES: dict[str, Callable[[torch.Generator], dict[str, torch.Tensor]]] = {
    "causal-lm": lambda g: {"input_ids": (ids := _ids(g, BATCH, SEQ)), "labels": ids},
    "masked-lm": lambda g: {"input_ids": (ids := _ids(g, BATCH, SEQ)), "labels": ids},
    "seq2seq-lm": lambda g: {"input_ids": _ids(g, BATCH, SEQ), "labels": _ids(g, BATCH, SEQ // 2)},
    "sequence-classification": lambda g: {"input_ids": _ids(g, BATCH, SEQ), "labels": _labels(g, BATCH)},
    "token-classification": lambda g: {"input_ids": _ids(g, BATCH, SEQ), "labels": _labels(g, BATCH, SEQ)},
    "question-answering": lambda g: {"input_ids": _ids(g, BATCH, SEQ), "start_positions": _labels(g, BATCH, classes=SEQ),
                                     "end_positions": _labels(g, BATCH, classes=SEQ)},
    "multiple-choice": lambda g: {"input_ids": _ids(g, BATCH, 2, SEQ), "labels": _labels(g, BATCH, classes=2)},
    "image-classification": lambda g: {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), "labels": _labels(g, BATCH)},
    "semantic-segmentation": lambda g: {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                                        "labels": _labels(g, BATCH, IMAGE, IMAGE)},
    "ctc": lambda g: {"input_values": _audio(g), "labels": _ids(g, BATCH, 8)},
    "audio-classification": lambda g: {"input_values": _audio(g), "labels": _labels(g, BATCH)},
}
# Each task's auto class, by the name of its mapping in transformers.models.auto.modeling_auto.
AUTO_CLASSES = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "sequence-classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "question-answering": ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    "multiple-choice": ("AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    "semantic-segmentation": ("AutoModelForSemanticSegmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"),
    "ctc": ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
    "audio-classification": ("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
}


def _tasks() -> dict[str, tuple[Any, Any, Callable[[torch.Generator], dict[str, torch.Tensor]]]]:
    """Each task's model types, auto class and batch."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    return {task: (getattr(auto, names), getattr(transformers, cls), BATCHES[task]) for task, (cls, names) in AUTO_CLASSES.items()}


def _ending_with_eos(batch: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """An encoder-decoder's sequence classifier (BART's) pools at each row's end-of-sequence
    token, which a tokenizer puts at the end of every row."""
    eos = getattr(config, "eos_token_id", None)
    if not (getattr(config, "is_encoder_decoder", False) and isinstance(eos, int) and "input_ids" in batch):
        return batch
    ids = batch["input_ids"].clone()
    ids[:, -1] = eos
    return {**batch, "input_ids": ids}


def check_one(task: str, model_type: str, budget: float) -> dict[str, Any]:
    """One model type: its outcome and what was said. remat's: "bitwise", "refused" (a
    RematError), "not bitwise", "peak off" (measured is not predicted), "failed" (another
    error); the generic config's: "not built", "eager fails", "out of memory" (over the
    process's 8 GiB: a type whose nested configs were not made small)."""
    from remat.measurement.check import twin
    from tests.support.architectures import run_model

    _, auto_class, make_batch = _tasks()[task]
    batch = make_batch(torch.Generator().manual_seed(0))
    for per_stage in (True, False):  # cut lists of stages may not fit together (a stage's input width is the last's output)
        torch.manual_seed(0)
        try:
            config = make_config(model_type, per_stage)
            config.num_labels = 2 if task == "question-answering" else config.num_labels  # a start and an end logit
            model = auto_class.from_config(config, attn_implementation="eager").train()
        except Exception as e:  # noqa: BLE001 - the generic config does not suit this type
            failed = {"outcome": "out of memory" if _out_of_memory(type(e).__name__, str(e)) else "not built", "said": f"{type(e).__name__}: {e}"[:300]}
            continue
        params = sum(p.numel() for p in model.parameters())
        batch = _ending_with_eos(batch, config) if task == "sequence-classification" else batch
        try:
            copy, _ = twin(model, None)
            copy(**batch).loss.backward()
            break
        except Exception as e:  # noqa: BLE001 - the model does not train on this batch in eager either
            failed = {"outcome": "eager fails", "said": f"{type(e).__name__}: {e}"[:300], "params": params}
    else:
        return failed
    row = run_model(model_type, model, batch, f"{params:,} parameters", budget, steps=3, pairs=0, profile_runs=1)
    if row.status != "ok":
        outcome = "out of memory" if _out_of_memory(row.status, row.error) else "refused" if "not a remat error" not in row.error else "failed"
        return {"outcome": outcome, "said": f"{row.status}: {row.error}"[:400], "params": params}
    peaks = {"baseline": row.baseline_peak_bytes, "predicted": row.predicted_peak_bytes, "measured": row.measured_peak_bytes}
    outcome = "bitwise" if row.grads_match else "not bitwise"
    if row.grads_match and row.measured_peak_bytes != row.predicted_peak_bytes:
        outcome = "peak off"
    return {"outcome": outcome, "said": row.error[:400], "params": params, "budget": row.budget, "recomputed": row.num_recomputed, **peaks}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def _run_child(task: str, model_type: str, budget: float, timeout: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks.transformers_sweep", "--one", task, model_type, "--budget", str(budget)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=_limit_memory)
        lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(lines[-1][4:]) if lines else {"outcome": "failed", "said": f"exit {done.returncode}: {done.stderr[-300:]}"}
    except subprocess.TimeoutExpired:
        row = {"outcome": "out of time", "said": f"over {timeout} s"}
    return {"task": task, "model_type": model_type, **row, "seconds": round(time.perf_counter() - t0, 1)}


def markdown(rows: list[dict[str, Any]], versions: str) -> str:
    counts = Counter(r["outcome"] for r in rows)
    outcomes = [k for k, _ in counts.most_common()]
    lines = [f"{len(rows)} models, a model type with a task's head ({versions}): " + ", ".join(f"{n} {k}" for k, n in counts.most_common()), "",
             "| task | " + " | ".join(outcomes) + " |", "|---|" + "---:|" * len(outcomes)]
    for task in dict.fromkeys(r["task"] for r in rows):
        by_task = Counter(r["outcome"] for r in rows if r["task"] == task)
        lines.append(f"| {task} | " + " | ".join(str(by_task[k]) for k in outcomes) + " |")
    lines += ["", "| task | model type | outcome | peak: eager → predicted / measured (bytes) | what was said |", "|---|---|---|---|---|"]
    for r in rows:
        peaks = f"{r['baseline']:,} → {r['predicted']:,} / {r['measured']:,}" if r.get("measured") else ""
        said = str(r.get("said", "")).replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r['task']} | {r['model_type']} | {r['outcome']} | {peaks} | {said} |")
    return "\n".join(lines) + "\n"


def _kept_rows(path: Path, versions: str, checking: set[tuple[str, str]]) -> list[dict[str, Any]]:
    """The rows of an earlier sweep in `path` (same versions) of models this one is not `checking`:
    a sweep of some tasks or types adds to the file rather than replacing it."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("versions") != versions:
        print(f"{path}: made with {earlier.get('versions')}, not {versions}; its rows are replaced", flush=True)
        return []
    return [r for r in earlier["rows"] if (r["task"], r["model_type"]) not in checking and r["task"] in AUTO_CLASSES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(AUTO_CLASSES), help="comma-separated, of: " + ", ".join(AUTO_CLASSES))
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one of each task)")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--jobs", type=int, default=1, help="models checked at once, each in its own process")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per model")
    parser.add_argument("--out", type=Path, default=Path("runs/transformers-sweep"))
    parser.add_argument("--one", nargs=2, metavar=("TASK", "MODEL_TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    if args.one:
        try:
            row = check_one(*args.one, args.budget)
        except Exception as e:  # noqa: BLE001 - recorded with where it came from
            where = traceback.extract_tb(e.__traceback__)[-1]
            row = {"outcome": "out of memory" if _out_of_memory(type(e).__name__, str(e)) else "failed", "said": f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})"[:400]}
        print("ROW " + json.dumps(row), flush=True)
        return
    tasks = _tasks()
    only = set(filter(None, args.only.split(",")))
    todo = [(t, m) for t in args.tasks.split(",") for m in tasks[t][0] if not only or m in only]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}, remat at budget {args.budget:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "transformers_sweep.json"
    kept = _kept_rows(path, versions, set(todo))
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, row in enumerate(pool.map(lambda tm: _run_child(*tm, args.budget, args.timeout), todo), 1):
            rows.append(row)
            print(f"[{i}/{len(todo)}] {row['task']} {row['model_type']}: {row['outcome']} ({row['seconds']} s) {str(row.get('said', ''))[:150]}", flush=True)
            _write(args.out, versions, kept + rows)  # as it goes: a sweep stopped early keeps what it checked
    print(markdown(kept + rows, versions).splitlines()[0])


def _write(out: Path, versions: str, rows: list[dict[str, Any]]) -> None:
    rows = sorted(rows, key=lambda r: (list(AUTO_CLASSES).index(r["task"]), r["model_type"]))
    doc = {"versions": versions, "counts": dict(Counter(r["outcome"] for r in rows).most_common()), "rows": rows}
    (out / "transformers_sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "transformers_sweep.md").write_text(markdown(rows, versions))


if __name__ == "__main__":
    main()
