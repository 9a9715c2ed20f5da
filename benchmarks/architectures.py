"""Model coverage: real `transformers` architectures under remat, checked against eager.

    .venv/bin/python -m benchmarks.architectures --out runs/architectures

Each architecture is built from a small config with random weights (nothing is
downloaded; attention forced to "eager", so attention is plain aten ops), trained with
AdamW on one random batch. For each: `remat.compile(..., memory_budget=0.5)` (if 0.5 is
refused, the smallest peak the planner can reach, as bytes, is recorded and used
instead), 3 steps compared bitwise with eager (`check_against_eager`), predicted vs
measured peak, and the time overhead: remat step / eager step, the median of alternating
pairs (`time_alternating`) in this one process. A model that cannot be captured or
planned is recorded with its error. Writes architectures.md, architectures.csv and
architectures.json to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

try:
    from tests.support.architectures import SIZES, ARCHITECTURES, Row, run_one
except ModuleNotFoundError as e:  # run as a script: the repository root is not on the path
    raise SystemExit(f"{e}: run it from the repository root as a module, python -m benchmarks.architectures") from e


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| architecture | config | budget | grads_match (3 steps, bitwise) | baseline peak MiB | predicted peak MiB | "
        "measured peak MiB | recomputed | overhead (remat/eager, median [min–max]) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.architecture} | {r.config} | {r.budget} | {r.status}: {r.error} | | | | | |")
            continue
        over = "" if r.overhead_ratio is None else f"{r.overhead_ratio:.2f} [{r.overhead_spread[0]:.2f}–{r.overhead_spread[1]:.2f}]"
        lines.append(
            f"| {r.architecture} | {r.config} | {r.budget} | {'yes' if r.grads_match else 'NO: ' + r.error} | "
            f"{_mib(r.baseline_peak_bytes)} | {_mib(r.predicted_peak_bytes)} | {_mib(r.measured_peak_bytes)} | "
            f"{r.num_recomputed} | {over} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    ap.add_argument("--size", default="small", choices=list(SIZES))
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--pairs", type=int, default=7, help="alternating eager/remat timing pairs (0: no timing)")
    ap.add_argument("--profile-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/architectures"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for name in args.models:
        t0 = time.perf_counter()
        row = run_one(name, args.size, args.budget, pairs=args.pairs, profile_runs=args.profile_runs)
        rows.append(row)
        print(f"{name}: {row.status}, grads_match={row.grads_match}, predicted {_mib(row.predicted_peak_bytes)} MiB, "
              f"measured {_mib(row.measured_peak_bytes)} MiB, overhead {row.overhead_ratio} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    (args.out / "architectures.md").write_text(markdown(rows))
    (args.out / "architectures.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    with open(args.out / "architectures.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in asdict(rows[0]) if k != "notes"])
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d.pop("notes")
            w.writerow(d)
    print("\n" + markdown(rows))
    return 0 if all(r.status == "ok" and r.grads_match for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
