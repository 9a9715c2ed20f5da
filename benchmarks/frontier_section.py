import json, pathlib, re
root = pathlib.Path("docs/frontier")
runs = [("mlp-deep-b512","mlp-deep","512","0.1:1.0:0.05"),("bert-tiny-b16","bert-tiny","16","0.1:1.0:0.05"),
        ("resnet-tiny-b16","resnet-tiny","16","0.1:1.0:0.05"),("bert-b8","bert","8","0.5:1.0:0.1")]
out = ["## Optimality: exact planner and frontier", "",
"Regenerate this section's tables with `.venv/bin/python benchmarks/frontier_section.py` (writes /tmp/section.md).", "",
"`remat/planners/milp/` (planner `milp`) solves a mixed-integer program with one binary per candidate "
"activation (dropped or kept); continuous variables model the schedule that `build_schedule` makes of that choice: "
"which forward ops are copied into each backward node's block and which forward ops are then removed. A rebuilt "
"value is reused while any value on its storage is still to be read (the schedule's storage-level reuse), and the "
"objective equals the schedule's `recompute_seconds` for every drop set (tests fix the binaries to every subset of "
"small candidate sets and compare). Memory rows are lower bounds on what `simulate_schedule` counts, so the program "
"is a relaxation: each solution is simulated, cut (no-good) and re-solved until HiGHS's bound meets the best fitting "
"plan. A second program models the shared rebuild schedule (a rebuilt value held for all its later readers); the "
"planner solves the per-block program (up to half the time limit), re-simulates its fitting sets under the shared "
"schedule, then solves the shared program cut off at the best plan in hand, and returns the cheaper plan: \"optimal\" "
"and the gap hold over both schedules. HiGHS through `scipy.optimize.milp`; `--time-limit` (default 60 s) per budget; "
"on time-out the best plan found with its proven gap (\"unknown\" when no finite bound was proven), or BudgetError. "
"Coarsening (`group_size`, automatic above 400 candidates) is there but not needed on these graphs "
"(BERT-base: 204 binaries).", "",
"Tests (`tests/test_milp.py`): both programs price every subset exactly (mlp-deep: all 8 candidates; bert-tiny and "
"resnet-tiny: 9 sampled); the exact planner equals brute force over both schedules at four budgets each and proves it "
"(gap 0); a hand-checkable chain; never worse than μ-TWO; the cut loop recovers when a solution is rejected; coarsened "
"plans fit; a milp plan is bitwise eager.", "",
"Every plan below was rewritten and run (`--measure`): 3 steps bitwise equal to eager (column eager-equal) and the "
"allocator's peak against the prediction. Overheads are predicted (summed median node times of the copies, less removed "
"forward ops), as a fraction of the profiled iteration. Budgets are fractions of the activation peak; rows where no "
"planner has a plan are left out. CPU, SGD, `OMP_NUM_THREADS=1`, one other job on the second core. Run again on 2026-11-24, after the default planner's fill was changed to pass over activations that raise the peak (see \"The default planner\"), each on the node times of the profile saved in its folder by the runs before (`--profile`, so that only the planners' code differs). The exact planner's 60 s per budget is shared by the four graphs planned (lean variants or not, updates moved or not): 15 s each. Each heuristic planner's gap is to the cheapest plan any planner found at that budget.", ""]
for d, model, b, budgets in runs:
    p = root / d
    if not (p / "frontier.md").exists():
        out += [f"### {model}, batch {b}", "", f"(not run yet: `remat frontier --model {model} --batch-size {b} --planners refined,mutwo,chen,milp --budgets {budgets} --measure --out docs/frontier/{d}`)", ""]
        continue
    fr = json.loads((p / "frontier.json").read_text())
    done = {pt["budget"] for pt in fr["points"] if pt["planner"] == fr["planners"][-1]}
    lines = (p / "frontier.md").read_text().splitlines()
    rows = [l for l in lines[2:] if not re.search(r"no plan \| — \| no plan \| — \| no plan", l)]
    skipped = len(lines) - 2 - len(rows)
    it = fr["baseline_iteration_seconds"]
    out += [f"### {model}, batch {b}", "",
            f"`remat frontier --model {model} --batch-size {b} --planners refined,mutwo,chen,milp --budgets {budgets} --measure "
            f"--profile <a copy of docs/frontier/{d}/profile.json> --out docs/frontier/{d}`", "",
            f"Peak without recomputation {fr['baseline_peak_bytes']/2**20:,.2f} MiB (persistent {fr['persistent_bytes']/2**20:,.2f} MiB), "
            f"iteration {it*1e3:,.1f} ms (profiled). {skipped} budgets below the smallest reachable peak left out." +
            ("" if len(done) == len(fr["budgets"]) else f" Sweep incomplete: {len(done)} of {len(fr['budgets'])} budgets done."), "",
            *lines[:2], *rows, "", f"![{model} b{b}](frontier/{d}/frontier.png)", ""]
pathlib.Path("/tmp/section.md").write_text("\n".join(out) + "\n")
findings = """### Findings

- **Every plan on the four frontiers ran bitwise equal to eager and measured exactly the predicted peak** (+0.00%
  everywhere, kernel scratch included).
- **The default planner (`refined`) is within 0.8% of the iteration of the cheapest plan found, at every budget from
  the floor to 1.0 on all four**: at most +0.08% on mlp-deep (0.9), +0.79% on bert-tiny (0.55, against the exact
  planner's optimum below its reserve), +0.68% on resnet-tiny (0.75, against a proven optimum), and on BERT-base
  batch 8 it is the cheapest at every budget but 0.7, where the exact program found a plan 0.22% cheaper in this run
  (2.0% against 1.8%; in the run before it stopped at 3.5%: a plan cut off by a time limit depends on the machine's
  speed). Where the exact planner stops at its time limit, the default's plan is otherwise cheaper: BERT-base 9.2%
  against 11.4% at 0.5 and 4.6% against 6.1% at 0.6; bert-tiny 26.8% against 30.5% at 0.4 and 14.3% against 15.0% at
  0.5. Against the run before, one default plan changed: bert-tiny at 0.4, 28.1% → 26.8%.
- **μ-TWO's gap** (its predicted overhead minus the cheapest, as a share of the iteration): small at loose budgets, large
  at tight ones: +131% on bert-tiny at 0.4 (its per-block set costs 4× the same set with rebuilt values shared) and
  +25 to +59% at 0.45–0.55; +8 to +14% on mlp-deep at every budget below 1.0; +4 to +7% on resnet-tiny at 0.6–0.65 and
  0.8; +7.6 to +8.7% on BERT-base at 0.5–0.6. The default planner's local search removes it (see "The default
  planner" below for which move finds what).
- **The exact planner is the lower envelope where it proves optimality**: mlp-deep and resnet-tiny at every budget
  (under 1 s each); bert-tiny at 0.55 and above (optimal below its replay reserve, see below). On BERT-base batch 8
  (204 binaries, ~60,000 continuous variables) its 15 s per graph proves nothing below 1.0.
- **Chen's √n segments** (shared rebuilds, one extra forward per segment) cost 15–47% of the iteration at every budget
  below 1.0, whatever the budget asks: a segment count that fits is found, but segments know nothing of where the peak
  is. On bert-tiny at 0.4 no segment count fits at all.
- **BERT-base at batch 2** (SGD): no budget below 1.0 is reachable by any planner: the peak sits where
  the gradients and the vocabulary-sized logits are live, which recomputation cannot reduce. Batch 8 shows the
  trade-off, down to the gradient floor at 0.48.
- Profiles were taken with one other job on the second core (`OMP_NUM_THREADS=1`): overheads are shares of those
  profiled iterations; compare planners within a row. Each run profiles anew, so two runs' figures differ by a little.
"""
s = pathlib.Path("/tmp/section.md").read_text() + "\n" + findings
pathlib.Path("/tmp/section.md").write_text(s)
