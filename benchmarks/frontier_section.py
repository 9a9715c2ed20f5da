import json, pathlib, re
root = pathlib.Path("docs/frontier")
runs = [("mlp-deep-b512","mlp-deep","512","0.1:1.0:0.05"),("bert-tiny-b16","bert-tiny","16","0.1:1.0:0.05"),
        ("resnet-tiny-b16","resnet-tiny","16","0.1:1.0:0.05"),("bert-b2","bert","2","0.1:1.0:0.1"),("bert-b8","bert","8","0.1:1.0:0.1")]
out = ["## Optimality: exact planner and frontier (issue 6)", "",
"`remat/planners/milp.py` (planner `milp`) solves a mixed-integer program with one binary per candidate "
"activation (dropped or kept); continuous variables model the schedule that `build_schedule` makes of that choice: "
"which forward ops are copied into each backward node's block (the closure through unavailable values that are not a "
"still-alive shared target) and which forward ops are then removed. The objective is exactly `recompute_seconds`. "
"Memory rows are lower bounds on what `simulate_schedule` counts (at every backward node: kept activations over "
"their interval, dropped ones over their late readers' span, backward storages, kernel scratch; at every copy: what is "
"live across the block plus the copy's new storages, its rebuilt inputs and the kept sources it extends). The program is "
"thus a relaxation; each solution is simulated, cut (no-good) and re-solved until the bound meets the best fitting plan. "
"HiGHS through `scipy.optimize.milp`; `time_limit` (default 60 s); on time-out the best plan with its proven gap, or "
"BudgetError. Coarsening (`group_size`, automatic above 400 candidates) ties candidates in creation order; not needed on "
"these graphs (BERT-base: 204 binaries, 60,823 copy variables, built in ~1 s).", "",
"Tests (`tests/test_milp.py`): on mlp-deep (all 8 candidates) and on 9 sampled candidates of bert-tiny and resnet-tiny, "
"the exact planner equals brute force (every subset through build_schedule + simulate_schedule) at four budgets each, "
"proves it (gap 0), and says when no plan exists; never worse than μ-TWO; the cut loop recovers when a solution is "
"rejected; coarsened plans fit; a milp plan is bitwise eager.", "",
"Every plan below was rewritten and run: 3 steps bitwise equal to eager (column eager-equal) and the allocator's peak "
"against the prediction (kernel scratch measured by the profiler is in the prediction). Overheads are predicted "
"(summed median node times of the copies, less removed forward ops), as a fraction of the profiled iteration. "
"Budgets are fractions of the activation peak; rows where no planner has a plan are left out (the exact planner then "
"proves none exists, in well under a second). CPU, shared 2-core machine, SGD.", ""]
for d, model, b, budgets in runs:
    p = root / d
    if not (p / "frontier.md").exists():
        out += [f"### {model}, batch {b}", "", f"(not run yet: `remat frontier --model {model} --batch-size {b} --planners mutwo,chen,milp --budgets {budgets} --measure --out docs/frontier/{d}`)", ""]
        continue
    fr = json.loads((p / "frontier.json").read_text())
    done = {pt["budget"] for pt in fr["points"] if pt["planner"] == fr["planners"][-1]}
    lines = (p / "frontier.md").read_text().splitlines()
    rows = [l for l in lines[2:] if not re.search(r"no plan \| — \| no plan \| — \| no plan", l)]
    skipped = len(lines) - 2 - len(rows)
    it = fr["baseline_iteration_seconds"]
    out += [f"### {model}, batch {b}", "",
            f"`remat frontier --model {model} --batch-size {b} --planners mutwo,chen,milp --budgets {budgets} --measure --out docs/frontier/{d}`", "",
            f"Peak without recomputation {fr['baseline_peak_bytes']/2**20:,.2f} MiB (persistent {fr['persistent_bytes']/2**20:,.2f} MiB), "
            f"iteration {it*1e3:,.1f} ms (profiled). {skipped} budgets below the smallest reachable peak left out." +
            ("" if len(done) == len(fr["budgets"]) else f" Sweep incomplete: {len(done)} of {len(fr['budgets'])} budgets done."), "",
            *lines[:2], *rows, "", f"![{model} b{b}](frontier/{d}/frontier.png)", ""]
pathlib.Path("/tmp/section.md").write_text("\n".join(out) + "\n")
findings = """### Findings

- The relaxation is tight on these graphs: the first MILP solution already fit when simulated and its model cost equalled
  the schedule's cost, so every exact plan above is proven optimal (gap 0) in one solve; solver times are the `milp s` column.
- μ-TWO's gap: up to 1.5× the optimal overhead on mlp-deep, 1.2–5× on bert-tiny (up to +15% of the iteration), small on
  resnet-tiny. Two causes: (1) the greedy never takes a pick back: once later picks make an earlier one unnecessary it stays
  (it often lands well under the budget, e.g. mlp-deep at 0.8: 8.77 MiB for a 9.22 MiB cap, where the exact plan uses 9.02);
  (2) its ratio is size / recompute time of the tensor alone, while the schedule's true cost of a set is not additive —
  rebuilt intermediates die with their block and are rebuilt again by the next block, and a kept source pays in memory
  for the rebuilds that extend its life; the exact planner sees both.
- Chen's √n segments are a poor fit for this schedule: dropping whole segments makes each backward node rebuild the chain
  from the segment's checkpoint again (intermediates are not shared across blocks), so its overhead is 90–270% where the
  exact planner needs a few %. That is a property of schedule.py's rebuild-per-block semantics (μ-TWO's cost model), not
  of Chen's method as published (which recomputes a segment once); a schedule that keeps a segment's rebuilt values until
  the segment's backward ends would serve it.
- BERT-base at batch 2 (SGD): no budget below 1.0 is reachable by any planner: the peak sits where gradients and the
  vocabulary-sized logits are live, which recomputation cannot reduce (the exact planner proves it from its lower bound).
  Batch 8 shows the trade-off.
- Measured peaks: equal to the prediction to the byte on bert-tiny and resnet-tiny (kernel scratch from the profile
  included); on mlp-deep every recomputing plan measured +255 KiB (2.5–2.8%, within 3%): a GEMM buffer of the rebuilt
  addmm that the profile's scratch of the original node does not show.
"""
s = pathlib.Path("/tmp/section.md").read_text() + "\n" + findings
pathlib.Path("/tmp/section.md").write_text(s)
