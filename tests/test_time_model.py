"""The time model: host and device timelines, node times that add up to a run, and a
plan's step priced op by op (copies, buckets of a multi-tensor update)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import remat
from remat import build as pipeline
from remat.memory.schedule import build_schedule
from remat.models import build_model, make_train_step
from remat.passes.update_buckets import made_from
from remat.passes.update_placement import moved_index
from remat.planners.evaluate import step_time
from remat.profile.time_model import MMAP_THRESHOLD_BYTES, OpCosts, first_touch_seconds_per_byte, fresh_pages_seconds, op_seconds, scaled_to_runs, simulate_time


def _by_recurrence(host: np.ndarray, device: np.ndarray) -> float:
    """The two timelines written as the recurrence: issue at H_i, run from max(H_i, D_{i-1})."""
    issued = done = 0.0
    for h, d in zip(host, device):
        issued += h
        done = max(issued, done) + d
    return max(issued, done)


@pytest.mark.parametrize("seed", range(5))
def test_the_two_timelines_end_where_the_recurrence_ends(seed):
    rng = np.random.default_rng(seed)
    host, device = rng.exponential(5e-6, 300), rng.exponential(5e-6, 300) * rng.integers(0, 3, 300)
    t = simulate_time(host, device, synchronous=False)
    assert t.seconds == pytest.approx(_by_recurrence(host, device), rel=1e-12)
    assert t.seconds >= max(t.host_seconds, t.device_seconds)
    assert t.device_wait_seconds == pytest.approx(t.seconds - device.sum(), rel=1e-12)
    assert simulate_time(host, device, synchronous=True).seconds == pytest.approx(host.sum() + device.sum())


def test_many_tiny_ops_cost_their_issuing_and_large_ones_their_kernels():
    tiny = simulate_time(np.full(50, 10e-6), np.full(50, 1e-6), synchronous=False)
    assert tiny.seconds == pytest.approx(50 * 10e-6 + 1e-6) and tiny.host_bound
    large = simulate_time(np.full(50, 10e-6), np.full(50, 1e-3), synchronous=False)
    assert large.seconds == pytest.approx(10e-6 + 50 * 1e-3) and not large.host_bound
    assert op_seconds(np.array([10e-6, 10e-6]), np.array([1e-6, 1e-3]), synchronous=False).tolist() == [10e-6, 1e-3]
    assert op_seconds(np.array([1.0]), np.array([2.0]), synchronous=True).tolist() == [3.0]
    with pytest.raises(ValueError, match="differ in length"):
        simulate_time(np.ones(3), np.ones(2), synchronous=False)


def test_ops_replayed_as_a_cuda_graph_cost_their_kernels_alone():
    costs = OpCosts(host={"a": 10e-6, "b": 10e-6}, device={"a": 1e-6, "b": 3e-6}, synchronous=False)
    assert costs.seconds_by_node() == {"a": 10e-6, "b": 10e-6}  # each issued from Python: the host is the bottleneck
    replayed = costs.replayed()
    assert replayed.seconds_by_node() == {"a": 1e-6, "b": 3e-6}
    assert simulate_time(list(replayed.host.values()), list(replayed.device.values()), False).seconds == pytest.approx(4e-6)


def test_node_times_keep_their_medians_ratios_and_add_up_to_the_median_run():
    # A slow sample falls on a different node in each run: medians alone miss it.
    runs = np.array([[1.0, 1.0, 5.0], [1.0, 5.0, 1.0], [5.0, 1.0, 1.0], [1.0, 1.0, 1.2]])
    seconds = scaled_to_runs(runs)
    assert seconds.sum() == pytest.approx(np.median(runs.sum(axis=1)))
    assert seconds[0] == pytest.approx(seconds[1]) and seconds[2] / seconds[0] == pytest.approx(np.median(runs[:, 2]) / 1.0)


@pytest.mark.parametrize("line", [None, -5e-6], ids=["calibrated", "negative line"])
def test_a_plans_step_is_the_captured_step_and_its_copies(line, monkeypatch):
    if line is not None:  # as a loaded machine calibrates it: ops cheaper than it cost zero, in both sums
        monkeypatch.setattr(importlib.import_module("remat.profile.profiler"), "line_seconds", lambda device: line)
    spec = build_model("mlp-deep", 32)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, foreach=False)
    step = remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, memory_budget=0.25, profile_runs=1)
    report = step.report
    plan, predicted = report.plan, report.predicted_time
    assert plan.num_recomputed > 0 and predicted is not None
    # On a CPU each op costs its issuing and its running; the planner's overhead is the copies' cost.
    assert predicted.seconds == pytest.approx(plan.baseline_iteration_seconds + plan.predicted_overhead_seconds, rel=1e-9)
    ops = [n for n in step.graph_module.graph.nodes if n.op == "call_function" and not n.name.endswith("_rng_state")]
    assert predicted.ops == len(ops) > len(report.profile.nodes)  # each op of the step that runs, copies included
    assert report.profile.line_seconds == report.profile.line_seconds  # calibrated: a number, not NaN


def test_a_bucket_of_a_multi_tensor_update_is_priced_at_its_share_of_the_op():
    spec = build_model("mlp-deep", 32)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-2, foreach=True)
    built = pipeline.build(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, runs=1)
    moved, placement = moved_index(built.index)
    assert moved is not None and len(placement.buckets) > 1
    costs = built.profile.op_costs()
    captured = step_time(built.index, build_schedule(built.index, set()), costs)
    bucketed = step_time(moved, build_schedule(moved, set()), costs)
    # The buckets run the whole update between them: the same device time, more issues.
    assert bucketed.device_seconds == pytest.approx(captured.device_seconds, rel=1e-9)
    split = [n for n in moved.order if made_from(n) != n]
    assert split and bucketed.ops == captured.ops + len(split) - len({made_from(n) for n in split})


def test_only_outputs_above_the_mmap_threshold_pay_for_fresh_pages():
    per_byte = first_touch_seconds_per_byte("cpu")
    assert per_byte >= 0.0 and first_touch_seconds_per_byte("cuda") == 0.0
    assert fresh_pages_seconds(MMAP_THRESHOLD_BYTES, 1e-9) == 0.0  # reused from the heap
    assert fresh_pages_seconds(2 * MMAP_THRESHOLD_BYTES, 1e-9) == pytest.approx(2 * MMAP_THRESHOLD_BYTES * 1e-9)


def test_on_cuda_the_device_is_held_while_the_host_queues_each_chunk_of_timed_ops(monkeypatch):
    """The call order `CudaOpTimer` gives the device, read through stand-ins for CUDA's
    events and spinning kernel: a host run records no events and holds nothing; a device
    run holds the device before every chunk of ops, for twice their host time, and each op
    sits between its own two events with no hold between them."""
    from remat.profile import node_runner

    log: list[tuple[str, object]] = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.at = None

        def record(self):
            self.at = len(log)
            log.append(("event", self))

        def elapsed_time(self, end):
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("hold", cycles)))
    monkeypatch.setattr(node_runner, "_sleep_cycles_per_second", lambda index: 1e9)
    graph = torch.fx.Graph()
    x = y = graph.placeholder("x")
    for _ in range(40):
        y = graph.call_function(torch.ops.aten.add.Tensor, (y, x))
    graph.output(y)
    runner = node_runner.NodeRunner(torch.fx.GraphModule(torch.nn.Module(), graph))
    def run_op(i, fn):
        log.append(("op", i))
        return fn()

    timer = node_runner.CudaOpTimer(runner.num_ops, torch.device("cuda", 0))
    host = timer.host_run(lambda: runner.run([torch.ones(1)], lambda i, fn: timer.call(i, lambda: run_op(i, fn))))
    assert [k for k, _ in log] == ["op"] * 40 and (host > 0).all()
    log.clear()
    host = np.full(40, 1e-5)
    device = timer.device_run(lambda: runner.run([torch.ones(1)], lambda i, fn: timer.call(i, lambda: run_op(i, fn))), host)
    holds = [(j, c) for j, (k, c) in enumerate(log) if k == "hold"]
    assert [c for _, c in holds] == [int((node_runner.HOLD_HOST_FACTOR * 16 * 1e-5 + node_runner.HOLD_MARGIN_SECONDS) * 1e9)] * 2 + [int((node_runner.HOLD_HOST_FACTOR * 8 * 1e-5 + node_runner.HOLD_MARGIN_SECONDS) * 1e9)]
    ops_at = {c: j for j, (k, c) in enumerate(log) if k == "op"}
    assert [log[j + 2] for j, _ in holds] == [("op", 0), ("op", 16), ("op", 32)]  # a hold, then the op's start event
    for i, j in ops_at.items():  # start event, the op, end event: nothing else inside the pair
        assert log[j - 1][0] == "event" and log[j + 1][0] == "event"
    assert (device == 2e-3).all()  # each pair: the two log entries up to its end, as milliseconds
