"""The CUDA-graph step's own logic, run on a CPU with a stand-in for CUDA graphs: a capture
that computes nothing (what it ran is undone) and a replay that runs the step again and
writes its outputs where the capture's were, as a graph's replay does. On a GPU the same
step is checked bitwise against eager by `remat run --device cuda --cuda-graph --check`
(benchmarks/cuda_runs.sh)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import remat
from remat import build as pipeline
from remat.capture.capture import capture
from remat.errors import BudgetError, RematError
from remat.memory.simulator import simulate
from remat.models import build_model, make_optimizer, make_train_step
from remat.ops import rng_replay
from remat.planners import make_plan
from remat.measurement.check import twin
from remat.passes.cuda_graph import CudaGraphStep


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    return tensors + [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class StandInGraphs:
    """A CUDA graph's semantics on a CPU for the state of `model` and `opt`."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt, self.replays = model, opt, 0
        self.device = torch.device("cpu")

    def capture(self, fn):
        saved = [t.clone() for t in _state(self.model, self.opt)]
        rng = torch.get_rng_state()
        out = fn()
        with torch.no_grad():
            for t, s in zip(_state(self.model, self.opt), saved):
                t.copy_(s)
        torch.set_rng_state(rng)

        def replay() -> None:
            self.replays += 1
            new = fn()
            with torch.no_grad():
                for o, n in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
                    if isinstance(o, torch.Tensor):
                        o.copy_(n)

        return out, replay

    def reserved_bytes(self) -> int:
        return 0


def _mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.Tanh()]
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))


def _train_step(model, opt, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)


def _graphed(budget=0.5):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_train_step, model, opt, _batch(0), memory_budget=budget, profile_runs=1)
    compiled = step.compiled_for(_batch(0))
    graphs = StandInGraphs(model, opt)
    compiled.cuda_graph = CudaGraphStep(compiled.gm, compiled.tg.inputs, graphs)
    return step, model, opt, eager_model, eager_opt, compiled.cuda_graph, graphs


def test_replays_train_bitwise_like_eager_and_losses_held_across_steps_keep_their_values():
    step, model, opt, eager_model, eager_opt, runner, graphs = _graphed()
    assert step.report.num_recomputed > 0
    losses, eager_losses, batches = [], [], [_batch(i) for i in range(6)]
    for b in batches:
        before = [t.clone() for t in b]
        losses.append(step(b))  # held, as a loop that sums losses later holds them
        eager_losses.append(_train_step(eager_model, eager_opt, b))
        assert all(torch.equal(t, s) for t, s in zip(b, before)), "the user's batch was written"
    assert graphs.replays == 5 and runner.captures == 1  # the first call runs the graph as it is
    assert [float(l) for l in losses] == [float(l) for l in eager_losses]
    for a, b in zip(_state(model, opt), _state(eager_model, eager_opt)):
        assert torch.equal(a, b)


def test_a_changed_learning_rate_captures_again_and_a_held_view_of_an_output_is_an_error():
    step, model, opt, eager_model, eager_opt, runner, _ = _graphed()
    for i in range(3):
        step(_batch(i))
        _train_step(eager_model, eager_opt, _batch(i))
    for group in (*opt.param_groups, *eager_opt.param_groups):
        group["lr"] = 0.05
    with pytest.warns(UserWarning, match=r"captured again, because param_groups\[0\]\.lr changed"):
        step(_batch(3))
    _train_step(eager_model, eager_opt, _batch(3))
    step(_batch(4))
    _train_step(eager_model, eager_opt, _batch(4))
    assert runner.captures == 2  # once at the change, not at every call after it
    for a, b in zip(_state(model, opt), _state(eager_model, eager_opt)):
        assert torch.equal(a, b)
    view = step(_batch(5))[None]  # the loss itself dropped, a view of it kept
    with pytest.raises(RematError, match=r"a view of a tensor the last step returned .*`\.clone\(\)`"):
        step(_batch(6))


def test_cuda_graph_on_a_cpu_model_is_refused_with_what_to_do():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RematError, match="cuda_graph=True replays the step on a GPU; this step runs on cpu. Use cuda_graph=False"):
        remat.compile(_train_step, model, opt, _batch(0), memory_budget=0.5, profile_runs=1, cuda_graph=True)


def _checking_step(model, opt, batch):
    opt.zero_grad()
    x, y = batch
    kept = y >= 0  # a size from the batch's values: checked on the host at every call
    loss = torch.nn.functional.cross_entropy(model(x)[kept], y[kept])
    assert torch.isfinite(loss), "the loss diverged"  # a value checked on the host at every call
    loss.backward()
    opt.step()
    return loss


def test_cuda_graph_with_checks_on_the_host_is_refused_naming_them():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _batch(0)
    batch[1][:3] = -1
    assert remat.compile(_checking_step, model, opt, batch, memory_budget=None, profile_runs=1)(batch).isfinite()
    with pytest.raises(RematError, match=r"reads values on the host at every call to check them \(2: a size from the batch's values, at test_cuda_graph.py, line \d+: .*; a branch on a value, at test_cuda_graph.py, line \d+: assert torch.isfinite"):
        remat.compile(_checking_step, model, opt, batch, memory_budget=None, profile_runs=1, cuda_graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_replays_are_bitwise_eager_through_a_changed_learning_rate_and_keep_held_losses():
    torch.manual_seed(0)
    model = _mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(model, opt)
    batches = [tuple(t.cuda() for t in _batch(i)) for i in range(8)]
    step = remat.compile(_train_step, model, opt, batches[0], memory_budget=0.5, profile_runs=1, cuda_graph=True)
    losses, eager_losses = [], []
    for i, b in enumerate(batches):
        if i == 5:
            for group in (*opt.param_groups, *eager_opt.param_groups):
                group["lr"] = 5e-4
        losses.append(step(b))
        eager_losses.append(_train_step(eager_model, eager_opt, b))
    assert step.report.cuda_graph_captures == 2 and step.report.cuda_graph_pool_bytes > 0
    assert [float(l) for l in losses] == [float(l) for l in eager_losses]
    for a, b in zip(_state(model, opt), _state(eager_model, eager_opt)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_on_a_gpu_adamw_keeps_one_graph_only_with_its_step_count_on_the_gpu(fused):
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    eager_model, eager_opt = twin(model, opt)
    batches = [tuple(t.cuda() for t in _batch(i)) for i in range(5)]
    step = remat.compile(_train_step, model, opt, batches[0], memory_budget=0.5, profile_runs=1, cuda_graph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches:
            step(b)
            _train_step(eager_model, eager_opt, b)
    for a, b in zip(_state(model, opt), _state(eager_model, eager_opt)):
        assert torch.equal(a, b)
    if fused:  # the step count is a GPU tensor: one address, one graph
        assert step.report.cuda_graph_captures == 1 and not caught
    else:  # a host number read by the update at capture: every step is a capture, and the warning says what to do
        assert step.report.cuda_graph_captures == 4 and "fused=True" in str(caught[0].message)


def test_with_replay_forbidden_no_plan_replays_a_random_op_in_any_index_derived_from_it():
    spec = build_model("bert-tiny", 4)  # dropout in every layer
    opt = make_optimizer("sgd", spec.model.parameters())
    tg = capture(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, frozenset())

    def replays(forbidden: bool, fraction: float) -> int:
        built = pipeline.build_on(tg, spec.model, opt, spec.batch, runs=1)
        if forbidden:  # before any plan, as the runtime does
            built.index.forbid_replay("a CUDA graph cannot set the generator's state")
            assert built.index.indexed(tg, same_nodes=False).replayable == set()  # a pass's graph with other nodes
        base = simulate(built.analysis, scratch=built.index.scratch)
        budget = base.persistent_bytes + int(fraction * (base.peak_bytes - base.persistent_bytes))
        plan = make_plan("refined", built.index, built.profile.seconds_by_node(), budget)
        assert plan.num_recomputed > 0
        return sum(isinstance(n.target, rng_replay.Replay) for n in plan.apply(built.index).runnable().graph.nodes)

    assert replays(forbidden=False, fraction=0.45) > 0  # this budget is reached by recomputing dropout masks
    with pytest.raises(BudgetError):  # which, forbidden, cannot be
        replays(forbidden=True, fraction=0.45)
    assert replays(forbidden=True, fraction=0.55) == 0
