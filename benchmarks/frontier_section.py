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
"planner has a plan are left out. CPU, SGD, `OMP_NUM_THREADS=1`, one other job on the second core; run at commit e51cd35.", ""]
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
            f"`remat frontier --model {model} --batch-size {b} --planners refined,mutwo,chen,milp --budgets {budgets} --measure --out docs/frontier/{d}`", "",
            f"Peak without recomputation {fr['baseline_peak_bytes']/2**20:,.2f} MiB (persistent {fr['persistent_bytes']/2**20:,.2f} MiB), "
            f"iteration {it*1e3:,.1f} ms (profiled). {skipped} budgets below the smallest reachable peak left out." +
            ("" if len(done) == len(fr["budgets"]) else f" Sweep incomplete: {len(done)} of {len(fr['budgets'])} budgets done."), "",
            *lines[:2], *rows, "", f"![{model} b{b}](frontier/{d}/frontier.png)", ""]
pathlib.Path("/tmp/section.md").write_text("\n".join(out) + "\n")
findings = """### Findings

- **Every plan on the four frontiers ran bitwise equal to eager and measured exactly the predicted peak** (+0.00%
  everywhere, kernel scratch included). The first runs showed mlp-deep 3–11% *below* prediction: the
  frontier measured a step while the check's gradients were still set, and the step frees them as it starts, which the
  allocator profiler (it never saw them allocated) cannot subtract. The frontier now clears them first, as `remat run`
  does; the figures above are from after that fix.
- **The exact planner is the lower envelope** on mlp-deep, bert-tiny and resnet-tiny: proven optimal (gap 0) at every
  budget, at or below μ-TWO and Chen everywhere. Solver times: under 0.4 s on mlp-deep and resnet-tiny, up to 9.4 s on
  bert-tiny at the tightest budgets (the shared-schedule program branches more). On BERT-base batch 8 (204 binaries,
  ~60,000 continuous variables) it proves optimality at 0.8 and 0.9 in 21–26 s and hits the 60 s limit at 0.5–0.7 with
  a proven gap of 3.4% (0.6) and 0.65% (0.7) of the iteration, and none proven at 0.5; at 0.7 its time-limited plan is
  0.09% of the iteration *worse* than μ-TWO's.
- **μ-TWO's gap** (its predicted overhead minus the exact one, as a share of the iteration): small at loose budgets
  (≤ 0.1% on BERT-base at 0.7–0.9, ≤ 2.7% on bert-tiny and resnet-tiny at 0.8 and above), large at tight ones: +12.6% on
  mlp-deep at 0.8, +19 to +90% on bert-tiny at 0.65–0.75 (6.3× the optimal overhead at 0.65), +5 to +7% on resnet-tiny
  at 0.6–0.65, +7% on BERT-base at 0.5–0.6. Two causes: the greedy never takes a pick back (once later picks make an
  earlier one unnecessary it stays, and it often lands well under the budget: resnet-tiny at 0.6–0.65, 6.27 MiB for a
  6.6–7.0 MiB cap), and its ratio is a tensor's size over its own recompute time, while the true cost of a set is not
  additive (rebuilt intermediates die with their block and are rebuilt again by the next one, and kept sources pay in
  memory for the rebuilds that extend their life). Both programs see the whole set.
- **Chen's √n segments** (shared rebuilds, one extra forward per segment) cost 13–43% of the iteration at every budget
  below 1.0, whatever the budget asks: a segment count that fits is found, but segments know nothing of where the peak
  is. On BERT-base at 0.5 no segment count fits at all.
- **BERT-base at batch 2** (SGD): no budget below 1.0 is reachable by any planner: the peak sits where
  the gradients and the vocabulary-sized logits are live, which recomputation cannot reduce. Batch 8 shows the
  trade-off, down to the gradient floor at 0.48.
- Profiles were taken with one other job on the second core (`OMP_NUM_THREADS=1`): overheads are shares of those
  profiled iterations; compare planners within a row.
"""
s = pathlib.Path("/tmp/section.md").read_text() + "\n" + findings
pathlib.Path("/tmp/section.md").write_text(s)
