"""The frontier sweep: every planner at every budget, failures recorded, plans run and
checked against eager, results written as JSON/CSV/plot."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from remat.errors import BudgetError, RematError
from remat.frontier import markdown_table, parse_budgets, run_frontier


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
    assert "μ-TWO gap" in table and "| 0.85 |" in table


def test_cli_frontier_arguments(tmp_path, capsys):
    from remat.cli_frontier import cmd_frontier, configure_frontier

    p = argparse.ArgumentParser()
    configure_frontier(p)
    args = p.parse_args(["--model", "mlp-deep", "--batch-size", "512", "--planners", "chen,milp", "--budgets", "0.9,1", "--runs", "1", "--out", str(tmp_path)])
    assert args.time_limit == 60.0 and not args.measure
    assert cmd_frontier(args) == 0
    assert "chen overhead" in capsys.readouterr().out
    assert (tmp_path / "frontier.png").is_file()
    bad = p.parse_args(["--model", "mlp-deep", "--batch-size", "8", "--planners", "greedy"])
    from remat.cli import UsageError

    with pytest.raises(UsageError, match="unknown planner 'greedy'"):
        cmd_frontier(bad)
