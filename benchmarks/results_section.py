"""Rebuild the tables of docs/RESULTS.md "Experiments" from docs/bench/ (prose stays hand-written).

    .venv/bin/python benchmarks/results_section.py > /tmp/tables.md
"""

import json
from pathlib import Path

from summary import table

MiB = 2**20
for model in ("bert", "resnet152"):
    out = Path("docs/bench") / model
    if (out / "results.json").exists():
        print(f"#### {model}: runs\n")
        print(table(out))
        print()
    for f in sorted(out.glob("maxbatch-*.json")):
        r = json.loads(f.read_text())
        print(f"#### {model}: largest batch under {r['cap_bytes'] / MiB:,.0f} MiB ({f})\n")
        print(f"- simulated: eager {r['eager_max_batch_simulated']}, remat {r['remat_max_batch_simulated']}")
        for m in r["measured"]:
            what = f"{m['peak_bytes'] / MiB:,.0f} MiB, {'fits' if m['fits'] else 'over the cap'}" if m["status"] == "ok" else m["status"] + ": " + m.get("reason", "")[:150]
            print(f"- measured {m['method']} at batch {m['batch_size']}: {what}")
        print(f"- **{r.get('summary', '(running)')}**\n")
