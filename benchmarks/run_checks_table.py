"""Turn the `remat run --json` lines of benchmarks/run_checks.sh into the Markdown table
of docs/RESULTS.md ("Rewriter and runtime").

    .venv/bin/python benchmarks/run_checks_table.py docs/run/runs.jsonl
"""

from __future__ import annotations

import json
import sys

MiB = 2**20


def row(d: dict) -> str:
    if "failed" in d:
        return f"| {d['model']} | {d['batch_size']} | {d['budget']} | no plan: {d['failed'].removeprefix('remat: error: ')} |||||||"
    persistent = d["persistent_bytes"]
    eager_act = d["eager_peak_bytes"] - persistent
    remat_act = d["peak_bytes_measured"] - persistent
    measured_vs_predicted = d["peak_bytes_measured"] / d["predicted_peak_bytes"] - 1
    under = "yes" if d["budget_bytes"] is None or d["peak_bytes_measured"] <= d["budget_bytes"] else "**no**"
    lo, hi = d["overhead_ratio_spread"]
    return (
        f"| {d['model']} | {d['batch_size']} | {d['budget'] or 'none'} "
        f"| {d['eager_peak_bytes'] / MiB:.1f} "
        f"| {d['peak_bytes_measured'] / MiB:.1f} / {d['predicted_peak_bytes'] / MiB:.1f} ({measured_vs_predicted:+.2%}) "
        f"| {under} "
        f"| {eager_act / MiB:.0f} → {remat_act / MiB:.0f} ({remat_act / eager_act:.2f}×) "
        f"| {d['overhead_ratio']:.3f} ({lo:.2f}–{hi:.2f}) / {d['predicted_overhead_ratio']:.3f} "
        f"| {d['num_recomputed']} | {d['grads_match']} |"
    )


def main(path: str) -> None:
    print(
        "| model | batch | budget | eager peak (MiB) | remat peak measured / predicted (MiB) | at or under budget "
        "| activation peak eager → remat (MiB) | time ratio remat/eager measured (spread) / predicted "
        "| recomputed | bitwise equal to eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with open(path) as f:
        for line in f:
            if line.strip():
                print(row(json.loads(line)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/run/runs.jsonl")
