"""Where a planned step's time goes, and how much of it compiled regions can take.

The step is compiled at `--budget` on the eager backend; the same planned graph is then
cut into regions and compiled by Inductor (`passes.inductor_regions.for_backend`, without
the splits a measured peak may add). Each op node of both graphs is timed in the graph's
own code (`profiler.node_costs`, the medians of `--runs` runs). Written to `--out`:

- `time_by_op.json` / `.md`: the planned graph's time by phase (forward, backward, update,
  recompute copies) and op, with whether the op may go into a region, and the part of each
  phase's time that the regions hold;
- the Inductor graph's time: each kind of region beside the same ops run one by one, and
  what runs between regions.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_time_by_op.py --model resnet152 --batch-size 4 --budget 0.3 --out docs/inductor/time-by-op-resnet152
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import torch

import remat
from remat.passes import inductor_regions
from remat.passes.rewriter import RECOMPUTED_SUFFIX
from remat.profile.profiler import node_costs
from remat.workloads import load


def measure(model_name: str, batch_size: int, budget: float, runs: int) -> dict[str, Any]:
    w = load(model_name, batch_size, seed=0, device="cpu")
    step = remat.compile(w.train_step, w.model, w.optimizer, w.batch, memory_budget=budget, measure=False)
    gm, tg = step.graph_module, step._last.tg
    kinds = inductor_regions.node_kinds(gm, tg.phase, {n.name for n in gm.graph.nodes if n.name.endswith(RECOMPUTED_SUFFIX)})
    planned = node_costs(gm, tg, w.model, w.optimizer, w.batch, runs=runs).seconds_by_node()
    start = time.perf_counter()
    compiled = inductor_regions.for_backend("inductor", gm, tg.phase)
    regions_run = node_costs(compiled, tg, w.model, w.optimizer, w.batch, runs=runs).seconds_by_node()  # the first run compiles
    compile_seconds = time.perf_counter() - start
    regions = compiled.meta["regions"].regions
    in_region = {op: r.kind for r in regions for op in r.ops}

    ops: collections.Counter[tuple[str, str, bool]] = collections.Counter()
    counts: collections.Counter[tuple[str, str, bool]] = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = (kinds[node.name], str(node.target), inductor_regions.compilable(node, kinds))
            ops[key] += planned[node.name]
            counts[key] += 1
    by_phase: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"seconds": 0.0, "in_regions_seconds": 0.0})
    for name, seconds in planned.items():
        by_phase[kinds[name]]["seconds"] += seconds
        by_phase[kinds[name]]["in_regions_seconds"] += seconds if name in in_region else 0.0
    region_kind = {r.name: r.kind for r in regions}
    compiled_kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"compiled_seconds": 0.0, "one_by_one_seconds": 0.0, "regions": 0})
    for r in regions:
        compiled_kinds[r.kind]["one_by_one_seconds"] += sum(planned[op] for op in r.ops)
    between = 0.0
    for name, seconds in regions_run.items():
        if name in region_kind:
            compiled_kinds[region_kind[name]]["compiled_seconds"] += seconds
            compiled_kinds[region_kind[name]]["regions"] += 1
        else:
            between += seconds
    return {
        "model": model_name, "batch_size": batch_size, "budget": budget, "threads": torch.get_num_threads(), "runs": runs,
        "planned_seconds": sum(planned.values()), "inductor_seconds": sum(regions_run.values()),
        "compile_seconds": compile_seconds, "regions": len(regions),
        "by_phase": dict(by_phase),
        "ops": [
            {"phase": p, "op": op, "compilable": c, "seconds": s, "count": counts[(p, op, c)]}
            for (p, op, c), s in ops.most_common()
        ],
        "regions_by_kind": dict(compiled_kinds), "between_regions_seconds": between,
    }  # fmt: skip


def table(result: dict[str, Any], top: int = 12) -> str:
    total = result["planned_seconds"]
    lines = [
        f"{result['model']} batch {result['batch_size']} at {result['budget']}, {result['threads']} threads: planned graph "
        f"{total:.3f} s op by op, {result['inductor_seconds']:.3f} s with {result['regions']} Inductor regions\n",
        "| phase | op | may go into a region | seconds | share | ops |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in result["ops"][:top]:
        lines.append(f"| {row['phase']} | `{row['op']}` | {'yes' if row['compilable'] else 'no'} | {row['seconds']:.3f} | {row['seconds'] / total:.0%} | {row['count']} |")
    lines += ["", "| phase | seconds op by op | of it in regions | regions | those ops compiled |", "|---|---:|---:|---:|---:|"]
    for phase, p in sorted(result["by_phase"].items()):
        k = result["regions_by_kind"].get(phase, {"compiled_seconds": 0.0, "regions": 0})
        lines.append(f"| {phase} | {p['seconds']:.3f} | {p['in_regions_seconds']:.3f} | {k['regions']} | {k['compiled_seconds']:.3f} |")
    lines.append(f"\nBetween regions, one op at a time: {result['between_regions_seconds']:.3f} s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each graph after one warm-up (default: %(default)s)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    result = measure(args.model, args.batch_size, args.budget, args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "time_by_op.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (args.out / "time_by_op.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
