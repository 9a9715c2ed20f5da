"""Print the compact Markdown tables of docs/RESULTS.md "Experiments" from the results files.

    .venv/bin/python benchmarks/summary.py docs/bench/bert docs/bench/resnet152
"""

import json
import sys
from pathlib import Path

MiB = 2**20


def table(out: Path) -> str:
    doc = json.loads((out / "results.json").read_text())
    rows = ["| batch | method | peak MiB measured (predicted) | activation peak MiB (× eager) | time / eager, median (min–max), rounds | note |", "|---:|---|---:|---:|---:|---|"]
    for r in doc["runs"]:
        if r["status"] == "ok":
            pred = f" ({r['predicted_peak_bytes'] / MiB:,.0f})" if r.get("predicted_peak_bytes") else ""
            act = r["activation_peak_bytes"] / MiB
            ratio = f" ({r['activation_ratio_to_eager']:.2f}×)" if r.get("activation_ratio_to_eager") else ""
            t = "1" if r["kind"] == "eager" else (f"{r['ratio_to_eager']:.2f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}), {r['rounds']}" if r.get("ratio_to_eager") else "–")
            if r["kind"] == "eager" and r.get("seconds"):
                t = f"1 ({r['seconds']:.1f} s/iter)"
            rows.append(f"| {r['batch_size']} | {r['method']} | {r['peak_bytes'] / MiB:,.0f}{pred} | {act:,.0f}{ratio} | {t} | {(r.get('notes') or '')[:90]} |")
        else:
            reason = (r.get("reason") or "").replace("|", "/")
            rows.append(f"| {r['batch_size']} | {r['method']} | {r['status']} | | | {reason[:200]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    for d in sys.argv[1:]:
        print(f"### {d}\n")
        print(table(Path(d)))
        print()
