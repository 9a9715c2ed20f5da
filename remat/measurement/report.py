"""Show where the memory and time of an iteration go: plot, tables and CSV files.

Everything here reads a `Profile` (or a bare simulator `Timeline`) and writes files or
rich tables; nothing measures. Bytes are shown in MiB (2**20), times in milliseconds.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from remat.memory.analysis import ROLES, Role
from remat.profile.profiles import PHASES, Profile
from remat.memory.simulator import Timeline

from remat.budget import MiB

# Stacking order, bottom to top: what lives across steps first (a flat base), then
# what the step itself makes.
STACK_ORDER: tuple[str, ...] = (
    Role.PARAMETER.value,
    Role.OPTIMIZER_STATE.value,
    Role.INPUT.value,
    Role.GRADIENT.value,
    Role.ACTIVATION.value,
    Role.OTHER.value,
)
assert set(STACK_ORDER) == {r.value for r in ROLES}

ROLE_LABELS = {
    "parameter": "parameters & buffers",
    "optimizer_state": "optimizer state",
    "input": "input batch",
    "gradient": "gradients",
    "activation": "activations",
    "other": "other (temporaries)",
}
ROLE_COLORS = {
    "parameter": "#4c72b0",
    "optimizer_state": "#8172b3",
    "input": "#937860",
    "gradient": "#dd8452",
    "activation": "#c44e52",
    "other": "#b8b8b8",
}
PHASE_COLORS = {"forward": "#2a9d8f", "backward": "#e76f51", "optimizer": "#6d597a"}


def short_op(target: str) -> str:
    """"aten.addmm.default" -> "addmm"; other overloads keep their name ("add.Tensor")."""
    return target.removeprefix("aten.").removesuffix(".default")


def mib(nbytes: float) -> float:
    return nbytes / MiB


def fmt_mib(nbytes: float) -> str:
    """MiB with enough decimals to tell small models' tensors apart."""
    v = nbytes / MiB
    digits = 1 if abs(v) >= 100 else 2 if abs(v) >= 1 else 3
    return f"{v:,.{digits}f}"


# ---------------------------------------------------------------------- plot


def plot_memory_breakdown(
    source: Profile | Timeline,
    path: str | Path,
    *,
    x: str = "rank",
    phase_bounds: dict[str, tuple[int, int]] | None = None,
    node_seconds: Sequence[float] | None = None,
    measured_peak_bytes: int | None = None,
    title: str | None = None,
    show_measured_nodes: bool = True,
) -> Path:
    """Stacked area of live memory over the iteration, by role, with phases and the peak.

    `x="rank"` puts the nodes in execution order on the x axis; `x="time"` puts them at
    their cumulative median run time (needs node times: from the profile or
    `node_seconds`). From a Profile, the measured step peak is drawn as a dashed line and
    the per-node measured peak (from the node-by-node run) as a thin black line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    profile = source if isinstance(source, Profile) else None
    timeline = profile.to_timeline() if profile else source
    if profile is not None:
        phase_bounds = phase_bounds or profile.phase_bounds
        node_seconds = node_seconds if node_seconds is not None else profile.node_seconds
        measured_peak_bytes = measured_peak_bytes if measured_peak_bytes is not None else profile.measured_peak_bytes
        if title is None:
            parts = [profile.model or "captured graph"]
            if profile.batch_size is not None:
                parts.append(f"batch {profile.batch_size}")
            if profile.optimizer:
                parts.append(profile.optimizer)
            parts.append(profile.device)
            title = "Live memory over one training iteration: " + ", ".join(parts)
    title = title or "Live memory over one training iteration"
    n = len(timeline.during)
    if n == 0:
        raise ValueError("the timeline is empty: the graph has no nodes")

    xs, edges, xlabel = _x_axis(x, n, node_seconds)

    ys = [
        (timeline.by_role[role] + timeline.persistent_by_role.get(role, 0)) / MiB
        if role in timeline.by_role
        else np.full(n, timeline.persistent_by_role.get(role, 0) / MiB)
        for role in STACK_ORDER
    ]
    total = np.sum(ys, axis=0)
    peak_rank = int(timeline.peak_rank)
    peak = timeline.peak_bytes

    fig, ax = plt.subplots(figsize=(12, 6.2), dpi=120)
    ax.stackplot(
        xs,
        ys,
        labels=[ROLE_LABELS[r] for r in STACK_ORDER],
        colors=[ROLE_COLORS[r] for r in STACK_ORDER],
        linewidth=0,
        alpha=0.9,
    )
    ax.set_xlim(edges[0], edges[-1])
    top = max(mib(peak), mib(measured_peak_bytes or 0), float(total.max())) * 1.16
    ax.set_ylim(0, top)

    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles[::-1], labels[::-1]  # legend top to bottom as the stack
    if profile is not None and show_measured_nodes and any(nd.peak_bytes for nd in profile.nodes):
        measured_line = (np.array([nd.peak_bytes for nd in profile.nodes]) + profile.persistent_bytes) / MiB
        (line,) = ax.plot(xs, measured_line, color="black", linewidth=0.6, alpha=0.75)
        handles.append(line)
        labels.append("measured, node by node")
    if measured_peak_bytes:
        ax.axhline(mib(measured_peak_bytes), color="black", linestyle="--", linewidth=1.0)
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1.0))
        labels.append(f"measured peak {fmt_mib(measured_peak_bytes)} MiB")

    _draw_phases(ax, edges, phase_bounds)

    # The simulated peak: a marker on the stack's top and its value.
    px, py = xs[peak_rank], mib(peak)
    ax.plot([px], [py], marker="v", color="black", markersize=7, zorder=5)
    right_half = (px - edges[0]) > 0.6 * (edges[-1] - edges[0])
    ax.annotate(
        f"simulated peak {fmt_mib(peak)} MiB (node {peak_rank})"
        + (f"\nmeasured peak {fmt_mib(measured_peak_bytes)} MiB" if measured_peak_bytes else ""),
        xy=(px, py),
        xytext=(-12 if right_half else 12, 18),
        textcoords="offset points",
        ha="right" if right_half else "left",
        va="bottom",
        fontsize=9,
        bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#666666", alpha=0.9),
        arrowprops=dict(arrowstyle="-", color="#666666", linewidth=0.8),
    )

    ax.set_xlabel(xlabel)
    ax.set_ylabel("live memory (MiB)")
    ax.set_title(title, fontsize=11, pad=20)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _x_axis(x: str, n: int, node_seconds: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """Positions of the n nodes, the edges between them, and the axis label: by rank or by time."""
    if x == "rank":
        xs = np.arange(n, dtype=np.float64)
        edges = np.arange(n + 1, dtype=np.float64) - 0.5
        xlabel = "node (execution order)"
    elif x == "time":
        if node_seconds is None or len(node_seconds) != n:
            raise ValueError("x='time' needs one time per node (a Profile, or node_seconds)")
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(node_seconds, dtype=np.float64))]) * 1e3
        xs = (cum[:-1] + cum[1:]) / 2
        edges = cum
        xlabel = "time into the iteration (ms, summed median node times)"
    else:
        raise ValueError(f"x must be 'rank' or 'time', got {x!r}")
    return xs, edges, xlabel


def _draw_phases(ax: Any, edges: np.ndarray, phase_bounds: dict[str, tuple[int, int]] | None) -> None:
    """Phase boundaries: a line where each phase starts, its name centred above its span."""
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    if phase_bounds:
        span = edges[-1] - edges[0]
        for phase in PHASES:
            if phase not in phase_bounds:
                continue
            lo, hi = phase_bounds[phase]
            x0, x1 = edges[lo], edges[hi]
            if lo > 0:
                ax.axvline(x0, color="#333333", linewidth=1.0, linestyle=":")
            # Above the axes, clear of the data and the peak's label; a narrow phase
            # gets its name from its start line rightwards, small.
            narrow = (x1 - x0) < 0.09 * span
            ax.text(
                x0 + (x1 - x0) / 2 if not narrow else x0,
                1.01,
                phase,
                transform=trans,
                ha="left" if narrow else "center",
                va="bottom",
                fontsize=8 if narrow else 10,
                fontweight="bold",
                color=PHASE_COLORS.get(phase, "black"),
                clip_on=False,
            )


# ---------------------------------------------------------------------- tables


def breakdown_table(breakdown: dict[str, int], peak_bytes: int | None = None, title: str = "Peak memory by role") -> Any:
    """A rich Table of bytes per role and their share of the peak."""
    from rich.table import Table

    peak_bytes = peak_bytes if peak_bytes is not None else sum(breakdown.values())
    table = Table(title=title, title_justify="left")
    # A long title would wrap over the narrow table: widen the first column instead.
    table.add_column("role", min_width=max(20, len(title) - 24))
    table.add_column("MiB", justify="right")
    table.add_column("% of peak", justify="right")
    for role in STACK_ORDER:
        b = breakdown.get(role, 0)
        table.add_row(ROLE_LABELS[role], fmt_mib(b), f"{100 * b / peak_bytes:.1f}" if peak_bytes else "-")
    table.add_row("[bold]total[/bold]", f"[bold]{fmt_mib(sum(breakdown.values()))}[/bold]", "100.0" if peak_bytes else "-")
    return table


def phase_table(profile: Profile) -> Any:
    from rich.table import Table

    table = Table(title="Time per phase (sum of median node times)", title_justify="left")
    table.add_column("phase")
    table.add_column("nodes", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("% of iteration", justify="right")
    total = profile.iteration_seconds
    counts = profile.nodes_per_phase
    for phase in PHASES:
        s = profile.phase_seconds.get(phase, 0.0)
        table.add_row(phase, str(counts.get(phase, 0)), f"{s * 1e3:,.1f}", f"{100 * s / total:.1f}" if total else "-")
    table.add_row("[bold]iteration[/bold]", str(profile.num_nodes), f"[bold]{total * 1e3:,.1f}[/bold]", "100.0" if total else "-")
    return table


def repeats_table(profile: Profile) -> Any | None:
    """The repeated blocks (profile.repeats) and their time per repeat, or None when there are none."""
    from rich.table import Table

    blocks = profile.meta.get("repeats") or []
    if not blocks:
        return None
    seconds = profile.node_seconds
    total = profile.iteration_seconds
    pooled = " (node times pooled over the repeats)" if profile.meta.get("pooled_repeats") else ""
    table = Table(title=f"Repeated blocks{pooled}", title_justify="left")
    for name in ("phase", "first node", "nodes", "repeats", "ms per repeat (mean)", "% of iteration"):
        table.add_column(name, justify="left" if name in ("phase", "first node") else "right")
    for b in blocks:
        start, length, count = int(b["start"]), int(b["length"]), int(b["count"])
        every = float(seconds[start : start + length * count].sum())
        one = every / count
        share = f"{100 * every / total:.1f}" if total else "-"
        table.add_row(str(b["phase"]), profile.nodes[start].name, str(length), str(count), f"{one * 1e3:,.2f}", share)
    return table


def peak_table(profile: Profile) -> Any:
    """Simulated against measured, for the whole peak and for the step's own part."""
    from rich.table import Table

    table = Table(title="Peak memory: simulated vs measured", title_justify="left")
    table.add_column("")
    table.add_column("simulated MiB", justify="right")
    table.add_column("measured MiB", justify="right")
    table.add_column("measured / simulated", justify="right")

    def ratio(m: int, s: int) -> str:
        return f"{m / s:.4f}" if s else "-"

    table.add_row(
        "peak (persistent + step)",
        fmt_mib(profile.simulated_peak_bytes),
        fmt_mib(profile.measured_peak_bytes),
        ratio(profile.measured_peak_bytes, profile.simulated_peak_bytes),
    )
    table.add_row(
        "step peak (above persistent)",
        fmt_mib(profile.simulated_step_peak_bytes),
        fmt_mib(profile.measured_step_peak_bytes),
        ratio(profile.measured_step_peak_bytes, profile.simulated_step_peak_bytes),
    )
    table.add_row("persistent", fmt_mib(profile.persistent_bytes), fmt_mib(profile.persistent_bytes), "1.0000")
    return table


def activations_table(profile: Profile, top_k: int = 10) -> Any:
    """The largest activations: what recomputation would go after first."""
    from rich.table import Table

    acts = sorted(profile.activations(), key=lambda t: (-t.nbytes, t.created))[:top_k]
    total = sum(t.nbytes for t in profile.activations())
    table = Table(
        title=f"Largest activations (top {len(acts)} of {profile.num_activations}, {fmt_mib(total)} MiB in all)",
        title_justify="left",
    )
    table.add_column("node")
    table.add_column("op")
    table.add_column("MiB", justify="right")
    table.add_column("created", justify="right")
    table.add_column("last fwd use", justify="right")
    table.add_column("first bwd use", justify="right")
    table.add_column("inactive ms", justify="right")
    targets = {n.name: n.target for n in profile.nodes}
    for t in acts:
        table.add_row(
            t.node,
            short_op(targets.get(t.node, "")),
            fmt_mib(t.nbytes),
            str(t.created),
            str(t.last_forward_use),
            str(t.first_backward_use),
            f"{(t.inactive_seconds or 0.0) * 1e3:,.1f}",
        )
    return table


def summary_tables(profile: Profile, top_k: int = 10) -> list[Any]:
    """Time per phase, repeated blocks, peak by role, simulated vs measured peak, largest activations."""
    peak_title = f"Memory at the simulated peak (node {profile.peak_rank}"
    if 0 <= profile.peak_rank < profile.num_nodes:
        node = profile.nodes[profile.peak_rank]
        peak_title += f", {node.name}, {node.phase}"
    peak_title += ")"
    tables = [
        phase_table(profile),
        repeats_table(profile),
        breakdown_table(profile.peak_breakdown, profile.simulated_peak_bytes, title=peak_title),
        peak_table(profile),
        activations_table(profile, top_k),
    ]
    return [t for t in tables if t is not None]


def console_for(file: Any = None) -> Any:
    """A rich Console; 120 columns wide when not on a terminal, so tables do not wrap."""
    import sys

    from rich.console import Console

    file = file if file is not None else sys.stdout
    tty = hasattr(file, "isatty") and file.isatty()
    return Console(file=file, width=None if tty else 120, emoji=False)  # hf:llama:... is a model, not an emoji code


def print_summary(profile: Profile, console: Any = None, top_k: int = 10) -> None:
    console = console or console_for()
    for table in summary_tables(profile, top_k):
        console.print(table)
        console.print()


# ---------------------------------------------------------------------- CSV


def write_nodes_csv(profile: Profile, path: str | Path) -> Path:
    """One row per node: time, measured bytes, simulated bytes (step's own, persistent excluded)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    during = profile.to_timeline().during
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            ["rank", "name", "target", "phase", "seconds", "allocated_bytes", "live_bytes_after", "measured_peak_bytes", "simulated_bytes"]
        )
        for i, n in enumerate(profile.nodes):
            w.writerow([i, n.name, n.target, n.phase, f"{n.seconds:.9f}", n.allocated_bytes, n.live_bytes_after, n.peak_bytes, int(during[i])])
    return path


def write_activations_csv(profile: Profile, path: str | Path) -> Path:
    """One row per activation, largest first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = {n.name: n.target for n in profile.nodes}
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "node", "target", "nbytes", "created", "last_forward_use", "first_backward_use", "last_use", "inactive_seconds"])
        for t in sorted(profile.activations(), key=lambda t: (-t.nbytes, t.created)):
            w.writerow(
                [
                    t.id,
                    t.node,
                    targets.get(t.node, ""),
                    t.nbytes,
                    t.created,
                    t.last_forward_use,
                    t.first_backward_use,
                    t.last_use,
                    f"{(t.inactive_seconds or 0.0):.9f}",
                ]
            )
    return path


def write_report(profile: Profile, out_dir: str | Path, *, plot_x: str = "rank") -> dict[str, Path]:
    """profile.json, nodes.csv, activations.csv and memory_breakdown.png in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "profile": profile.to_json(out / "profile.json"),
        "nodes": write_nodes_csv(profile, out / "nodes.csv"),
        "activations": write_activations_csv(profile, out / "activations.csv"),
        "plot": plot_memory_breakdown(profile, out / "memory_breakdown.png", x=plot_x),
    }
