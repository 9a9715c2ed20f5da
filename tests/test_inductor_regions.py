"""Compiled regions (`backend="inductor"`): the plan's order kept, recomputation still in the
backward pass, inputs freed where they die, within tolerance of eager, and the peak within
the budget, measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError
from remat.measurement.check import check_against_eager, model_snapshot, snapshot_differences, twin
from remat.measurement.tolerance import check_within_tolerance
from remat.passes import inductor_regions, region_compiler
from remat.passes.inductor_regions import RECOMPUTE
from remat.passes.rewriter import RECOMPUTED_SUFFIX


def _mlp(seed: int = 0, depth: int = 6) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(64)) for _ in range(depth)]
    model = nn.Sequential(*layers, nn.Linear(64, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"x": torch.randn(128, 64), "y": torch.randint(0, 5, (128,))}
    return model, optimizer, batch


class _Residual(nn.Module):
    """A ResNet block as torchvision writes it: an in-place ReLU and `out += identity`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


def _conv_bn(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """BatchNorm in training mode (its statistics and batch count written in place), in-place
    activations, and SGD's momentum buffers updated in place."""
    torch.manual_seed(seed)
    blocks = [_Residual() for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(8 * 8 * 8, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = {"x": torch.randn(16, 8, 8, 8), "y": torch.randint(0, 5, (16,))}
    return model, optimizer, batch


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def _runs_python(sub, inputs):
    """A stand-in compiler: the region's own graph, run as it is (so the result is bitwise)."""

    def run(args):
        values = list(args)
        args.clear()
        return sub(*values)

    return run


@pytest.mark.parametrize("make, budget", [(_mlp, 0.4), (_conv_bn, 0.7)], ids=["mlp-dropout-layernorm", "conv-batchnorm"])
def test_regions_run_by_a_plain_compiler_are_bitwise_and_recompute_in_the_backward_pass(monkeypatch, make, budget):
    """The cutting, boxing, re-made views and BatchNorm's statistics copied after the region
    alone: with regions that run their own graph, the step must stay bitwise equal to eager."""
    monkeypatch.setattr(inductor_regions, "_inductor", _runs_python)
    monkeypatch.setattr(inductor_regions, "_slower_regions", lambda *timings: [])  # every region kept, however it timed
    model, opt, batch = make()
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(train_step, model, opt, batch, memory_budget=budget, backend="inductor")
    compiled = step.graph_module
    made = compiled.meta["regions"]
    assert made.regions and any(r.kind == RECOMPUTE for r in made.regions)
    # Every copy the plan made is in a recompute region or runs eagerly, after the forward pass.
    order = [n.name for n in compiled.graph.nodes]
    last_forward = max(order.index(r.name) for r in made.regions if r.kind == "forward")
    for region in made.regions:
        copies = [op for op in region.ops if op.endswith(RECOMPUTED_SUFFIX)]
        assert not copies or region.kind == RECOMPUTE, region
        if region.kind == RECOMPUTE:
            assert order.index(region.name) > last_forward
    assert step.report.num_recomputed > 0 and step.report.regions == len(made.regions)
    if make is _conv_bn:  # the whole forward pass is one region: BatchNorm and its batch count do not cut it
        assert [r.kind for r in made.regions].count("forward") == 1
    result = check_against_eager(train_step, eager_model, eager_opt, model, opt, step, batch, steps=3)
    assert result.match, result.mismatches[:5]


def test_inductor_step_is_within_tolerance_and_its_measured_peak_within_the_budget(monkeypatch):
    # Every region kept, however it timed: on a loaded machine all of them timed slower
    # compiled once, leaving none to judge (the timing's own rule is tested below).
    monkeypatch.setattr(inductor_regions, "_slower_regions", lambda *timings: [])
    model, opt, batch = _mlp(1, depth=3)
    eager_model, eager_opt = twin(model, opt)
    before = model_snapshot(model)
    step = remat.compile(train_step, model, opt, batch, memory_budget=0.6, backend="inductor")
    assert not snapshot_differences(before, model_snapshot(model))  # compiling changed nothing of the user's
    report = step.report
    assert report.backend == "inductor" and report.regions > 0 and report.num_recomputed > 0
    # The time model prices the graph that runs: each region one op, timed as it runs.
    ops = [n for n in step.graph_module.graph.nodes if n.op == "call_function"]
    assert report.predicted_time.ops == len(ops) and report.predicted_time.seconds > 0
    result = check_within_tolerance(train_step, eager_model, eager_opt, model, opt, step, batch, steps=2, loss_steps=3)
    assert result.within, result.failures[:3]
    assert result.compared >= 2 * 2 * len(list(model.parameters()))
    assert len(result.losses) == 3 and result.largest_loss_difference < 1e-4
    assert report.measured_peak_bytes is not None and report.measured_peak_bytes <= report.budget_bytes
    # Dropout's masks come from eager's generator, replayed: the losses of a further step agree.
    torch.manual_seed(7)
    eager_loss = train_step(eager_model, eager_opt, batch)
    torch.manual_seed(7)
    assert abs(step(batch).item() - eager_loss.item()) < 1e-4


def test_a_region_over_the_bound_is_split_until_the_peak_fits(monkeypatch):
    monkeypatch.setattr(inductor_regions, "_inductor", _runs_python)
    model, opt, batch = _mlp(2)
    step = remat.compile(train_step, model, opt, batch, memory_budget=0.4, measure=False)
    gm, tg = step.graph_module, step._last.tg
    whole = inductor_regions.for_backend("inductor", gm, tg.phase)
    largest = max(whole.meta["regions"].regions, key=lambda r: len(r.ops))

    def peaks(compiled):  # the largest region "measured" over the bound while it stands whole
        names = {r.name: r.ops for r in compiled.meta["regions"].regions}
        return {name: (10 if ops == largest.ops else 1) for name, ops in names.items()}

    split = inductor_regions.for_backend("inductor", gm, tg.phase, bound_bytes=5, node_peaks=peaks)
    made = split.meta["regions"]
    assert made.splits == 1 and largest.ops not in [r.ops for r in made.regions]
    assert sum(len(r.ops) for r in made.regions) <= whole.meta["regions"].ops


def test_an_unknown_backend_is_refused_naming_the_choices():
    model, opt, batch = _mlp()
    with pytest.raises(RematError, match="'eager', 'inductor'"):
        remat.compile(train_step, model, opt, batch, memory_budget=0.5, backend="tensorrt")


def test_the_tolerance_check_fails_a_step_that_is_off():
    model, opt, batch = _mlp(3)
    eager_model, eager_opt = twin(model, opt)

    def off(b):
        loss = train_step(model, opt, b)
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
        return loss

    result = check_within_tolerance(train_step, eager_model, eager_opt, model, opt, off, batch, steps=2)
    assert not result.within and any("parameter 0.0.weight" in f for f in result.failures)


def test_a_region_given_inputs_laid_out_otherwise_than_at_its_first_call_compiles_for_them():
    """Inductor's code asserts the strides it was compiled with. A region before this one may
    compile in a later cut and hand over another layout (on CUDA, Inductor pads rows): the
    region must run, compiled again for that layout, not fail."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)), 1.0)),))
    region = region_compiler.Region("region_0_forward", "forward", ["mul", "add"])
    compiled = region_compiler.CompiledRegion(torch.fx.GraphModule(torch.nn.Module(), graph), region_compiler.inductor, region)
    dense = torch.randn(4, 6)
    padded = torch.randn(4, 8)[:, :6]  # rows padded to 8
    for value in (dense, padded, dense):
        (out,) = compiled([value])
        assert torch.equal(out, value * 2.0 + 1.0)
    assert len(compiled.fns) == 2 and region.compile_seconds > 0


def test_a_view_that_a_decomposition_makes_impossible_is_taken_as_a_reshape():
    """Hugging Face's GPT-2 concatenates its keys onto a legacy empty tensor: eager's cat
    returns a contiguous copy, which the captured graph then views, but the decomposition
    Inductor traces keeps the transposed strides of the other input, where that view is
    impossible. Inside a region a view is a value, so it may copy."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def attention_scores(x):
        k = x.view(2, 16, 4, 8).transpose(1, 2)
        k = torch.cat([torch.tensor([]), k], -2)
        return torch.matmul(k, k.transpose(-1, -2))

    x = torch.randn(2, 16, 32)
    owner = make_fx(attention_scores)(x)
    run = [n for n in owner.graph.nodes if n.op == "call_function"]
    region = inductor_regions._region_module(owner, run)
    inputs = [x if n.op == "placeholder" else getattr(owner, n.target) for n in region.inputs]
    compiled = region_compiler.CompiledRegion(region.module, region_compiler.inductor, region_compiler.Region("r", "forward", [n.name for n in run]))
    (out,) = compiled(inputs)
    assert not compiled.region.error
    torch.testing.assert_close(out, attention_scores(x))


def test_a_region_inductor_cannot_compile_runs_op_by_op_with_a_warning(monkeypatch):
    def fails(sub, inputs):
        raise RuntimeError("no lowering for this op\nmore detail")

    monkeypatch.setattr(inductor_regions, "_inductor", fails)
    monkeypatch.setattr(inductor_regions, "_slower_regions", lambda *timings: [])  # kept as regions, to be seen
    model, opt, batch = _mlp(4, depth=3)
    eager_model, eager_opt = twin(model, opt)
    with pytest.warns(UserWarning, match=r"could not compile region_\d+_\w+ .*RuntimeError: no lowering for this op\. It runs op by op"):
        step = remat.compile(train_step, model, opt, batch, memory_budget=0.6, backend="inductor")
    made = step.graph_module.meta["regions"]
    assert made.regions and all(r.error == "RuntimeError: no lowering for this op" for r in made.regions)
    result = check_against_eager(train_step, eager_model, eager_opt, model, opt, step, batch, steps=2)
    assert result.match, result.mismatches[:5]  # the regions' own graphs, run op by op: eager's kernels


def test_a_region_slower_compiled_than_its_ops_one_by_one_runs_them_one_by_one(monkeypatch):
    """Timed at compile time: each region's call (with its inputs' boxing) against its ops'
    times in the planned graph. Here every op takes 1 and every region's call 6, so regions of
    up to 6 nodes run op by op and longer ones stay compiled."""
    model, opt, batch = _mlp(5)
    step = remat.compile(train_step, model, opt, batch, memory_budget=0.4, measure=False)
    gm, tg = step.graph_module, step._last.tg
    whole = inductor_regions.for_backend("inductor", gm, tg.phase, compiler=_runs_python).meta["regions"].regions
    assert any(len(r.ops) <= 6 for r in whole) and any(len(r.ops) > 6 for r in whole)

    def seconds(g):
        calls = {r.name for r in g.meta["regions"].regions} if "regions" in g.meta else set()
        return {n.name: 5.0 if n.name in calls else 1.0 for n in g.graph.nodes if n.op == "call_function"}

    kept = inductor_regions.for_backend("inductor", gm, tg.phase, compiler=_runs_python, node_seconds=seconds)
    made = kept.meta["regions"]
    assert sorted(r.ops for r in made.regions) == sorted(r.ops for r in whole if len(r.ops) > 6)
    assert made.slower == sum(1 for r in whole if len(r.ops) <= 6)
    left = {n.name for n in kept.graph.nodes}
    assert all(op in left for r in whole if len(r.ops) <= 6 for op in r.ops)  # their ops, in the graph as planned


def _with_scratch(sub, inputs):
    """A stand-in compiler whose code holds a workspace while the region runs, as a kernel's may."""
    run = _runs_python(sub, inputs)

    def with_scratch(args):
        scratch = torch.empty(8 * 1024)  # noqa: F841 - held through the region: 32 KiB
        return run(args)

    return with_scratch


def test_a_regions_own_temporaries_are_in_the_predicted_peak(monkeypatch):
    """Within the budget, a region that holds more than its ops did op by op raises the
    prediction to its measured peak: the measured step peak is the prediction."""
    model, opt, batch = _mlp(3)
    planned = remat.compile(train_step, *twin(model, opt), batch, memory_budget=1.0, measure=False).report.predicted_peak_bytes
    monkeypatch.setattr(inductor_regions, "_inductor", _with_scratch)
    monkeypatch.setattr(inductor_regions, "_slower_regions", lambda *timed: [])  # a Python stand-in is slower: all kept
    step = remat.compile(train_step, model, opt, batch, memory_budget=planned + 64 * 1024, backend="inductor")
    step(batch)
    report = step.report
    assert report.measured_peak_bytes > planned and report.measured_peak_bytes <= report.budget_bytes
    assert report.predicted_peak_bytes == report.measured_peak_bytes
