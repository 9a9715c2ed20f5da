"""Would restarts help the default planner? Its plan against the best of k plans made from
node times perturbed at random, each priced with the true times.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/perturbed_restarts.py --model mlp-deep --batch-size 512 \
        --profile docs/plan_regression/mlp-deep-b512.json --budgets 0.6,0.75,0.85 --restarts 8

The same saved profile throughout (`--profile`). Each restart plans with the default
planner on every node's time scaled by a factor drawn from 1 ± `--spread` (seeded), on a
freshly derived index; its plan is priced with the profile's own times (the schedule's
rebuild seconds, as a share of the iteration). Prints a markdown table. A study for the
planner, not a planner: the default does not restart.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


from planner_gap import built_on_profile
from remat.errors import RematError
from remat.memory.schedule import recompute_seconds
from remat.memory.simulator import simulate
from remat.planners import make_plan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--profile", required=True, help="a saved profile (benchmarks/planner_gap.py writes one)")
    p.add_argument("--budgets", required=True, help="comma list of fractions of the activation peak")
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--spread", type=float, default=0.1, help="each node time scaled by a factor in 1 ± spread")
    args = p.parse_args()
    first, built = built_on_profile(args.model, args.batch_size, args.profile)
    true = first.node_seconds()
    base = simulate(first.analysis, scratch=first.index.scratch)
    iteration = sum(true.values())

    def priced(plan, index) -> float:  # type: ignore[no-untyped-def]
        ordered = plan.index_for(index)
        return 100 * recompute_seconds(plan.schedule(ordered), true) / iteration

    print(f"{args.model} batch {args.batch_size}: the default plan against the best of {args.restarts} plans made from node "
          f"times scaled by 1 ± {args.spread:g}, priced with the true times (% of the iteration)\n")
    print("| budget | default (s) | best of the restarts | each restart | restarts' seconds |\n|---|---:|---:|---|---:|")
    for fraction in (float(b) for b in args.budgets.split(",")):
        budget = int(base.persistent_bytes + fraction * base.step_peak_bytes)
        try:
            start = time.perf_counter()
            default = priced(make_plan("refined", first.index, true, budget), first.index)
            seconds = time.perf_counter() - start
        except RematError:
            print(f"| {fraction:g} | no plan | | | |")
            continue
        rng = random.Random(0)
        costs, spent = [], 0.0
        for _ in range(args.restarts):
            noisy = {n: s * (1 + rng.uniform(-args.spread, args.spread)) for n, s in true.items()}
            again = built()
            start = time.perf_counter()
            try:
                costs.append(priced(make_plan("refined", again.index, noisy, budget), again.index))
            except RematError:
                costs.append(float("inf"))
            spent += time.perf_counter() - start
        print(f"| {fraction:g} | {default:.2f}% ({seconds:.1f} s) | {min(costs):.2f}% | {' / '.join(f'{c:.2f}' for c in costs)} | {spent:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
