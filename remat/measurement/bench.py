"""`remat bench` and `remat maxbatch`: remat side by side with what users would otherwise pick.

For each batch size, every method trains its own identical copy of the model in one
process: eager PyTorch, remat at each budget, and the baselines (`remat.measurement.baselines`).
Their peaks come from the one allocator tracker (`remat.measurement.memory.measure_peak`), and their
times from round-robin rounds (eager, then each method, the order rotated every round),
so that each method's ratio to eager is the median of per-round ratios taken seconds
apart (DESIGN.md, "Measuring time").

Results are written after every step of the sweep (results.json / results.csv), so an
interrupted sweep keeps what it measured; `resume=True` skips what is already there.
Plots and tables are redrawn from results.json alone (`replot`).
"""

from __future__ import annotations

import csv
import gc
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MiB = 2**20
GiB = 2**30
RESULTS_FORMAT = "remat.bench"
RESULTS_VERSION = 1

# Method names: "eager", "remat@0.5", "hf", "sequential", "compile@0.5".
METHOD_COLORS = {"eager": "#4c72b0", "remat": "#c44e52", "hf": "#55a868", "sequential": "#dd8452", "compile": "#8172b3"}
METHOD_LABELS = {
    "eager": "eager (no checkpointing)",
    "remat": "remat (μ-TWO)",
    "hf": "HF gradient_checkpointing_enable()",
    "sequential": "checkpoint_sequential (√n)",
    "compile": "torch.compile + activation_memory_budget",
}


@dataclass(frozen=True)
class Method:
    kind: str  # eager, remat, hf, sequential, compile
    budget: float | str | None = None  # a fraction; "min": the smallest peak its planner reaches; "=hf": hf's measured peak

    @property
    def name(self) -> str:
        if self.budget is None:
            return self.kind
        return f"{self.kind}@{self.budget}" if isinstance(self.budget, str) else f"{self.kind}@{self.budget:g}"


def methods_for(budgets: list[float | str], baselines: list[str]) -> list[Method]:
    """Eager first, then remat at each budget, then the baselines (compile at each fraction)."""
    out = [Method("eager")] + [Method("remat", b) for b in budgets]
    for name in baselines:
        if name == "compile":
            out += [Method("compile", b) for b in budgets if not isinstance(b, str)]
        else:
            out.append(Method(name))
    return out


def method_kind(name: str) -> str:
    return name.split("@", 1)[0]


# ---------------------------------------------------------------------- results file


class Results:
    """results.json: meta, one record per (batch size, method), and per-batch-size stats."""

    def __init__(self, out_dir: Path, meta: dict[str, Any], resume: bool):
        self.out = out_dir
        self.path = out_dir / "results.json"
        self.meta = meta
        self.runs: list[dict[str, Any]] = []
        self.stats: dict[str, dict[str, Any]] = {}
        if resume and self.path.exists():
            doc = json.loads(self.path.read_text())
            for key in ("model", "device", "optimizer"):
                if doc["meta"].get(key) != meta.get(key):
                    from remat.errors import UsageError

                    raise UsageError(f"--resume: {self.path} is for {key} {doc['meta'].get(key)!r}, not {meta.get(key)!r}")
            self.runs = doc["runs"]
            for r in self.runs:  # left "running" by a sweep that was stopped: run again when asked
                if r.get("status") == "running":
                    r.update(status="interrupted", reason="the sweep was stopped during this run")
            self.stats = doc.get("stats", {})
            self.meta = {**doc["meta"], **meta}
        # Every command that added to this file, in order (the latest is "command").
        self.meta["commands"] = [c for c in self.meta.get("commands", []) if c] + ([meta["command"]] if meta.get("command") else [])

    def get(self, batch_size: int, method: str) -> dict[str, Any] | None:
        for r in self.runs:
            if r["batch_size"] == batch_size and r["method"] == method:
                return r
        return None

    retry_failed = False  # re-run failures other than BudgetError (e.g. a crash since fixed)

    def done(self, batch_size: int, method: str) -> bool:
        r = self.get(batch_size, method)
        if r is not None and r.get("status") == "failed" and self.retry_failed:
            return str(r.get("reason", "")).startswith("BudgetError")
        return r is not None and r.get("status") in ("ok", "failed", "not supported")

    def put(self, record: dict[str, Any]) -> None:
        old = self.get(record["batch_size"], record["method"])
        if old is not None:
            self.runs.remove(old)
        self.runs.append(record)
        self.runs.sort(key=lambda r: (r["batch_size"], _method_order(r["method"])))

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, "meta": self.meta, "runs": self.runs, "stats": self.stats}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.path)  # atomic: an interrupted write never leaves half a file
        write_results_csv(self.runs, self.out / "results.csv")


def _method_order(name: str) -> tuple[int, float]:
    order = ["eager", "remat", "hf", "sequential", "compile"]
    kind = method_kind(name)
    tail = name.split("@")[1] if "@" in name else "0"
    budget = float(tail) if tail.replace(".", "", 1).isdigit() else (-1.0 if tail == "min" else -2.0)  # then min, then =baseline
    return (order.index(kind) if kind in order else len(order), -budget)


RESULT_COLUMNS = [
    "model", "device", "optimizer", "batch_size", "method", "kind", "budget", "status", "reason",
    "peak_bytes", "predicted_peak_bytes", "reserved_peak_bytes", "persistent_bytes", "activation_peak_bytes",
    "eager_activation_peak_bytes", "activation_ratio_to_eager",
    "seconds", "eager_seconds", "ratio_to_eager", "ratio_min", "ratio_max", "rounds",
    "num_recomputed", "predicted_overhead_ratio", "setup_seconds", "notes",
]  # fmt: skip


def write_results_csv(runs: list[dict[str, Any]], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in runs:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in RESULT_COLUMNS})
    return path


# ---------------------------------------------------------------------- measuring


def persistent_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of the storages that live across steps: parameters, buffers, optimizer state."""
    import torch

    seen: dict[Any, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    return sum(seen.values())


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if "out of memory" in text.lower() or "can't allocate memory" in text.lower() or isinstance(e, MemoryError):
        return "out of memory: " + first[:300]
    return first[:500]


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
                x.record.update(status="failed", reason=_reason(e))
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


# ---------------------------------------------------------------------- one batch size


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
    from remat.pipeline import build as pipeline
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


def run_batch(
    model_name: str,
    batch_size: int,
    methods: list[Method],
    results: Results,
    *,
    optimizer: str = "sgd",
    device: str = "cpu",
    planner: str = "mutwo",
    pairs: int = 3,
    seed: int = 0,
    say: Callable[[str], None] = lambda s: None,
    advance: Callable[[str], None] = lambda s: None,
) -> None:
    """Measure every method not yet in `results` at one batch size (eager always runs)."""
    import torch

    import remat
    from remat.pipeline import build as pipeline
    from remat.measurement.baselines import make_baseline
    from remat.measurement.check import twin
    from remat.measurement.memory import measure_peak, measure_step_peak
    from remat.pipeline.simulator import simulate
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
        eager_predicted = simulate(analysis, scratch=prof.scratch_by_node()).peak_bytes
        stats = _profile_stats(prof)
        stats["capture_profile_seconds"] = time.perf_counter() - t0
        results.stats[str(batch_size)] = stats
        del built, analysis
    except Exception as e:  # noqa: BLE001
        eager_predicted = None
        say(f"b={batch_size}: capture/profile failed: {_reason(e)}")
        results.stats[str(batch_size)] = {"error": _reason(e)}
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
            if m.kind == "remat":
                budget = m.budget
                if budget == "min":
                    budget = smallest_reachable_peak(prof, spec, opt, train_step, planner)
                    rec["notes"] = f"planned at the smallest peak the planner reaches: {budget / MiB:,.1f} MiB"
                elif isinstance(budget, str) and budget.startswith("="):
                    # Planned at a baseline's measured peak at this batch size: the
                    # comparison at equal memory (the baseline must already be in the results).
                    other = results.get(batch_size, budget[1:])
                    if other is None or other.get("status") != "ok" or not other.get("peak_bytes"):
                        raise ValueError(f"budget {budget}: no measured peak of {budget[1:]!r} at batch {batch_size} in the results yet")
                    budget = int(other["peak_bytes"])
                    rec["notes"] = f"planned at {m.budget[1:]}'s measured peak: {budget / MiB:,.1f} MiB"
                step = remat.compile(train_step, mm, mo, spec.batch, memory_budget=budget, planner=planner, profile_cache=profile_cache)
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
                fn = (lambda s: lambda: s(spec.batch))(step)
            else:
                if spec.loss_fn is None:
                    from remat.measurement.baselines import NotSupported

                    raise NotSupported(f"{model_name} is a factory with its own train_step; {m.kind} rebuilds the step around a loss")
                bstep = make_baseline(m.kind, mm, spec.loss_fn, budget=m.budget)
                if m.kind == "sequential":
                    rec["notes"] = f"{bstep.segments} segments over {bstep.blocks} blocks"  # type: ignore[attr-defined]
                fn = (lambda s, a, o: lambda: s(a, o, spec.batch))(bstep, mm, mo)
            fn()  # first step: compiles (torch.compile) / measures (remat); state (momentum) now exists
            rec["setup_seconds"] = time.perf_counter() - t0
            live.append(_Live(m, fn, rec, [], mm))
        except Exception as e:  # noqa: BLE001 - a failed run is a result
            rec.update(status=_status_of(e), reason=_reason(e), setup_seconds=time.perf_counter() - t0)
            say(f"b={batch_size} {m.name}: {rec['status']}: {rec['reason']}")
            if not isinstance(e, (remat.errors.RematError,)) and "NotSupported" not in type(e).__name__:
                rec["traceback"] = traceback.format_exc()[-3000:]
            results.put(rec)
            results.write()
        gc.collect()

    # Peaks: one step each under the same tracker, state already created.
    advance(f"b={batch_size}: measure peaks")
    try:
        eager.step()
    except Exception as e:  # noqa: BLE001
        eager.record.update(status="failed", reason=_reason(e))
    persistent = persistent_bytes(eager_model, eager_opt)
    for x in [eager] + live:
        if x.record["status"] == "failed":
            continue
        try:
            # A step that clears the last gradients first frees them inside the run (see measure_step_peak).
            measured = measure_step_peak(x.step, device, x.model) if x.model is not None else measure_peak(x.step, device)
        except Exception as e:  # noqa: BLE001
            x.record.update(status="failed", reason=_reason(e))
            continue
        peak = measured.peak_bytes
        x.record.update(persistent_bytes=persistent, peak_bytes=persistent + peak, activation_peak_bytes=peak)
        if measured.reserved_peak_bytes is not None:
            x.record["reserved_peak_bytes"] = persistent + measured.reserved_peak_bytes
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


# ---------------------------------------------------------------------- the sweep


def bench(
    model: str,
    batch_sizes: list[int],
    budgets: list[float],
    baselines: list[str],
    out_dir: str | Path,
    *,
    optimizer: str = "sgd",
    device: str = "cpu",
    planner: str = "mutwo",
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
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    def steps_for(b: int) -> int:
        todo = [m for m in methods if m.kind != "eager" and not results.done(b, m.name)]
        if not todo and results.done(b, "eager") and str(b) in results.stats:
            return 0
        return 2 + len(todo) + pairs

    total = sum(steps_for(b) for b in batch_sizes)
    from remat.measurement.report import console_for

    console = console_for(sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console, disable=not progress) as bar:
        task = bar.add_task(f"{model}", total=total)

        def advance(what: str) -> None:
            bar.update(task, advance=1, description=f"{model} {what}")

        def say(msg: str) -> None:
            bar.console.print(msg)

        for b in batch_sizes:
            try:
                run_batch(model, b, methods, results, optimizer=optimizer, device=device, planner=planner, pairs=pairs, seed=seed, say=say, advance=advance)
            except Exception as e:  # noqa: BLE001 - the sweep goes on
                say(f"b={b}: failed: {_reason(e)}")
                if not results.done(b, "eager"):
                    results.put(dict(model=model, device=device, optimizer=optimizer, batch_size=b, method="eager", kind="eager", budget=None, status="failed", reason=_reason(e)))
                results.write()
            gc.collect()
        bar.update(task, completed=total, description=f"{model} done")
    return replot(out)


# ---------------------------------------------------------------------- tables and plots


def load_results(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / "results.json"
    if not path.exists():
        from remat.errors import UsageError

        raise UsageError(f"no results.json in {out_dir}")
    doc = json.loads(path.read_text())
    if doc.get("format") != RESULTS_FORMAT:
        from remat.errors import UsageError

        raise UsageError(f"{path} is not a remat bench results file")
    return doc


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


def _batch_sizes(doc: dict[str, Any]) -> list[int]:
    return sorted({r["batch_size"] for r in doc["runs"]} | {int(b) for b in doc.get("stats", {})})


def _method_names(doc: dict[str, Any]) -> list[str]:
    return sorted({r["method"] for r in doc["runs"]}, key=_method_order)


STATS_COLUMNS = [
    "batch_size", "iteration_ms", "forward_ms", "backward_ms", "optimizer_ms", "nodes",
    "persistent_mib", "peak_simulated_mib", "peak_measured_mib", "peak_phase",
    "parameter_mib", "optimizer_state_mib", "input_mib", "gradient_mib", "activation_mib", "other_mib",
    "activation_share_of_peak", "num_activations", "activation_total_mib",
]  # fmt: skip


def _stats_row(b: str, s: dict[str, Any]) -> dict[str, Any]:
    ph = s.get("phase_seconds", {})
    bd = s.get("peak_breakdown", {})
    return {
        "batch_size": int(b),
        "iteration_ms": round(s["iteration_seconds"] * 1e3, 1),
        "forward_ms": round(ph.get("forward", 0) * 1e3, 1),
        "backward_ms": round(ph.get("backward", 0) * 1e3, 1),
        "optimizer_ms": round(ph.get("optimizer", 0) * 1e3, 1),
        "nodes": s["num_nodes"],
        "persistent_mib": round(s["persistent_bytes"] / MiB, 1),
        "peak_simulated_mib": round(s["simulated_peak_bytes"] / MiB, 1),
        "peak_measured_mib": round(s["measured_peak_bytes"] / MiB, 1),
        "peak_phase": s.get("peak_phase"),
        **{f"{role}_mib": round(bd.get(role, 0) / MiB, 1) for role in ("parameter", "optimizer_state", "input", "gradient", "activation", "other")},
        "activation_share_of_peak": round(s["activation_share_of_peak"], 3) if s.get("activation_share_of_peak") is not None else None,
        "num_activations": s["num_activations"],
        "activation_total_mib": round(s["activation_bytes"] / MiB, 1),
    }


def write_stats_csv(doc: dict[str, Any], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=STATS_COLUMNS)
        w.writeheader()
        for b, s in sorted(doc.get("stats", {}).items(), key=lambda kv: int(kv[0])):
            if "error" not in s:
                w.writerow(_stats_row(b, s))
    return path


def write_top_activations_csv(doc: dict[str, Any], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["batch_size", "rank", "node", "op", "mib", "created", "last_forward_use", "first_backward_use", "inactive_ms"])
        for b, s in sorted(doc.get("stats", {}).items(), key=lambda kv: int(kv[0])):
            for i, t in enumerate(s.get("top_activations", [])):
                w.writerow([b, i + 1, t["node"], t["op"], round(t["nbytes"] / MiB, 2), t["created"], t["last_forward_use"], t["first_backward_use"], round((t["inactive_seconds"] or 0) * 1e3, 1)])
    return path


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v: Any, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def results_rows(doc: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for r in doc["runs"]:
        ok = r.get("status") == "ok"
        note = r.get("reason") or r.get("notes") or ""
        rows.append(
            [
                r["batch_size"],
                r["method"],
                r.get("status"),
                _fmt(r.get("peak_bytes") / MiB) if ok and r.get("peak_bytes") else "–",
                _fmt(r.get("predicted_peak_bytes") / MiB) if r.get("predicted_peak_bytes") else "–",
                _fmt(r.get("reserved_peak_bytes") / MiB) if ok and r.get("reserved_peak_bytes") else "–",
                _fmt(r.get("activation_peak_bytes") / MiB) if ok and r.get("activation_peak_bytes") is not None else "–",
                _fmt(r.get("activation_ratio_to_eager"), 2) if ok and r.get("activation_ratio_to_eager") is not None else ("1.00" if ok and r["kind"] == "eager" else "–"),
                _fmt(r.get("seconds") * 1e3, 0) if ok and r.get("seconds") else "–",
                (f"{r['ratio_to_eager']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f})" if ok and r.get("ratio_to_eager") and r["kind"] != "eager" else ("1" if ok and r["kind"] == "eager" else "–")),
                _fmt(r.get("predicted_overhead_ratio"), 3) if r.get("predicted_overhead_ratio") else "",
                str(note).replace("|", "/")[:160],
            ]
        )
    return rows


RESULTS_HEADER = ["batch", "method", "status", "peak MiB (measured)", "peak MiB (predicted)", "reserved MiB (CUDA)", "activation peak MiB", "act. peak / eager", "ms / iteration (median)", "time / eager (median, min–max)", "predicted time / eager", "note"]


def write_markdown(doc: dict[str, Any], path: Path) -> Path:
    meta = doc["meta"]
    parts = [
        f"# remat bench: {meta['model']} on {meta['device']} ({meta['optimizer']})",
        "",
        f"torch {meta.get('torch')}, {meta.get('threads')} threads, {meta.get('pairs')} timing rounds (round-robin with eager). "
        "Peaks: the allocator's events (`remat.measurement.memory.measure_peak`), persistent bytes (parameters, buffers, optimizer state) included. "
        "torch.compile times include kernel fusion (inductor): compare its memory, not its time.",
        "",
        "## Runs",
        "",
        _md_table(RESULTS_HEADER, results_rows(doc)),
        "",
        "## Profile of the eager iteration, per batch size",
        "",
    ]
    stats = sorted(((int(b), s) for b, s in doc.get("stats", {}).items() if "error" not in s), key=lambda kv: kv[0])
    if stats:
        rows = [_stats_row(str(b), s) for b, s in stats]
        parts.append(_md_table(STATS_COLUMNS, [[r[c] for c in STATS_COLUMNS] for r in rows]))
        parts.append("")
        for b, s in stats:
            parts += [f"### Largest activations, batch {b}", ""]
            parts.append(
                _md_table(
                    ["node", "op", "MiB", "created", "last fwd use", "first bwd use", "inactive ms"],
                    [[t["node"], t["op"].removeprefix("aten.").removesuffix(".default"), _fmt(t["nbytes"] / MiB, 2), t["created"], t["last_forward_use"], t["first_backward_use"], _fmt((t["inactive_seconds"] or 0) * 1e3)] for t in s.get("top_activations", [])],
                )
            )
            parts.append("")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(name: str, names: list[str]) -> Any:
    """Each kind its colour; budgets of a kind get lighter as the budget grows."""
    import matplotlib.colors as mcolors

    kind = method_kind(name)
    base = mcolors.to_rgb(METHOD_COLORS.get(kind, "#333333"))
    same = [n for n in names if method_kind(n) == kind]
    if len(same) <= 1:
        return base
    i = same.index(name)
    t = 0.6 * i / (len(same) - 1)
    return tuple(c + (1 - c) * t for c in base)


def _label(name: str) -> str:
    kind = method_kind(name)
    text = METHOD_LABELS.get(kind, kind)
    if "@" in name:
        tail = name.split("@")[1]
        text += f", at {tail[1:]}'s peak" if tail.startswith("=") else f", budget {tail}"
    return text


def plot_peak_vs_batch(doc: dict[str, Any], path: Path) -> Path:
    """(b): grouped bars of measured peak per batch size; predicted peaks as markers."""
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    sizes = _batch_sizes(doc)
    names = _method_names(doc)
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(sizes) * max(3, len(names)) * 0.45 + 2) + 4, 5.2))
    width = 0.8 / max(1, len(names))
    has_pred = False
    legend: list[tuple[Any, str]] = []
    for j, name in enumerate(names):
        xs, ys, preds, fails = [], [], [], []
        for i, b in enumerate(sizes):
            r = next((r for r in doc["runs"] if r["batch_size"] == b and r["method"] == name), None)
            x = i - 0.4 + width * (j + 0.5)
            if r is None:
                continue
            if r.get("status") == "ok" and r.get("peak_bytes"):
                xs.append(x)
                ys.append(r["peak_bytes"] / MiB)
            else:
                fails.append((x, {"not supported": "n/s", "interrupted": "stopped", "running": "running"}.get(r.get("status"), "failed")))
            if r.get("predicted_peak_bytes"):
                preds.append((x, r["predicted_peak_bytes"] / MiB))
        ax.bar(xs, ys, width=width * 0.95, color=_color(name, names), edgecolor="white", linewidth=0.5)
        legend.append((Patch(facecolor=_color(name, names)), _label(name) + ("" if xs else " (no successful run)")))
        if preds:
            has_pred = True
            ax.scatter([p[0] for p in preds], [p[1] for p in preds], marker="_", s=180, color="black", linewidths=2, zorder=5)
        for x, text in fails:
            ax.text(x, 0, text, rotation=90, ha="center", va="bottom", fontsize=7, color=_color(name, names))
    # Persistent bytes (parameters, buffers, optimizer state): the floor no method goes under.
    pers = [(i, s["persistent_bytes"] / MiB) for i, b in enumerate(sizes) if "persistent_bytes" in (s := doc.get("stats", {}).get(str(b), {}))]
    for i, p in pers:
        ax.hlines(p, i - 0.42, i + 0.42, colors="0.3", linestyles=":", linewidth=1.2, zorder=6)
    ax.set_xticks(range(len(sizes)), [str(b) for b in sizes])
    ax.set_xlabel("mini-batch size")
    ax.set_ylabel("peak memory per iteration (MiB)")
    meta = doc["meta"]
    ax.set_title(f"{meta['model']} ({meta['device']}, {meta['optimizer']}): measured peak memory vs batch size")
    handles, labels = [h for h, _ in legend], [t for _, t in legend]
    if has_pred:
        handles.append(Line2D([], [], marker="_", color="black", linestyle="none", markersize=12, markeredgewidth=2))
        labels.append("predicted (simulator)")
    if pers:
        handles.append(Line2D([], [], color="0.3", linestyle=":"))
        labels.append("persistent (params, buffers, optimizer state)")
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _series(doc: dict[str, Any], name: str, key: str) -> tuple[list[int], list[float], list[tuple[float, float]]]:
    xs, ys, spread = [], [], []
    for r in doc["runs"]:
        if r["method"] == name and r.get("status") == "ok" and r.get(key) is not None:
            xs.append(r["batch_size"])
            ys.append(r[key])
            spread.append((r.get("ratio_min", r[key]), r.get("ratio_max", r[key])))
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    return [xs[i] for i in order], [ys[i] for i in order], [spread[i] for i in order]


def plot_latency_vs_batch(doc: dict[str, Any], path: Path) -> Path:
    """(c): median seconds per iteration vs batch size, and the ratio to eager (min–max bars)."""
    plt = _plt()
    names = _method_names(doc)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        style = dict(color=_color(name, names), marker="o", label=_label(name), linestyle="--" if method_kind(name) == "compile" else "-")
        xs, ys, _ = _series(doc, name, "seconds")
        if xs:
            ax1.plot(xs, ys, **style)
        xs, ys, spread = _series(doc, name, "ratio_to_eager")
        if xs:
            err = [[y - lo for y, (lo, _) in zip(ys, spread)], [hi - y for y, (_, hi) in zip(ys, spread)]]
            ax2.errorbar(xs, ys, yerr=err, capsize=3, **style)
    sizes = _batch_sizes(doc)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("mini-batch size")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax1.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax1.yaxis.set_major_formatter(ScalarFormatter())
    ax1.yaxis.set_minor_formatter(ScalarFormatter())
    ax1.set_ylabel("iteration time, median (s, log scale)")
    ax1.set_title("iteration latency")
    ax2.axhline(1.0, color="0.4", linewidth=0.8)
    ratios = [y for name in names for y in _series(doc, name, "ratio_to_eager")[1]]
    if ratios and max(ratios) > 4:  # one plan at the edge of reach (tens of ×) would flatten the rest
        ax2.set_yscale("log")
        ax2.yaxis.set_major_formatter(ScalarFormatter())
        ax2.yaxis.set_minor_formatter(ScalarFormatter())
    ax2.set_ylabel("time / eager (median of rounds; bars: min–max)")
    ax2.set_title("time overhead vs eager (same process, round-robin)")
    ax2.legend(fontsize=8)
    meta = doc["meta"]
    fig.suptitle(f"{meta['model']} ({meta['device']}, {meta['optimizer']}); dashed: torch.compile (times include kernel fusion)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_tradeoff(doc: dict[str, Any], path: Path) -> Path:
    """Measured peak vs time overhead, one point per method and budget, one panel per batch size."""
    plt = _plt()
    sizes = [b for b in _batch_sizes(doc) if any(r["batch_size"] == b and r.get("status") == "ok" for r in doc["runs"])] or _batch_sizes(doc)
    names = _method_names(doc)
    n = max(1, len(sizes))
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.2 * rows + 0.8), squeeze=False)
    markers = {"eager": "s", "remat": "o", "hf": "^", "sequential": "D", "compile": "P"}
    seen: dict[str, Any] = {}
    for k, b in enumerate(sizes):
        ax = axes[k // cols][k % cols]
        for name in names:
            r = next((r for r in doc["runs"] if r["batch_size"] == b and r["method"] == name), None)
            if r is None or r.get("status") != "ok" or not r.get("peak_bytes") or r.get("ratio_to_eager") is None:
                continue
            kind = method_kind(name)
            h = ax.scatter(
                r["ratio_to_eager"], r["peak_bytes"] / MiB, s=60, marker=markers.get(kind, "o"), color=_color(name, names),
                edgecolors="black" if kind != "compile" else _color(name, names), facecolors="none" if kind == "compile" else None, linewidths=0.8 if kind != "compile" else 1.6, zorder=3,
            )  # fmt: skip
            if kind != "eager":
                lo, hi = r.get("ratio_min", r["ratio_to_eager"]), r.get("ratio_max", r["ratio_to_eager"])
                ax.hlines(r["peak_bytes"] / MiB, lo, hi, color=_color(name, names), linewidth=1, alpha=0.6)
            if "@" in name:
                ax.annotate(name.split("@")[1], (r["ratio_to_eager"], r["peak_bytes"] / MiB), textcoords="offset points", xytext=(5, 4), fontsize=7)
            seen.setdefault(name, h)
        ax.set_title(f"batch {b}")
        ratios = [r.get("ratio_max") or 1.0 for r in doc["runs"] if r["batch_size"] == b and r.get("status") == "ok"]
        if ratios and max(ratios) > 4:  # one far-off point would squash the rest
            ax.set_xscale("log")
        ax.set_xlabel("iteration time / eager (median; line: min–max)")
        ax.set_ylabel("measured peak memory (MiB)")
        ax.grid(alpha=0.3)
    for k in range(len(sizes), rows * cols):
        axes[k // cols][k % cols].axis("off")
    meta = doc["meta"]
    fig.suptitle(f"{meta['model']} ({meta['device']}): memory vs time trade-off; lower left is better (torch.compile hollow: its time includes fusion)", fontsize=10)
    fig.legend(list(seen.values()), [_label(n) for n in seen], loc="lower center", ncol=min(3, max(1, len(seen))), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(seen) / 3), 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- largest batch under a cap


def _simulated_fit(model_name: str, batch_size: int, cap: int, budget: float | None, optimizer: str, device: str, seed: int, times: dict[str, Any]) -> dict[str, Any]:
    """Capture + analyze (+ plan) one batch size: eager's simulated peak, and whether remat fits."""
    from remat.pipeline.analysis import analyze
    from remat.budget import parse_budget
    from remat.pipeline.capture import capture
    from remat.errors import BudgetError
    from remat.planners import make_plan
    from remat.pipeline.schedule import GraphIndex
    from remat.pipeline.simulator import simulate, simulate_schedule
    from remat.workloads import load

    spec = load(model_name, batch_size, optimizer, seed=seed, device=device)
    tg = capture(spec.train_step, spec.model, spec.optimizer, spec.batch)
    analysis = analyze(tg)
    index = GraphIndex.build(tg, analysis)
    # Node times and kernel scratch from one profiled batch size, scaled by batch size:
    # the plan's choices need relative costs, and profiling every candidate would cost
    # as much as running it.
    scale = batch_size / times["batch_size"]
    node_seconds = {}
    for n in tg.op_nodes():
        node_seconds[n.name] = times["seconds"].get(n.name, times["median"]) * scale
    index.scratch = {k: int(v * scale) for k, v in times["scratch"].items() if k in node_seconds}
    baseline = simulate(analysis, scratch=index.scratch)
    out = {"batch_size": batch_size, "eager_predicted_peak_bytes": baseline.peak_bytes, "eager_fits": baseline.peak_bytes <= cap}
    budget_bytes = cap if budget is None else min(cap, parse_budget(budget).to_bytes(baseline.persistent_bytes, baseline.step_peak_bytes))
    try:
        plan = make_plan("mutwo", index, node_seconds, budget_bytes)
        predicted = simulate_schedule(index, plan.schedule(index)).peak_bytes
        out.update(remat_predicted_peak_bytes=predicted, remat_fits=predicted <= cap)
    except BudgetError as e:
        out.update(remat_predicted_peak_bytes=None, remat_fits=False, remat_reason=str(e).splitlines()[0][:300])
    return out


def _search(fits: Callable[[int], bool], start: int, max_batch: int) -> tuple[int, list[int]]:
    """Largest b in [1, max_batch] with fits(b) (assumed monotone): doubling, then bisection. 0 if none."""
    tried: list[int] = []

    def f(b: int) -> bool:
        tried.append(b)
        return fits(b)

    b = max(1, min(start, max_batch))
    if not f(b):
        lo, hi = 0, b
    else:
        lo = b
        while True:
            nb = min(lo * 2, max_batch)
            if nb == lo:
                return lo, tried
            if f(nb):
                lo = nb
            else:
                hi = nb
                break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def maxbatch(
    model: str,
    cap: str | int,
    *,
    budget: float | None = None,
    max_batch: int = 256,
    start: int = 1,
    optimizer: str = "sgd",
    device: str = "cpu",
    seed: int = 0,
    confirm: bool = True,
    out_dir: str | Path | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Largest batch that fits `cap` without and with remat: simulator search, then measured runs."""
    import remat
    from remat.pipeline import build as pipeline
    from remat.budget import parse_budget
    from remat.measurement.check import twin
    from remat.measurement.memory import measure_peak
    from remat.workloads import load

    cap_budget = parse_budget(cap)
    if cap_budget.nbytes is None:
        from remat.errors import UsageError

        raise UsageError(f"--cap must be an absolute size such as 8GiB, got {cap!r}")
    cap_bytes = cap_budget.nbytes
    t_start = time.perf_counter()

    # Costs for the planner during the search: one profile at the start batch size.
    b0 = max(1, start)
    spec = load(model, b0, optimizer, seed=seed, device=device)
    say(f"profiling {model} at batch {b0} for node costs ...")
    prof = pipeline.build(spec.train_step, spec.model, spec.optimizer, spec.batch, runs=1).profile
    secs = prof.seconds_by_node()
    times = {"batch_size": b0, "seconds": secs, "median": statistics.median(secs.values()) if secs else 0.0, "scratch": prof.scratch_by_node()}
    del spec

    sims: dict[int, dict[str, Any]] = {}

    def sim(b: int) -> dict[str, Any]:
        if b not in sims:
            t = time.perf_counter()
            sims[b] = _simulated_fit(model, b, cap_bytes, budget, optimizer, device, seed, times)
            s = sims[b]
            say(
                f"  batch {b}: eager {s['eager_predicted_peak_bytes'] / MiB:,.0f} MiB ({'fits' if s['eager_fits'] else 'over'}), remat "
                + (f"{s['remat_predicted_peak_bytes'] / MiB:,.0f} MiB" if s.get("remat_predicted_peak_bytes") else "no plan")
                + f" ({'fits' if s['remat_fits'] else 'over'}) [{time.perf_counter() - t:.0f} s]"
            )
        return sims[b]

    say(f"searching the largest eager batch under {cap_bytes / MiB:,.0f} MiB (simulator) ...")
    eager_b, _ = _search(lambda b: sim(b)["eager_fits"], start, max_batch)
    say(f"searching the largest remat batch under {cap_bytes / MiB:,.0f} MiB (simulator) ...")
    remat_b, _ = _search(lambda b: sim(b)["remat_fits"], max(start, eager_b), max_batch)

    result: dict[str, Any] = {
        "model": model,
        "device": device,
        "optimizer": optimizer,
        "cap_bytes": cap_bytes,
        "cap": str(cap),
        "budget": budget,
        "max_batch": max_batch,
        "eager_max_batch_simulated": eager_b,
        "remat_max_batch_simulated": remat_b,
        "simulated": [sims[b] for b in sorted(sims)],
        "measured": [],
    }

    def measure(kind: str, b: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"method": kind, "batch_size": b}
        t = time.perf_counter()
        try:
            spec = load(model, b, optimizer, seed=seed, device=device)
            opt, train_step = spec.optimizer, spec.train_step
            m, o = twin(spec.model, opt)
            del spec.model
            if kind == "eager":
                fn = lambda: train_step(m, o, spec.batch)  # noqa: E731
            else:
                step = remat.compile(train_step, m, o, spec.batch, memory_budget=cap_bytes if budget is None else budget)
                rec.update(predicted_peak_bytes=step.report.predicted_peak_bytes, num_recomputed=step.report.num_recomputed)
                fn = lambda: step(spec.batch)  # noqa: E731
            fn()
            peak = persistent_bytes(m, o) + measure_peak(fn, device).peak_bytes
            rec.update(status="ok", peak_bytes=peak, fits=peak <= cap_bytes)
        except Exception as e:  # noqa: BLE001
            rec.update(status="failed", reason=_reason(e), fits=False)
        rec["seconds"] = time.perf_counter() - t
        say(f"  measured {kind} at batch {b}: " + (f"{rec['peak_bytes'] / MiB:,.0f} MiB, {'fits' if rec['fits'] else 'OVER the cap'}" if rec["status"] == "ok" else rec["reason"]))
        gc.collect()
        return rec

    if confirm:
        say("confirming with measured runs ...")
        plan_runs = [("eager", eager_b), ("eager", eager_b + 1), ("remat", remat_b)] if eager_b else [("eager", 1), ("remat", remat_b)]
        for kind, b in plan_runs:
            if b < 1:
                continue
            result["measured"].append(measure(kind, b))
            if out_dir:
                _write_maxbatch(result, out_dir)
        # If a measured run misses the cap (the simulator is an estimate), step down until one fits.
        for kind, best in (("eager", eager_b), ("remat", remat_b)):
            rec = next((r for r in result["measured"] if r["method"] == kind and r["batch_size"] == best), None)
            b = best
            while rec is not None and not rec["fits"] and b > 1:
                b = max(1, int(b * 0.9)) if b > 10 else b - 1
                rec = measure(kind, b)
                result["measured"].append(rec)
            result[f"{kind}_max_batch_measured"] = b if rec is not None and rec["fits"] else None
    e, r = result.get("eager_max_batch_measured", eager_b), result.get("remat_max_batch_measured", remat_b)
    result["ratio"] = (r / e) if e else None
    result["seconds"] = time.perf_counter() - t_start
    result["summary"] = (
        f"{model}, cap {cap_bytes / GiB:.2f} GiB: eager fits batch {e}, remat fits batch {r}"
        + (f" ({result['ratio']:.2f}×)" if result["ratio"] else "")
        + (" (measured)" if confirm else " (simulated)")
    )
    if out_dir:
        _write_maxbatch(result, out_dir)
    return result


def _write_maxbatch(result: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"maxbatch-{result['cap_bytes'] // MiB}MiB.json"
    path.write_text(json.dumps(result, indent=1))
    return path


# ---------------------------------------------------------------------- demo


def demo(
    out_dir: str | Path = "runs/demo",
    progress: bool = True,
    model: str = "bert",
    batch_sizes: tuple[int, ...] = (8,),
    budgets: tuple[float | str, ...] = (0.6,),
) -> dict[str, Path]:
    """A small bench on CPU: BERT-base at batch 8, remat at 0.6, HF's per-block
    checkpointing, 2 rounds (a few minutes). Smaller BERT batches are no demo: with SGD
    their peak is where all gradients are alive, which no recomputation lowers."""
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
