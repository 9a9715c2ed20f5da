"""Capture: the captured graph trains bitwise like eager, phases and roles are right, and
what cannot be captured is refused with a message that says why."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
import re
import types
import warnings

import numpy as np

import pytest
import torch
import torch.utils._pytree as pytree

import remat
from remat.memory.analysis import Role, analyze
from remat.capture.capture import capture
from remat.capture.step_inputs import flat_inputs, run_captured
from remat.capture.state.kept_numbers import KeptNumber, Term
from remat.capture.train_graph import InputKind, Phase
from remat.measurement.check import check_against_eager, twin
from remat.errors import CaptureError
from remat.models import build_model, make_optimizer, make_train_step

TINY = [("mlp", 4), ("bert-tiny", 2), ("resnet-tiny", 2)]


@pytest.mark.parametrize("model_name,batch_size", TINY)
@pytest.mark.parametrize("optimizer,zero_grad_first", [("sgd", False), ("adamw", True)])
def test_captured_graph_trains_bitwise_like_eager(model_name, batch_size, optimizer, zero_grad_first):
    spec = build_model(model_name, batch_size)
    opt = make_optimizer(optimizer, spec.model.parameters())
    eager_model, eager_opt = twin(spec.model, opt)
    step = make_train_step(spec.loss_fn, zero_grad_first=zero_grad_first)
    tg = capture(step, spec.model, opt, spec.batch)

    def captured_step(batch):
        return run_captured(tg, tg.gm, spec.model, flat_inputs(tg, spec.model, opt, batch))

    result = check_against_eager(step, eager_model, eager_opt, spec.model, opt, captured_step, spec.batch, steps=3)
    assert result.match, result.summary()
    # Gradients are compared too when the step leaves them set.
    assert all((p.grad is not None) == zero_grad_first for p in spec.model.parameters())


def test_dropout_is_active_and_follows_the_seed():
    spec = build_model("bert-tiny", 2)
    step = make_train_step(spec.loss_fn)
    opt = make_optimizer("sgd", spec.model.parameters())
    tg = capture(step, spec.model, opt, spec.batch)
    assert any(n.target is torch.ops.aten.bernoulli_.float for n in tg.op_nodes())
    losses = []
    for seed in (0, 0, 1):
        model, o = twin(spec.model, opt)
        torch.manual_seed(seed)
        losses.append(run_captured(tg, tg.gm, model, flat_inputs(tg, model, o, spec.batch)))
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])


def test_phases_in_order_and_every_tensor_has_a_role():
    spec = build_model("resnet-tiny", 2)
    opt = make_optimizer("adamw", spec.model.parameters())
    tg = capture(make_train_step(spec.loss_fn), spec.model, opt, spec.batch)
    phases = [tg.phase[n.name] for n in tg.op_nodes()]
    firsts = [phases.index(p) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)]
    assert firsts == sorted(firsts) and firsts[0] == 0
    assert phases == sorted(phases, key=[Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER].index)
    assert tg.phase[tg.loss_node] is Phase.FORWARD
    analysis = analyze(tg)
    roles = {t.role for t in analysis.tensors}
    assert roles <= set(Role) and {Role.PARAMETER, Role.ACTIVATION, Role.GRADIENT, Role.OPTIMIZER_STATE, Role.INPUT} <= roles
    for t in analysis.activations():
        assert t.created <= t.last_forward_use < t.first_backward_use <= t.last_use
        assert analysis.phases[t.created] is Phase.FORWARD
    # One gradient per parameter, made in the backward pass.
    params = [i for i in tg.inputs if i.kind.value == "parameter"]
    assert len(tg.grad_nodes) == len(params)
    assert all(tg.phase[n] is Phase.BACKWARD for n in tg.grad_nodes.values())


def test_no_optimizer_captures_forward_and_backward_only():
    spec = build_model("mlp", 4)
    step = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, _ = twin(spec.model, None)
    tg = capture(step, spec.model, None, spec.batch)
    assert set(tg.phase.values()) == {Phase.FORWARD, Phase.BACKWARD}
    before = [p.detach().clone() for p in spec.model.parameters()]
    loss = run_captured(tg, tg.gm, spec.model, flat_inputs(tg, spec.model, None, spec.batch))
    eager_loss = step(eager_model, None, spec.batch)
    assert torch.equal(loss, eager_loss.detach())
    for p, q, b in zip(spec.model.parameters(), eager_model.parameters(), before):
        assert torch.equal(p, b) and torch.equal(p.grad, q.grad)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow
            return y * 2
        return y


def _step(model, opt, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss


def test_data_dependent_control_flow_is_refused_with_a_reason():
    # The error names the model's line that branched, not a line inside torch.
    with pytest.raises(CaptureError, match=r"data-dependent.*, at test_capture\.py, line \d+: if y\.sum\(\) > 0:"):
        capture(_step, _Branchy(), None, torch.randn(2, 4))


def test_a_number_read_from_a_tensor_made_a_tensor_again_is_made_in_the_graph():
    def step(model, opt, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss, torch.tensor(loss.item())  # a metric read on the host, then wrapped again

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    eager_model = copy.deepcopy(model)
    loss, metric = remat.compile(step, model, None, x, memory_budget=None)(x)
    eager_loss, eager_metric = step(eager_model, None, x)
    assert torch.equal(loss, eager_loss) and torch.equal(metric, eager_metric) and metric.dtype == eager_metric.dtype


class _GroupedExperts(torch.nn.Module):
    """Two experts applied to the rows of their group by one grouped matmul, in float32: the
    CPU kernel runs it, its shape function (which tracing runs) accepts only bfloat16."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):
        offs = torch.tensor([2, 4], dtype=torch.int32)
        return torch.nn.functional.grouped_mm(x, self.w, offs=offs)


def test_a_grouped_matmul_in_float32_on_a_cpu_is_captured_with_the_cpu_kernels_shape():
    model, x = _GroupedExperts(), torch.randn(4, 8)
    y = next(n.meta["val"] for n in capture(_step, model, None, x).gm.graph.nodes if n.target is torch.ops.aten._grouped_mm.default)
    assert (y.shape, y.dtype) == (torch.Size([4, 8]), torch.float32)


def test_an_op_whose_shape_function_refuses_its_inputs_is_named(monkeypatch):
    from remat.ops import cpu_shape_functions

    monkeypatch.setattr(cpu_shape_functions, "CPU_KERNEL_SHAPES", frozenset())  # the meta function decides
    model, x = _GroupedExperts(), torch.randn(4, 8)
    _step(model, None, x)  # eager runs it
    with pytest.raises(CaptureError, match=r"aten\._grouped_mm\.default's shape function.*refuses these inputs.*batched_mm"):
        capture(_step, model, None, x)


def test_bad_batches_are_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=r"batch\['scale'\] is a ndarray. Convert it to a tensor \(torch.as_tensor"):
        capture(_step, model, None, {"x": torch.randn(2, 4), "scale": np.ones(2)})
    with pytest.raises(CaptureError, match="holds no tensors"):
        capture(_step, model, None, {"scale": 2.0})
    with pytest.raises(CaptureError, match="holds no tensors"):
        capture(_step, model, None, [])


def test_anomaly_detection_is_refused_saying_to_turn_it_off():
    model = torch.nn.Linear(4, 4)
    with torch.autograd.set_detect_anomaly(True), pytest.raises(CaptureError, match=r"anomaly detection is on .*set_detect_anomaly\(False\)"):
        capture(_sgd_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    capture(_sgd_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))  # off again: captured


def test_anomaly_detection_turned_on_inside_the_step_is_refused_by_name_and_without_nan_checks_trains_bitwise():
    import remat

    def step(model, opt, batch, check_nan=True):
        opt.zero_grad()
        with torch.autograd.detect_anomaly(check_nan=check_nan):
            loss = torch.nn.functional.gelu(model(batch)).square().mean()
            loss.backward()
        opt.step()
        return loss

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match=r"backward pass with autograd's anomaly detection on, at test_capture.py.*check_nan=False"):
        capture(step, model, opt, torch.randn(2, 4))
    eager_model, eager_opt = twin(model, opt)
    compiled = remat.compile(functools.partial(step, check_nan=False), model, opt, torch.randn(2, 4), profile_runs=1, measure=False)
    for _ in range(3):
        batch = torch.randn(2, 4)
        assert torch.equal(compiled(batch), step(eager_model, eager_opt, batch, check_nan=False))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))


def _encoded_step(model, opt, batch):
    assert type(batch).__name__ == "BatchEncoding" and batch.x is batch["x"]  # the kind the loop passed, attributes and all
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(torch.nn.functional.dropout(model(batch["x"]), 0.5), batch["labels"])
    loss.backward()
    opt.step()
    return loss


def test_a_batch_encoding_from_a_tokenizer_or_collator_is_a_batch_bitwise():
    import remat

    transformers = pytest.importorskip("transformers")
    batches = [transformers.BatchEncoding({"x": torch.randn(8, 4), "labels": torch.randint(0, 4, (8,))}) for _ in range(3)]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_encoded_step, model, opt, batches[0], memory_budget=None, profile_runs=1, measure=False)
    torch.manual_seed(1)
    losses = [step(b) for b in batches]
    torch.manual_seed(1)
    assert all(torch.equal(a, _encoded_step(eager_model, eager_opt, b)) for a, b in zip(losses, batches))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters())) and len(step._graphs) == 1


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


def test_a_batch_remat_cannot_look_into_is_refused_naming_its_kind():
    with pytest.raises(CaptureError, match=r"the batch \(_Batch\) holds no tensors remat can find.*dataclasses\.asdict\(batch\)"):
        capture(_step, torch.nn.Linear(4, 4), None, _Batch(torch.randn(2, 4)))


def test_step_that_never_calls_backward_is_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="never called loss.backward"):
        capture(lambda m, o, b: m(b).sum(), model, None, torch.randn(2, 4))


def test_step_must_return_tensors_and_numbers():
    model = torch.nn.Linear(4, 4)

    def step(m, o, b):
        m(b).sum().backward()
        return "done"

    with pytest.raises(CaptureError, match="must return the loss, or a tuple, list or dict of tensors and numbers; it returned str"):
        capture(step, model, None, torch.randn(2, 4))


class _Meter:
    """PyTorch's ImageNet example's AverageMeter."""

    def __init__(self):
        self.val, self.sum, self.count, self.avg = 0, 0, 0, 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


@pytest.mark.parametrize("returns", ["nothing", "a None beside the loss"])
def test_a_step_that_logs_through_a_meter_and_returns_nothing_trains_as_eager_and_returns_none(returns):
    def run(compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        meter = _Meter()

        def step(m, o, b):
            loss = torch.nn.functional.cross_entropy(m(b[0]), b[1])
            meter.update(loss.item(), b[0].size(0))
            o.zero_grad()
            loss.backward()
            o.step()
            return None if returns == "nothing" else (loss.detach(), None)

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
        call = remat.compile(step, model, opt, batches[0]) if compiled else lambda b: step(model, opt, b)
        returned = [call(b) for b in batches]
        return returned, (meter.val, meter.sum, meter.count, meter.avg), [p.detach().clone() for p in model.parameters()]

    (ours, meter, params), (theirs, eager_meter, eager_params) = run(True), run(False)
    if returns == "nothing":
        assert ours == theirs == [None] * 4
    else:
        assert all(r[1] is None and torch.equal(r[0], e[0]) for r, e in zip(ours, theirs, strict=True))
    assert meter == eager_meter and meter[2] == 64
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params))


def test_optimizer_over_foreign_tensors_is_refused():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    with pytest.raises(CaptureError, match="not a parameter of the model"):
        capture(_step, model, opt, torch.randn(2, 4))


class _OwnSGD(torch.optim.Optimizer):
    """A user's optimizer that makes its state at its first step."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def test_a_torch_compiled_model_is_refused_saying_to_pass_the_module_before_compiling():
    model = torch.compile(torch.nn.Linear(4, 4))
    with pytest.raises(CaptureError, match=r"torch\.compile'd.*pass the module before torch\.compile \(its _orig_mod\)"):
        capture(_step, model, None, torch.randn(2, 4))
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.compile(torch.nn.Linear(4, 4)))
    with pytest.raises(CaptureError, match=r"submodule '1' is torch\.compile'd.*\(model\.get_submodule\('1'\)\._orig_mod\)"):
        capture(_step, inner, None, torch.randn(2, 4))


def test_data_parallel_wrappers_that_communicate_outside_a_graph_are_refused_naming_the_one_to_use():
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 needs an accelerator to be made; its class is what is refused, so one is made
    # without FSDP's __init__, holding a module as FSDP holds it.
    shell = torch.nn.Module()
    shell.add_module("_fsdp_wrapped_module", torch.nn.Linear(4, 4))
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    fsdp1.__dict__.update(vars(shell))
    with pytest.raises(CaptureError, match=r"the model's '1' is wrapped in FullyShardedDataParallel \(FSDP1\).*fully_shard instead"):
        remat.compile(_step, torch.nn.Sequential(torch.nn.Linear(4, 4), fsdp1), None, torch.randn(2, 4))
    replicated = torch.nn.DataParallel(torch.nn.Linear(4, 4))
    replicated.device_ids = [0, 1]  # as on a machine with two GPUs
    with pytest.raises(CaptureError, match=r"torch\.nn\.DataParallel over 2 devices.*use DistributedDataParallel"):
        remat.compile(_step, replicated, None, torch.randn(2, 4))
    # Without devices DataParallel calls its module as it is: captured as that module.
    step = remat.compile(_step, torch.nn.DataParallel(torch.nn.Linear(4, 4)), None, torch.randn(2, 4), memory_budget=None)
    assert step(torch.randn(2, 4)) is not None


_FOCUS = 2.0  # the focal loss's gamma, which the loop changes


@torch.compile
def _compiled_focal_loss(logits, y):
    logp = torch.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
    return (-((1 - logp.exp()) ** _FOCUS) * logp).mean()


def _step_with_loss(model, opt, batch, loss_fn):
    opt.zero_grad()
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.detach()


_PLAIN_FOCAL_LOSS = _compiled_focal_loss._torchdynamo_orig_callable
_GIVEN = {  # how the step reaches the loss function: (compiled, eager) steps
    "torch.compile": (lambda m, opt, b, loss_fn=_compiled_focal_loss: _step_with_loss(m, opt, b, loss_fn), lambda m, opt, b: _step_with_loss(m, opt, b, _PLAIN_FOCAL_LOSS)),
    "default argument": (lambda m, opt, b, loss_fn=_PLAIN_FOCAL_LOSS: _step_with_loss(m, opt, b, loss_fn),) * 2,
    "partial's keyword": (functools.partial(_step_with_loss, loss_fn=_PLAIN_FOCAL_LOSS),) * 2,
}


@pytest.mark.parametrize("given_as", list(_GIVEN))
def test_a_loss_function_given_to_the_step_has_the_globals_it_reads_watched_and_a_compiled_one_is_traced_as_its_plain_code(given_as):
    """A `@torch.compile` function is traced as its plain code, with a warning, and trains as
    the plain function does; each way the step is given it, the global it reads is watched."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    step, eager_step = _GIVEN[given_as]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = remat.compile(step, model, o, batch, memory_budget=0.8, profile_runs=1)
    said = [str(w.message) for w in caught if "compiled by torch.compile" in str(w.message)]
    assert len(said) == (given_as == "torch.compile") and all(re.search(r"at test_capture\.py.*loss_fn\(model", m) for m in said), said

    def focus(i, m, opt):  # a global the loss function reads
        global _FOCUS
        _FOCUS = 1.0 + i

    try:
        result = check_against_eager(eager_step, eager_model, eager_opt, model, o, compiled, batch, steps=3, between_steps=focus)
    finally:
        focus(1, None, None)
    assert result.match, result.summary()


def test_a_shape_that_depends_on_values_is_refused_naming_the_line_and_what_to_do():
    def step(model, opt, batch):
        opt.zero_grad()
        out = model(batch[0])
        picked = out[out.sum(1) > 0]  # boolean-mask indexing by the model's values: as many rows as the mask holds
        picked.sum().backward()
        opt.step()

    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=r"depends on tensor values \(aten\.nonzero.*at test_capture\.py, line \d+: picked = out\[out\.sum\(1\) > 0\].*loss in train_step from its logits"):
        capture(step, model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(6, 4), torch.randn(6)))


def test_a_users_optimizer_gets_the_state_its_first_step_makes_before_the_trace():
    """Made by its own step on a copy of each parameter (the first value set under each key),
    with nothing of the user's changed; the graph takes it as state."""
    model = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    opt = _OwnSGD(model.parameters())
    tg = capture(lambda m, o, b: _step_with_loss(m, o, b, torch.nn.functional.mse_loss), model, opt, (torch.randn(2, 4), torch.randn(2, 4)))
    assert all(torch.equal(opt.state[p]["buf"], torch.zeros_like(p)) for p in model.parameters())
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
    assert sorted(i.name for i in tg.inputs if i.kind is InputKind.OPTIMIZER_STATE) == ["bias.buf", "weight.buf"]


def test_other_batch_structure_is_refused_at_run_time():
    spec = build_model("mlp", 4)
    tg = capture(make_train_step(spec.loss_fn), spec.model, None, spec.batch)
    with pytest.raises(CaptureError, match="different structure"):
        flat_inputs(tg, spec.model, None, {"x": spec.batch[0]})


def test_a_step_that_accumulates_gradients_across_calls_takes_those_it_finds_as_inputs():
    """A step with no zero_grad() adds its gradients to the last step's, as eager's backward
    does: captured with none set, its graph makes them; with them set, it takes them as
    inputs and adds to them in place."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulating(m, o, b):  # no zero_grad anywhere: eager adds to last step's grads
        loss = m(b).pow(2).mean()
        loss.backward()
        o.step()
        return loss

    fresh = capture(accumulating, model, opt, torch.randn(2, 4))
    assert fresh.call.accumulates and not [i for i in fresh.inputs if i.kind is InputKind.GRADIENT]
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    adding = capture(accumulating, model, opt, torch.randn(2, 4))
    assert adding.call.accumulates and [i.name for i in adding.inputs if i.kind is InputKind.GRADIENT] == ["weight", "bias"]
    # The gradients are added to in place, as eager's AccumulateGrad does when grad mode is off.
    placeholders = {n.name: n for n in adding.gm.graph.nodes if n.op == "placeholder"}
    written = [u for n in list(placeholders.values())[2:4] for u in n.users if u.target is torch.ops.aten.add_.Tensor]
    assert len(written) == 2
    model.weight.grad = torch.ones(4, 4).to_sparse()  # not like its parameter: refused, naming it
    with pytest.raises(CaptureError, match=r"weight.grad is a torch.sparse_coo float32 tensor of shape \(4, 4\)"):
        capture(accumulating, model, opt, torch.randn(2, 4))
    # A trained parameter that no optimizer holds keeps its gradient through zero_grad(): as in eager, said.
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def zero_first(m, o, b):
        o.zero_grad()
        return accumulating(m, o, b)

    only_last = torch.optim.SGD(two[1].parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"2 parameters that no optimizer holds \(first: 0.weight\).*Freeze them"):
        assert capture(zero_first, two, only_last, torch.randn(2, 4)).call.accumulates
    # Clearing in place (set_to_none=False) before backward is a fresh start.
    def clears_in_place(m, o, b):
        o.zero_grad(set_to_none=False)
        return accumulating(m, o, b)

    model.weight.grad = None
    assert not capture(clears_in_place, model, opt, torch.randn(2, 4)).call.accumulates


class _LSTMTagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y)


def _per_token_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]).flatten(0, 1), batch["y"].flatten())
    loss.backward()
    optimizer.step()
    return loss


def _lstm_batch():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(4, 8, 16, generator=g), "y": torch.randint(0, 5, (4, 8), generator=g)}


@pytest.mark.parametrize("onednn", [True, False])
def test_an_lstm_trains_bitwise_with_its_workspace_counted(onednn):
    """On CPU, nn.LSTM runs oneDNN's layer, which keeps the workspace its backward reads
    only while autograd records (the graph runs under no_grad) and whose fake kernel gives
    that workspace no bytes: the graph runs a twin that keeps it, sized for real. With
    oneDNN off, PyTorch's own LSTM kernels."""
    import remat

    if onednn and not torch.backends.mkldnn.is_available():
        pytest.skip("this build of torch has no oneDNN")
    model = _LSTMTagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch.backends.mkldnn.flags(enabled=onednn):
        eager_model, eager_opt = twin(model, opt)
        step = remat.compile(_per_token_step, model, opt, _lstm_batch(), memory_budget=0.8, profile_runs=1)
        result = check_against_eager(_per_token_step, eager_model, eager_opt, model, opt, step, _lstm_batch(), steps=3)
    assert result.match, result.summary()
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    if onednn:
        workspaces = [n.meta["val"][3] for n in step.compiled_for(_lstm_batch()).tg.gm.graph.nodes if n.target is torch.ops.remat.mkldnn_rnn_layer_recording.default]
        assert len(workspaces) == 2 and all(w.numel() > 0 for w in workspaces)


class _Checkpointed(torch.nn.Module):
    """Residual blocks with dropout, each under the user's own torch.utils.checkpoint."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.use_reentrant = use_reentrant
        self.inp = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 32)) for _ in range(3)
        )
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.out(h)


def _checkpointed_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_users_own_checkpoint_calls_with_dropout_train_bitwise(use_reentrant):
    """Traced as they are, the regions would be recomputed in the backward pass with new
    dropout masks (the RNG state checkpoint restores is restored at trace time only), and
    the gradients would differ from eager's with no error. They are traced as plain calls,
    and remat plans their recomputation."""
    import remat

    model = _Checkpointed(use_reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    batch = {"x": torch.randn(256, 16, generator=g), "y": torch.randint(0, 4, (256,), generator=g)}
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_checkpointed_step, model, opt, batch, memory_budget=0.7, profile_runs=1)
    captured = step.compiled_for(batch).tg.gm
    assert sum(1 for n in captured.graph.nodes if n.target is torch.ops.aten.bernoulli_.float) == 3  # each dropout traced once
    result = check_against_eager(_checkpointed_step, eager_model, eager_opt, model, opt, step, batch, steps=3)
    assert result.match, result.summary()
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__  # checkpoint itself is left as it was


class _CheckpointedFirst(torch.nn.Module):
    """A reentrant checkpoint around the first layer, whose input (the batch) needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True))


def test_a_reentrant_checkpoint_on_an_input_without_grad_leaves_the_layer_inside_untrained_as_eager_does():
    # Eager's reentrant checkpoint is an autograd.Function: no input requires grad, so its
    # output requires none, and `a` gets no gradient. As a plain call, `a` was trained.
    import remat

    torch.manual_seed(0)
    model = _CheckpointedFirst()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"x": torch.randn(32, 16), "y": torch.randint(0, 4, (32,))}
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_checkpointed_step, model, opt, batch, memory_budget=None, profile_runs=1, measure=False)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        result = check_against_eager(_checkpointed_step, eager_model, eager_opt, model, opt, step, batch, steps=2)
    assert result.match, result.summary()
    assert model.a.weight.grad is None and model.b.weight.grad is not None


def _sgd_step(model, opt, batch):
    opt.zero_grad()
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_a_sparse_gradient_is_refused_naming_the_dense_option():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(24, 4))
    with pytest.raises(CaptureError, match=r"makes a sparse_coo tensor .* nn\.Embedding\(sparse=True\): remat plans dense tensors only"):
        capture(_sgd_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, 50, (2, 3)))


@pytest.mark.parametrize("make,words", [
    (lambda ps: torch.optim.LBFGS(ps, max_iter=3), r"LBFGS cannot be captured .* calls the closure again and again.* Instead: train with"),
    (lambda ps: torch.optim.SparseAdam(ps), r"SparseAdam cannot be captured .* sparse gradients.*nn\.Embedding\(\.\.\., sparse=False\)"),
])
def test_an_optimizer_whose_step_is_not_one_graph_is_refused_naming_what_to_use(make, words):
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(24, 4))
    with pytest.raises(CaptureError, match=words):
        capture(_sgd_step, model, make(list(model.parameters())), torch.randint(0, 50, (2, 3)))


class _Queue(torch.nn.Module):
    """A MoCo-style queue of past outputs written at a pointer kept in a buffer: as an int
    slice bound (refused), or as the index tensor the refusal advises."""

    def __init__(self, by_index: bool):
        super().__init__()
        self.lin, self.by_index = torch.nn.Linear(4, 4), by_index
        self.register_buffer("queue", torch.zeros(4, 8))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        y = self.lin(x)
        keys = y.detach().T
        if self.by_index:
            self.queue.index_copy_(1, (torch.arange(x.shape[0]) + self.ptr) % 8, keys)
            self.ptr.add_(x.shape[0]).remainder_(8)
        else:
            ptr = int(self.ptr)
            self.queue[:, ptr:ptr + x.shape[0]] = keys
            self.ptr[0] = (ptr + x.shape[0]) % 8
        return y @ self.queue


def test_a_tensor_read_as_an_int_is_refused_and_the_advised_index_tensor_trains_bitwise():
    import remat

    with pytest.raises(CaptureError, match=r"uses a tensor's value as a Python int, at test_capture\.py, line \d+: ptr = int\(self\.ptr\).*index_copy_"):
        model = _Queue(by_index=False)
        capture(_sgd_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4))
    torch.manual_seed(0)
    model = _Queue(by_index=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_sgd_step, model, opt, torch.randn(3, 4), memory_budget=None)
    for _ in range(4):  # 12 keys through a queue of 8: the pointer wraps
        batch = torch.randn(3, 4)
        assert torch.equal(step(batch), _sgd_step(eager_model, eager_opt, batch))
    for name, value in eager_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert model.ptr.item() == 4 and len(step._graphs) == 1


def _one_hot_step(num_classes):
    def train_step(model, opt, batch):
        opt.zero_grad()
        logits = model(batch["x"])
        target = torch.nn.functional.one_hot(batch["y"]) if num_classes is None else torch.nn.functional.one_hot(batch["y"], num_classes=num_classes)
        loss = -(target.float() * logits.log_softmax(-1)).sum(-1).mean()
        loss.backward()
        opt.step()
        return loss

    return train_step


def test_one_hot_without_num_classes_is_refused_saying_to_pass_it_and_with_it_trains_bitwise():
    import remat

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [{"x": torch.randn(6, 8), "y": torch.randint(0, 5, (6,))} for _ in range(3)]
    with pytest.raises(CaptureError, match=r"one_hot without num_classes, at test_capture\.py, line \d+: .*num_classes=\.\.\."):
        remat.compile(_one_hot_step(None), model, opt, batches[0], memory_budget=None)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_one_hot_step(5), model, opt, batches[0], memory_budget=None)
    for batch in batches:
        assert torch.equal(step(batch), _one_hot_step(5)(eager_model, eager_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


def test_float_of_the_loss_is_refused_saying_to_use_item_which_trains_bitwise():
    import remat

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(6, 8) for _ in range(3)]

    def step_of(as_number):  # type: ignore[no-untyped-def]
        def train_step(model, opt, batch):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            return as_number(loss)

        return train_step

    with pytest.raises(CaptureError, match=r"float\(\), at test_capture\.py, line \d+: +return as_number\(loss\).*Use \.item\(\) instead"):
        remat.compile(step_of(float), model, opt, batches[0], memory_budget=None)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(step_of(lambda t: t.item()), model, opt, batches[0], memory_budget=None)
    for batch in batches:
        got, expected = step(batch), step_of(float)(eager_model, eager_opt, batch)
        assert type(got) is float and got == expected


def test_a_torchscript_submodule_is_traced_as_its_ops_with_a_warning_that_it_is_not_bitwise():
    import remat

    def scripted():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)  # made twice: a deep copy of a TorchScript module is not one to train
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    (model, opt), (eager_model, eager_opt) = scripted(), scripted()
    with pytest.warns(UserWarning, match=r"the model's 1 is a TorchScript module .* not bitwise"):
        step = remat.compile(_sgd_step, model, opt, torch.randn(4, 8), memory_budget=None)
    for _ in range(3):
        batch = torch.randn(4, 8)
        torch.testing.assert_close(step(batch), _sgd_step(eager_model, eager_opt, batch))


class _PackedGRU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(4, 8, batch_first=True)

    def forward(self, batch):
        packed = torch.nn.utils.rnn.pack_padded_sequence(batch["x"], batch["lengths"], batch_first=True, enforce_sorted=False)
        return self.gru(packed)[1]


def test_a_recurrent_layer_on_a_packed_sequence_is_refused_saying_to_run_it_padded():
    model = _PackedGRU()
    batch = {"x": torch.randn(3, 5, 4), "lengths": torch.tensor([5, 2, 4])}
    _sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)  # eager runs it
    with pytest.raises(CaptureError, match=r"a recurrent layer on a PackedSequence .*, at test_capture\.py, line \d+: packed = torch\.nn\.utils\.rnn\.pack_padded_sequence.*Run the layer on the padded batch"):
        capture(_sgd_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch)


def test_a_setting_that_branches_on_a_tensor_is_refused_naming_the_setting_to_change():
    cumulative = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=None))
    with pytest.raises(CaptureError, match=r"momentum=None .* Give the layer a float momentum"):
        capture(_sgd_step, cumulative, torch.optim.SGD(cumulative.parameters(), lr=0.1), torch.randn(2, 3, 6, 6))


def _per_parameter_optimizers(model):
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_now(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    return list(optimizers.values())


def test_an_optimizer_per_parameter_stepped_in_a_hook_is_refused_saying_what_to_do_instead():
    model = torch.nn.Linear(4, 4)
    optimizers = _per_parameter_optimizers(model)

    def train_step(model, opt, batch):
        model(batch).pow(2).mean().backward()

    with pytest.raises(CaptureError, match=r"a dict keyed by the model's tensors.*pass one optimizer \(or a list\)"):
        capture(train_step, model, optimizers, torch.randn(2, 4))


def test_a_hugging_face_model_with_gradient_checkpointing_enabled_trains_bitwise():
    import remat

    spec = build_model("bert-tiny", 4)
    spec.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = make_optimizer("adamw", spec.model.parameters())
    step_fn = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    step = remat.compile(step_fn, spec.model, opt, spec.batch, memory_budget=0.6, profile_runs=1, measure=False)
    result = check_against_eager(step_fn, eager_model, eager_opt, spec.model, opt, step, spec.batch, steps=3)
    assert result.match, result.summary()


class _ScaledEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, ids):
        return self.embedding(ids) * self.scale


class _SecondReference(torch.nn.Module):
    """A submodule held at two places, as peft's prompt tuning keeps the backbone's embedding
    as `word_embeddings` beside the backbone, and reads it there."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.ModuleDict({"embed": _ScaledEmbedding(), "head": torch.nn.Linear(16, 50)})
        self.word_embeddings = self.backbone["embed"]

    def forward(self, ids):
        return self.backbone["head"](torch.nn.functional.gelu(self.word_embeddings(ids)))


def test_a_submodule_held_at_two_places_is_left_as_it_was_and_trains_bitwise():
    torch.manual_seed(0)
    model = _SecondReference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"x": torch.randint(0, 50, (8, 12)), "y": torch.randint(0, 50, (8, 12))}
    step_fn = _per_token_step
    eager_model, eager_opt = twin(model, opt)
    held = [(type(t), id(t)) for t in [*model.parameters(), *model.buffers()]]
    step = remat.compile(step_fn, model, opt, batch, memory_budget=0.7, profile_runs=1, measure=False)
    # Tracing swaps traced tensors into each slot once and back: not the trace's fake tensors left behind.
    assert [(type(t), id(t)) for t in [*model.parameters(), *model.buffers()]] == held
    assert model.word_embeddings.embedding.weight is model.backbone["embed"].embedding.weight
    result = check_against_eager(step_fn, eager_model, eager_opt, model, opt, step, batch, steps=3)
    assert result.match, result.summary()


def _seeding_step(seed_inside):
    def step(model, optimizer, batch):
        with seed_inside():
            return _checkpointed_step(model, optimizer, batch)

    return step


@pytest.mark.parametrize(
    "seed_inside,message",
    [
        (lambda: contextlib.nullcontext(torch.manual_seed(0)), r"calls torch.manual_seed\(\)"),
        (torch.random.fork_rng, r"calls torch.set_rng_state\(\) \(torch.random.fork_rng does when it ends\)"),
        (lambda: contextlib.nullcontext(torch.default_generator.manual_seed(5)), r"changes the random-number generator's state"),
    ],
)
def test_a_step_that_sets_the_generators_state_is_refused(seed_inside, message):
    """Done once while tracing and absent from the graph, it would leave the graph's dropout
    masks, and the generator after each step, different from eager's without an error."""
    import remat

    model = _Checkpointed(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))}
    setters = [torch.manual_seed, torch.random.manual_seed, torch.set_rng_state, torch.random.set_rng_state]
    with pytest.raises(CaptureError, match=message):
        remat.compile(_seeding_step(seed_inside), model, opt, batch, memory_budget=None, profile_runs=1, measure=False)
    assert setters == [torch.manual_seed, torch.random.manual_seed, torch.set_rng_state, torch.random.set_rng_state]


_NUMPY_RNG = None


def _drawing_step(draw, checked=False):
    def step(model, opt, batch):
        opt.zero_grad()
        loss = model(batch).square().mean() * draw()  # a mixup coefficient drawn on the host
        if checked == "with-a-value-check":  # one of its traces fails after the draw
            assert torch.isfinite(loss)
        if checked == "then-masked-by-it":  # the trace fails on the draw's use (SpecAugment's masks)
            loss = loss + model(batch)[torch.tensor([draw() < 0.5, draw() < 0.5])].sum()
        loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.parametrize(
    "draw,message",
    [(lambda: random.random(), r"draws from Python's random module"), (lambda: np.random.beta(0.4, 0.4), r"draws from numpy's global generator"),
     (lambda: _NUMPY_RNG.random(), r"draws from global _NUMPY_RNG")],
)  # fmt: skip
@pytest.mark.parametrize("checked", ["plain", "with-a-value-check", "then-masked-by-it"])
def test_a_draw_from_pythons_or_numpys_generator_in_the_step_is_refused_and_their_states_put_back(draw, message, checked):
    # Drawn once while tracing, it would be the same number at every step, with no error.
    global _NUMPY_RNG
    _NUMPY_RNG = np.random.default_rng(0)
    states = random.getstate(), np.random.get_state()[1].copy(), _NUMPY_RNG.bit_generator.state
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=message):
        capture(_drawing_step(draw, checked), model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    assert _NUMPY_RNG.bit_generator.state == states[2]


@pytest.mark.parametrize("of", ["output", "batch"])
def test_a_numpy_array_made_in_the_step_is_refused_saying_to_do_that_work_with_torch_ops(of):
    # A host computation on the step's values (a scipy matching) would run once, at capture.
    def step(model, opt, batch):
        opt.zero_grad()
        out = model(batch)
        picked = int((out if of == "output" else batch).detach().numpy().argmax())
        loss = out.flatten()[picked] + out.square().mean()
        loss.backward()
        opt.step()
        return loss

    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=r"makes a numpy array of a tensor \(\.numpy\(\)\), at test_capture.py.*with torch ops"):
        capture(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))


def test_a_checkpoint_saved_inside_the_step_is_refused_saying_to_save_in_the_loop(tmp_path):
    def step(model, opt, batch):
        loss = _stepping(model, opt, batch)
        torch.save(model.state_dict(), tmp_path / "last.pt")
        return loss

    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=r"saves with torch.save, at test_capture.py.*Save outside train_step: in the loop"):
        capture(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    assert not (tmp_path / "last.pt").exists()


def test_mixup_drawn_with_torchs_generator_trains_bitwise():
    import remat

    def mixup(model, opt, batch):
        opt.zero_grad()
        lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4), validate_args=False).sample()
        mixed = lam * batch + (1 - lam) * batch[torch.randperm(batch.shape[0])]
        loss = model(mixed).square().mean()
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(mixup, model, opt, torch.randn(8, 4), memory_budget=None, profile_runs=1, measure=False)
    result = check_against_eager(mixup, eager_model, eager_opt, model, opt, step, torch.randn(8, 4), steps=3)
    assert result.match, result.summary()


def _metric_step(mean, accuracy):
    """A step that updates torchmetrics metrics it closes over (each side of a comparison its own)."""

    def step(model, opt, batch):
        opt.zero_grad()
        logits = model(batch["x"])
        loss = torch.nn.functional.cross_entropy(logits, batch["y"])
        loss.backward()
        opt.step()
        mean.update(loss.detach())
        accuracy.update(logits.argmax(-1), batch["y"])
        return loss

    return step


def test_torchmetrics_updated_in_the_step_is_refused_naming_its_checks_and_trains_bitwise_with_them_off():
    torchmetrics = pytest.importorskip("torchmetrics")

    def metrics(checks: bool):
        mean = torchmetrics.MeanMetric() if checks else torchmetrics.MeanMetric(nan_strategy="disable")
        return mean, torchmetrics.Accuracy(task="multiclass", num_classes=4, validate_args=checks)

    torch.manual_seed(0)
    batches = [{"x": torch.randn(16, 8), "y": torch.randint(0, 4, (16,))} for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (mean, accuracy), (checked_mean, checked_accuracy) = metrics(checks=False), metrics(checks=True)
    # the NaN check's branch (MeanMetric); the label check's count of unique values (Accuracy)
    for with_checks in ((checked_mean, accuracy), (mean, checked_accuracy)):
        with pytest.raises(CaptureError, match="torchmetrics metric .*nan_strategy='disable'.*validate_args=False"):
            remat.compile(_metric_step(*with_checks), model, opt, batches[0], memory_budget=None, profile_runs=1, measure=False)

    eager_model, eager_opt = twin(model, opt)
    eager_metrics, remat_metrics = metrics(checks=False), metrics(checks=False)
    step = remat.compile(_metric_step(*remat_metrics), model, opt, batches[0], memory_budget=None, profile_runs=1, measure=False)
    for batch in batches:
        assert torch.equal(step(batch), _metric_step(*eager_metrics)(eager_model, eager_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    for ours, eagers in zip(remat_metrics, eager_metrics, strict=True):
        assert torch.equal(ours.compute(), eagers.compute())
    assert remat_metrics[1].compute() > 0 and len(step._graphs) == 1


def test_macro_averaged_torchmetrics_updated_from_logits_train_bitwise_with_their_checks_off():
    """A macro average counts each class with a bincount of `num_classes ** 2` bins over
    target * num_classes + prediction: values the model makes, their bins fixed at minlength."""
    torchmetrics = pytest.importorskip("torchmetrics")

    def metrics():
        return [
            torchmetrics.classification.MulticlassAccuracy(num_classes=4, validate_args=False),
            torchmetrics.classification.MulticlassF1Score(num_classes=4, average="macro", validate_args=False),
        ]

    def metric_step(ms):
        def step(model, opt, batch):
            opt.zero_grad()
            logits = model(batch["x"])
            loss = torch.nn.functional.cross_entropy(logits, batch["y"])
            loss.backward()
            opt.step()
            for m in ms:
                m.update(logits.detach(), batch["y"])
            return loss

        return step

    torch.manual_seed(0)
    batches = [{"x": torch.randn(16, 8), "y": torch.randint(0, 4, (16,))} for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model, eager_opt = twin(model, opt)
    ours, eagers = metrics(), metrics()
    step = remat.compile(metric_step(ours), model, opt, batches[0], memory_budget=None, profile_runs=1, measure=False)
    for batch in batches:
        assert torch.equal(step(batch), metric_step(eagers)(eager_model, eager_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    for a, b in zip(ours, eagers, strict=True):
        assert torch.equal(a.compute(), b.compute()) and a.compute() > 0
    assert len(step._graphs) == 1


def test_a_transformer_given_a_mask_not_said_to_be_causal_is_refused_where_its_values_are_not_known():
    """nn.TransformerDecoder compares a tgt_mask with a causal mask where tgt_is_causal is
    not given. A mask the step makes from Python numbers is a constant whose comparison the
    trace knows, and one in the batch decides the branch as the example batch does (checked
    at every call): both train bitwise, told or not. One the step reads from elsewhere (a
    tensor it closes over) is refused naming the argument, which then trains bitwise."""
    torch.manual_seed(0)
    decoder = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, batch_first=True), 1)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    batches = [{"x": torch.randn(4, 6, 16), "memory": torch.randn(4, 5, 16), "mask": causal} for _ in range(3)]

    held = causal.clone()

    def decoding(told: bool, made: str):
        def step(model, opt, batch):
            opt.zero_grad()
            mask = {"made": lambda: torch.nn.Transformer.generate_square_subsequent_mask(batch["x"].shape[1]), "batch": lambda: batch["mask"],
                    "held": lambda: held}[made]()
            extra = {"tgt_is_causal": True} if told else {}
            loss = model(batch["x"], batch["memory"], tgt_mask=mask, **extra).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    opt = torch.optim.SGD(decoder.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match="without being told whether it is causal.*tgt_is_causal=True"):
        remat.compile(decoding(told=False, made="held"), decoder, opt, batches[0], profile_runs=1, measure=False)
    for told, made in ((True, "held"), (False, "made"), (False, "batch")):
        model, o = twin(decoder, opt)
        eager_model, eager_opt = twin(decoder, opt)
        step = remat.compile(decoding(told, made), model, o, batches[0], memory_budget=0.9, profile_runs=1, measure=False)
        for i, batch in enumerate(batches):
            torch.manual_seed(i)  # the same dropout draws on both sides
            ours = step(batch)
            torch.manual_seed(i)
            assert torch.equal(ours, decoding(told=False, made=made)(eager_model, eager_opt, batch))  # eager detects it causal
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


def _mixup_of_the_batch(model, opt, batch):
    opt.zero_grad()
    lam = batch["lam"]
    mixed = lam * batch["x"] + (1 - lam) * batch["x"].flip(0)
    loss = model(mixed).square().mean() * (1 - lam) ** 2
    loss.backward()
    opt.step()
    return loss, lam / 2


def test_a_float_of_the_batch_is_read_at_every_call_bitwise_in_one_graph():
    # The numpy refusal's advice: draw in the loop, pass the number in the batch.
    import remat

    rng = np.random.default_rng(0)
    batches = [{"x": torch.randn(8, 4), "lam": float(rng.beta(0.4, 0.4))} for _ in range(4)]
    batches[2]["lam"] = np.float64(batches[2]["lam"])  # numpy's scalars are floats too
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_mixup_of_the_batch, model, opt, batches[0], memory_budget=None, profile_runs=1, measure=False)
    for batch in batches:
        (loss, half), (eager_loss, eager_half) = step(batch), _mixup_of_the_batch(eager_model, eager_opt, batch)
        assert torch.equal(loss, eager_loss) and half == eager_half
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    assert len(step._graphs) == 1


@pytest.mark.parametrize("use,words", [
    (lambda w: 1.0 if w > 0.5 else 2.0, r"needs batch\['w'\], a float of the batch, as a fixed value, at test_capture\.py"),
    (lambda w: np.sqrt(w), r"uses batch\['w'\] \(floats of the batch\) where a number that changes .*TypeError.*Compute that use outside"),
])
def test_a_use_of_a_batch_float_that_needs_its_value_is_refused_by_name(use, words):
    def step(model, opt, batch):
        loss = model(batch["x"]).square().mean() * use(batch["w"])
        loss.backward()
        return loss

    with pytest.raises(CaptureError, match=words):  # named among the batch's floats
        capture(step, torch.nn.Linear(4, 4), None, {"x": torch.randn(2, 4), "v": 0.1, "w": 0.7})


class _Annealed(torch.nn.Module):
    """A loss weight warmed up from a Python counter the forward increments."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * min(1.0, self.calls / 10)


_GLOBAL_CALLS = 0


def _counting_step(model, opt, batch):
    global _GLOBAL_CALLS
    _GLOBAL_CALLS += 1
    return _step(model, opt, batch * _GLOBAL_CALLS)


def _closure_counting_step():
    calls = 0

    def step(model, opt, batch):
        nonlocal calls
        calls += 1
        return _step(model, opt, batch * calls)

    return step


class _CountsInAList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.counts = [0]

    def forward(self, x):
        self.counts[0] += 1
        return self.lin(x) * (1 + self.counts[0])


_LOSSES: list = []


def _logging_step(model, opt, batch):
    loss = _step(model, opt, batch)
    _LOSSES.append(loss.item())  # appended after each run (capture.state.logged_numbers)
    return loss


class _LogsInTheModel(torch.nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.log = []


def _logging_into_the_model_step(model, opt, batch):
    loss = _step(model, opt, batch)
    model.log.append(loss.item())  # a traced placeholder at capture: computed by the graph, appended after each run
    model.log.append(loss.detach())
    return loss


def test_what_the_step_logs_into_a_modules_list_is_appended_after_each_run_as_eager_does():
    m = _LogsInTheModel()
    eager = copy.deepcopy(m)
    opt, eager_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    step = remat.compile(_logging_into_the_model_step, m, opt, torch.randn(2, 4), memory_budget=None)
    assert m.log == []
    for batch in torch.randn(3, 2, 4):
        assert torch.equal(step(batch), _logging_into_the_model_step(eager, eager_opt, batch))
    assert [type(v) for v in m.log] == [float, torch.Tensor] * 3
    assert all(a == b if isinstance(a, float) else torch.equal(a, b) for a, b in zip(m.log, eager.log, strict=True))


def test_a_list_in_a_module_that_the_step_changes_is_refused_by_name_and_left_as_it_was():
    m = _CountsInAList()
    counts = m.counts
    with pytest.raises(CaptureError, match=r"changed model\.counts while it was traced \(list\.__setitem__\)"):
        capture(_step, m, None, torch.randn(2, 4))
    assert m.counts is counts and counts == [0]


def _closure_dict_step():
    state = {"seen": 0}

    def step(model, opt, batch):
        state["seen"] += 1
        return _step(model, opt, batch * state["seen"])

    return step, state


_CLOSURE_STEP, _CLOSURE_STATE = _closure_dict_step()


class _Trainer:
    """A trainer whose method is the step, counting its steps for a warm-up."""

    def __init__(self):
        self.steps = 0

    def step(self, model, opt, batch):
        self.steps += 1
        return _step(model, opt, batch * min(1.0, self.steps / 10))


_TRAINER = _Trainer()


@dataclasses.dataclass
class _Schedule:
    weight: float = 1.0


@dataclasses.dataclass
class _Config:
    schedule: _Schedule


_CONFIG = _Config(_Schedule())


def _config_step(model, opt, batch):
    _CONFIG.schedule.weight *= 0.5  # a field of an object in a field
    return _step(model, opt, batch * _CONFIG.schedule.weight)


def test_a_float_the_step_scales_is_read_at_every_call_and_set_after_each_run_the_state_put_back():
    # Traced once, the step would repeat its first value at every call, silently: the float is
    # an input instead, and what the step computes from it is set there after each run.
    tg = capture(_config_step, torch.nn.Linear(4, 4), None, torch.randn(2, 4))
    assert [i.name for i in tg.inputs if i.kind is InputKind.NUMBER] == ["global _CONFIG.schedule.weight"]
    assert _CONFIG.schedule.weight == 1.0  # compiling changes nothing
    model = torch.nn.Linear(4, 4)
    step, batch = remat.compile(_config_step, model, None, torch.randn(2, 4), profile_runs=1, measure=False), torch.randn(2, 4)
    for i in range(3):
        loss = step(batch)
        with torch.no_grad():  # no optimizer: the model stays as it is, only the weight moves
            assert torch.equal(loss, model(batch * 0.5 ** (i + 1)).pow(2).mean())
        assert _CONFIG.schedule.weight == 0.5 ** (i + 1)
    _CONFIG.schedule.weight = 1.0


@pytest.mark.parametrize(
    "model,step,name",
    [(_Annealed, _step, "model.calls"), (lambda: torch.nn.Linear(4, 4), _counting_step, "global _GLOBAL_CALLS"),
     (lambda: torch.nn.Linear(4, 4), _closure_counting_step(), "calls (from the closure of step)"),
     (lambda: torch.nn.Linear(4, 4), _TRAINER.step, "_Trainer.steps"),
     (lambda: torch.nn.Linear(4, 4), _CLOSURE_STEP, "state['seen'] (from the closure of step)")],
)  # fmt: skip
def test_an_int_the_step_counts_up_and_computes_with_is_an_input_counted_after_each_run_the_state_put_back(model, step, name):
    # In a module, a global, a closure, a trainer's field or a dict: read at every call
    # (read_numbers), and what the step added to it added again after each run.
    m = model()
    tg = capture(step, m, None, torch.randn(2, 4))
    assert [i.name for i in tg.inputs if i.kind is InputKind.NUMBER] == [name]
    assert [u.terms for u in tg.call.state_updates if isinstance(u, KeptNumber) and u.slot.name == name] == [(Term.SLOT, 1)]
    assert _GLOBAL_CALLS == 0 and getattr(m, "calls", 0) == 0  # compiling changes nothing
    assert _LOSSES == [] and _CLOSURE_STATE == {"seen": 0} and _TRAINER.steps == 0


class _KeepsItsOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        self.last_outputs = [y.detach()]  # in a new list: graph outputs, set after each run
        return y


def _stepping(model, opt, batch):
    opt.zero_grad()
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


class _KeepingTrainer:
    def step(self, model, opt, batch):
        loss = _stepping(model, opt, batch)
        self.last_losses = [loss.detach()]
        return loss


_LAST = None
_STATE = {"hidden": (torch.zeros(2, 4), torch.zeros(2, 4))}  # an RNN's state carried from step to step


def _global_keeping_step(model, opt, batch):
    global _LAST
    loss = _stepping(model, opt, batch)
    _LAST = {"loss": loss.detach()}
    return loss


def _carrying_step(model, opt, batch):
    h, c = _STATE["hidden"]
    opt.zero_grad()
    out = model(batch + h)
    loss = (out * c.tanh()).square().mean() + out.square().mean()
    loss.backward()
    opt.step()
    _STATE["hidden"] = (out.detach(), (c + out).detach())
    return loss


_KEEPING_TRAINER = _KeepingTrainer()


@pytest.mark.parametrize(
    "model,step,kept",
    [(_KeepsItsOutput, _stepping, lambda m: m.last_outputs), (lambda: torch.nn.Linear(4, 4), _KEEPING_TRAINER.step, lambda m: _KEEPING_TRAINER.last_losses),
     (lambda: torch.nn.Linear(4, 4), _global_keeping_step, lambda m: _LAST), (lambda: torch.nn.Linear(4, 4), _carrying_step, lambda m: _STATE["hidden"])],
)  # fmt: skip
def test_a_tuple_list_or_dict_of_tensors_the_step_keeps_in_python_state_is_each_steps_as_in_eager(model, step, kept):
    import remat

    global _LAST
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eager_model, eager_opt = twin(m, opt)
    before = copy.deepcopy(_STATE)
    compiled = remat.compile(step, m, opt, torch.randn(2, 4), profile_runs=1, measure=False)
    assert not hasattr(m, "last_outputs") and _LAST is None and not hasattr(_KEEPING_TRAINER, "last_losses")  # compiling changes nothing
    assert all(torch.equal(a, b) for a, b in zip(_STATE["hidden"], before["hidden"]))
    for _ in range(3):
        batch = torch.randn(2, 4)
        eager_loss = step(eager_model, eager_opt, batch)
        eager_kept = copy.deepcopy(kept(eager_model))
        if step is _carrying_step:
            _STATE["hidden"] = before["hidden"]  # the compiled step carries on from where eager's did
        assert torch.equal(compiled(batch), eager_loss)
        assert type(kept(m)) is type(eager_kept) and all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(kept(m)), pytree.tree_leaves(eager_kept)))
        before = {"hidden": eager_kept} if step is _carrying_step else before
    _LAST = None
    _STATE["hidden"] = (torch.zeros(2, 4), torch.zeros(2, 4))
    vars(_KEEPING_TRAINER).pop("last_losses", None)


def _mixed_keeping_step(model, opt, batch):
    global _LAST
    loss = _stepping(model, opt, batch)
    _LAST = (loss.detach(), model.weight) if _MIXED == "parameter" else (loss.detach(), 3)
    return loss


@pytest.mark.parametrize("mixed", ["parameter", "number"])
def test_a_tuple_of_a_computed_tensor_and_anything_else_kept_in_python_state_is_refused_and_put_back(mixed):
    # No graph output gives the parameter or the number beside the step's tensor.
    global _MIXED
    _MIXED = mixed
    with pytest.raises(CaptureError, match=r"kept a tensor \(or a number computed from one\) in Python state: global _LAST\. .* Return it from train_step"):
        model = torch.nn.Linear(4, 4)
        capture(_mixed_keeping_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    assert _LAST is None


_HOLDERS = [types.SimpleNamespace(scale=torch.ones(4))]  # the user's object inside a list: searched
_PRIOR = torch.distributions.Normal(torch.zeros(4), torch.ones(4))  # a library's object in a global: its tensor fields searched
_PRIORS = [torch.distributions.Normal(torch.zeros(4), torch.ones(4))]  # a library's object inside a list: not searched


def test_a_tensor_held_where_remat_does_not_look_is_refused_naming_where_it_looks():
    def step(m, o, b):
        m.zero_grad()
        loss = (m(b) * _PRIORS[0].scale).sum()
        loss.backward()
        return loss

    with pytest.raises(CaptureError, match=r"uses a tensor of shape \(4,\) that is not the model's.*not held where remat looks.*_PRIORS\[0\]\.scale"):
        capture(step, torch.nn.Linear(4, 4), None, torch.randn(2, 4))

    def held_by_a_library_object(m, o, b):
        m.zero_grad()
        loss = (m(b) * _PRIOR.scale).sum()
        loss.backward()
        return loss

    tg = capture(held_by_a_library_object, torch.nn.Linear(4, 4), None, torch.randn(2, 4))
    assert [o.locations[0].get() for o in tg.call.outside.values()] == [_PRIOR.scale]

    def held_in_a_list(m, o, b):
        m.zero_grad()
        loss = (m(b) * _HOLDERS[0].scale).sum()
        loss.backward()
        return loss

    tg = capture(held_in_a_list, torch.nn.Linear(4, 4), None, torch.randn(2, 4))
    assert [o.locations[0].get() for o in tg.call.outside.values()] == [_HOLDERS[0].scale]


def _logging_sgd_step(model, opt, batch):
    opt.zero_grad()
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    _LOSSES.append(loss.item())
    _LOSSES.append(opt.param_groups[0]["lr"])
    return loss


def test_numbers_the_step_logs_into_a_list_are_appended_at_every_call_as_eager_appends_them():
    """`losses.append(loss.item())`: computed in the graph, appended after each run, to the
    list the global holds then (a new one per epoch); the list is not part of the key."""
    import remat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(model, opt)
    batch = torch.randn(32, 16)
    step = remat.compile(_logging_sgd_step, model, opt, batch, memory_budget=1.0, profile_runs=1)
    assert _LOSSES == []  # nothing appended while compiling
    eager_log, remat_log = [], []
    try:
        for i in range(4):
            if i == 2:
                globals()["_LOSSES"] = []  # a new epoch's list
                for o in (opt, eager_opt):
                    o.param_groups[0]["lr"] = 0.05
            _logging_sgd_step(eager_model, eager_opt, batch)
            eager_log += _LOSSES[-2:]
            del _LOSSES[-2:]
            step(batch)
            remat_log += _LOSSES[-2:]
        assert remat_log == eager_log and _LOSSES == eager_log[4:] and len(step._graphs) == 1
        assert [type(v) for v in remat_log] == [float] * 8 and eager_log[5] == 0.05
    finally:
        globals()["_LOSSES"] = []


def _reads_its_log(model, opt, batch):
    loss = _step(model, opt, batch)
    _LOSSES.append(loss.item())
    return loss * (1.0 if len(_LOSSES) < 100 else 0.5)


def _logs_a_parameter(model, opt, batch):
    loss = _step(model, opt, batch)
    _LOSSES.append(model.weight)  # eager's list would hold the parameter itself, not a value the graph computes
    return loss


def _trims_its_log(model, opt, batch):
    loss = _step(model, opt, batch)
    _LOSSES.append(loss.item())
    _LOSSES.pop(0) if len(_LOSSES) > 10 else None
    return loss


@pytest.mark.parametrize(
    "step,message",
    [(_reads_its_log, r"reads global _LOSSES \(list\.__len__\), a list it also logs numbers to"),
     (_logs_a_parameter, r"appends a tensor the step did not compute \(a parameter, the batch\) to global _LOSSES"),
     (_trims_its_log, r"reads global _LOSSES \(list\.__len__\)")],
)  # fmt: skip
def test_a_log_the_trace_cannot_repeat_is_refused_and_left_as_it_was(step, message):
    with pytest.raises(CaptureError, match=message):
        capture(step, torch.nn.Linear(4, 4), None, torch.randn(2, 4))
    assert _LOSSES == []


class _ScriptedInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("scripted_whole", [False, True])
def test_a_torchscript_module_trains_bitwise(scripted_whole):
    """A scripted module's tables of parameters and submodules are torch.jit's own mappings,
    not dicts: the checks at each call read them as mappings."""
    import remat

    def made():
        torch.manual_seed(0)
        return torch.jit.script(_ScriptedInside()) if scripted_whole else _ScriptedInside()

    model, eager_model = made(), made()
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    batches = [{"x": torch.randn(32, 16), "y": torch.randint(0, 5, (32,))} for _ in range(3)]

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return loss

    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=None, profile_runs=1)
    for batch in batches:
        assert torch.equal(step(batch), step_fn(eager_model, eager_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


class _Gan(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.D = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 1))


def _critic_step(model, optimizers, batch):
    """WGAN-GP's critic step: the generator's output detached (its parameters get no
    gradient, and keep none), a gradient penalty through autograd.grad(create_graph=True)."""
    _, opt_d = optimizers
    real, z = batch
    opt_d.zero_grad()
    fake = model.G(z).detach()
    alpha = torch.rand(real.shape[0], 1)
    mix = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(model.D(mix).sum(), mix, create_graph=True)
    loss = model.D(fake).mean() - model.D(real).mean() + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss.backward()
    opt_d.step()
    return loss


def test_a_step_whose_loss_reaches_some_parameters_and_penalises_a_gradient_trains_bitwise():
    """The generator's parameters, which this step's loss does not reach, are not taken for
    gradients accumulated across calls (they were: the check presets every gradient and
    counted one that only flowed to the graph's output as read)."""
    import remat

    model, eager_model = _Gan(), _Gan()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.9)) for m in (model.G, model.D)]
    eager_opts = [torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.9)) for m in (eager_model.G, eager_model.D)]
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(64, 32, generator=g), torch.randn(64, 16, generator=g)) for _ in range(3)]
    step = remat.compile(_critic_step, model, opts, batches[0], memory_budget=0.9, profile_runs=1)
    for i, batch in enumerate(batches):
        torch.manual_seed(i)
        loss = step(batch)
        torch.manual_seed(i)
        assert torch.equal(loss, _critic_step(eager_model, eager_opts, batch))
    assert step.report.num_recomputed > 0 and step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    assert all(p.grad is None for p in model.G.parameters())


def test_a_step_clearing_every_gradient_before_backward_is_traced_once_and_one_that_does_not_twice(monkeypatch):
    """Where zero_grad() cleared every trainable gradient before the first backward, the step
    starts from no gradients whatever the step before left: no second trace with them preset.
    Otherwise the second trace tells whether backward would add to them (accumulation across calls)."""
    import importlib

    capture_module = importlib.import_module("remat.capture.capture")

    traces = []
    real = capture_module._trace
    monkeypatch.setattr(capture_module, "_trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_clearing(when):  # "first", "last" or "never"
        def step(m, o, b):
            if when == "first":
                o.zero_grad()
            loss = m(b).sum()
            loss.backward()
            o.step()
            if when == "last":
                o.zero_grad()
            return loss

        return step

    capture(step_clearing("first"), model, opt, torch.randn(2, 4))
    assert len(traces) == 1
    capture(step_clearing("last"), model, opt, torch.randn(2, 4))
    assert len(traces) == 2  # nothing stays set after it: no preset trace either
    traces.clear()
    assert capture(step_clearing("never"), model, opt, torch.randn(2, 4)).call.accumulates
    assert len(traces) == 2


@pytest.mark.parametrize("torch_trace", [False, True], ids=["quiet", "TORCH_TRACE set"])
def test_torchs_structured_trace_log_is_quiet_while_tracing_unless_torch_trace_is_set(monkeypatch, torch_trace):
    """torch logs a record with its stack for each symbolic float the trace specializes (the
    optimizer's hyperparameters); a handler on its structured trace log (pytest's capture)
    formatting them doubled a trace's time. Without TORCH_TRACE the log has no handlers while
    remat traces, and has them back after."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("torch.__trace")
    log.addHandler(handler)
    if torch_trace:
        monkeypatch.setenv("TORCH_TRACE", "/nonexistent-remat-test")
    else:
        monkeypatch.delenv("TORCH_TRACE", raising=False)
    try:
        spec = build_model("mlp-deep", 4)
        capture(make_train_step(spec.loss_fn), spec.model, make_optimizer("adamw", spec.model.parameters()), spec.batch)
        attached_after = handler in log.handlers
    finally:
        log.removeHandler(handler)
    assert bool(records) == torch_trace, len(records)  # the records are there to be silenced
    assert attached_after


def test_torchs_lines_are_not_named_as_the_users_where_its_packages_are_reached_through_a_symlink(tmp_path) -> None:
    """A virtual environment reached through a symlink: torch's frames resolve to another
    path than the one it was imported from, and were named as the user's line."""
    import os
    import pathlib
    import subprocess
    import sys

    site = pathlib.Path(torch.__file__).resolve().parents[1]
    (tmp_path / "site").symlink_to(site)
    code = (
        "import torch, traceback; from remat.capture import trace_checks\n"
        "frame = traceback.FrameSummary(torch.__file__.replace('__init__.py', 'nn/functional.py'), 1, 'f', line='x')\n"
        "assert '/site/torch/' in frame.filename, frame.filename\n"
        "print(repr(trace_checks.where_in_frames([frame])))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{pathlib.Path(remat.__file__).resolve().parents[1]}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "''"


def test_a_lazy_module_not_yet_run_is_refused_naming_its_parameter_and_trains_after_a_first_forward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))

    def step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(CaptureError, match=r"the model's 0.weight is not initialized yet .* run the model once on an example batch"):
        remat.compile(step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    model(batch[0])  # the advice
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    compiled = remat.compile(step, model, opt, batch)
    for _ in range(2):
        assert torch.equal(compiled(batch), step(eager_model, eager_opt, batch))


def _reads_the_loops_count(model, opt, batch):
    opt.zero_grad()
    loss = model(batch).sum() * (_COUNT_SET_BY_THE_LOOP + 1)  # noqa: F821 - the loop sets it after compiling
    loss.backward()
    opt.step()
    return loss


def test_a_global_the_loop_sets_only_after_compiling_is_named_saying_to_give_it_a_value_first():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match=r"NameError: name '_COUNT_SET_BY_THE_LOOP' is not defined.*give each global it reads a value before compiling"):
        remat.compile(_reads_the_loops_count, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4), memory_budget=None)
