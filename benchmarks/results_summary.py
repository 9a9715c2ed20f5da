"""The summary table that opens docs/RESULTS.md, rebuilt from the result files.

    .venv/bin/python benchmarks/results_summary.py            # print the table
    .venv/bin/python benchmarks/results_summary.py --write    # and put it in docs/RESULTS.md

Each row: the headline figure, read from its result file; the command that wrote the
file; the date the file was last committed (git), which is when the figure was measured;
the machine. A file that is missing gives a row that says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "RESULTS.md"
BEGIN, END = "<!-- summary: benchmarks/results_summary.py -->", "<!-- end of summary -->"
CPU = "CPU, 2 cores, torch 2.13.0+cpu"
H100 = "NVIDIA H100, torch 2.11.0+cu130"


def _date(path: Path) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "not committed"


def _runs(doc: dict[str, Any], batch: int) -> dict[str, dict[str, Any]]:
    return {r["method"]: r for r in doc["runs"] if r["batch_size"] == batch and r.get("status") == "ok"}


def _bench(batch: int, budget: str, versus: str | None) -> Callable[[Any], str]:
    def figure(doc: dict[str, Any]) -> str:
        runs = _runs(doc, batch)
        ours = runs[f"remat@{budget}"]
        error = abs(ours["peak_bytes"] - ours["predicted_peak_bytes"]) / ours["predicted_peak_bytes"]
        text = (
            f"batch {batch}: remat {ours['activation_ratio_to_eager']:.2f}× of eager's activation peak at "
            f"{ours['ratio_to_eager']:.2f}× its time (peak {100 * error:.2f}% off the prediction)"
        )
        if versus in runs:
            other = runs[versus]
            text += f"; HF's checkpointing {other['activation_ratio_to_eager']:.2f}× at {other['ratio_to_eager']:.2f}×"
        return text

    return figure


def _randomized(doc: dict[str, Any]) -> str:
    across = doc.get("with_accumulation_across_calls")
    return (
        f"{doc['examples']:,} random models{f' ({across:,} accumulating across calls)' if across else ''}, "
        f"{doc['failures']} failures (bitwise with eager, within budget); "
        f"largest measured-vs-predicted difference {doc['max_abs_error_bytes']} B"
    )


def _idioms(doc: list[dict[str, Any]]) -> str:
    count = {k: sum(r["outcome"] == k for r in doc) for k in ("works", "refused", "WRONG")}
    return f"{len(doc)} loop idioms: {count['works']} bitwise over 6 steps, {count['refused']} refused by name, {count['WRONG']} wrong"


def _data_parallel(doc: dict[str, Any]) -> str:
    r = doc["ranks"][0]
    eager = r["eager_activation_peak_bytes"]
    wrapper = r.get("wrapper", "DDP")
    return (
        f"BERT-base, {doc['nproc']} ranks, batch {r['batch_size_per_rank']} at {r['budget']}: "
        f"{r['activation_peak_bytes_measured'] / eager:.2f}× of eager {wrapper}'s activation peak per rank at "
        f"{r['overhead_ratio']:.2f}× its time (HF checkpointing {r['hf_activation_peak_bytes'] / eager:.2f}× at "
        f"{r['hf_overhead_ratio']:.2f}×), bitwise: {'yes' if all(x['grads_match'] for x in doc['ranks']) else 'NO'}"
    )


def _call(doc: list[dict[str, Any]]) -> str:
    rows = {r["model"]: r for r in doc}
    return (
        f"BERT-base: {rows['bert']['host_warm_ms']:.2f} ms of host time a call beside its graph; "
        f"bert-tiny batch 1 at {rows['bert-tiny']['remat_over_eager']:.2f}× eager's time"
    )


def _buckets(doc: list[dict[str, Any]]) -> str:
    r = doc[0]
    f = r["foreach"]
    return (
        f"{r['model']} batch {r['batch_size']}, AdamW(foreach=True) at {r['budget']}: updates in the backward pass in "
        f"buckets, bitwise: {'yes' if f['bitwise'] else 'NO'}, {f['ops_over_eager']:.2f}× eager's aten ops"
    )


def _library_optimizers(doc: dict[str, Any]) -> str:
    counts = doc["counts"]
    tried = sum(counts.values()) - counts.get("not built", 0)
    return (
        f"{doc['library']}: {counts.get('bitwise', 0)} of {tried} optimizers bitwise over {doc['steps']} steps, "
        f"{counts.get('refused', 0)} refused by name, {counts.get('not bitwise', 0)} wrong"
    )


def _transformers_sweep(doc: dict[str, Any]) -> str:
    counts = Counter(r["outcome"] for r in doc["rows"])
    tried = sum(counts.values()) - counts["not built"] - counts["eager fails"] - counts["out of memory"]
    return (
        f"{doc['versions'].split(',')[0]}, {len({r['task'] for r in doc['rows']})} tasks: {counts['bitwise']} of {tried} models "
        "(a model type with a task's head) that train in eager are bitwise over "
        f"3 steps with measured peak = predicted, {counts['refused']} refused by name, "
        f"{counts['not bitwise']} wrong, {counts['failed'] + counts['peak off'] + counts['out of time']} other failures"
    )


def _trainer(doc: dict[str, Any]) -> str:
    rows = [r for r in doc["rows"] if "error" not in r]
    base = next(r for r in rows if r["variant"] == "trainer")
    hf = next(r for r in rows if r["variant"] == "hf_checkpointing")
    ours = min((r for r in rows if r["variant"] == "remat"), key=lambda r: r["step_peak_bytes"])

    def ratios(r: dict[str, Any]) -> str:
        return f"{r['step_peak_bytes'] / base['step_peak_bytes']:.2f}× of Trainer's step peak at {r['step_seconds'] / base['step_seconds']:.2f}× its time"

    return (
        f"{doc['model']} batch {doc['batch_size']}, Trainer's defaults: RematTrainer at {ours['budget']} {ratios(ours)}; "
        f"gradient_checkpointing=True {ratios(hf)}"
    )


def _regions(doc: dict[str, Any]) -> str:
    ratio = doc["activation_peak_bytes_measured"] / doc["eager_activation_peak_bytes"]
    off = doc["peak_bytes_measured"] - doc["predicted_peak_bytes"]
    tol = doc["tolerance"] or {}
    return (
        f"{doc['model']} batch {doc['batch_size']} at {doc['budget']}, {doc['regions']} regions"
        + (f" ({doc['regions_slower']} more left op by op, slower compiled)" if doc.get("regions_slower") else "")
        + f": {ratio:.2f}× of eager's activation "
        f"peak (measured {'=' if off == 0 else f'{off:+,} B from'} predicted) at {doc['overhead_ratio']:.2f}× eager's time; "
        f"within tolerance: {'yes' if tol.get('within') else 'no'}"
    )


def _time_model(doc: dict[str, Any]) -> str:
    parts = []
    for r in doc["rows"]:
        parts.append(f"{r['model']} b{r['batch_size']} {r['backend']} {r['error']:+.0%}")
    within = sum(abs(r["error"]) <= 0.10 for r in doc["rows"])
    return f"predicted step time against measured (steps one after another), {within} of {len(doc['rows'])} runs within 10%: " + ", ".join(parts)


def _gpu(doc: dict[str, Any]) -> str:
    equal = "within tolerance" if doc.get("backend") == "inductor" else "bitwise: " + ("yes" if doc["grads_match"] else "no")
    backend = ", Inductor regions" if doc.get("backend") == "inductor" else ""
    if doc.get("cuda_graph"):
        backend += ", replayed as one CUDA graph"
        time = f"{doc['overhead_ratio']:.2f}× eager's time ({doc['iteration_seconds'] * 1e3:.1f} ms against {doc['eager_iteration_seconds'] * 1e3:.1f})"
    else:
        time = (
            f"{doc['overhead_ratio']:.2f}× eager's time (graph {doc['graph_seconds'] * 1e3:.1f} ms, "
            f"time model {doc['predicted_graph_seconds'] * 1e3:.1f} ms)"
        )
    return (
        f"{doc['model']} batch {doc['batch_size']} at {doc['budget']} ({doc['optimizer']}{backend}): "
        f"{doc['activation_peak_bytes_measured'] / doc['eager_activation_peak_bytes']:.2f}× of eager's activation peak, "
        f"allocated peak {doc['peak_bytes_measured'] / 2**20:,.0f} MiB against {doc['predicted_peak_bytes'] / 2**20:,.0f} "
        f"predicted, {time}; {equal}"
    )


ROWS: list[tuple[str, str, Callable[[Any], str], str | None, str]] = [
    ("Memory and time, BERT-base", "docs/bench-refined/bert/results.json", _bench(16, "0.25", "hf"), None, CPU),
    ("", "docs/bench-refined/bert/results.json", _bench(32, "0.25", "hf"), None, CPU),
    ("Memory and time, ResNet-152", "docs/bench-refined/resnet152/results.json", _bench(8, "0.2", None), None, CPU),
    ("Never a wrong gradient", "docs/randomized/summary.json", _randomized,
     "python -m benchmarks.long_randomized --examples 3000 --seed 1 --out docs/randomized", CPU),
    ("Training loops", "docs/training_loops/idioms.json", _idioms, "python -m benchmarks.training_loops --out docs/training_loops", CPU),
    ("Data parallel (DDP, gloo)", "docs/bench-ddp/bert-b8-0.33.json", _data_parallel,
     "remat run --model bert --batch-size 8 --budget 0.33 --nproc 2 --check --pairs 3 --steps 1 --json", CPU),
    ("Sharded data parallel (FSDP2, gloo)", "docs/bench-fsdp/bert-b8-0.33.json", _data_parallel,
     "remat run --model bert --batch-size 8 --budget 0.33 --nproc 2 --fsdp --check --pairs 3 --steps 1 --json", CPU),
    ("A call's host time", "docs/call-overhead/call_overhead.json", _call,
     "python benchmarks/call_overhead.py --models bert-tiny,bert --batch-size 1 --calls 30", CPU),
    ("Multi-tensor optimizers", "docs/update-buckets/update_buckets.json", _buckets,
     "python benchmarks/update_buckets.py --models bert-tiny --batch-size 1 --budget 0.6 --pairs 21", CPU),
    ("Optimizers beyond torch's", "docs/library-optimizers/library_optimizers.json", _library_optimizers,
     "python benchmarks/library_optimizers.py --skip kron --out docs/library-optimizers", CPU),
    ("Architectures beyond the tests", "docs/transformers-sweep/transformers_sweep.json", _transformers_sweep,
     "python -m benchmarks.transformers_sweep --jobs 2 --out docs/transformers-sweep", CPU),
    ("Hugging Face Trainer", "docs/trainer/trainer.json", _trainer, None, CPU),
    ("Compiled regions (Inductor)", "docs/inductor/resnet152-b4-0.3.json", _regions,
     "remat run --model resnet152 --batch-size 4 --budget 0.3 --backend inductor --check --pairs 5 --json", CPU),
    ("", "docs/inductor/bert-b8-0.33.json", _regions,
     "remat run --model bert --batch-size 8 --budget 0.33 --backend inductor --check --pairs 5 --json", CPU),
    ("Time model (host and device)", "docs/time-model/time_model.json", _time_model,
     "python benchmarks/time_model.py --out docs/time-model", CPU),
    ("On a GPU", "docs/cuda/run-bert-b32-0.5-det.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda run", H100),
    ("", "docs/cuda/run-bert-b8-0.6-adamw-det.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda run", H100),
    ("", "docs/cuda/run-resnet152-b8-0.6.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda run", H100),
    ("", "docs/cuda/run-bert-b8-0.33-inductor.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda run", H100),
    ("The step as one CUDA graph", "docs/cuda/run-resnet152-b8-0.6-graph.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda graph", H100),
    ("", "docs/cuda/run-bert-b8-0.6-graph.json", _gpu, "benchmarks/cuda_runs.sh docs/cuda graph", H100),
]  # fmt: skip


def table() -> str:
    lines = ["| | figure | command | measured | machine |", "|---|---|---|---|---|"]
    for what, name, figure, command, machine in ROWS:
        path = ROOT / name
        if not path.exists():
            lines.append(f"| {what} | missing: {name} | | | {machine} |")
            continue
        doc = json.loads(path.read_text())
        if command is None:
            command = doc["meta"]["command"]
        lines.append(f"| {what} | {figure(doc)} ([{path.parent.name}/{path.name}]({path.relative_to(RESULTS.parent)})) | `{command}` | {_date(path)} | {machine} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table between the markers in {RESULTS.name}")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.write:
        doc = RESULTS.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{RESULTS} has no {BEGIN} ... {END} markers to put the table between")
        head, rest = doc.split(BEGIN, 1)
        RESULTS.write_text(head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
