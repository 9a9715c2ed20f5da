"""What compiling costs as graphs grow: capture, profile, plan and the whole compile.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planning_time.py --out docs/planning-time \
        --also bert:16:docs/planners/bert-b16-profile.json --also resnet152:4

On the deep, narrow decoders of `remat.models` (gpt-narrow-6, -20, -60: about 3,100,
9,900 and 29,200 nodes with AdamW at batch 2) each stage is timed once: capture,
profile (`--profile-runs`, as `remat.compile` does), and one plan per planner and budget
(each make_plan call's wall time, every graph it plans included; deriving those graphs
from the captured one, done once per compile, is timed on its own: those the default
planner plans, then the rest that planners without a local search also plan). Plans at
later budgets reuse what earlier ones worked out per graph; the default planner is also
timed cold, on a fresh index per budget, derivation included: what one compile pays. The whole compile
(`remat.compile`, first call: capture, profile, plan at the first budget, rewrite) is
timed on its own. `--also MODEL:BATCH[:PROFILE]` (repeatable) adds rows for a model with
SGD at `--also-budgets`, planned from a saved profile where one is given (only if it was
measured on the same graph), else profiled now.
Writes planning_time.csv, planning_time.md and planning_time.png (planning time against
node count) to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

COLD = "{} (cold: graphs derived, first plan)"  # the planner column of the plans timed on a fresh index
COLUMNS = ["model", "batch_size", "nodes", "stage", "planner", "budget", "seconds", "overhead_percent", "note"]


def _timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(model: str, batch: int, optimizer: str, budgets: list[float], planners: list[str], runs: int, saved: Path | None, compile_too: bool) -> list[dict]:
    import remat
    from remat.errors import BudgetError
    from remat.gc_pause import gc_paused
    from remat import build as pipeline
    from remat.capture.capture import capture
    from remat.profile.profiles import Profile
    from remat.memory.simulator import simulate
    from remat.defaults import DEFAULT_PLANNER
    from remat.memory.graph_index import GraphIndex
    from remat.planners import make_plan, planned_graphs
    from remat.workloads import load

    spec = load(model, batch, optimizer)
    tg, capture_s = _timed(lambda: capture(spec.train_step, spec.model, spec.optimizer, spec.batch))
    nodes = len(tg.gm.graph.nodes)
    profile = Profile.from_json(saved) if saved is not None else None
    built, profile_s = _timed(lambda: pipeline.build_on(tg, spec.model, spec.optimizer, spec.batch, runs=runs, saved_profile=profile))
    row = {"model": model, "batch_size": batch, "nodes": nodes, "planner": "", "budget": "", "overhead_percent": "", "note": ""}
    rows = [{**row, "stage": "capture", "seconds": capture_s}]
    rows.append({**row, "stage": "profile", "seconds": profile_s, "note": "saved profile read" if saved else f"{runs} runs"})
    # The graphs planned (lean variants, updates moved), derived once per index and shared
    # by every plan of it: timed on their own, so each plan's time is its own. The default
    # planner plans those with lean variants; the others also plan those without.
    # As a compile derives them: with the cyclic collector paused (`gc_paused`).
    with gc_paused():
        _, derive_s = _timed(lambda: planned_graphs(built.index, local_search=True))
        _, rest_s = _timed(lambda: planned_graphs(built.index))
    rows.append({**row, "stage": "derive", "seconds": derive_s, "note": "graphs the default planner plans: lean variants, updates moved"})
    rows.append({**row, "stage": "derive rest", "seconds": rest_s, "note": "graphs only planners without a local search plan: no lean variants"})
    base = simulate(built.analysis, scratch=built.index.scratch)
    seconds = built.node_seconds()
    iteration = sum(seconds.values())
    # What one compile's planning costs: the default planner on an index of its own (a fresh
    # copy of the captured one), so that the graphs it derives and every table it keeps per
    # graph are made inside the time.
    for fraction in budgets:
        budget = int(base.persistent_bytes + fraction * base.step_peak_bytes)
        fresh_index = GraphIndex.build(tg, built.analysis)
        fresh_index.scratch = built.index.scratch
        with gc_paused():
            t0 = time.perf_counter()
            try:
                plan = make_plan(DEFAULT_PLANNER, fresh_index, seconds, budget)
                overhead, note = f"{100 * plan.predicted_overhead_seconds / iteration:.2f}", ""
            except BudgetError as e:
                overhead, note = "", f"no plan: {str(e).splitlines()[0][:80]}"
            cold_s = time.perf_counter() - t0
        rows.append({**row, "stage": "plan", "planner": COLD.format(DEFAULT_PLANNER), "budget": fraction, "seconds": cold_s, "overhead_percent": overhead, "note": note})
        print(f"{model}: {nodes} nodes, {rows[-1]['planner']} at {fraction}: {cold_s:.2f} s {note}", flush=True)
    for fraction in budgets:
        budget = int(base.persistent_bytes + fraction * base.step_peak_bytes)
        for planner in planners:
            t0 = time.perf_counter()
            try:
                plan = make_plan(planner, built.index, seconds, budget)
                overhead, note = f"{100 * plan.predicted_overhead_seconds / iteration:.2f}", ""
            except BudgetError as e:
                overhead, note = "", f"no plan: {str(e).splitlines()[0][:80]}"
            rows.append({**row, "stage": "plan", "planner": planner, "budget": fraction, "seconds": time.perf_counter() - t0, "overhead_percent": overhead, "note": note})
            print(f"{model}: {nodes} nodes, {planner} at {fraction}: {rows[-1]['seconds']:.2f} s {note}", flush=True)
    if compile_too:
        fresh = load(model, batch, optimizer)
        step, compile_s = _timed(
            lambda: remat.compile(fresh.train_step, fresh.model, fresh.optimizer, fresh.batch, memory_budget=budgets[0], profile_runs=runs)
        )
        compile_s += _timed(lambda: step.compiled_for(fresh.batch))[1]  # where compile waits for the first batch
        rows.append({**row, "stage": "compile", "planner": step.planner, "budget": budgets[0], "seconds": compile_s, "note": "capture + profile + plan + rewrite"})
    print(f"{model}: {nodes} nodes, capture {capture_s:.1f} s, profile {profile_s:.1f} s" + (f", compile {rows[-1]['seconds']:.1f} s" if compile_too else ""), flush=True)
    return rows


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "planning_time.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.3f}" if k == "seconds" else r[k]) for k in COLUMNS})
    models = list(dict.fromkeys((r["model"], r["batch_size"], r["nodes"]) for r in rows))
    lines = ["| model | nodes | capture s | profile s | derive s (+ rest) | compile s | planner | " + " | ".join(f"plan s at {b}" for b in _budgets(rows)) + " |"]
    lines.append("|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(_budgets(rows)))
    for model, batch, nodes in models:
        mine = [r for r in rows if r["model"] == model and r["batch_size"] == batch]
        stage = {r["stage"]: r for r in mine if r["stage"] != "plan"}
        for planner in dict.fromkeys(r["planner"] for r in mine if r["stage"] == "plan"):
            cells = []
            for b in _budgets(rows):
                found = [r for r in mine if r["stage"] == "plan" and r["planner"] == planner and r["budget"] == b]
                cells.append(
                    "" if not found else f"{found[0]['seconds']:.2f}" + (f" ({found[0]['overhead_percent']}%)" if found[0]["overhead_percent"] else " (no plan)")
                )
            fmt = lambda k: f"{stage[k]['seconds']:.1f}" if k in stage else "–"  # noqa: E731
            derive = fmt("derive") + (f" (+ {fmt('derive rest')})" if "derive rest" in stage else "")
            lines.append(f"| {model} b{batch} | {nodes:,} | {fmt('capture')} | {fmt('profile')} | {derive} | {fmt('compile')} | {planner} | " + " | ".join(cells) + " |")
    (out / "planning_time.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "planning_time.png")


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["batch_size"], r["nodes"], r["seconds"] = int(r["batch_size"]), int(r["nodes"]), float(r["seconds"])
        r["budget"] = float(r["budget"]) if r["budget"] else ""
    return rows


def _budgets(rows: list[dict]) -> list[float]:
    return sorted({r["budget"] for r in rows if r["stage"] == "plan"})


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.8))
    plans = [r for r in rows if r["stage"] == "plan"]
    # Lines across models of one family (one graph each), one colour per budget, one line
    # style per planner; a model alone (BERT-base) as points at its own size.
    grown = {r["model"] for r in rows if r["model"].startswith("gpt-narrow")}
    colours = dict(zip(_budgets(rows), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for planner, style in ((COLD.format("refined"), "-D"), ("refined", "-o"), ("mutwo", ":s")):
        for b in _budgets(rows):
            pts = sorted((r["nodes"], r["seconds"]) for r in plans if r["planner"] == planner and r["budget"] == b and r["model"] in grown)
            if pts:
                ax.plot(*zip(*pts), style, color=colours[b], label=f"{planner}, budget {b}")
        alone = [(r["nodes"], r["seconds"]) for r in plans if r["planner"] == planner and r["model"] not in grown]
        if alone:
            marker = {"refined": "x", "mutwo": "+"}.get(planner, "1")
            ax.plot(*zip(*alone), marker, color="k", label=f"{planner}, BERT-base b16 and ResNet-152 b4 (each budget)")
    for stage, style, label in (("compile", "k--^", "whole compile (capture + profile + plan + rewrite)"), ("derive", "k-.v", "graphs the default planner plans, derived once")):
        pts = sorted((r["nodes"], r["seconds"]) for r in rows if r["stage"] == stage and r["model"] in grown)
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.axhline(3.0, color="grey", linestyle=":", linewidth=1, label="planning target at 30,000 nodes: 3 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [3_000, 10_000, 30_000]
    ax.set_xticks(ticks, [f"{t // 1000}k" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("graph nodes (one training iteration)")
    ax.set_ylabel("seconds, this machine")
    ax.set_title("Planning and compile time against graph size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt-narrow-6,gpt-narrow-20,gpt-narrow-60")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--budgets", default="0.4,0.6,0.8")
    p.add_argument("--planners", default="refined,mutwo")
    p.add_argument("--profile-runs", type=int, default=3)
    p.add_argument("--also", action="append", default=[], metavar="MODEL:BATCH[:PROFILE]", help="also plan MODEL at BATCH (SGD), from a saved profile if given")
    p.add_argument("--also-budgets", default="0.25,0.33,0.5,0.7,0.9")
    p.add_argument("--no-compile", action="store_true", help="skip timing the whole compile")
    p.add_argument("--out", default="runs/planning-time")
    p.add_argument("--replot", action="store_true", help="only redraw the table and plot from --out's planning_time.csv")
    args = p.parse_args()
    if args.replot:
        write(_read(Path(args.out) / "planning_time.csv"), Path(args.out))
        return 0
    budgets = [float(b) for b in args.budgets.split(",")]
    planners = args.planners.split(",")
    rows: list[dict] = []
    for model in args.models.split(","):
        rows += measure(model, args.batch_size, args.optimizer, budgets, planners, args.profile_runs, None, not args.no_compile)
        write(rows, Path(args.out))
    for also in args.also:
        model, batch, *path = also.split(":", 2)
        also_budgets = [float(b) for b in args.also_budgets.split(",")]
        rows += measure(model, int(batch), "sgd", also_budgets, planners, args.profile_runs, Path(path[0]) if path else None, False)
        write(rows, Path(args.out))
    print((Path(args.out) / "planning_time.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
