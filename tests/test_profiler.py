"""The run-time profiler: per-node times and memory, the simulated vs measured peak,
inactive times, the JSON round trip, and that profiling leaves the user's state alone."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from remat.memory.analysis import ROLES, Role, analyze
from remat.capture.capture import capture
from remat.errors import PlanError
from remat.models import build_model, make_optimizer, make_train_step
from remat.profile.allocator import measure_peak
from remat.profile.profiler import profile
from remat.profile.profiles import Profile, graph_fingerprint
from remat.measurement.report import (
    breakdown_table,
    plot_memory_breakdown,
    summary_tables,
    write_activations_csv,
    write_nodes_csv,
)

ROLE_VALUES = {r.value for r in ROLES}


def _setup(name: str, batch_size: int, optimizer: str):
    spec = build_model(name, batch_size, seed=0)
    opt = make_optimizer(optimizer, spec.model.parameters())
    tg = capture(make_train_step(spec.loss_fn), spec.model, opt, spec.batch)
    return spec, opt, tg


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"b.{n}": b.detach().clone() for n, b in model.named_buffers()})
    if opt is not None:
        for i, (p, st) in enumerate(opt.state.items()):
            for k, v in st.items():
                out[f"s.{i}.{k}"] = v.detach().clone()
    return out


@pytest.fixture(scope="module", params=[("mlp", 4, "sgd"), ("bert-tiny", 2, "adamw")], ids=["mlp-sgd", "bert-tiny-adamw"])
def profiled(request):
    """(spec, optimizer, graph, profile, state before, state after, rng before, rng after)."""
    name, batch, optimizer = request.param
    spec, opt, tg = _setup(name, batch, optimizer)
    torch.manual_seed(1234)
    before = _state(spec.model, opt)
    rng_before = torch.get_rng_state()
    grads_before = [p.grad for p in spec.model.parameters()]
    prof = profile(tg, spec.model, opt, spec.batch, warmup=1, runs=3, progress=False)
    after = _state(spec.model, opt)
    rng_after = torch.get_rng_state()
    grads_after = [p.grad for p in spec.model.parameters()]
    prof.model, prof.batch_size, prof.optimizer = name, batch, optimizer
    return dict(
        spec=spec, opt=opt, tg=tg, prof=prof, before=before, after=after,
        rng=(rng_before, rng_after), grads=(grads_before, grads_after),
    )


def test_every_node_is_timed_and_in_order(profiled):
    prof, tg = profiled["prof"], profiled["tg"]
    op_nodes = tg.op_nodes()
    assert [n.name for n in prof.nodes] == [n.name for n in op_nodes]
    assert all(n.seconds > 0 for n in prof.nodes), [n.name for n in prof.nodes if n.seconds <= 0]
    assert prof.iteration_seconds == pytest.approx(sum(n.seconds for n in prof.nodes))
    assert sum(prof.phase_seconds.values()) == pytest.approx(prof.iteration_seconds)
    counts = prof.nodes_per_phase
    assert sum(counts.values()) == prof.num_nodes
    assert counts["forward"] > 0 and counts["backward"] > 0 and counts["optimizer"] > 0
    for n in prof.nodes:
        assert n.phase == tg.phase[n.name].value
    assert any(n.target == "aten.addmm.default" for n in prof.nodes)


def test_every_tensor_has_a_known_role(profiled):
    prof = profiled["prof"]
    assert all(t.role in ROLE_VALUES for t in prof.tensors)
    roles = {t.role for t in prof.tensors}
    assert {"parameter", "activation", "input", "optimizer_state", "gradient"} <= roles
    assert prof.num_activations > 0
    assert set(prof.peak_breakdown) == ROLE_VALUES


def test_simulated_step_peak_matches_measured(profiled):
    prof = profiled["prof"]
    assert prof.measured_step_peak_bytes > 0
    ratio = prof.measured_step_peak_bytes / prof.simulated_step_peak_bytes
    assert abs(ratio - 1) < 0.03, (prof.simulated_step_peak_bytes, prof.measured_step_peak_bytes)
    assert prof.measured_peak_bytes == prof.persistent_bytes + prof.measured_step_peak_bytes
    assert prof.simulated_peak_bytes == prof.persistent_bytes + prof.simulated_step_peak_bytes
    assert sum(prof.peak_breakdown.values()) == prof.simulated_peak_bytes
    # The node-by-node run frees values as fx's generated code does: same peak.
    node_peak = max(n.peak_bytes for n in prof.nodes)
    assert abs(node_peak / prof.measured_step_peak_bytes - 1) < 0.03
    assert all(n.allocated_bytes >= 0 for n in prof.nodes)
    assert sum(n.allocated_bytes for n in prof.nodes) >= prof.measured_step_peak_bytes


def test_inactive_times(profiled):
    prof = profiled["prof"]
    secs = prof.node_seconds
    for t in prof.tensors:
        if t.role == Role.ACTIVATION.value:
            assert t.last_forward_use is not None and t.first_backward_use is not None
            assert t.created <= t.last_forward_use < t.first_backward_use <= t.last_use
            assert t.inactive_seconds is not None and t.inactive_seconds >= 0
            expected = secs[t.last_forward_use + 1 : t.first_backward_use].sum()
            assert t.inactive_seconds == pytest.approx(expected, rel=1e-9, abs=1e-12)
        else:
            assert t.inactive_seconds is None
    assert max(t.inactive_seconds for t in prof.activations()) > 0


def test_profiling_leaves_model_optimizer_and_rng_alone(profiled):
    before, after = profiled["before"], profiled["after"]
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    rng_before, rng_after = profiled["rng"]
    assert torch.equal(rng_before, rng_after)
    grads_before, grads_after = profiled["grads"]
    assert all(a is b for a, b in zip(grads_before, grads_after))


def test_profile_json_round_trip(profiled, tmp_path):
    prof = profiled["prof"]
    path = prof.to_json(tmp_path / "profile.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == "remat.profile" and doc["version"] == 1
    back = Profile.from_json(path)
    assert back == prof
    assert back.fingerprint == graph_fingerprint(profiled["tg"])
    assert np.array_equal(back.to_timeline().during, prof.to_timeline().during)
    back.check_graph(profiled["tg"])  # same graph: accepted


def test_timeline_matches_simulator(profiled):
    from remat.memory.simulator import simulate

    tl = simulate(analyze(profiled["tg"]))
    back = profiled["prof"].to_timeline()
    assert np.array_equal(back.during, tl.during)
    assert back.peak_bytes == tl.peak_bytes and back.peak_rank == tl.peak_rank


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"format": "remat.plan", "version": 1}, r"is a 'remat.plan' file; expected \"format\": 'remat.profile'"),
        ({"version": 1}, r"has no \"format\" field"),
        ({"format": "remat.profile", "version": 2}, r"version 2, but this remat reads version 1"),
        ({"format": "remat.profile"}, r"version None"),
        ([1, 2], r"holds a JSON list"),
    ],
    ids=["other-format", "no-format", "newer-version", "no-version", "not-an-object"],
)
def test_wrong_profile_files_are_refused(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        Profile.from_json(path)


def test_broken_profile_files_are_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="is not a JSON file"):
        Profile.from_json(path)
    path.write_text(json.dumps({"format": "remat.profile", "version": 1, "device": "cpu"}))
    with pytest.raises(PlanError, match="malformed remat profile"):
        Profile.from_json(path)
    with pytest.raises(PlanError, match="no such file"):
        Profile.from_json(tmp_path / "missing.json")


def test_profile_of_another_graph_is_refused():
    mlp = _setup("mlp", 2, "sgd")
    other = _setup("mlp", 3, "sgd")  # same ops, another batch shape
    prof = profile(mlp[2], mlp[0].model, mlp[1], mlp[0].batch, runs=1, progress=False)
    prof.model, prof.batch_size = "mlp", 2
    with pytest.raises(PlanError, match=r"this profile \(mlp, batch 2\) was measured on another graph"):
        prof.check_graph(other[2])


def test_profile_arguments_are_checked():
    spec, opt, tg = _setup("mlp", 2, "none")
    with pytest.raises(ValueError, match="runs must be at least 1"):
        profile(tg, spec.model, opt, spec.batch, runs=0, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="captured on cpu"):
            profile(tg, spec.model, opt, spec.batch, device="cuda", progress=False)


def test_report_files_and_tables(profiled, tmp_path):
    prof = profiled["prof"]
    png = plot_memory_breakdown(prof, tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png_t = plot_memory_breakdown(prof, tmp_path / "t.png", x="time")
    assert png_t.stat().st_size > 10_000
    # A bare timeline can be plotted too.
    plot_memory_breakdown(prof.to_timeline(), tmp_path / "tl.png", phase_bounds=prof.phase_bounds)

    nodes = write_nodes_csv(prof, tmp_path / "nodes.csv").read_text().splitlines()
    assert len(nodes) == prof.num_nodes + 1 and nodes[0].startswith("rank,name,target,phase,seconds")
    acts = write_activations_csv(prof, tmp_path / "activations.csv").read_text().splitlines()
    assert len(acts) == prof.num_activations + 1

    from rich.console import Console

    console = Console(record=True, width=140)
    for table in summary_tables(prof, top_k=3):
        console.print(table)
    text = console.export_text()
    for needle in ("forward", "backward", "optimizer", "activations", "measured / simulated", "Largest activations"):
        assert needle in text
    console.print(breakdown_table({"activation": 3 * 2**20, "parameter": 2**20}))
    assert "75.0" in console.export_text()


def test_measured_peak_sees_frees_on_other_threads():
    """A tensor made here and let go on another thread (as gloo's workers let go of a
    collective's buffers) is freed for the measurement: the peak of two such tensors in
    turn is one of them, and nothing is left at the end. Allocations on another thread
    count too."""
    mib = 2**20

    def hand_over() -> None:
        for _ in range(3):
            box = [torch.ones(mib // 4)]  # 1 MiB, held only by the list
            worker = threading.Thread(target=box.clear)
            worker.start()
            worker.join()

    measured = measure_peak(hand_over)
    assert measured.peak_bytes == mib and measured.end_bytes == 0, measured

    made: list[torch.Tensor] = []

    def made_elsewhere() -> None:
        worker = threading.Thread(target=lambda: made.append(torch.ones(mib // 2)))
        worker.start()
        worker.join()
        torch.ones(mib // 4)  # an event on this thread, where the level is read

    measured = measure_peak(made_elsewhere)
    assert measured.peak_bytes == 3 * mib and measured.end_bytes == 2 * mib, measured


def test_a_kernel_whose_scratch_follows_its_inputs_values_is_given_its_largest() -> None:
    """matrix_exp holds more matrix powers the larger its input's norm. Compiled while the
    norm is small (an orthogonal parametrization near its start), the step's peak stays
    within the prediction after the weights grow."""
    import remat
    from remat.profile.allocator import measure_step_peak

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    torch.nn.utils.parametrizations.orthogonal(model[0])
    with torch.no_grad():
        model[0].parametrizations.weight.original.mul_(1e-3)  # a small skew part: matrix_exp's lowest degree
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(16, 64), torch.randn(16, 4))

    def step_fn(m, opt, b):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(b[0]), b[1])
        loss.backward()
        opt.step()
        return loss.detach()

    step = remat.compile(step_fn, model, optimizer, batch, profile_runs=1)
    step(batch)
    assert step.report.measured_peak_bytes <= step.report.predicted_peak_bytes
    with torch.no_grad():
        model[0].parametrizations.weight.original.mul_(1e4)  # grown: matrix_exp's highest degree
    later = measure_step_peak(lambda: step(batch), "cpu", model)
    assert later.peak_bytes <= step.report.predicted_peak_bytes, (later.peak_bytes, step.report.predicted_peak_bytes)
