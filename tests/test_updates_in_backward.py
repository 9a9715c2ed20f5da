"""Optimizer updates moved into the backward pass: where they may move, what they save,
and that the step still leaves bitwise what eager leaves."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.errors import BudgetError
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model, make_optimizer, make_train_step
from remat import build as pipeline
from remat.memory.schedule import build_schedule
from remat.memory.simulator import simulate_schedule
from remat.capture.train_graph import Phase
from remat.passes.update_placement import moved_index


def _built(model_name: str, batch: int, optimizer: str, train_step=None):
    spec = build_model(model_name, batch)
    opt = make_optimizer(optimizer, spec.model.parameters())
    step = train_step or make_train_step(spec.loss_fn)
    return spec, opt, step, pipeline.build(step, spec.model, opt, spec.batch, runs=1)


def _model_is_the_loss(model, batch):
    """The loss of a test model whose forward returns it."""
    return model(batch)


def _peak(index) -> int:
    return simulate_schedule(index, build_schedule(index, set())).peak_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_each_update_follows_its_gradient_and_lowers_the_peak(optimizer):
    spec, opt, step, built = _built("mlp-deep", 64, optimizer)
    moved, placement = moved_index(built.index)
    assert moved is not None and placement.moved
    # Every moved update runs after its gradient is final and before the backward pass ends.
    order = moved.order
    last_backward = max(i for i, n in enumerate(order) if moved.tg.phase[n] is Phase.BACKWARD)
    for param, grad in built.tg.grad_nodes.items():
        if param in placement.moved:
            ops = [i for i, n in enumerate(order) if moved.tg.phase[n] is Phase.OPTIMIZER and grad in moved.inputs[n]]
            assert ops and min(ops) > moved.rank[grad] and min(ops) < last_backward
    # The first layer's gradient is the last one made: its update cannot move earlier.
    assert set(placement.held) == {"0.weight"} or set(placement.held) <= {"0.weight", "0.bias"}
    assert _peak(moved) < _peak(built.index)


def test_moved_updates_run_bitwise_and_reach_a_budget_the_captured_order_cannot():
    spec, opt, step, built = _built("mlp-deep", 64, "adamw")
    moved, _ = moved_index(built.index)
    budget = (_peak(moved) + _peak(built.index)) // 2
    with pytest.raises(BudgetError):
        remat.compile(step, spec.model, opt, spec.batch, memory_budget=budget, profile_runs=1, updates_in_backward=False)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=budget, profile_runs=1)
    plan = compiled.report.plan
    assert plan.updates_in_backward and "run in the backward pass" in plan.updates_note
    assert plan.predicted_peak_bytes <= budget

    def lower_lr(i, model, optimizer):  # the loop changes the learning rate between steps
        for group in optimizer.param_groups:
            group["lr"] *= 0.5

    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3, between_steps=lower_lr)
    assert result.match, result.summary()
    assert all(p.grad is None for p in spec.model.parameters())  # cleared after the step, as eager leaves them
    measured = compiled.report.measured_peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= max(0.03 * plan.predicted_peak_bytes, 128 * 1024)


def test_clipped_gradients_are_updated_only_after_clipping():
    """clip_grad_norm_ reads every gradient, then scales each in place: an update may run
    only once its gradient is scaled."""
    spec = build_model("mlp", 8)
    opt = make_optimizer("sgd", spec.model.parameters())

    def step(model, optimizer, batch):
        loss = spec.loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    _, _, _, built = _built("mlp", 8, "sgd", step)
    moved, placement = moved_index(built.index)
    index = moved or built.index
    for param, grad in built.tg.grad_nodes.items():
        grad_storages = set(index.storages[grad])
        writes = [r for r, n in enumerate(index.order) if index.tg.phase[n] is not Phase.OPTIMIZER and set(index.writes[n]) & grad_storages]
        reads = [
            r for r, n in enumerate(index.order)
            if index.tg.phase[n] is Phase.OPTIMIZER and any(grad_storages & set(index.storages.get(a, [])) for a in index.inputs[n])
        ]
        assert writes, "clip_grad_norm_ scales every gradient in place"
        assert min(reads) > max(writes)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=1.0, profile_runs=1)
    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3)
    assert result.match, result.summary()


def _square_loss_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    return loss


def _foreach_ops(index) -> list[str]:
    return [n for n in index.order if index.tg.phase[n] is Phase.OPTIMIZER and str(index.node_map[n].target).startswith("aten._foreach_")]


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True),
], ids=["sgd", "adamw", "adam"])
def test_a_multi_tensor_update_runs_in_buckets_in_the_backward_pass_bitwise(make):
    spec = build_model("mlp-deep", 64)
    opt = make(spec.model.parameters())
    step = make_train_step(spec.loss_fn)
    built = pipeline.build(step, spec.model, opt, spec.batch, runs=1)
    moved, placement = moved_index(built.index)
    assert moved is not None and placement.buckets and "buckets of multi-tensor ops" in placement.summary()
    assert sorted(p for b in placement.buckets for p in b) == sorted(placement.moved)
    # One op per bucket for each multi-tensor op of the update, most of them inside the
    # backward pass; fewer than one per parameter.
    kernels = len(_foreach_ops(built.index))
    last_backward = max(i for i, n in enumerate(moved.order) if moved.tg.phase[n] is Phase.BACKWARD)
    in_backward = [n for n in _foreach_ops(moved) if moved.rank[n] < last_backward]
    assert len(in_backward) >= kernels * (len(placement.buckets) - 1)
    assert len(_foreach_ops(moved)) <= kernels * (len(placement.buckets) + 1) < kernels * len(placement.moved)
    assert _peak(moved) < _peak(built.index)
    # A budget only the moved updates reach: planned, bitwise over steps that change the
    # learning rate, at the predicted peak.
    budget = (_peak(moved) + _peak(built.index)) // 2
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=budget, profile_runs=1)
    assert compiled.report.plan.updates_in_backward

    def lower_lr(i, model, optimizer):
        for group in optimizer.param_groups:
            group["lr"] *= 0.5

    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3, between_steps=lower_lr)
    assert result.match, result.summary()
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes


def test_where_buckets_hold_too_much_each_parameter_is_updated_alone():
    """Small batches, many layers: the peak is late in the backward pass, where a bucket's
    waiting gradients count. A budget below the bucketed floor and above the per-parameter
    one is planned with one parameter to a bucket, bitwise, at the predicted peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    step = _square_loss_step

    batch = torch.randn(2, 64)
    built = pipeline.build(step, model, opt, batch, runs=1)
    in_buckets, _ = moved_index(built.index)
    one_each, placement = moved_index(built.index, in_buckets=False)
    assert max(map(len, placement.buckets)) == 1 and _peak(one_each) < _peak(in_buckets)
    budget = (_peak(one_each) + _peak(in_buckets)) // 2
    eager_model, eager_opt = twin(model, opt)
    compiled = remat.compile(step, model, opt, batch, memory_budget=budget, profile_runs=1)
    plan = compiled.report.plan
    assert plan.updates_in_backward and plan.meta.get("update_buckets") is False and plan.predicted_peak_bytes <= budget
    result = check_against_eager(step, eager_model, eager_opt, model, opt, compiled, batch, steps=3)
    assert result.match, result.summary()
    assert compiled.report.measured_peak_bytes == plan.predicted_peak_bytes


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True),
    lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, fused=True),
    lambda params: torch.optim.Adagrad(params, lr=1e-2, fused=True),
], ids=["adamw-amsgrad", "adam", "sgd-nesterov", "adagrad"])
def test_a_fused_optimizer_reads_its_learning_rate_at_every_call_and_runs_in_buckets_bitwise(make):
    """The fused kernel's tensor-lr form takes the learning rate from the graph's input, so
    a schedule changes it between steps; its other settings are fixed numbers, and a
    change to one compiles the step again, naming it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 4))
    opt = make(model.parameters())

    step = _square_loss_step

    batch = torch.randn(32, 64)
    eager_model, eager_opt = twin(model, opt)
    compiled = remat.compile(step, model, opt, batch, memory_budget=0.95, profile_runs=1)
    plan = compiled.report.plan
    assert plan.updates_in_backward and "buckets of multi-tensor ops" in plan.updates_note
    fused = [n for n in compiled.graph_module.graph.nodes if str(n.target).startswith("aten._fused_")]
    assert len(fused) > 1 and all("tensor_lr" in str(n.target) for n in fused)

    def halve_lr(i, model, optimizer):
        for group in optimizer.param_groups:
            group["lr"] *= 0.5

    result = check_against_eager(step, eager_model, eager_opt, model, opt, compiled, batch, steps=5, between_steps=halve_lr)
    assert result.match, result.summary()
    assert compiled.report.measured_peak_bytes == plan.predicted_peak_bytes
    fixed = next(k for k in ("eps", "momentum", "lr_decay") if k in opt.param_groups[0])
    for o in (opt, eager_opt):
        o.param_groups[0][fixed] = o.param_groups[0][fixed] * 2 + 0.5
    with pytest.warns(UserWarning, match=rf"\['{fixed}'\] changed from .* compiled again"):
        result = check_against_eager(step, eager_model, eager_opt, model, opt, compiled, batch, steps=2)
    assert result.match, result.summary()


def test_a_clipped_multi_tensor_update_stays_at_the_end():
    """clip_grad_norm_ reads every gradient before any update: no bucket can run earlier."""
    spec = build_model("mlp", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9, foreach=True)

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = spec.loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=True)
        optimizer.step()
        return loss

    built = pipeline.build(step, spec.model, opt, spec.batch, runs=1)
    moved, placement = moved_index(built.index)
    assert moved is None and placement.held and not placement.moved
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=1.0, profile_runs=1)
    assert not compiled.report.plan.updates_in_backward and "stay at the end" in compiled.report.plan.updates_note
    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3)
    assert result.match, result.summary()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_foreach_adamw_step_recomputes_at_the_per_parameter_floor_in_few_more_ops_than_eager():
    """bert-tiny at batch 1 with torch's multi-tensor AdamW, at a budget that needs the
    updates in the backward pass and recomputes: bitwise, and at most 1.35x the aten ops
    eager's step dispatches (one update per parameter would dispatch about twice)."""
    spec = build_model("bert-tiny", 1)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, foreach=True)
    step = make_train_step(spec.loss_fn)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=0.6, profile_runs=1)
    plan = compiled.report.plan
    assert plan.updates_in_backward and plan.num_recomputed > 0 and "buckets" in plan.updates_note
    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3)
    assert result.match, result.summary()
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes
    with _CountOps() as eager:
        step(eager_model, eager_opt, spec.batch)
    with _CountOps() as ours:
        compiled(spec.batch)
    assert ours.ops <= 1.35 * eager.ops, (ours.ops, eager.ops)


class _Tied(nn.Module):
    """A language-model head that reuses the embedding: the weight is read again late in the backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mid = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.2), nn.GELU(), nn.Linear(64, 32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.emb(ids))
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_a_tied_weight_is_updated_only_after_its_last_reader():
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (8, 12))
    step = make_train_step(_model_is_the_loss)
    built = pipeline.build(step, model, opt, ids, runs=1)
    moved, placement = moved_index(built.index)
    assert moved is not None
    weight = next(n for n, spec in zip([n.name for n in moved.tg.gm.graph.nodes if n.op == "placeholder"], moved.tg.inputs) if spec.name == "emb.weight")
    readers = [moved.rank[u] for u in moved.order if moved.tg.phase[u] is not Phase.OPTIMIZER and any(
        s in moved.storages.get(a, []) for a in moved.inputs[u] for s in moved.storages[weight])]
    writers = [r for r, n in enumerate(moved.order) if set(moved.writes[n]) & set(moved.storages[weight])]
    assert writers and min(writers) > max(readers)

    eager_model, eager_opt = twin(model, opt)
    profiles: dict = {}  # the same node times for both: the reach depends on them
    try:
        compiled = remat.compile(step, model, opt, ids, memory_budget=0.3, profile_runs=1, profile_cache=profiles)
    except BudgetError as e:  # then at the smallest peak it reaches
        compiled = remat.compile(step, model, opt, ids, memory_budget=e.reach.best, profile_runs=1, profile_cache=profiles)
    assert compiled.report.plan.updates_in_backward
    torch.manual_seed(3)
    result = check_against_eager(step, eager_model, eager_opt, model, opt, compiled, ids, steps=3)
    assert result.match, result.summary()


def test_a_step_that_keeps_its_gradients_returns_them_bitwise():
    spec = build_model("bert-tiny", 4)
    opt = make_optimizer("adamw", spec.model.parameters())
    keep = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(keep, spec.model, opt, spec.batch, memory_budget=0.7, profile_runs=1)
    result = check_against_eager(keep, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3)
    assert result.match, result.summary()
    assert all(p.grad is not None for p in spec.model.parameters())


def test_a_saved_plan_says_where_the_updates_run_and_applies_the_same_way(tmp_path):
    from remat.planners import make_plan
    from remat.planners.plan import Plan

    spec, opt, step, built = _built("mlp-deep", 64, "adamw")
    ns = built.profile.seconds_by_node()
    plan = make_plan("mutwo", built.index, ns, _peak(built.index), lean_ops=False)
    assert plan.updates_in_backward
    again = Plan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert again.updates_in_backward and again.updates_note == plan.updates_note
    ordered = again.index_for(built.index)
    assert ordered is moved_index(built.index)[0]
    assert simulate_schedule(ordered, again.schedule(built.index)).peak_bytes == plan.predicted_peak_bytes
    kept = make_plan("mutwo", built.index, ns, _peak(built.index), updates_in_backward=False, lean_ops=False)
    assert not kept.updates_in_backward and "not allowed" in kept.updates_note
    assert kept.index_for(built.index) is built.index


def test_a_budget_out_of_reach_names_the_floor_with_the_updates_moved():
    spec, opt, step, built = _built("mlp-deep", 64, "adamw")
    moved, _ = moved_index(built.index)
    from remat.planners import make_plan

    with pytest.raises(BudgetError) as info:
        make_plan("mutwo", built.index, built.profile.seconds_by_node(), _peak(moved) // 4)
    assert info.value.reach.best < _peak(built.index)  # the floor with the updates moved
    assert any("as soon as its gradient is final" in note for note in info.value.__notes__)


def test_a_reordered_graph_keeps_its_module_and_runs_in_the_new_order():
    """The graph with its updates moved shares the captured module (no copy); what runs it is
    emitted in the index's order, and a bad order is refused."""
    from remat.passes.rewriter import runnable
    from remat.passes.update_placement import reorder

    spec, opt, step, built = _built("mlp-deep", 64, "adamw")
    moved, _ = moved_index(built.index)
    assert moved.tg.gm is built.tg.gm and moved.tg.order == moved.order != built.index.order
    gm = runnable(moved, build_schedule(moved, set()))
    assert [n.name for n in gm.graph.nodes if n.op == "call_function"] == moved.order
    assert runnable(built.index, build_schedule(built.index, set())) is built.tg.gm  # as captured: the module itself
    order = built.index.order
    with pytest.raises(ValueError, match="before one of its inputs"):
        reorder(built.tg, order[::-1])
    with pytest.raises(ValueError, match="exactly once"):
        reorder(built.tg, order[:-1])
    with pytest.raises(ValueError, match="its own order"):
        reorder(moved.tg, moved.order)


def test_the_default_planner_plans_the_captured_order_only_where_it_holds_less(monkeypatch):
    """Both orders give the greedy the same picks in the same order; the local search plans
    the captured order only where it holds less under the picks the moved plan made."""
    import dataclasses

    import remat.planners.refined as refined
    from remat.planners import make_plan
    from remat.planners.placement import _holds_no_less

    spec, opt, step, built = _built("mlp-deep", 64, "adamw")
    ns = built.profile.seconds_by_node()
    budget = int(_peak(moved_index(built.index)[0]) * 0.97)  # some recomputation needed, either order
    planned = []
    original = refined.plan
    monkeypatch.setattr(refined, "plan", lambda idx, *a, **k: planned.append(idx) or original(idx, *a, **k))
    plan = make_plan("refined", built.index, ns, budget, lean_ops=False)
    assert plan.recomputed and plan.updates_in_backward
    assert planned == [moved_index(built.index)[0]]
    assert "holds no less" in plan.meta["other_placement"]["not_planned"]
    mutwo = make_plan("mutwo", built.index, ns, budget, lean_ops=False)
    assert "not_planned" not in mutwo.meta["other_placement"]  # μ-TWO alone plans both orders
    # The rule itself: the captured order's peak under the moved plan's picks, against the plan's.
    captured_peak = simulate_schedule(built.index, build_schedule(built.index, mutwo.dropped(built.index), mutwo.policy)).peak_bytes
    assert _holds_no_less(built.index, dataclasses.replace(mutwo, predicted_peak_bytes=captured_peak)) is not None
    assert _holds_no_less(built.index, dataclasses.replace(mutwo, predicted_peak_bytes=captured_peak + 1)) is None
