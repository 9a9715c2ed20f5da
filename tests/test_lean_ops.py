"""Lean operator variants: a backward op writing its result into an input that dies there.
Each kind of op is bitwise its original; the pass applies only where its precondition
holds; plans with it reach budgets the captured graph cannot, bitwise equal to eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetError, PlanError
from remat.measurement.check import check_against_eager, twin
from remat import build as pipeline
from remat.passes.lean_ops import ROW_WISE, find_lean_ops, out_overload
from remat.memory.simulator import simulate_schedule
from remat.capture.train_graph import Phase
from remat.planners import make_plan
from remat.planners.plan import Plan
from remat.models import make_train_step
from remat.passes.lean_ops import lean_index
from remat.passes.update_placement import moved_index
from tests.test_updates_in_backward import _built, _model_is_the_loss, _peak

aten = torch.ops.aten


def _special(shape, dtype, gen):
    x = torch.randn(shape, dtype=dtype, generator=gen)
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40], dtype=dtype)
    return x


def _cases(g, x):
    """(op, args) with the incoming gradient `g` first; x holds the forward values."""
    return [
        (aten._log_softmax_backward_data.default, (g, torch.log_softmax(x, -1), x.dim() - 1, x.dtype)),
        (aten._softmax_backward_data.default, (g, torch.softmax(x, -1), x.dim() - 1, x.dtype)),
        (aten.gelu_backward.default, (g, x)),
        (aten.threshold_backward.default, (g, torch.relu(x), 0.0)),
        (aten.tanh_backward.default, (g, torch.tanh(x))),
        (aten.sigmoid_backward.default, (g, torch.sigmoid(x))),
        (aten.mul.Tensor, (g, x)),
        (aten.add.Tensor, (g, x)),
        (aten.div.Tensor, (g, x)),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_each_variant_is_bitwise_its_original(dtype, layout):
    gen = torch.Generator().manual_seed(0)
    x = _special((37, 129), dtype, gen)
    g = _special((37, 129), dtype, gen)
    if layout == "transposed":  # a non-contiguous gradient, the layout an mm backward leaves
        g = _special((129, 37), dtype, gen).t()
    checked = 0
    for op, args in _cases(g, x):
        assert torch.Tag.pointwise in op.tags or op in ROW_WISE
        expected = op(*args)
        overload, name = out_overload(op, "cpu")
        buf = args[0].clone(memory_format=torch.preserve_format)
        if expected.stride() != buf.stride():
            continue  # the pass refuses this input: the result would be laid out otherwise
        got = overload(buf, *args[1:], **{name: buf})
        assert got.data_ptr() == buf.data_ptr(), f"{op} did not write into its input"
        assert torch.equal(_bits(got), _bits(expected)), f"{op} ({layout}, {dtype}) differs from its original"
        checked += 1
    assert checked >= 3


def test_only_ops_with_their_own_out_kernel_count():
    """A generated out= wrapper allocates the result and copies it: no byte saved."""
    assert out_overload(aten.native_dropout_backward.default, "cpu") is None
    assert out_overload(aten.gelu_backward.default, "cpu") is not None
    assert out_overload(aten.gelu_backward.default, "meta") is None


def test_the_loss_backward_writes_into_its_incoming_gradient_and_every_variant_holds_its_precondition():
    spec, opt, step, built = _built("bert-tiny", 4, "sgd")
    lean = find_lean_ops(built.tg, built.analysis)
    into = {v.node: v.into for v in lean.applied}
    assert into.get("_log_softmax_backward_data") == "nll_loss_backward"
    index = built.index
    for v in lean.applied:
        (sid,) = index.storages[v.into]
        tensor = index.analysis.tensors[sid]
        assert built.tg.phase[tensor.node] is not Phase.FORWARD  # never a value a rebuild reads
        readers = [index.rank[u] for a in tensor.aliases for u in index.users.get(a, [])]
        assert max(readers) == index.rank[v.node], f"{v.into} is read after {v.node}"
    derived, found = lean_index(index)
    assert derived.lean_ops == found.nodes and derived.captured is index
    # The same ops, in the same order; each variant's result lives on its input's storage.
    assert derived.order == index.order
    for v in found.applied:
        assert derived.storages[v.node] == derived.storages[v.into]
    assert _peak(derived) < _peak(index)


class _TwiceRead(nn.Module):
    """The gradient of `h` is read by two backward ops: no op may overwrite it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return (torch.tanh(h) * torch.sigmoid(h)).sum()


def test_an_input_read_later_is_never_overwritten():
    model = _TwiceRead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_train_step(_model_is_the_loss)
    batch = torch.randn(8, 16)
    built = pipeline.build(step, model, opt, batch, runs=1)
    index = built.index
    applied = find_lean_ops(built.tg, built.analysis).applied
    assert applied, "the other backward ops of this model can write into their dying inputs"
    for v in applied:
        (sid,) = index.storages[v.into]
        later = [u for a in index.analysis.tensors[sid].aliases for u in index.users.get(a, []) if index.rank[u] > index.rank[v.node]]
        assert not later, f"{v.node} overwrites {v.into}, which {later[0]} reads later"
    eager_model, eager_opt = twin(model, opt)
    compiled = remat.compile(step, model, opt, batch, memory_budget=1.0, profile_runs=1)
    assert check_against_eager(step, eager_model, eager_opt, model, opt, compiled, batch, steps=3).match


def test_a_metric_under_inference_mode_in_the_step_is_left_its_own_buffers_and_trains_bitwise():
    # Inference tensors take no out= write outside inference mode: the pass leaves them alone.
    def step(model, opt, batch):
        opt.zero_grad()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        with torch.inference_mode():
            hidden = model[1](model[0](batch))
        return loss.detach(), torch.nn.functional.gelu(model[2](hidden.clone()) * 2).mean() + torch.nn.functional.gelu(hidden).mean()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    eager_model, eager_opt = twin(model, opt)
    compiled = remat.compile(step, model, opt, torch.randn(8, 16), memory_budget=0.95, profile_runs=1)
    for _ in range(3):
        batch = torch.randn(8, 16)
        assert all(torch.equal(a, b) for a, b in zip(compiled(batch), step(eager_model, eager_opt, batch)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_budget_only_the_lean_graph_reaches_runs_bitwise_at_its_predicted_peak(optimizer):
    spec, opt, step, built = _built("bert-tiny", 8, optimizer)
    ns = built.profile.seconds_by_node()
    with pytest.raises(BudgetError) as refused:
        make_plan("mutwo", built.index, ns, 10**6, lean_ops=False)
    floor = refused.value.reach.best
    with pytest.raises(BudgetError) as lean_refused:
        make_plan("mutwo", built.index, ns, 10**6)
    lean_floor = lean_refused.value.reach.best
    assert lean_floor < floor, "the lean graph must reach below the captured graph's floor"
    budget = (floor + lean_floor) // 2
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, spec.model, opt, spec.batch, memory_budget=budget, profile_runs=1)
    plan = compiled.report.plan
    assert plan.lean_ops and "write their result into a dying input" in plan.meta["lean_ops_note"]
    assert plan.predicted_peak_bytes <= budget
    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, compiled, spec.batch, steps=3)
    assert result.match, result.summary()
    assert compiled.report.measured_peak_bytes == plan.predicted_peak_bytes


def test_a_saved_plan_names_its_variants_and_refuses_a_graph_without_them(tmp_path):
    spec, opt, step, built = _built("bert-tiny", 4, "sgd")
    ns = built.profile.seconds_by_node()
    derived, _ = lean_index(built.index)
    plan = make_plan("mutwo", built.index, ns, (_peak(derived) + _peak(built.index)) // 2)
    assert plan.lean_ops == derived.lean_ops
    again = Plan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert again.lean_ops == plan.lean_ops
    assert again.index_for(built.index).lean_ops == plan.lean_ops
    assert simulate_schedule(again.index_for(built.index), again.schedule(built.index)).peak_bytes == plan.predicted_peak_bytes
    again.lean_ops = again.lean_ops[1:]
    with pytest.raises(PlanError, match="dying inputs"):
        again.index_for(built.index)


def _storages_as_seen(analysis):
    """Each node's storages by key, with their bytes and lives: what the simulator reads."""
    t = analysis.tensors
    return {n: [(t[s].key, t[s].nbytes, t[s].created, t[s].last_use, t[s].role) for s in sids] for n, sids in analysis.node_storages.items()}


def test_the_lean_graph_keeps_the_captured_module_and_is_analysed_as_its_rewrite_runs():
    """The variants are kept beside the captured module, not in a copy of it; the analysis
    reads each result on its input's storage, as the emitted out= calls make it (their
    fake values propagated afresh), and the graph with its updates moved is analysed the
    same from it."""
    from remat.memory.analysis import analyze, reordered_analysis
    from remat.passes.rewriter import rewrite, runnable
    from remat.memory.schedule import build_schedule

    spec, opt, step, built = _built("bert-tiny", 4, "adamw")
    derived, found = lean_index(built.index)
    assert derived.tg.gm is built.tg.gm and derived.tg.lean_into == {v.node: v.into for v in found.applied}
    schedule = build_schedule(derived, set())
    gm = runnable(derived, schedule)
    emitted = {n.name: n for n in gm.graph.nodes}
    for v in found.applied:
        out_op, out_name = out_overload(built.index.node_map[v.node].target, "cpu")
        assert emitted[v.node].target is out_op and emitted[v.node].kwargs[out_name].name == v.into
    rewritten = rewrite(derived, schedule)
    assert _storages_as_seen(analyze(derived.tg, rewritten.gm, rewritten.phase)) == _storages_as_seen(derived.analysis)
    assert derived.writes[found.applied[0].node] == derived.storages[found.applied[0].into]  # the out= write, seen by the index
    moved, _ = moved_index(derived)
    assert moved.tg.gm is built.tg.gm and moved.tg.lean_into == derived.tg.lean_into
    assert moved.analysis == analyze(moved.tg)  # derived from the lean graph's, as analysed afresh
    assert moved.analysis == reordered_analysis(moved.tg, derived.analysis)
