"""Plots of measured results: a bench's peak and latency against batch size and its time-memory
trade-off, and a frontier's overhead against peak memory per planner."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat.budget import MiB
from remat.measurement.results import _batch_sizes, _method_names, method_kind

if TYPE_CHECKING:  # annotations only: the frontier's files import this module to plot
    from remat.measurement.frontier_files import Frontier


# Method names: "eager", "remat@0.5", "hf", "sequential", "compile@0.5".
METHOD_COLORS = {
    "eager": "#4c72b0", "remat": "#c44e52", "remat-inductor": "#e377c2", "hf": "#55a868", "sequential": "#dd8452", "compile": "#8172b3",
    "hf-compile": "#8c564b",
}  # fmt: skip


METHOD_LABELS = {
    "eager": "eager (no checkpointing)",
    "remat": "remat",
    "hf": "HF gradient_checkpointing_enable()",
    "sequential": "checkpoint_sequential (√n)",
    "compile": "torch.compile + activation_memory_budget",
    "remat-inductor": "remat, regions compiled by Inductor",
    "hf-compile": "HF checkpointing under torch.compile",
}


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


def wrapped_title(fig: Any, text: str, fontsize: float = 11) -> None:
    """The figure's title, wrapped to the figure's width (a narrow figure, one panel, would
    cut a long line at both sides)."""
    chars = max(30, int(fig.get_figwidth() * 72 / (0.55 * fontsize)))
    fig.suptitle("\n".join(textwrap.wrap(text, chars)), fontsize=fontsize)


def save_figure(fig: Any, path: Path) -> None:
    """Saved with the canvas grown to hold every title, label and legend."""
    fig.savefig(path, dpi=130, bbox_inches="tight")


def _finish(fig: Any, path: Path) -> Path:
    """Laid out, saved and closed."""
    fig.tight_layout()
    save_figure(fig, path)
    _plt().close(fig)
    return path


def _has_compile(doc: dict[str, Any]) -> bool:
    return any(method_kind(r["method"]) == "compile" and r.get("status") == "ok" for r in doc["runs"])


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
    return _finish(fig, path)


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
    """(c): median seconds per iteration vs batch size, and the ratio to eager (min–max bars);
    over one batch size, a bar a method."""
    if len(_batch_sizes(doc)) == 1:
        return _latency_bars(doc, path)
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
    _log_y(ax1)
    ax1.set_ylabel("iteration time, median (s, log scale)")
    ax1.set_title("iteration latency")
    ax2.axhline(1.0, color="0.4", linewidth=0.8)
    ratios = [y for name in names for y in _series(doc, name, "ratio_to_eager")[1]]
    if ratios and max(ratios) > 4:  # one plan at the edge of reach (tens of ×) would flatten the rest
        _log_y(ax2)
    ax2.set_ylabel("time / eager (median of rounds; bars: min–max)")
    ax2.set_title("time overhead vs eager (same process, round-robin)")
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    meta = doc["meta"]
    note = "; dashed: torch.compile (times include kernel fusion)" if _has_compile(doc) else ""
    wrapped_title(fig, f"{meta['model']} ({meta['device']}, {meta['optimizer']}){note}")
    return _finish(fig, path)


def _latency_bars(doc: dict[str, Any], path: Path) -> Path:
    """One batch size: a bar a method, its milliseconds per iteration and its time / eager
    (min–max), methods named on the axis (a column of points over one x is unreadable)."""
    plt = _plt()
    names = [n for n in _method_names(doc) if _series(doc, n, "seconds")[0]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.42 * len(names)), sharey=True)
    rows = list(range(len(names)))[::-1]  # the first method on top
    colors = [_color(n, _method_names(doc)) for n in names]
    ms = [_series(doc, n, "seconds")[1][0] * 1e3 for n in names]
    ax1.barh(rows, ms, color=colors, edgecolor="black", linewidth=0.5)
    ax1.set_yticks(rows, [_label(n) for n in names], fontsize=8)
    ax1.set_xlabel("ms per iteration (median)")
    ax1.set_title("iteration latency")
    ratios = [_series(doc, n, "ratio_to_eager") for n in names]
    for row, color, (_, ys, spread) in zip(rows, colors, ratios):
        if ys:
            (lo, hi), y = spread[0], ys[0]
            ax2.barh(row, y, color=color, edgecolor="black", linewidth=0.5, xerr=[[y - lo], [hi - y]], capsize=3)
    ax2.axvline(1.0, color="0.4", linewidth=0.8)
    ax2.set_xlabel("time / eager (median of rounds; bars: min–max)")
    ax2.set_title("time overhead vs eager (same process, round-robin)")
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    meta = doc["meta"]
    note = "; torch.compile's times include kernel fusion" if _has_compile(doc) else ""
    wrapped_title(fig, f"{meta['model']} ({meta['device']}, {meta['optimizer']}), batch {_batch_sizes(doc)[0]}{note}")
    return _finish(fig, path)


def _log_y(ax: Any) -> None:
    """A log y axis labelled at 1, 2 and 5 of each decade alone, in plain numbers: labels at
    every minor tick (0.3, 0.4, ... 0.9) overlap where a decade is short."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    axis = ax.yaxis
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def plot_tradeoff(doc: dict[str, Any], path: Path) -> Path:
    """Measured peak vs time overhead, one point per method and budget, one panel per batch size."""
    plt = _plt()
    sizes = [b for b in _batch_sizes(doc) if any(r["batch_size"] == b and r.get("status") == "ok" for r in doc["runs"])] or _batch_sizes(doc)
    names = _method_names(doc)
    n = max(1, len(sizes))
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.2 * rows + 0.8), squeeze=False)
    markers = {"eager": "s", "remat": "o", "remat-inductor": "*", "hf": "^", "sequential": "D", "compile": "P", "hf-compile": "v"}
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
    note = " (torch.compile hollow: its time includes fusion)" if _has_compile(doc) else ""
    wrapped_title(fig, f"{meta['model']} ({meta['device']}): memory vs time trade-off; lower left is better{note}", fontsize=10)
    ncol = max(1, min(len(seen), cols))  # about one label per panel's width
    fig.tight_layout()
    fig.legend(list(seen.values()), [_label(n) for n in seen], loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_frontier(fr: "Frontier", path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"mutwo": "#c44e52", "chen": "#4c72b0", "milp": "#55a868", "refined": "#8172b2"}
    labels = {"mutwo": "μ-TWO (greedy)", "chen": "Chen √n segments", "milp": "exact (MILP)", "refined": "default (μ-TWO, then a local search)"}
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for planner in fr.planners:
        pts = sorted((p for p in fr.points if p.planner == planner and p.status == "ok"), key=lambda p: p.predicted_peak_bytes or 0)
        if not pts:
            continue
        c = colors.get(planner)
        xs = [p.predicted_peak_bytes / MiB for p in pts]
        ys = [100 * (p.predicted_overhead_fraction or 0.0) for p in pts]
        ax.plot(xs, ys, marker="o", color=c, label=f"{labels.get(planner, planner)}: predicted peak")
        meas = [(p.measured_peak_bytes / MiB, 100 * (p.predicted_overhead_fraction or 0.0)) for p in pts if p.measured_peak_bytes is not None]
        if meas:
            ax.scatter([m[0] for m in meas], [m[1] for m in meas], marker="x", s=45, color=c, label=f"{labels.get(planner, planner)}: measured peak")
        timed = [(p.measured_peak_bytes / MiB, 100 * (p.measured_overhead_ratio - 1)) for p in pts if p.measured_overhead_ratio is not None and p.measured_peak_bytes is not None]
        if timed:
            ax.scatter([m[0] for m in timed], [m[1] for m in timed], marker="^", s=35, facecolors="none", edgecolors=c, label=f"{labels.get(planner, planner)}: measured time")
    ax.axvline(fr.baseline_peak_bytes / MiB, color="#888888", linestyle=":", label="peak without recomputation")
    ax.set_xlabel("peak memory of the iteration (MiB; persistent bytes included)")
    ax.set_ylabel("recompute overhead (% of the iteration time, predicted)")
    ax.set_title(f"Memory–time frontier: {fr.model}, batch {fr.batch_size} ({fr.optimizer}, {fr.device})", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", bbox_inches="tight")
        tmp.replace(path)  # never half a picture
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
