"""`remat plan`: profile (or load a profile), plan under a budget, show and save the plan.

Writes to the output folder: plan.json (the Plan), recomputed.csv (every recomputed
activation), plan_memory.png (the simulated memory timeline with and without the plan,
with the budget) and, when it profiled, profile.json (to pass back with --profile, so
that planning at other budgets skips the slow profiling).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

HELP = "choose what to recompute so that an iteration fits a memory budget, and predict the cost"
from remat.budget import MiB
from remat.defaults import DEFAULT_PLANNER


def configure(p: argparse.ArgumentParser) -> None:
    from remat.cli.common import add_model_arguments

    add_model_arguments(p, 'a fraction of the activation peak in (0, 1] (e.g. 0.5), or a cap on the whole peak: bytes or "6GiB", "500MB"')
    p.add_argument("--profile", default=None, metavar="FILE", help="a profile.json of this model and batch size (skips profiling)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/plan-<model>-b<B>-<planner>)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; tables go to stderr")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs per node when profiling (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and batch (default: 0)")
    p.add_argument("--top", type=int, default=20, metavar="K", help="recomputed activations to list (default: 20; all are in recomputed.csv)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `plan` to an argparse subparsers object (the registry in remat/cli/main.py does the same)."""
    p = subparsers.add_parser("plan", help=HELP, description=HELP)
    configure(p)
    p.set_defaults(_run=run)
    return p


# ---------------------------------------------------------------------- the steps


def plan_command(
    model: str,
    batch_size: int,
    budget: str | int | float,
    *,
    planner: str = DEFAULT_PLANNER,
    optimizer: str = "sgd",
    profile_path: str | Path | None = None,
    out_dir: str | Path | None = None,
    device: str = "cpu",
    runs: int = 3,
    seed: int = 0,
    progress: bool = True,
    lean_ops: bool = True,
) -> dict[str, Any]:
    """Everything `remat plan` does but printing: returns the plan, timelines and files."""
    from remat import build as pipeline
    from remat.budget import parse_budget
    from remat.cli.common import build_and_capture
    from remat.errors import PlanError
    from remat.planners.evaluate import baseline_of, evaluate
    from remat.planners import PLANNERS, make_plan
    from remat.profile.profiler import load_profile_for

    # Cheap checks first: a typo must not cost a profiling run.
    parsed = parse_budget(budget)
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r}; available planners: {', '.join(PLANNERS)}")
    if profile_path is not None and not Path(profile_path).is_file():
        raise PlanError(f"{profile_path}: no such profile file; make one with `remat profile` or drop --profile")

    spec, opt, tg, capture_s = build_and_capture(model, batch_size, optimizer, device, seed)
    if progress:
        print(f"captured {model} (batch {batch_size}, {optimizer}): {len(tg.op_nodes())} nodes in {capture_s:.1f} s", file=sys.stderr)
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"plan-{model}-b{batch_size}-{planner}"
    files: dict[str, Path] = {}
    saved = load_profile_for(profile_path, tg, model, batch_size, optimizer) if profile_path is not None else None
    built = pipeline.build_on(tg, spec.model, opt, spec.batch, runs=runs, device=device, progress=progress, saved_profile=saved)
    prof, index = built.profile, built.index  # predictions include the kernels' measured scratch
    if saved is None:
        prof.model, prof.batch_size, prof.optimizer = model, batch_size, optimizer
        prof.meta["seed"] = seed
        files["profile"] = prof.to_json(out / "profile.json")
    node_seconds = prof.seconds_by_node()

    baseline = baseline_of(index)
    budget_bytes = parsed.to_bytes(baseline.timeline.persistent_bytes, baseline.timeline.step_peak_bytes)
    plan = make_plan(
        planner,
        index,
        node_seconds,
        budget_bytes,
        fingerprint=prof.fingerprint,
        model=model,
        batch_size=batch_size,
        optimizer=optimizer,
        baseline_iteration_seconds=prof.iteration_seconds,
        meta={"budget": str(budget), "device": prof.device},
        lean_ops=lean_ops,
    )
    planned = plan.index_for(index)  # the graph the plan runs: its lean variants and moved updates
    final = evaluate(planned, plan.dropped(planned), node_seconds, plan.policy)
    files["plan"] = plan.to_json(out / "plan.json")
    files["recomputed"] = write_recomputed_csv(plan, out / "recomputed.csv")
    files["plot"] = plot_plan_memory(
        baseline,
        final,
        node_seconds,
        budget_bytes,
        out / "plan_memory.png",
        title=f"Simulated memory, {model} batch {batch_size} ({optimizer}), {planner} plan for budget {budget}",
    )
    return {"plan": plan, "profile": prof, "baseline": baseline, "final": final, "out": out, "files": files, "budget": parsed}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The one JSON object `remat plan --json` prints."""
    plan = result["plan"]
    return {
        "model": plan.model,
        "batch_size": plan.batch_size,
        "optimizer": plan.optimizer,
        "planner": plan.planner,
        "budget": result["budget"].describe(),
        "budget_bytes": plan.budget_bytes,
        "persistent_bytes": plan.persistent_bytes,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "baseline_step_peak_bytes": plan.baseline_step_peak_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_peak_bytes": plan.predicted_step_peak_bytes,
        "predicted_overhead_seconds": plan.predicted_overhead_seconds,
        "predicted_overhead_fraction": plan.predicted_overhead_fraction,
        "baseline_iteration_seconds": plan.baseline_iteration_seconds,
        "num_recomputed": plan.num_recomputed,
        "recomputed_bytes": sum(r.nbytes for r in plan.recomputed),
        "planning_seconds": plan.planning_seconds,
        "updates_in_backward": plan.updates_in_backward,
        "updates_note": plan.updates_note,
        "lean_ops": plan.lean_ops,
        "lean_ops_note": plan.meta.get("lean_ops_note", ""),
        "fingerprint": plan.fingerprint,
        "out_dir": str(result["out"]),
        "files": {k: str(v) for k, v in result["files"].items()},
    }


# ---------------------------------------------------------------------- output


def recomputed_table(plan: Any, top_k: int = 20) -> Any:
    """A rich Table of the recomputed activations in pick order: size, recompute time, ratio."""
    from rich.table import Table

    from remat.measurement.report import fmt_mib

    shown = plan.recomputed[: max(top_k, 0)]
    title = f"Recomputed activations ({plan.planner}): {plan.num_recomputed}"
    if len(shown) < plan.num_recomputed:
        title += f", first {len(shown)} in pick order (all in recomputed.csv)"
    table = Table(
        title=title,
        title_justify="left",
        caption="recompute time and ratio: rebuilding it from what the plan keeps (its sources)",
        caption_justify="left",
    )
    table.add_column("#", justify="right")
    table.add_column("activation")
    table.add_column("MiB", justify="right")
    table.add_column("recompute ms", justify="right")
    table.add_column("ratio MiB/ms", justify="right")
    table.add_column("ops", justify="right")
    table.add_column("sources")
    for i, r in enumerate(shown, 1):
        ratio = "∞" if r.ratio is None else f"{r.ratio / MiB / 1e3:,.3f}"
        srcs = ", ".join(r.sources[:3]) + (f" +{len(r.sources) - 3}" if len(r.sources) > 3 else "")
        table.add_row(str(i), r.key, fmt_mib(r.nbytes), f"{r.recompute_seconds * 1e3:,.3f}", ratio, str(len(r.ops)), srcs)
    return table


def totals_table(plan: Any) -> Any:
    from rich.table import Table

    from remat.measurement.report import fmt_mib

    table = Table(title="Predicted effect of the plan", title_justify="left")
    table.add_column("")
    table.add_column("without", justify="right")
    table.add_column("with plan", justify="right")
    table.add_row("peak (MiB)", fmt_mib(plan.baseline_peak_bytes), fmt_mib(plan.predicted_peak_bytes))
    table.add_row("activation peak (MiB)", fmt_mib(plan.baseline_step_peak_bytes), fmt_mib(plan.predicted_step_peak_bytes))
    table.add_row("budget (MiB)", "", fmt_mib(plan.budget_bytes))
    it = plan.baseline_iteration_seconds
    table.add_row("iteration (ms)", f"{it * 1e3:,.1f}", f"{(it + plan.predicted_overhead_seconds) * 1e3:,.1f}")
    table.add_row("overhead", "", f"{plan.predicted_overhead_fraction:.1%}")
    return table


def write_recomputed_csv(plan: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pick", "key", "nbytes", "recompute_seconds", "ratio_bytes_per_second", "num_ops", "sources"])
        for i, r in enumerate(plan.recomputed, 1):
            w.writerow([i, r.key, r.nbytes, f"{r.recompute_seconds:.9f}", "" if r.ratio is None else f"{r.ratio:.6g}", len(r.ops), " ".join(r.sources)])
    return path


def plot_plan_memory(baseline: Any, final: Any, node_seconds: dict[str, float], budget_bytes: int, path: str | Path, title: str = "") -> Path:
    """Total live memory over the iteration's run time, without and with the plan, and the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=120)
    for ev, label, color in ((baseline, "without recomputation", "#4c72b0"), (final, "with the plan", "#c44e52")):
        secs = np.array([node_seconds[s.node] for s in ev.schedule.steps], dtype=np.float64)
        x = np.concatenate([[0.0], np.cumsum(secs)]) * 1e3
        y = (ev.timeline.during + ev.timeline.persistent_bytes) / MiB
        ax.step(x, np.concatenate([y, y[-1:]]), where="post", color=color, linewidth=1.2, label=f"{label}: peak {ev.peak_bytes / MiB:,.1f} MiB")
    ax.axhline(budget_bytes / MiB, color="black", linestyle="--", linewidth=1.0, label=f"budget {budget_bytes / MiB:,.1f} MiB")
    ax.axhline(baseline.timeline.persistent_bytes / MiB, color="#888888", linestyle=":", linewidth=1.0, label="persistent (parameters, optimizer state)")
    ax.set_xlabel("time into the iteration (ms, summed median node times; copies included)")
    ax.set_ylabel("live memory (MiB)")
    ax.set_ylim(0, max(baseline.peak_bytes, final.peak_bytes, budget_bytes) / MiB * 1.12)
    ax.set_title(title or "Simulated memory with and without the plan", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from remat.measurement.report import console_for

    if args.batch_size < 1:
        from remat.errors import RematError

        raise RematError(f"batch size must be at least 1, got {args.batch_size}")
    t0 = time.perf_counter()
    result = plan_command(
        args.model,
        args.batch_size,
        args.budget,
        planner=args.planner,
        optimizer=args.optimizer,
        profile_path=args.profile,
        out_dir=args.out,
        device=args.device,
        runs=args.runs,
        seed=args.seed,
        progress=True,
        lean_ops=not args.no_lean_ops,
    )
    plan = result["plan"]
    console = console_for(sys.stderr) if args.json else console_for(sys.stdout)
    console.print(recomputed_table(plan, args.top))
    console.print(totals_table(plan))
    console.print(
        f"{plan.planner}: {plan.num_recomputed} activations recomputed, predicted peak "
        f"{plan.predicted_peak_bytes / MiB:,.1f} MiB (budget {plan.budget_bytes / MiB:,.1f} MiB), planned in "
        f"{plan.planning_seconds:.2f} s"
    )
    console.print(f"optimizer updates: {plan.updates_note}")
    console.print(f"lean operator variants: {plan.meta.get('lean_ops_note', '')}")
    console.print(f"wrote {', '.join(str(p) for p in result['files'].values())} ({time.perf_counter() - t0:.1f} s)")
    if args.json:
        print(json.dumps(summary(result)))
    return 0
