"""`remat profile`: the files it writes, its one JSON object, and its errors."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from remat.cli import COMMANDS, main
from remat.errors import CaptureError
from remat.profile.profiles import Profile

REQUIRED_KEYS = {
    "model",
    "batch_size",
    "num_nodes",
    "nodes_per_phase",
    "num_activations",
    "peak_bytes_simulated",
    "peak_bytes_measured",
    "peak_breakdown",
    "iteration_seconds",
    "out_dir",
    "files",
}


def test_profile_json_on_mlp(tmp_path, capsys):
    out = tmp_path / "mlp"
    rc = main(["profile", "--model", "mlp", "--batch-size", "2", "--out", str(out), "--json", "--runs", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)  # stdout holds exactly one JSON object
    assert REQUIRED_KEYS <= summary.keys()
    assert summary["model"] == "mlp" and summary["batch_size"] == 2
    assert set(summary["nodes_per_phase"]) == {"forward", "backward", "optimizer"}
    assert sum(summary["nodes_per_phase"].values()) == summary["num_nodes"] > 0
    assert summary["num_activations"] > 0
    assert summary["iteration_seconds"] > 0
    assert sum(summary["peak_breakdown"].values()) == summary["peak_bytes_simulated"]
    assert abs(summary["peak_bytes_measured"] / summary["peak_bytes_simulated"] - 1) < 0.03
    # The tables went to stderr.
    assert "Time per phase" in captured.err and "Largest activations" in captured.err

    names = {"profile.json", "nodes.csv", "activations.csv", "memory_breakdown.png"}
    assert {p.name for p in out.iterdir()} == names
    assert {p.split("/")[-1] for p in summary["files"].values()} == names
    prof = Profile.from_json(out / "profile.json")
    assert prof.model == "mlp" and prof.batch_size == 2 and prof.optimizer == "sgd"
    assert prof.num_nodes == summary["num_nodes"] and prof.runs == 2
    with (out / "nodes.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == summary["num_nodes"]
    assert all(float(r["seconds"]) > 0 for r in rows)
    with (out / "activations.csv").open() as f:
        assert len(list(csv.DictReader(f))) == summary["num_activations"]


def test_profile_without_json_prints_tables(tmp_path, capsys):
    rc = main(["profile", "--model", "mlp", "--batch-size", "1", "--optimizer", "none", "--out", str(tmp_path), "--runs", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "Peak memory: simulated vs measured" in captured.out
    assert "memory_breakdown.png" in captured.out
    prof = Profile.from_json(tmp_path / "profile.json")
    assert prof.nodes_per_phase["optimizer"] == 0


def _error(capsys, argv):
    rc = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.err


def test_unknown_model(capsys):
    rc, err = _error(capsys, ["profile", "--model", "gpt5", "--batch-size", "2"])
    assert rc == 2
    assert "remat: error: unknown model 'gpt5'; use one of mlp, mlp-deep," in err and "hf:<model_type>" in err


def test_unknown_optimizer(capsys):
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", "2", "--optimizer", "lion"])
    assert rc == 2
    assert "remat: error: unknown optimizer 'lion'; available optimizers: sgd, adamw, none" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(capsys):
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", "2", "--device", "cuda"])
    assert rc == 2
    assert "remat: error: CUDA was requested but no CUDA device is present; use --device cpu" in err


def test_unknown_device(capsys):
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", "2", "--device", "tpu"])
    assert rc == 2
    assert "remat: error: unknown device 'tpu'; use cpu or cuda" in err


@pytest.mark.parametrize("batch", ["0", "-3"])
def test_batch_size_below_one(capsys, batch):
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", batch])
    assert rc == 2
    assert f"remat: error: batch size must be at least 1, got {batch}" in err


def test_usage_errors_exit_2(capsys):
    rc, err = _error(capsys, ["profile", "--batch-size", "2"])
    assert rc == 2 and "remat: error: the following arguments are required: --model" in err
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", "two"])
    assert rc == 2 and "invalid int value: 'two'" in err
    rc, err = _error(capsys, [])
    assert rc == 2 and "remat: error:" in err


def test_capture_errors_are_reported_without_traceback(capsys, monkeypatch):
    import importlib

    # `remat.capture.capture` is also the public function; the module is reached by its full name.
    capture_module = importlib.import_module("remat.capture.capture")

    def refuse(*args, **kwargs):
        raise CaptureError("train_step has data-dependent Python control flow; use torch.where")

    monkeypatch.setattr(capture_module, "capture", refuse)
    rc, err = _error(capsys, ["profile", "--model", "mlp", "--batch-size", "2"])
    assert rc == 2
    assert "remat: error: train_step has data-dependent Python control flow; use torch.where" in err


def test_subcommands_are_registered_in_one_place(capsys):
    names = [c.name for c in COMMANDS]
    assert "profile" in names and "demo" in names
    assert main(["--help"]) == 0
    assert "profile" in capsys.readouterr().out
