"""`remat bench` and `remat maxbatch`: remat side by side with what users would otherwise pick.

For each batch size, every method trains its own identical copy of the model in one
process: eager PyTorch, remat at each budget, and the baselines (`remat.measurement.baselines`).
Their peaks come from the one allocator tracker (`remat.profile.allocator.measure_peak`), and their
times from round-robin rounds (eager, then each method, the order rotated every round),
so that each method's ratio to eager is the median of per-round ratios taken seconds
apart (DESIGN.md, "Measuring time").

Results are written after every step of the sweep (results.json / results.csv), so an
interrupted sweep keeps what it measured; `resume=True` skips what is already there.
Plots and tables are redrawn from results.json alone (`replot`)."""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from remat.budget import MiB
from remat.defaults import DEFAULT_PLANNER
from remat.ops import dropout_masks
from remat.profile.allocator import persistent_bytes
from remat.progress import progress_bar
from remat.measurement.plots import plot_latency_vs_batch, plot_peak_vs_batch, plot_tradeoff
from remat.measurement.results import failure_reason, Method, RESULTS_HEADER, Results, load_results, methods_for, results_rows, write_markdown, write_results_csv, write_stats_csv, write_top_activations_csv




def _status_of(e: BaseException) -> str:
    from remat.measurement.baselines import NotSupported

    return "not supported" if isinstance(e, NotSupported) else "failed"


@dataclass
class _Live:
    method: Method
    step: Callable[[], Any]
    record: dict[str, Any]
    times: list[float]
    model: Any = None  # its own copy of the model: its gradients are dropped before the peak is measured


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_round_robin(live: list[_Live], eager: _Live, rounds: int, device: str, on_round: Callable[[], None] | None = None) -> None:
    """Rounds of one run per method, eager included, order rotated each round.

    A method that fails here is marked failed and leaves the rounds; eager failing
    ends the timing. Per-round times are appended to each `_Live.times`.
    """
    everyone = [eager] + live
    for r in range(rounds):
        active = [x for x in everyone if x.record.get("status") != "failed"]
        if eager not in active:
            return
        shift = r % len(active)
        order = active[shift:] + active[:shift]
        if r % 2:
            order.reverse()
        for x in order:
            _sync(device)
            t = time.perf_counter()
            try:
                x.step()
            except Exception as e:  # noqa: BLE001 - a failed run is a result
                x.record.update(status="failed", reason=failure_reason(e))
                continue
            _sync(device)
            x.times.append(time.perf_counter() - t)
        if on_round:
            on_round()


def _ratios(m: _Live, eager: _Live) -> dict[str, Any]:
    n = min(len(m.times), len(eager.times))
    if n == 0:
        return {}
    # Both lists grow one entry per round; a method that joined late is aligned from the end.
    ta, tb = eager.times[-n:], m.times[-n:]
    per = [b / a for a, b in zip(ta, tb)]
    return {
        "seconds": statistics.median(tb),
        "eager_seconds": statistics.median(ta),
        "ratio_to_eager": statistics.median(per),
        "ratio_min": min(per),
        "ratio_max": max(per),
        "rounds": n,
        "seconds_all": tb,
        "ratios_all": per,
    }


def _profile_stats(prof: Any, top_k: int = 10) -> dict[str, Any]:
    """What (a) shows for one batch size, from the eager graph's profile."""
    acts = prof.activations()
    act_bytes = sum(t.nbytes for t in acts)
    targets = {n.name: n.target for n in prof.nodes}
    top = sorted(acts, key=lambda t: (-t.nbytes, t.created))[:top_k]
    return {
        "num_nodes": prof.num_nodes,
        "nodes_per_phase": prof.nodes_per_phase,
        "phase_seconds": prof.phase_seconds,
        "iteration_seconds": prof.iteration_seconds,
        "persistent_bytes": prof.persistent_bytes,
        "simulated_peak_bytes": prof.simulated_peak_bytes,
        "measured_peak_bytes": prof.measured_peak_bytes,
        "peak_rank": prof.peak_rank,
        "peak_phase": prof.nodes[prof.peak_rank].phase if 0 <= prof.peak_rank < prof.num_nodes else None,
        "peak_breakdown": prof.peak_breakdown,
        "num_activations": len(acts),
        "activation_bytes": act_bytes,
        "activation_share_of_peak": prof.peak_breakdown.get("activation", 0) / prof.simulated_peak_bytes if prof.simulated_peak_bytes else None,
        "top_activations": [
            {
                "node": t.node,
                "op": targets.get(t.node, ""),
                "nbytes": t.nbytes,
                "created": t.created,
                "last_forward_use": t.last_forward_use,
                "first_backward_use": t.first_backward_use,
                "inactive_seconds": t.inactive_seconds,
            }
            for t in top
        ],
    }


def smallest_reachable_peak(prof: Any, spec: Any, opt: Any, train_step: Any, planner: str) -> int:
    """The smallest whole peak (bytes) `planner` reaches on this graph: asked for 1 byte, it says."""
    from remat import build as pipeline
    from remat.errors import BudgetError
    from remat.planners import make_plan

    built = pipeline.build(train_step, spec.model, opt, spec.batch, saved_profile=prof)
    try:
        plan = make_plan(planner, built.index, prof.seconds_by_node(), 1)
    except BudgetError as e:
        if e.reach is None:
            raise
        return int(e.reach.best)
    return int(plan.predicted_peak_bytes)


def _method_step(
    m: Method, mm: Any, mo: Any, spec: Any, rec: dict[str, Any], results: Results, batch_size: int, prof: Any, planner: str,
    profile_cache: dict[str, Any],
) -> Callable[[], Any]:  # fmt: skip
    """One training step of method `m` on its own model copy (mm, mo); notes and predictions go into `rec`."""
    import remat
    from remat.measurement.baselines import make_baseline
    from remat.measurement.check import check_one_graph

    if m.kind in ("remat", "remat-inductor"):
        budget = m.budget
        if budget == "min":
            budget = smallest_reachable_peak(prof, spec, spec.optimizer, spec.train_step, planner)
            rec["notes"] = f"planned at the smallest peak the planner reaches: {budget / MiB:,.1f} MiB"
        elif isinstance(budget, str) and budget.startswith("="):
            # Planned at a baseline's measured peak at this batch size: the
            # comparison at equal memory (the baseline must already be in the results).
            other = results.get(batch_size, budget[1:])
            if other is None or other.get("status") != "ok" or not other.get("peak_bytes"):
                raise ValueError(f"budget {budget}: no measured peak of {budget[1:]!r} at batch {batch_size} in the results yet")
            budget = int(other["peak_bytes"])
            rec["notes"] = f"planned at {m.budget[1:]}'s measured peak: {budget / MiB:,.1f} MiB"
        backend = "inductor" if m.kind == "remat-inductor" else "eager"
        step = remat.compile(spec.train_step, mm, mo, spec.batch, memory_budget=budget, planner=planner, profile_cache=profile_cache, backend=backend)
        check_one_graph(step._last.tg, "remat bench")
        rep = step.report
        rec.update(
            predicted_peak_bytes=rep.predicted_peak_bytes,
            budget_bytes=rep.budget_bytes,
            num_recomputed=rep.num_recomputed,
            recompute_ops=rep.copies,
            predicted_overhead_seconds=rep.plan.predicted_overhead_seconds if rep.plan else 0.0,
            predicted_overhead_ratio=(
                1 + rep.plan.predicted_overhead_seconds / rep.profile.iteration_seconds if rep.plan and rep.profile.iteration_seconds else 1.0
            ),
        )
        return lambda: step(spec.batch)
    else:
        if spec.loss_fn is None:
            from remat.measurement.baselines import NotSupported

            raise NotSupported(f"{spec.name} is a factory with its own train_step; {m.kind} rebuilds the step around a loss")
        bstep = make_baseline(m.kind, mm, spec.loss_fn, budget=m.budget)
        if m.kind == "sequential":
            rec["notes"] = f"{bstep.segments} segments over {bstep.blocks} blocks"  # type: ignore[attr-defined]
        return lambda: bstep(mm, mo, spec.batch)


def _measure_peaks(eager: _Live, live: list[_Live], device: str, persistent: int) -> None:
    """Each method's peak over one step, all under the one allocator tracker."""
    from remat.profile.allocator import measure_peak, measure_step_peak

    try:
        eager.step()
    except Exception as e:  # noqa: BLE001
        eager.record.update(status="failed", reason=failure_reason(e))
    for x in [eager] + live:
        if x.record["status"] == "failed":
            continue
        try:
            # A step that clears the last gradients first frees them inside the run (see measure_step_peak).
            measured = measure_step_peak(x.step, device, x.model) if x.model is not None else measure_peak(x.step, device)
        except Exception as e:  # noqa: BLE001
            x.record.update(status="failed", reason=failure_reason(e))
            continue
        peak = measured.peak_bytes
        x.record.update(persistent_bytes=persistent, peak_bytes=persistent + peak, activation_peak_bytes=peak)
        if measured.reserved_peak_bytes is not None:
            x.record["reserved_peak_bytes"] = persistent + measured.reserved_peak_bytes


def run_batch(
    model_name: str,
    batch_size: int,
    methods: list[Method],
    results: Results,
    *,
    optimizer: str = "sgd",
    device: str = "cpu",
    planner: str = DEFAULT_PLANNER,
    pairs: int = 3,
    seed: int = 0,
    say: Callable[[str], None] = lambda s: None,
    advance: Callable[[str], None] = lambda s: None,
) -> None:
    """Measure every method not yet in `results` at one batch size (eager always runs)."""
    import torch

    import remat
    from remat import build as pipeline
    from remat.measurement.check import twin
    from remat.memory.simulator import simulate
    from remat.workloads import load

    base = {"model": model_name, "device": device, "optimizer": optimizer, "batch_size": batch_size}
    todo = [m for m in methods if m.kind != "eager" and not results.done(batch_size, m.name)]
    eager_done = results.done(batch_size, "eager")
    if not todo and eager_done and str(batch_size) in results.stats:
        return
    spec = load(model_name, batch_size, optimizer, seed=seed, device=device)
    opt, train_step = spec.optimizer, spec.train_step

    def plain_step(m: Any, o: Any) -> Callable[[], Any]:
        return lambda: train_step(m, o, spec.batch)

    profile_cache: dict[str, Any] = {}  # every remat budget at this batch size plans from the eager graph's profile
    # The eager graph's profile: statistics (a), the eager prediction, and what every
    # remat budget plans from (profile_cache hands it to remat.compile).
    advance(f"b={batch_size}: capture + profile")
    t0 = time.perf_counter()
    prof = None
    try:
        built = pipeline.build(train_step, spec.model, opt, spec.batch, runs=3, profile_cache=profile_cache)
        prof, analysis = built.profile, built.analysis
        # The captured graph holds dropout masks as booleans where eager holds floats: no prediction of eager's peak then.
        eager_predicted = None if dropout_masks.held(built.tg.gm) else simulate(analysis, scratch=prof.scratch_by_node()).peak_bytes
        stats = _profile_stats(prof)
        stats["capture_profile_seconds"] = time.perf_counter() - t0
        results.stats[str(batch_size)] = stats
        del built, analysis
    except Exception as e:  # noqa: BLE001
        eager_predicted = None
        say(f"b={batch_size}: capture/profile failed: {failure_reason(e)}")
        results.stats[str(batch_size)] = {"error": failure_reason(e)}
    results.write()

    eager_model, eager_opt = twin(spec.model, opt)
    eager = _Live(Method("eager"), plain_step(eager_model, eager_opt), dict(base, method="eager", kind="eager", budget=None, status="running"), [], eager_model)
    eager.record["predicted_peak_bytes"] = eager_predicted
    live: list[_Live] = []
    for m in todo:
        advance(f"b={batch_size}: set up {m.name}")
        rec = dict(base, method=m.name, kind=m.kind, budget=m.budget, status="running")
        t0 = time.perf_counter()
        try:
            mm, mo = twin(spec.model, opt)
            fn = _method_step(m, mm, mo, spec, rec, results, batch_size, prof, planner, profile_cache)
            fn()  # first step: compiles (torch.compile) / measures (remat); state (momentum) now exists
            rec["setup_seconds"] = time.perf_counter() - t0
            live.append(_Live(m, fn, rec, [], mm))
        except Exception as e:  # noqa: BLE001 - a failed run is a result
            rec.update(status=_status_of(e), reason=failure_reason(e), setup_seconds=time.perf_counter() - t0)
            say(f"b={batch_size} {m.name}: {rec['status']}: {rec['reason']}")
            if not isinstance(e, (remat.errors.RematError,)) and "NotSupported" not in type(e).__name__:
                rec["traceback"] = traceback.format_exc()[-3000:]
            results.put(rec)
            results.write()
        gc.collect()

    # Peaks: one step each under the same tracker, state already created.
    advance(f"b={batch_size}: measure peaks")
    _measure_peaks(eager, live, device, persistent_bytes(eager_model, eager_opt, spec.batch))
    eager_act = eager.record.get("activation_peak_bytes")
    for x in live:
        if eager_act and x.record.get("activation_peak_bytes") is not None:
            x.record["eager_activation_peak_bytes"] = eager_act
            x.record["activation_ratio_to_eager"] = x.record["activation_peak_bytes"] / eager_act
    if not eager_done or live:
        results.put(eager.record)
    for x in live:
        results.put(x.record)
    results.write()

    # Times: round-robin with eager; results rewritten after every round.
    def on_round() -> None:
        advance(f"b={batch_size}: timing round")
        for x in live:
            x.record.update(_ratios(x, eager))
        if eager.times:
            eager.record.update(seconds=statistics.median(eager.times), ratio_to_eager=1.0, ratio_min=1.0, ratio_max=1.0, rounds=len(eager.times), seconds_all=list(eager.times))
        results.write()

    if eager.record["status"] != "failed":
        # No separate warm-up round: every method has already run twice (its first
        # step, then the peak measurement).
        time_round_robin([x for x in live if x.record["status"] != "failed"], eager, pairs, device, on_round)
    for x in [eager] + live:
        if x.record["status"] == "running":
            x.record["status"] = "ok"
        if x.record["status"] == "ok" and x.record.get("peak_bytes") is None:
            x.record.update(status="failed", reason="no peak measured")
    if not eager_done or live:
        results.put(eager.record)
    results.write()
    del live, eager, spec, opt, prof
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench(
    model: str,
    batch_sizes: list[int],
    budgets: list[float],
    baselines: list[str],
    out_dir: str | Path,
    *,
    optimizer: str = "sgd",
    device: str = "cpu",
    planner: str = DEFAULT_PLANNER,
    pairs: int = 3,
    seed: int = 0,
    resume: bool = False,
    retry_failed: bool = False,
    progress: bool = True,
) -> dict[str, Path]:
    """Run the sweep, writing results after every step; then tables and plots. Returns the files."""
    import torch

    out = Path(out_dir)
    meta = {
        "model": model,
        "device": device,
        "optimizer": optimizer,
        "planner": planner,
        "pairs": pairs,
        "seed": seed,
        "budgets": budgets,
        "baselines": baselines,
        "batch_sizes": batch_sizes,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(["remat"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("remat", "cli_bench.py")) else None,
    }
    results = Results(out, meta, resume)
    results.retry_failed = retry_failed
    results.meta.update(budgets=sorted(set(results.meta.get("budgets", [])) | set(budgets), key=lambda b: (isinstance(b, str), -b if not isinstance(b, str) else 0)))
    methods = methods_for(budgets, baselines)

    def steps_for(b: int) -> int:
        todo = [m for m in methods if m.kind != "eager" and not results.done(b, m.name)]
        if not todo and results.done(b, "eager") and str(b) in results.stats:
            return 0
        return 2 + len(todo) + pairs

    total = sum(steps_for(b) for b in batch_sizes) + 1  # and the tables and plots
    with progress_bar(progress, total, model) as bar:

        def advance(what: str) -> None:
            bar.advance(f"{model} {what}")

        say = bar.say
        for b in batch_sizes:
            try:
                run_batch(model, b, methods, results, optimizer=optimizer, device=device, planner=planner, pairs=pairs, seed=seed, say=say, advance=advance)
            except Exception as e:  # noqa: BLE001 - the sweep goes on
                say(f"b={b}: failed: {failure_reason(e)}")
                if not results.done(b, "eager"):
                    results.put(dict(model=model, device=device, optimizer=optimizer, batch_size=b, method="eager", kind="eager", budget=None, status="failed", reason=failure_reason(e)))
                results.write()
            gc.collect()
        bar.advance(f"{model}: tables and plots")
    return replot(out)


def replot(out_dir: str | Path) -> dict[str, Path]:
    """Tables and plots from results.json alone: no model is run."""
    out = Path(out_dir)
    doc = load_results(out)
    files = {
        "results": out / "results.json",
        "results_csv": write_results_csv(doc["runs"], out / "results.csv"),
        "stats_csv": write_stats_csv(doc, out / "profile_stats.csv"),
        "top_activations_csv": write_top_activations_csv(doc, out / "top_activations.csv"),
        "tables": write_markdown(doc, out / "tables.md"),
        "peak_plot": plot_peak_vs_batch(doc, out / "peak_vs_batch.png"),
        "latency_plot": plot_latency_vs_batch(doc, out / "latency_vs_batch.png"),
        "tradeoff_plot": plot_tradeoff(doc, out / "tradeoff.png"),
    }
    return files


def demo(
    out_dir: str | Path = "runs/demo",
    progress: bool = True,
    model: str = "bert",
    batch_sizes: tuple[int, ...] = (8,),
    budgets: tuple[float | str, ...] = (0.45,),
) -> dict[str, Path]:
    """A small bench on CPU: BERT-base at batch 8, remat at 0.45 of eager's activation
    peak (below HF's per-block checkpointing, about 0.48 there), HF's checkpointing, 2
    rounds (a few minutes). Below the gradient floor only because each update runs as
    soon as its gradient is final."""
    from remat.measurement.report import console_for

    out = Path(out_dir) / f"bench-{model}"
    files = bench(model, list(batch_sizes), list(budgets), ["hf"], out, pairs=2, progress=progress)
    console = console_for(sys.stdout)
    doc = load_results(out)
    from rich.table import Table

    table = Table(title=f"{model}: eager vs remat vs HF checkpointing", title_justify="left")
    for h in ["batch", "method", "peak MiB", "predicted MiB", "time / eager"]:
        table.add_column(h, justify="right" if h != "method" else "left")
    col = {h: i for i, h in enumerate(RESULTS_HEADER)}  # by name: the table gains columns (reserved peak on CUDA)
    for row in results_rows(doc):
        time_or_reason = row[col["time / eager (median, min–max)"]] if row[col["status"]] == "ok" else f"{row[col['status']]}: {row[col['note']][:60]}"
        table.add_row(str(row[col["batch"]]), row[col["method"]], row[col["peak MiB (measured)"]], row[col["peak MiB (predicted)"]], time_or_reason)
    console.print(table)
    console.print("[bold]bench outputs[/bold]")
    for k, p in files.items():
        console.print(f"  {k}: {p}")
    return files
