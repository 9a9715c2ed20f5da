"""The time model against the clock: each configuration's predicted step time beside its
measured one, for each backend.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/time_model.py --out docs/time-model            # the defaults below
    .venv/bin/python benchmarks/time_model.py --configs bert-tiny:1:0.6 --backends eager --repeats 1 --out /tmp/tm

Each run is `remat run`'s measurement (remat.cli.run.run_one): the step compiled, then
timed against eager in alternating pairs. Predicted: the time model's graph (the plan's
ops, or for compiled regions the regions as they run, on the host and device timelines:
remat.profile.time_model) plus the host's own work around the graph as measured
(`call_host_seconds`). Measured: the median of real steps run one after another, as a
training loop runs them (`back_to_back_seconds`); beside it the median remat step of the
pairs, each run right after an eager step, where a step of compiled kernels on a small
model runs cold. Also shown, the prediction the planner's old sum made: eager's median
step (of the pairs) times the predicted overhead ratio. Writes one JSON per run, time_model.json (all rows), time_model.md (the table) and
time_model.png (predicted against measured).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = ("bert-tiny:1:0.6", "bert:8:0.33")  # host-bound, compute-bound on a CPU
FIELDS = ("back_to_back_seconds", "iteration_seconds", "predicted_iteration_seconds", "graph_seconds", "predicted_graph_seconds", "call_host_seconds")


def _row(result: dict[str, Any], repeat: int) -> dict[str, Any]:
    measured, predicted = result["back_to_back_seconds"], result["predicted_iteration_seconds"]
    return {
        "model": result["model"], "batch_size": result["batch_size"], "budget": result["budget"], "backend": result["backend"],
        "repeat": repeat, **{k: result[k] for k in FIELDS},
        "error": predicted / measured - 1.0,
        "error_in_pairs": predicted / result["iteration_seconds"] - 1.0,
        "ops": result["time_model"]["ops"], "num_recomputed": result["num_recomputed"], "regions": result["regions"],
        "eager_iteration_seconds": result["eager_iteration_seconds"],
        "sum_prediction_error": result["eager_iteration_seconds"] * result["predicted_overhead_ratio"] / result["iteration_seconds"] - 1.0
        if result["predicted_overhead_ratio"] else None,
    }  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | batch | budget | backend | ops | measured step, one after another (ms) | predicted (ms) | error | in pairs beside eager (ms): error | graph measured / predicted (ms) | eager × predicted ratio: error |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        old = "" if r["sum_prediction_error"] is None else f"{r['sum_prediction_error']:+.1%}"
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['budget']} | {r['backend']} | {r['ops']:,} | {r['back_to_back_seconds'] * 1e3:,.2f} | "
            f"{r['predicted_iteration_seconds'] * 1e3:,.2f} | {r['error']:+.1%} | {r['iteration_seconds'] * 1e3:,.2f}: {r['error_in_pairs']:+.1%} | "
            f"{r['graph_seconds'] * 1e3:,.2f} / "
            f"{r['predicted_graph_seconds'] * 1e3:,.2f} | {old} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["model"], r["batch_size"]) for r in rows}, key=lambda c: (c[1], c[0]))
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], configs):
        mine = [r for r in rows if (r["model"], r["batch_size"]) == (model, batch)]
        for backend, marker in (("eager", "o"), ("inductor", "s")):
            pts = [r for r in mine if r["backend"] == backend]
            if pts:
                ax.scatter([r["back_to_back_seconds"] * 1e3 for r in pts], [r["predicted_iteration_seconds"] * 1e3 for r in pts], marker=marker, label=f"backend {backend}")
        values = [r[k] * 1e3 for r in mine for k in ("back_to_back_seconds", "predicted_iteration_seconds")]
        lo, hi = min(values) * 0.85, max(values) * 1.15
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1, label="predicted = measured")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15, label="±10%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(f"{model}, batch {batch}", fontsize=11)
        ax.set_xlabel("measured step, one after another (ms)")
        ax.set_ylabel("predicted step (ms)")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Predicted step time (host and device timelines) against measured, CPU", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="model:batch:budget (default: %(default)s)")
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor"], choices=["eager", "inductor"])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, each its own compile (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=5, help="alternating eager/remat pairs timed per run (default: %(default)s)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    from remat.cli.run import run_one

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs:
        try:
            model, batch, budget = config.split(":")
            batch_size = int(batch)
        except ValueError:
            parser.error(f"--configs takes model:batch:budget, such as bert-tiny:1:0.6; got {config!r}")
        for backend in args.backends:
            for repeat in range(args.repeats):
                print(f"{model} batch {batch_size} budget {budget} backend {backend}, run {repeat + 1}/{args.repeats} ...", flush=True)
                result = run_one(model, batch_size, budget, pairs=args.pairs, backend=backend, progress=False)
                (args.out / f"{model}-b{batch_size}-{backend}-{repeat}.json").write_text(json.dumps(result) + "\n")
                rows.append(_row(result, repeat))
                print(f"  measured {rows[-1]['back_to_back_seconds'] * 1e3:.2f} ms, predicted {rows[-1]['predicted_iteration_seconds'] * 1e3:.2f} ms ({rows[-1]['error']:+.1%})", flush=True)
    (args.out / "time_model.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (args.out / "time_model.md").write_text(_table(rows))
    _plot(rows, args.out / "time_model.png")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
