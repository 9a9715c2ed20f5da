"""Plans before and after a change: every planner at every budget, on saved profiles.

    .venv/bin/python benchmarks/plan_regression.py --save DIR    # profiles + plans of this code
    .venv/bin/python benchmarks/plan_regression.py --check DIR   # re-plan from DIR's profiles, compare
    .venv/bin/python benchmarks/plan_regression.py --replan DIR  # re-plan from DIR's profiles, write the plans (a rule changed on purpose)
    (--no-lean-ops: plan without lean operator variants, to compare with plans made before them)

A restructuring of the memory model or the planners must not change a plan. `--save`
captures and profiles each model once (the profiles are kept in DIR) and writes every
plan; `--check` re-plans from those same profiles with the code as it is now and reports
every plan whose JSON differs (the planning time aside). The exact planner's time limit
is kept short and its plans compared only where it proved them optimal (a plan cut off
by a time limit depends on the machine's speed). Exit status 1 if a plan changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


from remat import build as pipeline
from remat.capture.capture import capture
from remat.errors import RematError
from remat.planners import make_plan
from remat.profile.profiles import Profile
from remat.memory.simulator import simulate
from remat.workloads import load

MODELS = [("mlp-deep", 512), ("bert-tiny", 16), ("resnet-tiny", 16)]
BUDGETS = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
PLANNERS = {"mutwo": {}, "chen": {}, "milp": {"time_limit": 10.0}, "refined": {}}
VOLATILE = ("planning_seconds", "meta")  # meta: the solvers' own statistics (times, bounds in the last bits)


def _stable(plan_json: dict[str, Any]) -> dict[str, Any]:
    """The plan itself: what is recomputed, under which schedule, and its predictions."""
    out = {k: v for k, v in plan_json.items() if k not in VOLATILE}
    if not out.get("lean_ops"):
        out.pop("lean_ops", None)  # a plan without lean operator variants reads as one made before they existed
    out["schedule"] = plan_json.get("meta", {}).get("schedule")
    return out


def plans_for(model: str, batch: int, profiles: Path, save: bool, lean_ops: bool = True) -> dict[str, Any]:
    spec = load(model, batch, "sgd")
    tg = capture(spec.train_step, spec.model, spec.optimizer, spec.batch)
    path = profiles / f"{model}-b{batch}.json"
    saved = None if save else Profile.from_json(path)
    built = pipeline.build_on(tg, spec.model, spec.optimizer, spec.batch, runs=3, saved_profile=saved)
    if save:
        built.profile.to_json(path)
    base = simulate(built.analysis, scratch=built.index.scratch)
    out: dict[str, Any] = {}
    for planner, kwargs in PLANNERS.items():
        for b in BUDGETS:
            budget = int(base.persistent_bytes + b * base.step_peak_bytes)
            key = f"{model}-b{batch}/{planner}@{b:g}"
            try:
                plan = make_plan(planner, built.index, built.node_seconds(), budget, lean_ops=lean_ops, **kwargs)
            except RematError as e:
                out[key] = {"error": f"{type(e).__name__}: {str(e).split(':')[0]}"}
                continue
            doc = _stable(json.loads(json.dumps(plan.to_dict())))
            if planner == "milp" and plan.meta.get("milp_status") not in ("optimal", "optimal_below_reserve"):
                doc = {"not optimal within the time limit": True}
            out[key] = doc
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="DIR")
    mode.add_argument("--check", metavar="DIR")
    mode.add_argument("--replan", metavar="DIR")
    p.add_argument("--no-lean-ops", action="store_true", help="plan without lean operator variants (compare with plans made before them)")
    args = p.parse_args()
    folder = Path(args.save or args.check or args.replan)
    folder.mkdir(parents=True, exist_ok=True)
    plans: dict[str, Any] = {}
    for model, batch in MODELS:
        plans.update(plans_for(model, batch, folder, save=bool(args.save), lean_ops=not args.no_lean_ops))
        print(f"{model} b{batch}: planned", file=sys.stderr, flush=True)
    if args.save or args.replan:
        (folder / "plans.json").write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")
        print(f"saved {len(plans)} plans to {folder}")
        return 0
    before = json.loads((folder / "plans.json").read_text())
    changed = [k for k in sorted(set(before) | set(plans)) if before.get(k) != plans.get(k)]
    for k in changed:
        print(f"CHANGED {k}")
    print(f"{len(plans) - len(changed)} of {len(plans)} plans identical, {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
