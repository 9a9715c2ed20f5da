"""`remat maxbatch`: the largest batch that fits a memory cap, with and without remat."""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from remat.budget import MiB, format_bytes
from remat.profile.allocator import persistent_bytes
from remat.measurement.results import failure_reason


def _simulated_fit(model_name: str, batch_size: int, cap: int, budget: float | None, optimizer: str, device: str, seed: int, times: dict[str, Any]) -> dict[str, Any]:
    """Capture + analyze (+ plan) one batch size: eager's simulated peak, and whether remat fits."""
    from remat.memory.analysis import analyze
    from remat.budget import parse_budget
    from remat.capture.capture import capture
    from remat.errors import BudgetError
    from remat.planners import make_plan
    from remat.memory.schedule import GraphIndex
    from remat.memory.simulator import simulate
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
        predicted = plan.apply(index).peak_bytes
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
    from remat import build as pipeline
    from remat.budget import parse_budget
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
        return _measured_fit(model, kind, b, cap_bytes, budget, optimizer, device, seed, say)

    if confirm:
        say("confirming with measured runs ...")
        plan_runs = [("eager", eager_b), ("eager", eager_b + 1), ("remat", remat_b)] if eager_b else [("eager", 1), ("remat", remat_b)]
        plan_runs = [(kind, b) for kind, b in plan_runs if b <= max_batch]
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
        f"{model}, cap {format_bytes(cap_bytes)}: eager fits batch {e}, remat fits batch {r}"
        + (f" ({result['ratio']:.2f}×)" if result["ratio"] else "")
        + (" (measured)" if confirm else " (simulated)")
        + (f"; {max_batch} is the search's limit: raise --max-batch to search further" if max_batch in (e, r) else "")
    )
    if out_dir:
        _write_maxbatch(result, out_dir)
    return result


def _measured_fit(
    model: str, kind: str, b: int, cap_bytes: int, budget: float | None, optimizer: str, device: str, seed: int,
    say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """One measured run of `kind` (eager or remat) at batch b: its peak, and whether it fits the cap."""
    import remat
    from remat.measurement.check import twin
    from remat.profile.allocator import measure_peak
    from remat.workloads import load

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
        peak = persistent_bytes(m, o, spec.batch) + measure_peak(fn, device).peak_bytes
        rec.update(status="ok", peak_bytes=peak, fits=peak <= cap_bytes)
    except Exception as e:  # noqa: BLE001
        rec.update(status="failed", reason=failure_reason(e), fits=False)
    rec["seconds"] = time.perf_counter() - t
    say(f"  measured {kind} at batch {b}: " + (f"{rec['peak_bytes'] / MiB:,.0f} MiB, {'fits' if rec['fits'] else 'OVER the cap'}" if rec["status"] == "ok" else rec["reason"]))
    gc.collect()
    return rec


def _write_maxbatch(result: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"maxbatch-{result['cap_bytes'] // MiB}MiB.json"
    path.write_text(json.dumps(result, indent=1))
    return path
