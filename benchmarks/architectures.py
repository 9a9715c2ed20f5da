"""Model coverage: real `transformers` architectures under remat, checked against eager.

    .venv/bin/python benchmarks/architectures.py --out runs/architectures

Each architecture is built from a small config with random weights (nothing is
downloaded; attention forced to "eager", so attention is plain aten ops), trained with
AdamW on one random batch. For each: `remat.compile(..., memory_budget=0.5)` (if 0.5 is
refused, the smallest peak the planner can reach, as bytes, is recorded and used
instead), 3 steps compared bitwise with eager (`check_against_eager`), predicted vs
measured peak, and the time overhead: remat step / eager step, the median of alternating
pairs (`time_alternating`) in this one process. A model that cannot be captured or
planned is recorded with its error. Writes architectures.md, architectures.csv and
architectures.json to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import remat  # noqa: E402
from remat.budget import format_bytes  # noqa: E402
from remat.measurement.check import check_against_eager, time_alternating, twin  # noqa: E402
from remat.errors import BudgetError, RematError  # noqa: E402
from remat.models import hf_loss, make_train_step  # noqa: E402


@dataclass(frozen=True)
class Arch:
    name: str
    kind: str  # what it stands for
    build: Callable[[str, torch.Generator], tuple[torch.nn.Module, dict[str, torch.Tensor], str]]


# Sizes: "small" for the table (activations dominate the peak, so 0.5 is meaningful);
# "tiny" for the fast test (seconds).
_SIZES = {
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

    s = _SIZES[size]
    config = GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], n_inner=s["ffn"], vocab_size=s["vocab"],
                        n_positions=s["seq"], attn_implementation="eager")
    desc = f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}; batch {s['batch']}×{s['seq']} tokens"
    return GPT2LMHeadModel(config), _lm_batch(s, gen), desc


def _llama(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    s = _SIZES[size]
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["heads"] // 2, vocab_size=s["vocab"],
                         max_position_embeddings=s["seq"], attn_implementation="eager")
    desc = (f"{s['layers']} layers, d {s['hidden']}, {s['heads']} heads ({s['heads'] // 2} KV), vocab {s['vocab']}; "
            f"batch {s['batch']}×{s['seq']} tokens")
    return LlamaForCausalLM(config), _lm_batch(s, gen), desc


def _vit(size: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    from transformers import ViTConfig, ViTForImageClassification

    s = _SIZES[size]
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

    s = _SIZES[size]
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

    s = _SIZES[size]
    n = s["layers"] // 2
    config = BartConfig(d_model=s["hidden"], encoder_layers=n, decoder_layers=n, encoder_attention_heads=s["heads"],
                        decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"],
                        vocab_size=s["vocab"], max_position_embeddings=s["seq"], attn_implementation="eager")
    desc = f"{n}+{n} layers, d {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}; batch {s['batch']}×{s['seq']} → {s['target']} tokens"
    return BartForConditionalGeneration(config), _seq2seq_batch(s, gen), desc


ARCHITECTURES: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("gpt2", "GPT2LMHeadModel: decoder-only LM", _gpt2),
        Arch("llama", "LlamaForCausalLM: decoder-only LM (RMSNorm, RoPE, SwiGLU, GQA)", _llama),
        Arch("vit", "ViTForImageClassification: vision transformer", _vit),
        Arch("t5", "T5ForConditionalGeneration: encoder-decoder", _t5),
        Arch("bart", "BartForConditionalGeneration: encoder-decoder", _bart),
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


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| architecture | config | budget | grads_match (3 steps, bitwise) | baseline peak MiB | predicted peak MiB | "
        "measured peak MiB | recomputed | overhead (remat/eager, median [min–max]) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.architecture} | {r.config} | {r.budget} | {r.status}: {r.error} | | | | | |")
            continue
        over = "" if r.overhead_ratio is None else f"{r.overhead_ratio:.2f} [{r.overhead_spread[0]:.2f}–{r.overhead_spread[1]:.2f}]"
        lines.append(
            f"| {r.architecture} | {r.config} | {r.budget} | {'yes' if r.grads_match else 'NO: ' + r.error} | "
            f"{_mib(r.baseline_peak_bytes)} | {_mib(r.predicted_peak_bytes)} | {_mib(r.measured_peak_bytes)} | "
            f"{r.num_recomputed} | {over} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    ap.add_argument("--size", default="small", choices=list(_SIZES))
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--pairs", type=int, default=7, help="alternating eager/remat timing pairs (0: no timing)")
    ap.add_argument("--profile-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/architectures"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for name in args.models:
        t0 = time.perf_counter()
        row = run_one(name, args.size, args.budget, pairs=args.pairs, profile_runs=args.profile_runs)
        rows.append(row)
        print(f"{name}: {row.status}, grads_match={row.grads_match}, predicted {_mib(row.predicted_peak_bytes)} MiB, "
              f"measured {_mib(row.measured_peak_bytes)} MiB, overhead {row.overhead_ratio} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    (args.out / "architectures.md").write_text(markdown(rows))
    (args.out / "architectures.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    with open(args.out / "architectures.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in asdict(rows[0]) if k != "notes"])
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d.pop("notes")
            w.writerow(d)
    print("\n" + markdown(rows))
    return 0 if all(r.status == "ok" and r.grads_match for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
