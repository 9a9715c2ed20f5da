"""The frontier sweep: every planner at every budget, failures recorded, plans run and
checked against eager, results written as JSON/CSV/plot."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from remat.errors import BudgetError, RematError
from remat.measurement.frontier import parse_budgets, run_frontier
from remat.measurement.frontier_files import markdown_table


def test_parse_budgets():
    assert parse_budgets("0.1:1.0:0.1") == ["0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1"]
    assert parse_budgets("0.5:0.6:0.05") == ["0.5", "0.55", "0.6"]
    assert parse_budgets("0.5, 6GiB") == ["0.5", "6GiB"]
    with pytest.raises(RematError, match="start:stop:step"):
        parse_budgets("0.1:1.0")
    with pytest.raises(RematError, match="0 < start <= stop <= 1"):
        parse_budgets("0.5:1.5:0.1")
    with pytest.raises(BudgetError, match="invalid memory budget"):
        parse_budgets("0.5,lots")


def test_frontier_plans_measures_and_records_failures(tmp_path):
    out = tmp_path / "fr"
    fr = run_frontier(
        "mlp-deep", 512, ["mutwo", "milp"], ["0.1", "0.85", "1"], measure=True, out_dir=out, time_limit=30, runs=1, progress=False
    )
    assert [(p.budget, p.planner) for p in fr.points] == [(b, p) for b in ("0.1", "0.85", "1") for p in ("mutwo", "milp")]
    low = [p for p in fr.points if p.budget == "0.1"]
    assert all(p.status == "no_plan" and "no " in (p.error or "") for p in low)  # recorded, the sweep went on
    ok = [p for p in fr.points if p.status == "ok"]
    assert len(ok) == 4
    for p in ok:
        assert p.predicted_peak_bytes <= p.budget_bytes
        assert p.grads_match is True, p.mismatches
        # Measured against predicted (kernel scratch included in the prediction): a few KiB
        # on these tiny graphs, where 3% of the peak is about 300 KiB.
        assert abs(p.peak_error) <= 0.03 + 300 * 1024 / p.predicted_peak_bytes
    exact = fr.point("milp", "0.85")
    greedy = fr.point("mutwo", "0.85")
    assert exact.solver["milp_status"] == "optimal"
    assert exact.predicted_overhead_seconds <= greedy.predicted_overhead_seconds + 1e-12
    for name in ("frontier.json", "frontier.csv", "frontier.md", "frontier.png", "profile.json"):
        assert (out / name).is_file(), name
    data = json.loads((out / "frontier.json").read_text())
    assert len(data["points"]) == 6 and data["model"] == "mlp-deep"
    rows = list(csv.DictReader((out / "frontier.csv").open()))
    assert [r["status"] for r in rows] == ["no_plan", "no_plan", "ok", "ok", "ok", "ok"]
    table = markdown_table(fr)
    assert "mutwo − best (of iteration)" in table
    row = next(line for line in table.splitlines() if line.startswith("| 0.85 |")).split(" | ")
    best = min(greedy.predicted_overhead_seconds, exact.predicted_overhead_seconds)
    assert f"{(greedy.predicted_overhead_seconds - best) / fr.baseline_iteration_seconds:+.2%}" in row


def test_cli_frontier_arguments(tmp_path, capsys):
    from remat.cli.frontier import cmd_frontier, configure_frontier

    p = argparse.ArgumentParser()
    configure_frontier(p)
    args = p.parse_args(["--model", "mlp-deep", "--batch-size", "512", "--planners", "chen,milp", "--budgets", "0.9,1", "--runs", "1", "--out", str(tmp_path)])
    assert args.time_limit == 60.0 and not args.measure
    assert cmd_frontier(args) == 0
    assert "chen overhead" in capsys.readouterr().out
    assert (tmp_path / "frontier.png").is_file()
    bad = p.parse_args(["--model", "mlp-deep", "--batch-size", "8", "--planners", "greedy"])
    from remat.cli.common import UsageError

    with pytest.raises(UsageError, match="unknown planner 'greedy'"):
        cmd_frontier(bad)


# ---------------------------------------------------------------------- interrupted sweeps


def _counting(monkeypatch, fail=None):
    """Patch frontier.run_point to record the (budget, planner) it runs; `fail(n, budget,
    planner)` may raise instead of running the n-th one (1-based)."""
    import remat.measurement.frontier as frontier_mod

    real = frontier_mod.run_point
    ran: list[tuple[str, str]] = []

    def run_point(sw, planner, budget, budget_bytes, fraction):
        ran.append((budget, planner))
        if fail is not None:
            fail(len(ran), budget, planner)
        return real(sw, planner, budget, budget_bytes, fraction)

    monkeypatch.setattr(frontier_mod, "run_point", run_point)
    return ran


def test_interrupted_frontier_keeps_its_points_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "fr"
    args = ("mlp-deep", 512, ["mutwo", "chen"], ["0.85", "1"])

    def ctrl_c_on_second(n, budget, planner):
        if n == 2:
            raise KeyboardInterrupt

    ran = _counting(monkeypatch, ctrl_c_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_frontier(*args, out_dir=out, runs=1, progress=False)
    assert ran == [("0.85", "mutwo"), ("0.85", "chen")]
    # The finished point is on disk, in every file; nothing half-written is left.
    doc = json.loads((out / "frontier.json").read_text())
    assert doc["format"] == "remat.frontier" and [(p["budget"], p["planner"], p["status"]) for p in doc["points"]] == [("0.85", "mutwo", "ok")]
    assert [r["planner"] for r in csv.DictReader((out / "frontier.csv").open())] == ["mutwo"]
    assert (out / "profile.json").is_file() and not list(out.glob(".*.tmp"))
    first = doc["points"][0]

    # Resumed (the real run_point, counted): only the three left are run, on the saved profile.
    ran = _counting(monkeypatch)
    fr = run_frontier(*args, out_dir=out, runs=1, progress=False, resume=True)
    assert ran == [("0.85", "chen"), ("1", "mutwo"), ("1", "chen")]
    assert [(p.budget, p.planner) for p in fr.points] == [(b, p) for b in ("0.85", "1") for p in ("mutwo", "chen")]
    assert all(p.status == "ok" for p in fr.points)
    assert json.loads(json.dumps(fr.to_dict()["points"][0])) == first  # kept as it was, timings included
    assert fr.baseline_iteration_seconds == doc["baseline_iteration_seconds"]  # node times of the saved profile
    assert fr.meta["resumed_from"] == 1
    assert len(json.loads((out / "frontier.json").read_text())["points"]) == 4

    # Resumed again with one more budget: only that budget runs; the others stay listed.
    ran = _counting(monkeypatch)
    fr = run_frontier("mlp-deep", 512, ["mutwo"], ["0.9"], out_dir=out, runs=1, progress=False, resume=True)
    assert ran == [("0.9", "mutwo")]
    assert fr.planners == ["mutwo", "chen"] and fr.budgets == ["0.9", "0.85", "1"] and len(fr.points) == 5
    assert "| 0.9 |" in (out / "frontier.md").read_text()


def test_frontier_resume_refuses_another_configuration(tmp_path):
    from remat.cli.common import UsageError
    from remat.errors import PlanError
    from remat.measurement.frontier_files import Frontier, Point, load_frontier, write_results

    out = tmp_path / "fr"
    fr = Frontier("mlp-deep", 512, "sgd", "cpu", ["mutwo"], ["0.5"], 1, 2, 1, 0.1,
                  points=[Point("mutwo", "0.5", 100, 0.5, "no_plan", error="no plan")])  # fmt: skip
    write_results(fr, out)
    assert load_frontier(out / "frontier.json") == fr
    for model, batch, optimizer, what in [("mlp-deep", 256, "sgd", "batch size"), ("mlp", 512, "sgd", "model"), ("mlp-deep", 512, "adamw", "optimizer")]:
        with pytest.raises(
            UsageError,
            match=rf"--resume: .*frontier\.json is a frontier of mlp-deep with batch size 512 \(sgd, cpu\), not of {model} with batch "
            rf"size {batch} \({optimizer}, cpu\): its {what} differs",
        ):
            run_frontier(model, batch, ["mutwo"], ["0.5"], optimizer=optimizer, out_dir=out, progress=False, resume=True)
    # A damaged frontier.json is refused, not half-read (and not overwritten).
    text = (out / "frontier.json").read_text()
    (out / "frontier.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match=r"frontier\.json is truncated"):
        run_frontier("mlp-deep", 512, ["mutwo"], ["0.5"], out_dir=out, progress=False, resume=True)
    doc = json.loads(text)
    doc["points"][0]["status"] = 3
    (out / "frontier.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"frontier\.json: points\[0\]\.status must be a string, not 3"):
        run_frontier("mlp-deep", 512, ["mutwo"], ["0.5"], out_dir=out, progress=False, resume=True)


def test_frontier_out_of_memory_in_one_configuration(tmp_path, monkeypatch):
    import remat.measurement.frontier as frontier_mod
    import remat.planners

    real_measure, real_plan = frontier_mod._measure, remat.planners.make_plan

    def measure(sw, plan, point):
        if point.budget == "0.85":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)")
        return real_measure(sw, plan, point)

    def make_plan(planner, *args, **kwargs):
        if planner == "chen":
            raise MemoryError("cannot allocate 2 GiB for the solver")
        return real_plan(planner, *args, **kwargs)

    monkeypatch.setattr(frontier_mod, "_measure", measure)
    monkeypatch.setattr(remat.planners, "make_plan", make_plan)
    out = tmp_path / "fr"
    fr = run_frontier("mlp-deep", 512, ["mutwo", "chen"], ["0.85", "1"], measure=True, out_dir=out, runs=1, progress=False)
    oom = fr.point("mutwo", "0.85")
    assert oom.status == "error" and oom.error.startswith("while running the plan: out of memory: RuntimeError: CUDA out of memory")
    assert oom.predicted_peak_bytes <= oom.budget_bytes and oom.measured_peak_bytes is None  # what was predicted is kept
    for b in ("0.85", "1"):
        crashed = fr.point("chen", b)
        assert crashed.status == "error" and crashed.error == "out of memory: MemoryError: cannot allocate 2 GiB for the solver"
    ok = fr.point("mutwo", "1")  # the sweep went on
    assert ok.status == "ok" and ok.grads_match is True and ok.measured_peak_bytes
    rows = {(r["budget"], r["planner"]): r for r in csv.DictReader((out / "frontier.csv").open())}
    assert rows[("0.85", "mutwo")]["status"] == "error" and "out of memory" in rows[("0.85", "mutwo")]["error"]
    assert "error" in markdown_table(fr)
    # Failed points are results: a resumed sweep keeps them (as `remat bench --resume` does).
    ran = _counting(monkeypatch)
    run_frontier("mlp-deep", 512, ["mutwo", "chen"], ["0.85", "1"], measure=True, out_dir=out, runs=1, progress=False, resume=True)
    assert ran == []


def test_cli_frontier_resume(tmp_path, capsys, monkeypatch):
    from remat.cli import main

    argv = ["frontier", "--model", "mlp-deep", "--batch-size", "512", "--planners", "chen", "--budgets", "0.9,1", "--runs", "1", "--out", str(tmp_path)]

    def ctrl_c_on_second(n, budget, planner):
        if n == 2:
            raise KeyboardInterrupt

    _counting(monkeypatch, ctrl_c_on_second)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"every point finished so far is in {tmp_path}/frontier.json; rerun with --resume" in err and "remat: interrupted" in err
    ran = _counting(monkeypatch)
    assert main([*argv, "--resume"]) == 0
    assert ran == [("1", "chen")]
    assert main([*argv[:4], "256", *argv[5:], "--resume"]) == 2
    assert "its batch size differs" in capsys.readouterr().err
