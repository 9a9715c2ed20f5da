"""Hugging Face Trainer three ways on one model: plain `Trainer`, `Trainer` with the
model's own activation checkpointing (`gradient_checkpointing=True`) and `RematTrainer`
at `--budgets`: each optimizer step's memory peak and time, side by side.

Every run trains the same model (random weights) on the same batches with Trainer's
default optimizer and scheduler. A TrainerCallback brackets optimizer steps: one step
(`--measure-step`, after the first, which creates the optimizer's state and, for remat,
compiles) runs under the CPU allocator's profiler, whose events give the step's peak above
what was live when it began; the others are timed (median over steps 2..N but the
measured one). remat's predicted peak (above the persistent state) stands beside its
measured one. Writes `trainer.json` and `trainer.png` under --out.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.trainer --model bert --batch-size 8 --budgets 0.33
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from remat.errors import BudgetError
from remat.integrations.transformers import RematTrainer
from remat.measurement.plots import save_figure, wrapped_title
from remat.models import build_model
from remat.profile.allocator import cpu_memory_events, cpu_memory_profile


class _StepMeter(TrainerCallback):
    """Times each optimizer step; profiles the memory of step `measure_step` (1-based)."""

    def __init__(self, measure_step: int):
        self.measure_step, self.seconds, self.peak_bytes = measure_step, {}, None
        self._start, self._prof, self._profiling = 0.0, None, None

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step + 1 == self.measure_step:
            self._profiling = cpu_memory_profile()
            self._prof = self._profiling.__enter__()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.seconds[state.global_step] = time.perf_counter() - self._start
        if self._prof is not None:
            self._profiling.__exit__(None, None, None)
            levels = [live for _, _, live in cpu_memory_events(self._prof)]
            self.peak_bytes, self._prof = max([0, *levels]), None


def _dataset(name: str, batch_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    batch = build_model(name, batch_size * steps, seed=1).batch
    return [{k: v[i] for k, v in batch.items()} for i in range(batch_size * steps)]


def run(name: str, batch_size: int, steps: int, measure_step: int, variant: str, budget: float | None) -> dict[str, Any]:
    model = build_model(name, batch_size).model
    meter = _StepMeter(measure_step)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="remat-trainer-bench-"), per_device_train_batch_size=batch_size, max_steps=steps, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1,
        gradient_checkpointing=variant == "hf_checkpointing",
    )
    data = _dataset(name, batch_size, steps)
    if variant == "remat":
        trainer = RematTrainer(model=model, args=args, train_dataset=data, callbacks=[meter], memory_budget=budget)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[meter])
    trainer.train()
    timed = [s for step, s in meter.seconds.items() if step >= 2 and step != measure_step]
    row: dict[str, Any] = {
        "variant": variant, "budget": budget, "step_peak_bytes": meter.peak_bytes,
        "step_seconds": statistics.median(timed), "step_seconds_all": [round(s, 4) for s in timed],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }  # fmt: skip
    if variant == "remat":
        report = trainer.remat_report
        row.update(
            predicted_step_peak_bytes=report.predicted_peak_bytes - report.persistent_bytes,
            measured_first_step_peak_bytes=report.measured_peak_bytes - report.persistent_bytes,
            no_recompute_step_peak_bytes=report.baseline_peak_bytes - report.persistent_bytes,
            recomputed=report.num_recomputed, planner=report.plan.planner if report.plan else None,
        )  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table: peaks in MiB, times against plain Trainer's (one run)."""
    mib = 2**20
    base = next(r for r in rows if r["variant"] == "trainer")
    lines = ["| | step peak above the state (MiB) | remat predicted (MiB) | × Trainer's peak | s per step: median (fastest) | × Trainer's time |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        name = r["variant"].replace("_", " ") + (f" {r['budget']}" if r["budget"] is not None else "")
        if "error" in r:
            lines.append(f"| {name} | refused: {r['error']} | | | | |")
            continue
        predicted = f"{r['predicted_step_peak_bytes'] / mib:,.1f}" if "predicted_step_peak_bytes" in r else ""
        lines.append(
            f"| {name} | {r['step_peak_bytes'] / mib:,.1f} | {predicted} | {r['step_peak_bytes'] / base['step_peak_bytes']:.2f} "
            f"| {r['step_seconds']:.3f} ({min(r['step_seconds_all']):.3f}) | {r['step_seconds'] / base['step_seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["variant"].replace("_", " ") + (f" {r['budget']}" if r["budget"] is not None else "") for r in rows]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax_mem.bar(labels, [r["step_peak_bytes"] / 2**20 for r in rows], color="tab:blue")
    ax_mem.set_ylabel("step peak above the state (MiB)")
    ax_time.bar(labels, [r["step_seconds"] for r in rows], color="tab:orange")
    ax_time.set_ylabel("seconds per optimizer step (median)")
    for ax in (ax_mem, ax_time):
        ax.tick_params(axis="x", labelrotation=25)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    wrapped_title(fig, title)
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budgets", default="0.33")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--measure-step", type=int, default=3)
    parser.add_argument("--out", default="docs/trainer")
    args = parser.parse_args()
    if not 2 <= args.measure_step <= args.steps:
        parser.error("--measure-step must be after the first step and at most --steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    variants = [("trainer", None), ("hf_checkpointing", None), *(("remat", b) for b in budgets)]
    rows = []
    for variant, budget in variants:
        try:
            rows.append(run(args.model, args.batch_size, args.steps, args.measure_step, variant, budget))
        except BudgetError as e:  # below what remat can reach: said in the results, the other runs go on
            rows.append({"variant": variant, "budget": budget, "error": str(e).splitlines()[0]})
            print(json.dumps(rows[-1]), flush=True)
    command = "OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.trainer " + " ".join(sys.argv[1:])
    result = {"meta": {"command": command}, "model": args.model, "batch_size": args.batch_size, "steps": args.steps, "measure_step": args.measure_step,
              "threads": torch.get_num_threads(), "rows": rows}  # fmt: skip
    (out / "trainer.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "trainer.md").write_text(_table(rows))
    _plot([r for r in rows if "error" not in r], f"Hugging Face Trainer, {args.model} batch {args.batch_size}: one optimizer step's peak and time (CPU)", out / "trainer.png")
    print(f"wrote {out / 'trainer.json'} and {out / 'trainer.png'}")


if __name__ == "__main__":
    main()
