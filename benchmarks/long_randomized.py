"""The long randomized run: thousands of random models, each checked against eager.

    .venv/bin/python -m benchmarks.long_randomized --examples 3000 --seed 1 --out runs/randomized

Draws models from tests/support/random_models.py with hypothesis (not derandomized: `--seed`
picks the stream) and runs `check_example` on each, as tests/test_randomized.py does in
CI on a few hundred. By default it keeps going past a failure, records it and prints
every failing model (as `RandomSpec(...)`, ready to paste into a test) at the end; with
`--shrink` it stops at the first failure and lets hypothesis shrink it to a minimal model.
Writes summary.json (and failures.txt) to `--out`. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

try:
    from tests.support.random_models import RandomSpec, check_example, random_specs
except ModuleNotFoundError as e:  # run as a script: the repository root is not on the path
    raise SystemExit(f"{e}: run it from the repository root as a module, python -m benchmarks.long_randomized") from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-ops", type=int, default=14)
    ap.add_argument("--steps", type=int, default=3, help="training steps compared with eager per model")
    ap.add_argument("--minutes", type=float, default=None, help="stop drawing new models after this long")
    ap.add_argument("--shrink", action="store_true", help="stop at the first failure and shrink it")
    ap.add_argument("--out", type=Path, default=Path("runs/randomized"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    kinds: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    failures: list[tuple[RandomSpec, str]] = []
    stats = {"examples": 0, "recomputed": 0, "copies": 0, "max_abs_error_bytes": 0, "max_rel_error": 0.0,
             "max_over_budget_bytes": 0, "max_nodes": 0, "updates_in_backward": 0, "replayed_random_ops": 0,
             "with_lean_ops": 0, "with_outside_tensors": 0, "with_read_numbers": 0, "with_gradient_hooks": 0,
             "with_accumulation_across_calls": 0}
    start = time.perf_counter()
    deadline = start + 60 * args.minutes if args.minutes else None

    phases = [Phase.generate, Phase.shrink] if args.shrink else [Phase.generate]

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(random_specs(max_ops=args.max_ops))
    def run(spec: RandomSpec) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            return
        stats["examples"] += 1
        ops.update(op.kind for op in spec.ops)
        try:
            outcome = check_example(spec, steps=args.steps)
        except Exception as e:  # noqa: BLE001 - recorded, reported at the end
            if args.shrink:
                raise
            kinds["FAILED"] += 1
            failures.append((spec, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
            return
        kinds[outcome.kind] += 1
        stats["with_outside_tensors"] += int(spec.outside and outcome.kind != "capture_error")
        stats["with_gradient_hooks"] += int(spec.hooks and outcome.kind != "capture_error")
        stats["with_read_numbers"] += int("a loss weight read at every call" in outcome.notes)
        stats["with_accumulation_across_calls"] += int(any(n.startswith("accumulated across calls") for n in outcome.notes))
        if outcome.measured_peak is not None and outcome.predicted_peak:
            err = abs(outcome.measured_peak - outcome.predicted_peak)
            stats["max_abs_error_bytes"] = max(stats["max_abs_error_bytes"], err)
            stats["max_rel_error"] = max(stats["max_rel_error"], err / outcome.predicted_peak)
            stats["max_over_budget_bytes"] = max(stats["max_over_budget_bytes"], outcome.measured_peak - (outcome.budget_bytes or 0))
            stats["recomputed"] += outcome.num_recomputed
            stats["copies"] += outcome.copies
            stats["max_nodes"] = max(stats["max_nodes"], outcome.nodes)
            stats["updates_in_backward"] += int(outcome.updates_in_backward)
            stats["replayed_random_ops"] += outcome.replayed
            stats["with_lean_ops"] += int(outcome.lean_ops > 0)
        if stats["examples"] % 100 == 0:
            print(f"{stats['examples']} models, {time.perf_counter() - start:.0f} s: {dict(kinds)}", flush=True)

    shrunk: str | None = None
    try:
        run()
    except Exception as e:  # --shrink: hypothesis has printed the minimal example
        shrunk = f"{type(e).__name__}: {e}"

    seconds = time.perf_counter() - start
    summary = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "seconds": round(seconds, 1),
        "outcomes": dict(kinds),
        "ops": dict(ops.most_common()),
        **stats,
        "failures": len(failures) + (1 if shrunk else 0),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "ops"}, indent=2))
    if failures or shrunk:
        text = "\n\n".join(f"{spec!r}\n{spec.describe()}\n{err}" for spec, err in failures) + (shrunk or "")
        (args.out / "failures.txt").write_text(text)
        print(f"\n{len(failures) + (1 if shrunk else 0)} failures, written to {args.out / 'failures.txt'}")
        for spec, err in failures[:10]:
            print("\n" + spec.describe() + "\n" + err.splitlines()[0][:500])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
