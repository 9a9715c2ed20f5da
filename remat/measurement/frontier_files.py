"""A frontier's file (frontier.json, written after every point so that a run can resume),
its CSV and its markdown table."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from remat.budget import MiB
from remat.measurement.plots import plot_frontier


@dataclass
class Point:
    """One planner at one budget."""

    planner: str
    budget: str
    budget_bytes: int
    fraction: float | None  # the budget as a fraction of the activation peak (None: absolute)
    status: str  # "ok", "no_plan" (BudgetError), "error"
    error: str | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_peak_bytes: int | None = None
    predicted_overhead_seconds: float | None = None
    predicted_overhead_fraction: float | None = None
    planning_seconds: float | None = None
    num_recomputed: int | None = None
    measured_peak_bytes: int | None = None  # persistent + the allocator's peak of one step
    measured_step_peak_bytes: int | None = None
    peak_error: float | None = None  # (measured - predicted) / predicted, whole peak
    grads_match: bool | None = None
    mismatches: list[str] = field(default_factory=list)
    measured_overhead_ratio: float | None = None  # remat / eager step time (alternating pairs), if timed
    solver: dict[str, Any] = field(default_factory=dict)  # the planner's own stats (milp: status, bound, gap)


@dataclass
class Frontier:
    model: str
    batch_size: int
    optimizer: str
    device: str
    planners: list[str]
    budgets: list[str]
    persistent_bytes: int
    baseline_peak_bytes: int
    baseline_step_peak_bytes: int
    baseline_iteration_seconds: float
    measured_baseline_peak_bytes: int | None = None
    profile_seconds: float = 0.0
    time_limit: float | None = None
    points: list[Point] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def point(self, planner: str, budget: str) -> Point | None:
        return next((p for p in self.points if p.planner == planner and p.budget == budget), None)


def _position(items: list[str], item: str) -> int:
    return items.index(item) if item in items else len(items)


FRONTIER_FORMAT = "remat.frontier"


FRONTIER_VERSION = 1


def load_frontier(path: str | Path) -> Frontier:
    """A frontier.json back as a Frontier; a broken or foreign file is refused (PlanError).

    Files written before frontier.json carried a format tag are read too.
    """
    from remat.serialize import check_fields, load_document

    path = Path(path)
    doc = load_document(path, FRONTIER_FORMAT, FRONTIER_VERSION, untagged=True)
    check_fields(doc, Frontier, str(path))
    d = {k: v for k, v in doc.items() if k not in ("format", "version")}
    d["points"] = [Point(**p) for p in d["points"]]
    return Frontier(**d)


def _resumable(out: Path, model: str, batch_size: int, optimizer: str, device: str, lean_ops: bool = True) -> Frontier | None:
    """The frontier a resumed sweep goes on from (None: none yet), refused if it is of another configuration."""
    from remat.errors import UsageError

    path = out / "frontier.json"
    if not path.exists():
        return None
    previous = load_frontier(path)
    wanted = (model, batch_size, optimizer, device)
    found = (previous.model, previous.batch_size, previous.optimizer, previous.device)
    for what, w, f in zip(("model", "batch size", "optimizer", "device"), wanted, found):
        if w != f:
            raise UsageError(
                f"--resume: {path} is a frontier of {found[0]} with batch size {found[1]} ({found[2]}, {found[3]}), not of "
                f"{model} with batch size {batch_size} ({optimizer}, {device}): its {what} differs. Use another --out, or drop "
                "--resume to start over."
            )
    if previous.meta.get("lean_ops", True) != lean_ops:
        had = "with" if previous.meta.get("lean_ops", True) else "without"
        raise UsageError(
            f"--resume: {path} was planned {had} lean operator variants; resume it with the same --no-lean-ops setting, "
            "or use another --out"
        )
    return previous


def describe(p: Point, iteration: float) -> str:
    s = (f"peak {p.predicted_peak_bytes / MiB:,.2f} MiB predicted, overhead {p.predicted_overhead_fraction:.1%} "
         f"({p.num_recomputed} dropped, planned in {p.planning_seconds:.2f} s)")
    if p.solver.get("milp_status"):
        gap = p.solver.get("milp_gap_seconds")
        s += f", milp {p.solver['milp_status']}, gap " + ("unknown" if gap is None else f"{gap:.2g} s")
    if p.measured_peak_bytes is not None:
        s += f"; measured {p.measured_peak_bytes / MiB:,.2f} MiB ({p.peak_error:+.2%}), eager-equal: {p.grads_match}"
    return s


CSV_FIELDS = [
    "planner", "budget", "fraction", "budget_bytes", "status", "predicted_peak_bytes", "predicted_step_peak_bytes",
    "predicted_overhead_seconds", "predicted_overhead_fraction", "planning_seconds", "num_recomputed",
    "measured_peak_bytes", "measured_step_peak_bytes", "peak_error", "grads_match", "measured_overhead_ratio",
    "milp_status", "milp_lower_bound", "milp_gap_seconds", "milp_iterations", "milp_solver_seconds", "error",
]


def write_results(frontier: Frontier, out: Path, plot: bool = False) -> dict[str, Path]:
    """frontier.json, .csv and .md (and with `plot`, .png), each replaced whole: a sweep
    stopped at any moment leaves every file as it was after its last finished point."""
    from remat.serialize import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "frontier.json", "csv": out / "frontier.csv", "table": out / "frontier.md"}
    doc = {"format": FRONTIER_FORMAT, "version": FRONTIER_VERSION, **_finite(frontier.to_dict())}
    write_atomic(files["json"], json.dumps(doc, indent=1, allow_nan=False))
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for p in frontier.points:
        row = {k: v for k, v in asdict(p).items() if k in CSV_FIELDS}
        for k in ("milp_status", "milp_lower_bound", "milp_gap_seconds", "milp_iterations", "milp_solver_seconds"):
            row[k] = p.solver.get(k)
        row["error"] = (p.error or "").splitlines()[0][:200] if p.error else ""
        w.writerow(row)
    write_atomic(files["csv"], buf.getvalue())
    write_atomic(files["table"], markdown_table(frontier))
    if plot:
        files["plot"] = plot_frontier(frontier, out / "frontier.png")
    return files


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity as None: JSON has neither, and a resume reads it back."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def markdown_table(fr: Frontier) -> str:
    """Per budget: each planner's predicted overhead, each heuristic planner's gap to the
    cheapest plan found at that budget (the exact planner's, where it ran), solver time."""
    it = fr.baseline_iteration_seconds
    head = ["budget", "cap MiB"]
    for p in fr.planners:
        head += [f"{p} peak MiB", f"{p} overhead"]
    heuristics = [p for p in fr.planners if p != "milp"] if len(fr.planners) > 1 else []
    head += [f"{p} − best (of iteration)" for p in heuristics]
    if "milp" in fr.planners:
        head += ["milp status", "milp proven gap", "milp s"]
    measured = any(p.measured_peak_bytes is not None for p in fr.points)
    if measured:
        head += ["measured/predicted peak (worst)", "eager-equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in fr.budgets:
        pts = {p: fr.point(p, b) for p in fr.planners}
        first = next((x for x in pts.values() if x is not None), None)
        if first is None:
            continue
        row = [b, f"{first.budget_bytes / MiB:,.2f}"]
        for p in fr.planners:
            x = pts[p]
            if x is None:
                row += ["—", "not run"]  # a sweep still under way, or stopped
            elif x.status != "ok":
                row += ["—", "no plan" if x.status == "no_plan" else "error"]
            else:
                row += [f"{x.predicted_peak_bytes / MiB:,.2f}", f"{x.predicted_overhead_fraction:.2%}"]
        fitting = [x.predicted_overhead_seconds for x in pts.values() if x is not None and x.status == "ok"]
        for p in heuristics:
            x = pts[p]
            row.append(f"{(x.predicted_overhead_seconds - min(fitting)) / it:+.2%}" if x is not None and x.status == "ok" and it else "—")
        ex = pts.get("milp")
        if "milp" in fr.planners:
            if ex is not None and ex.status == "ok":
                g = ex.solver.get("milp_gap_seconds")  # None: no finite bound proven (a time-out)
                row += [str(ex.solver.get("milp_status")), f"{g / it:.2%}" if it and g is not None else "—", f"{ex.planning_seconds:.2f}"]
            else:
                row += ["infeasible" if ex is not None and ex.status == "no_plan" else "—", "—", f"{ex.planning_seconds:.2f}" if ex and ex.planning_seconds else "—"]
        if measured:
            ok = [x for x in pts.values() if x is not None and x.measured_peak_bytes is not None]
            if ok:
                worst = max(ok, key=lambda x: abs(x.peak_error or 0.0))
                diff = (worst.measured_peak_bytes or 0) - (worst.predicted_peak_bytes or 0)
                row += [f"{worst.peak_error:+.2%} ({diff / 1024:+,.0f} KiB)", "yes" if all(x.grads_match for x in ok) else "NO"]
            else:
                row += ["—", "—"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
