"""The memory–time frontier: every planner at every budget, on one profile.

`run_frontier` profiles a model once, then plans each budget with each planner on the
same node times (`remat.planners.make_plan`); with `measure`, each plan is also rewritten
and run: three steps compared bitwise with eager PyTorch (`remat.measurement.check`), then the
allocator's peak of one more step (`remat.profile.allocator.measure_peak`) next to the prediction.
A budget a planner cannot meet is recorded (its error message) and the sweep goes on, as
does a configuration that fails in any other way (out of memory while its plan runs,
say): an "error" point with the reason.

Results are written after every point (frontier.json, frontier.csv, frontier.md), each
file replaced whole, and the plot after every budget, so a sweep stopped at any moment
(Ctrl-C, a killed run) keeps every point it finished; `resume=True` (`--resume`) keeps
them and does only the rest."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.budget import parse_budget
from remat.errors import BudgetError, RematError, UsageError
from remat.measurement.check import check_one_graph

from remat.budget import MiB
from remat.measurement.frontier_files import Frontier, Point, _position, _resumable, describe, write_results


DEFAULT_PLANNERS = ("mutwo", "chen", "milp")


def parse_budgets(text: str) -> list[str]:
    """`start:stop:step` (fractions, stop included) or a comma list of budgets ("0.5,6GiB")."""
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise RematError(f"invalid budget range {text!r}: expected start:stop:step, e.g. 0.1:1.0:0.1")
        try:
            start, stop, step = (float(p) for p in parts)
        except ValueError:
            raise RematError(f"invalid budget range {text!r}: start, stop and step must be numbers") from None
        if not (step > 0 and 0 < start <= stop <= 1):
            raise RematError(f"invalid budget range {text!r}: need 0 < start <= stop <= 1 and step > 0")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        values = [round(start + i * step, 10) for i in range(count)]
        out = [f"{v:g}" for v in values]
    else:
        out = [p.strip() for p in text.split(",") if p.strip()]
    if not out:
        raise RematError(f"no budgets in {text!r}")
    for b in out:
        parse_budget(b)  # refuse a bad one before any profiling
    return out


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


@dataclass
class Sweep:
    """What every point of one sweep shares: the graph, its profile, the model to run."""

    model: str
    batch_size: int
    optimizer: str
    device: str
    seed: int
    time_limit: float
    measure: bool
    pairs: int
    lean_ops: bool  # plan with lean operator variants too (passes.lean_ops)
    tg: Any
    index: Any
    prof: Any
    node_seconds: dict[str, float]
    persistent_bytes: int
    spec: Any  # models.ModelSpec: the model and batch the plans run on
    opt: Any
    train_step: Any


def run_point(sw: Sweep, planner: str, budget: str, budget_bytes: int, fraction: float | None) -> Point:
    """One planner at one budget: plan it and, with `sw.measure`, run it.

    A budget the planner cannot meet is a "no_plan" point; a planner's RematError, or
    any failure while the plan is run (out of memory, say), an "error" point keeping
    what was predicted: the sweep goes on either way.
    """
    from remat.planners import make_plan

    point = Point(planner=planner, budget=budget, budget_bytes=int(budget_bytes), fraction=fraction, status="ok")
    kwargs: dict[str, Any] = {"time_limit": sw.time_limit} if planner == "milp" else {}
    t1 = time.perf_counter()
    try:
        plan = make_plan(
            planner, sw.index, sw.node_seconds, int(budget_bytes), fingerprint=sw.prof.fingerprint, model=sw.model,
            batch_size=sw.batch_size, optimizer=sw.optimizer, baseline_iteration_seconds=sw.prof.iteration_seconds,
            lean_ops=sw.lean_ops, **kwargs,
        )
    except BudgetError as e:
        point.status, point.error = "no_plan", str(e)
        point.planning_seconds = time.perf_counter() - t1
        return point
    except RematError as e:
        point.status, point.error = "error", f"{type(e).__name__}: {e}"
        point.planning_seconds = time.perf_counter() - t1
        return point
    point.predicted_peak_bytes = plan.predicted_peak_bytes
    point.predicted_step_peak_bytes = plan.predicted_step_peak_bytes
    point.predicted_overhead_seconds = plan.predicted_overhead_seconds
    point.predicted_overhead_fraction = plan.predicted_overhead_fraction
    point.planning_seconds = plan.planning_seconds
    point.num_recomputed = plan.num_recomputed
    point.solver = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)  # JSON has no infinity (an unbounded solver)
        for k, v in plan.meta.items()
        if isinstance(v, (int, float, str, bool)) or v is None
    }
    if sw.measure:
        try:
            _measure(sw, plan, point)
        except Exception as e:  # noqa: BLE001 - a plan that fails to run (out of memory) is a result
            from remat.measurement.results import failure_reason

            point.status, point.error = "error", f"while running the plan: {failure_reason(e)}"
            _release(sw.device)
    return point


def _measure(sw: Sweep, plan: Any, point: Point) -> None:
    """Run the plan: three steps bitwise against eager, one step's peak, and timing pairs."""
    from remat.capture.step_inputs import flat_inputs, run_captured
    from remat.measurement.check import check_against_eager, time_alternating, twin
    from remat.profile.allocator import measure_step_peak

    tg, spec = sw.tg, sw.spec
    gm = plan.apply(sw.index).runnable()
    eager_model, eager_opt = twin(spec.model, sw.opt)
    remat_model, remat_opt = twin(spec.model, sw.opt)

    def remat_step(batch: Any) -> Any:
        return run_captured(tg, gm, remat_model, flat_inputs(tg, remat_model, remat_opt, batch))

    check = check_against_eager(sw.train_step, eager_model, eager_opt, remat_model, remat_opt, remat_step, spec.batch, steps=3, seed=sw.seed)
    point.grads_match = check.match
    point.mismatches = check.mismatches[:10]
    measured = measure_step_peak(lambda: remat_step(spec.batch), sw.device, remat_model)  # the check left gradients set
    point.measured_peak_bytes = int(sw.persistent_bytes + measured.peak_bytes)
    point.measured_step_peak_bytes = int(measured.peak_bytes)
    point.peak_error = (point.measured_peak_bytes - plan.predicted_peak_bytes) / plan.predicted_peak_bytes
    if sw.pairs > 0:
        timing = time_alternating(
            lambda: sw.train_step(eager_model, eager_opt, spec.batch), lambda: remat_step(spec.batch), pairs=sw.pairs, device=sw.device
        )
        point.measured_overhead_ratio = timing.ratio


def _release(device: str) -> None:
    """Give back what a failed configuration held, so that the next one starts clean."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _finished(p: Point, measure: bool) -> bool:
    """Whether a point kept from an earlier sweep stands (a resumed sweep skips it)."""
    if p.status not in ("ok", "no_plan", "error"):
        return False
    return not (measure and p.status == "ok" and p.measured_peak_bytes is None)  # planned only: now run it too


def run_frontier(
    model: str,
    batch_size: int,
    planners: list[str] | tuple[str, ...] = DEFAULT_PLANNERS,
    budgets: list[str] | None = None,
    *,
    optimizer: str = "sgd",
    measure: bool = False,
    out_dir: str | Path | None = None,
    time_limit: float = 60.0,
    device: str = "cpu",
    seed: int = 0,
    runs: int = 3,
    pairs: int = 0,
    profile_path: str | Path | None = None,
    progress: bool = True,
    resume: bool = False,
    lean_ops: bool = True,
) -> Frontier:
    """Plan (and with `measure`, run) every budget with every planner; write the results.

    The results are on disk after every point. With `resume`, the points already in the
    output folder's frontier.json (of the same model, batch size, optimizer and device)
    are kept and not planned again, and its profile.json gives the node times, so that
    the new points are planned on the same ones.
    """
    from remat import build as pipeline
    from remat.capture.capture import capture
    from remat.planners.evaluate import baseline_of
    from remat.planners import PLANNERS
    from remat.profile.profiler import load_profile_for
    from remat.workloads import check_arguments as check_model_args
    from remat.workloads import load

    budgets = list(budgets) if budgets is not None else parse_budgets("0.1:1.0:0.1")
    parsed = [parse_budget(b) for b in budgets]
    unknown = [p for p in planners if p not in PLANNERS]
    if unknown:
        raise UsageError(f"unknown planner {unknown[0]!r}; available planners: {', '.join(PLANNERS)}")
    check_model_args(model, batch_size, optimizer, device)
    if time_limit <= 0:
        raise UsageError(f"--time-limit must be positive, got {time_limit}")
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"frontier-{model}-b{batch_size}"
    previous = _resumable(out, model, batch_size, optimizer, device, lean_ops) if resume else None
    if previous is not None and profile_path is None and (out / "profile.json").is_file():
        profile_path = out / "profile.json"

    # Gradients stay set after a step, so that the eager check compares them too.
    spec = load(model, batch_size, optimizer, seed=seed, device=device, zero_grad_first=True)
    opt, train_step = spec.optimizer, spec.train_step
    tg = capture(train_step, spec.model, opt, spec.batch)
    check_one_graph(tg, "the frontier")
    t0 = time.perf_counter()
    saved = load_profile_for(profile_path, tg, model, batch_size, optimizer) if profile_path is not None else None
    if saved is None:
        _say(progress, f"profiling {model} (batch {batch_size}, {optimizer}) ...")
    built = pipeline.build_on(tg, spec.model, opt, spec.batch, runs=runs, device=device, saved_profile=saved)
    prof, index = built.profile, built.index  # predictions include measured kernel scratch
    if saved is None:
        prof.model, prof.batch_size, prof.optimizer = model, batch_size, optimizer
        prof.to_json(out / "profile.json")
    profile_seconds = time.perf_counter() - t0
    _check_same_graph(previous, prof.fingerprint, out)
    node_seconds = prof.seconds_by_node()
    baseline = baseline_of(index)
    base_tl = baseline.timeline
    frontier = Frontier(
        model=model,
        batch_size=batch_size,
        optimizer=optimizer,
        device=device,
        planners=list(planners),
        budgets=list(budgets),
        persistent_bytes=int(base_tl.persistent_bytes),
        baseline_peak_bytes=int(base_tl.peak_bytes),
        baseline_step_peak_bytes=int(base_tl.step_peak_bytes),
        baseline_iteration_seconds=float(prof.iteration_seconds),
        measured_baseline_peak_bytes=int(prof.measured_peak_bytes) if prof.measured_peak_bytes is not None else None,
        profile_seconds=profile_seconds,
        time_limit=time_limit,
        meta={"seed": seed, "runs": runs, "fingerprint": prof.fingerprint, "num_nodes": len(index.order), "lean_ops": lean_ops},
    )
    if previous is not None:  # its points first; planners and budgets it had that this sweep has not stay listed
        frontier.points = list(previous.points)
        frontier.planners += [p for p in previous.planners if p not in frontier.planners]
        frontier.budgets += [b for b in previous.budgets if b not in frontier.budgets]
        frontier.meta["resumed_from"] = len(previous.points)
    _say(progress, f"{len(index.order)} nodes; peak without recomputation {base_tl.peak_bytes / MiB:,.2f} MiB "
         f"(persistent {base_tl.persistent_bytes / MiB:,.2f} MiB); iteration {prof.iteration_seconds * 1e3:,.1f} ms")
    sweep = Sweep(
        model=model, batch_size=batch_size, optimizer=optimizer, device=device, seed=seed, time_limit=time_limit, measure=measure,
        pairs=pairs, lean_ops=lean_ops, tg=tg, index=index, prof=prof, node_seconds=node_seconds, persistent_bytes=int(base_tl.persistent_bytes),
        spec=spec, opt=opt, train_step=train_step,
    )  # fmt: skip

    for budget, b in zip(budgets, parsed):
        budget_bytes = b.to_bytes(base_tl.persistent_bytes, base_tl.step_peak_bytes)
        fraction = b.fraction
        for planner in planners:
            kept = frontier.point(planner, budget)
            if kept is not None and _finished(kept, measure):
                _say(progress, f"  {budget:>6} {planner:>6}: kept from {out / 'frontier.json'} ({kept.status})")
                continue
            if kept is not None:
                frontier.points.remove(kept)
            t1 = time.perf_counter()
            try:
                point = run_point(sweep, planner, budget, int(budget_bytes), fraction)
            except Exception as e:  # noqa: BLE001 - one configuration failing (out of memory, a crash) is a result
                from remat.measurement.results import failure_reason

                point = Point(planner=planner, budget=budget, budget_bytes=int(budget_bytes), fraction=fraction, status="error",
                              error=failure_reason(e), planning_seconds=time.perf_counter() - t1)  # fmt: skip
                _release(device)
            frontier.points.append(point)
            frontier.points.sort(key=lambda p: (_position(frontier.budgets, p.budget), _position(frontier.planners, p.planner)))
            _say(progress, f"  {budget:>6} {planner:>6}: {_outcome(point, frontier.baseline_iteration_seconds)}")
            write_results(frontier, out)
        write_results(frontier, out, plot=True)
    return frontier


def _outcome(point: Point, iteration_seconds: float) -> str:
    if point.status == "ok":
        return describe(point, iteration_seconds)
    if point.status == "no_plan":
        return f"no plan ({point.planning_seconds:.2f} s)"
    return f"error: {point.error}"


def _check_same_graph(previous: Frontier | None, fingerprint: str, out: Path) -> None:
    """A resumed frontier must be of this very graph."""
    if previous is not None and previous.meta.get("fingerprint") not in (None, fingerprint):
        raise UsageError(
            f"--resume: {out / 'frontier.json'} was made on another graph (fingerprint {str(previous.meta['fingerprint'])[:12]}…, "
            f"this one {fingerprint[:12]}…): another torch or remat version captures it differently. Use another --out, "
            "or drop --resume to start over."
        )
