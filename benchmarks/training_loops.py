"""What remat does with the idioms of real training loops (tests/support/loop_idioms.py):
each runs in eager PyTorch and under remat (bert-tiny cut to one layer, AdamW(foreach=True), budget 0.9, 6 steps),
compared bitwise after every step.

    .venv/bin/python -m benchmarks.training_loops --out docs/training_loops

An idiom either works (bitwise equal to eager over every step) or is refused with a
CaptureError naming it; anything else ("WRONG": a mismatch, or another error) is a bug.
Writes idioms.md and idioms.json to --out; exit status 1 if an idiom did not do what
it is expected to (tests/test_training_loops.py runs each too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

try:
    from tests.support.loop_idioms import IDIOMS, run_idiom
except ModuleNotFoundError as e:  # run as a script: the repository root is not on the path
    raise SystemExit(f"{e}: run it from the repository root as a module, python -m benchmarks.training_loops") from e


def write(results: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "idioms.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "| idiom | outcome | detail |",
        "|---|---|---|",
        *[f"| {r['idiom']} | {r['outcome']}{'' if r['as_expected'] else ' (UNEXPECTED)'} | {r['detail'].splitlines()[0].replace('|', '/')[:300]} |" for r in results],
    ]
    (out / "idioms.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/training_loops")
    args = p.parse_args()
    results = []
    for idiom in IDIOMS:
        results.append(run_idiom(idiom))
        print(f"{results[-1]['outcome']:8} {idiom.name}", flush=True)
    write(results, Path(args.out))
    bad = [r for r in results if not r["as_expected"]]
    print(f"{len(results) - len(bad)} as expected, {len(bad)} not; wrote {args.out}/idioms.md")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
