"""remat bench / maxbatch and the baselines, on tiny models (fast)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from remat.measurement.baselines import NotSupported, block_sequence, make_baseline, sqrt_segments
from remat.measurement.maxbatch import _search, maxbatch
from remat.measurement.results import load_results
from remat.measurement.sweep import bench, replot
from remat.measurement.check import compare_state, twin
from remat.cli import main as cli_main
from remat.models import build_model, make_optimizer, make_train_step


def _eager_and(name: str, model_name: str, batch: int = 4):
    spec = build_model(model_name, batch)
    opt = make_optimizer("sgd", spec.model.parameters())
    step = make_train_step(spec.loss_fn)
    em, eo = twin(spec.model, opt)
    bm, bo = twin(spec.model, opt)
    bstep = make_baseline(name, bm, spec.loss_fn)
    for i in range(2):
        torch.manual_seed(i)
        le = step(em, eo, spec.batch)
        torch.manual_seed(i)
        lb = bstep(bm, bo, spec.batch)
        assert torch.equal(le.detach(), lb.detach())
    return compare_state(em, eo, bm, bo)


@pytest.mark.parametrize("name,model", [("hf", "bert-tiny"), ("sequential", "bert-tiny"), ("sequential", "mlp-deep")])
def test_baselines_train_like_eager(name, model):
    # Checkpointing replays the RNG (dropout) and recomputes the same ops: bitwise equal on CPU.
    assert _eager_and(name, model) == []


def test_sequential_on_resnet_updates_batchnorm_statistics_twice():
    # torch.utils.checkpoint re-runs BatchNorm in training mode during the backward, so
    # running statistics move twice per step: everything else matches eager (remat
    # recomputes BatchNorm with its stat-free twin and has no such difference).
    diffs = _eager_and("sequential", "resnet-tiny")
    assert diffs and all(d.startswith("buffer ") and ("running_" in d or "num_batches" in d) for d in diffs), diffs[:3]


def test_hf_resnet_is_not_supported_with_reason():
    spec = build_model("resnet-tiny", 2)
    with pytest.raises(NotSupported, match="does not support"):
        make_baseline("hf", spec.model, spec.loss_fn)
    with pytest.raises(NotSupported, match="not a Hugging Face model"):
        make_baseline("hf", build_model("mlp-deep", 2).model, spec.loss_fn)


def test_block_sequences():
    assert len(block_sequence(build_model("bert-tiny", 2).model)[0]) == 2
    assert len(block_sequence(build_model("resnet-tiny", 2).model)[0]) == 4  # depths [1, 1, 1, 1], flattened
    assert len(block_sequence(build_model("mlp-deep", 2).model)[0]) == 15
    assert [sqrt_segments(n) for n in (1, 4, 12, 50)] == [1, 2, 3, 7]


def test_sequential_checkpointing_saves_memory_on_mlp_deep():
    from remat.profile.allocator import measure_peak

    spec = build_model("mlp-deep", 512)
    opt = make_optimizer("sgd", spec.model.parameters())
    step = make_train_step(spec.loss_fn)
    em, eo = twin(spec.model, opt)
    bm, bo = twin(spec.model, opt)
    bstep = make_baseline("sequential", bm, spec.loss_fn)
    step(em, eo, spec.batch), bstep(bm, bo, spec.batch)
    eager = measure_peak(lambda: step(em, eo, spec.batch)).peak_bytes
    seq = measure_peak(lambda: bstep(bm, bo, spec.batch)).peak_bytes
    assert seq < 0.9 * eager


def test_search_doubles_then_bisects():
    best, tried = _search(lambda b: b <= 37, 1, 256)
    assert best == 37 and tried[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert _search(lambda b: False, 4, 256)[0] == 0
    assert _search(lambda b: True, 1, 20)[0] == 20


def test_bench_records_every_run_resumes_and_replots(tmp_path, monkeypatch, capsys):
    import remat
    from remat.errors import BudgetError

    real_compile = remat.compile

    def compile_or_fail(*args, memory_budget=None, **kw):  # a budget no plan reaches, made certain
        if memory_budget == 0.01:
            raise BudgetError("no mutwo plan fits the budget (test)")
        return real_compile(*args, memory_budget=memory_budget, **kw)

    monkeypatch.setattr(remat, "compile", compile_or_fail)
    out = tmp_path / "bench"
    files = bench("mlp-deep", [1024], ["min", 0.01], ["sequential", "hf"], out, pairs=1, progress=False)
    doc = load_results(out)
    runs = {(r["batch_size"], r["method"]): r for r in doc["runs"]}
    assert set(runs) == {(b, m) for b in (1024,) for m in ("eager", "remat@min", "remat@0.01", "sequential", "hf")}
    for b in (1024,):
        eager, remat = runs[(b, "eager")], runs[(b, "remat@min")]
        assert eager["status"] == remat["status"] == "ok"
        assert remat["peak_bytes"] < eager["peak_bytes"]  # measured, same tracker
        assert remat["predicted_peak_bytes"] < eager["predicted_peak_bytes"]
        # The measured peak counts what the prediction counts, the batch included (mlp-deep's
        # input is 2 MiB at batch 1024: without it, every measured peak read that much low).
        # Eager's prediction also holds the graph's 0-dim hyperparameter inputs (8 bytes
        # each), which eager does not make.
        assert remat["peak_bytes"] == remat["predicted_peak_bytes"]
        assert 0 <= eager["predicted_peak_bytes"] - eager["peak_bytes"] <= 64
        assert remat["predicted_peak_bytes"] and remat["ratio_to_eager"] > 0 and remat["rounds"] == 1
        assert runs[(b, "remat@0.01")]["status"] == "failed" and "BudgetError" in runs[(b, "remat@0.01")]["reason"]
        assert runs[(b, "hf")]["status"] == "not supported"
        assert runs[(b, "sequential")]["status"] == "ok"
        assert doc["stats"][str(b)]["num_activations"] > 0
    for f in files.values():
        assert f.exists() and f.stat().st_size > 0
    assert "remat@min" in (out / "tables.md").read_text()

    # Resume: nothing left to do, nothing re-measured.
    before = (out / "results.json").read_text()
    bench("mlp-deep", [1024], ["min", 0.01], ["sequential", "hf"], out, pairs=1, resume=True, progress=False)
    assert json.loads((out / "results.json").read_text())["runs"] == json.loads(before)["runs"]
    # Resume with one more batch size: only that one runs. Its progress, written where no bar
    # is drawn (here, pytest's capture; a log file), is lines: the first stage and the last.
    capsys.readouterr()
    bench("mlp-deep", [1024, 512], ["min"], [], out, pairs=1, resume=True, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"mlp-deep b=512: capture \+ profile \(1/5, 0:\d\d\)", lines[0]), lines
    assert re.fullmatch(r"mlp-deep: tables and plots \(5/5, \d+:\d\d\)", lines[-1]), lines
    doc = load_results(out)
    assert {r["batch_size"] for r in doc["runs"]} == {512, 1024}
    assert [r.get("seconds_all") for r in doc["runs"] if r["batch_size"] == 1024] == [
        r.get("seconds_all") for r in json.loads(before)["runs"] if r["batch_size"] == 1024
    ]
    (out / "peak_vs_batch.png").unlink()
    assert replot(out)["peak_plot"].exists()


def test_interrupted_bench_keeps_finished_runs_and_resumes(tmp_path, monkeypatch):
    import remat.measurement.sweep as bench_mod
    import remat.models

    real_rounds = bench_mod.time_round_robin
    rounds = []

    def ctrl_c_in_second(*args, **kwargs):  # Ctrl-C while the 2nd batch size is being timed
        rounds.append(1)
        if len(rounds) == 2:
            raise KeyboardInterrupt
        return real_rounds(*args, **kwargs)

    monkeypatch.setattr(bench_mod, "time_round_robin", ctrl_c_in_second)
    out = tmp_path / "bench"
    with pytest.raises(KeyboardInterrupt):
        bench("mlp-deep", [512, 1024], [0.9], [], out, pairs=1, progress=False)
    # The finished batch size is on disk; the one stopped half-way is marked running.
    stopped = load_results(out)
    runs = {(r["batch_size"], r["method"]): r for r in stopped["runs"]}
    assert runs[(512, "eager")]["status"] == runs[(512, "remat@0.9")]["status"] == "ok"
    assert runs[(512, "remat@0.9")]["seconds_all"] and runs[(512, "remat@0.9")]["peak_bytes"]
    assert runs[(1024, "eager")]["status"] == runs[(1024, "remat@0.9")]["status"] == "running"
    assert not list(out.glob("*.tmp"))

    # Resumed, un-patched: the finished batch size is not run again (its model is never
    # built), the stopped one is run from the start.
    monkeypatch.setattr(bench_mod, "time_round_robin", real_rounds)
    real_build, built = remat.workloads.build_model, []

    def build_model(name, batch_size, **kwargs):
        built.append(batch_size)
        return real_build(name, batch_size, **kwargs)

    monkeypatch.setattr(remat.workloads, "build_model", build_model)
    bench("mlp-deep", [512, 1024], [0.9], [], out, pairs=1, resume=True, progress=False)
    assert built == [1024]
    doc = load_results(out)
    assert [r for r in doc["runs"] if r["batch_size"] == 512] == [r for r in stopped["runs"] if r["batch_size"] == 512]
    assert {(r["batch_size"], r["method"]): r["status"] for r in doc["runs"]} == {
        (b, m): "ok" for b in (512, 1024) for m in ("eager", "remat@0.9")
    }


def test_bench_out_of_memory_in_one_configuration(tmp_path, monkeypatch):
    import remat
    import remat.measurement.baselines
    import remat.workloads

    oom = "CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 79.10 GiB total capacity)"
    real_compile, real_baseline, real_build = remat.compile, remat.measurement.baselines.make_baseline, remat.workloads.build_model

    def compile_oom(*args, memory_budget=None, **kwargs):  # out of memory while it is set up
        if memory_budget == 0.5:
            raise RuntimeError(oom)
        return real_compile(*args, memory_budget=memory_budget, **kwargs)

    def baseline_oom_later(*args, **kwargs):  # out of memory in its 3rd step: the first timing round
        step, calls = real_baseline(*args, **kwargs), []

        def run(*a, **kw):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError(oom)
            return step(*a, **kw)

        run.segments, run.blocks = step.segments, step.blocks
        return run

    def build_oom(name, batch_size, **kwargs):  # a whole batch size out of memory
        if batch_size == 4096:
            raise MemoryError("cannot allocate the batch")
        return real_build(name, batch_size, **kwargs)

    monkeypatch.setattr(remat, "compile", compile_oom)
    monkeypatch.setattr(remat.measurement.baselines, "make_baseline", baseline_oom_later)
    monkeypatch.setattr(remat.workloads, "build_model", build_oom)
    out = tmp_path / "bench"
    bench("mlp-deep", [4096, 512], [0.5, 0.9], ["sequential"], out, pairs=1, progress=False)
    runs = {(r["batch_size"], r["method"]): r for r in load_results(out)["runs"]}
    assert runs[(4096, "eager")]["status"] == "failed"
    assert runs[(4096, "eager")]["reason"] == "out of memory: MemoryError: cannot allocate the batch"
    assert runs[(512, "remat@0.5")]["status"] == "failed" and runs[(512, "remat@0.5")]["reason"] == f"out of memory: RuntimeError: {oom}"
    assert runs[(512, "sequential")]["status"] == "failed" and runs[(512, "sequential")]["reason"] == f"out of memory: RuntimeError: {oom}"
    assert runs[(512, "sequential")]["peak_bytes"]  # measured before it failed
    for method in ("eager", "remat@0.9"):  # the sweep went on
        assert runs[(512, method)]["status"] == "ok" and runs[(512, method)]["rounds"] == 1


def test_maxbatch_remat_fits_a_larger_batch(tmp_path):
    from remat.memory.analysis import analyze
    from remat.capture.capture import capture
    from remat.memory.simulator import simulate

    spec = build_model("mlp-deep", 256)
    tg = capture(make_train_step(spec.loss_fn), spec.model, make_optimizer("sgd", spec.model.parameters()), spec.batch)
    cap = simulate(analyze(tg)).peak_bytes + 4096  # eager fits about 256
    r = maxbatch("mlp-deep", cap, max_batch=512, start=64, out_dir=tmp_path)
    assert r["eager_max_batch_measured"] and r["remat_max_batch_measured"] >= r["eager_max_batch_measured"]  # mlp-deep: gradients bound the peak
    for m in r["measured"]:
        if m["method"] == "remat" and m["batch_size"] == r["remat_max_batch_measured"]:
            assert m["peak_bytes"] <= cap
    assert "remat fits batch" in r["summary"] and "search's limit" not in r["summary"]
    assert list(tmp_path.glob("maxbatch-*.json"))
    # A cap nothing reaches: both fit the largest batch tried, which the summary says is the search's limit.
    r = maxbatch("mlp", "1GiB", max_batch=8, start=4, confirm=False)
    assert r["eager_max_batch_simulated"] == r["remat_max_batch_simulated"] == 8
    assert r["summary"].endswith("8 is the search's limit: raise --max-batch to search further") and "cap 1.00 GiB" in r["summary"]


def test_cli_usage_errors(capsys):
    assert cli_main(["bench", "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert cli_main(["bench", "--model", "mlp", "--baselines", "magic"]) == 2
    assert "unknown baseline" in capsys.readouterr().err
    assert cli_main(["bench", "--model", "mlp", "--budgets", "2"]) == 2
    assert cli_main(["maxbatch", "--model", "mlp", "--cap", "0.5"]) == 2
    assert "absolute size" in capsys.readouterr().err


def test_demo_table_shows_time_ratios(tmp_path, capsys):
    from remat.measurement.sweep import demo

    demo(tmp_path, progress=False, model="bert-tiny", batch_sizes=(16,), budgets=(0.9,))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "remat@0.9" in line or "│ hf" in line]
    assert len(rows) == 2, out
    for line in rows:  # the ratio with its range, e.g. "1.032 (0.98–1.10)", not milliseconds
        assert re.search(r"\d\.\d{3} \(\d\.\d\d–\d\.\d\d\)", line), line


def test_latency_over_one_batch_size_is_a_bar_a_method_named_on_the_axis(tmp_path, monkeypatch):
    """Over one batch size, points over one x stack into an unreadable column under the
    legend: a bar a method, each named on the axis, its time / eager's beside it."""
    from remat.measurement import plots

    runs = [
        {"batch_size": 8, "method": m, "status": "ok", "seconds": s, "ratio_to_eager": r, "ratio_min": r * 0.9, "ratio_max": r * 1.1}
        for m, s, r in (("eager", 1.0, 1.0), ("remat@0.5", 1.1, 1.1), ("hf", 1.3, 1.3))
    ]
    doc = {"runs": runs, "meta": {"model": "bert", "device": "cpu", "optimizer": "sgd"}}
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.append(fig))
    plots.plot_latency_vs_batch(doc, tmp_path / "latency.png")
    (fig,) = figures
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == [plots._label(m) for m in ("eager", "remat@0.5", "hf")]
    assert sorted(round(p.get_width(), 6) for p in right.patches) == [1.0, 1.1, 1.3]
    two = {"runs": runs + [dict(r, batch_size=16) for r in runs], "meta": doc["meta"]}
    plots.plot_latency_vs_batch(two, tmp_path / "latency2.png")
    assert len(figures[1].axes[0].get_lines()) == 3  # a line a method over several batch sizes
