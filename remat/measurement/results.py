"""The bench's results file (results.json, written after every step of a sweep) and the tables and CSVs
read from it alone."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.budget import MiB


RESULTS_FORMAT = "remat.bench"


RESULTS_VERSION = 1


@dataclass(frozen=True)
class Method:
    kind: str  # eager, remat, remat-inductor, hf, sequential, compile, hf-compile
    budget: float | str | None = None  # a fraction; "min": the smallest peak its planner reaches; "=hf": hf's measured peak

    @property
    def name(self) -> str:
        if self.budget is None:
            return self.kind
        return f"{self.kind}@{self.budget}" if isinstance(self.budget, str) else f"{self.kind}@{self.budget:g}"


def methods_for(budgets: list[float | str], baselines: list[str]) -> list[Method]:
    """Eager first, then remat at each budget, then the baselines (compile and remat-inductor
    at each fraction)."""
    out = [Method("eager")] + [Method("remat", b) for b in budgets]
    for name in baselines:
        if name in ("compile", "remat-inductor"):
            out += [Method(name, b) for b in budgets if not isinstance(b, str)]
        else:
            out.append(Method(name))
    return out


def method_kind(name: str) -> str:
    return name.split("@", 1)[0]


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
    order = ["eager", "remat", "remat-inductor", "hf", "sequential", "compile", "hf-compile"]
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
        "Peaks: the allocator's events (`remat.profile.allocator.measure_peak`), persistent bytes (parameters, buffers, optimizer state) included. "
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


def failure_reason(e: BaseException) -> str:
    """One line for a results file: the error's first line, out-of-memory said so."""
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if "out of memory" in text.lower() or "can't allocate memory" in text.lower() or isinstance(e, MemoryError):
        return "out of memory: " + first[:300]
    return first[:500]
