"""Floats and ints the loop changes between steps: read at every call as graph inputs after
their first change (one more compile, then none for a float, one per side of each comparison
for an int), or constants of the graph where the step needs the value (a compile per value)."""

from __future__ import annotations

import importlib
import math
import os
import re
import warnings
from dataclasses import dataclass

import pytest
import torch

import remat
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model, make_optimizer
from remat.capture.train_graph import InputKind


@dataclass
class _Settings:
    aux_weight: float = 0.0
    threshold: float = 0.0


SETTINGS = _Settings()


def _step_with(loss_of):
    """A training step on bert-tiny's masked-LM output whose loss is `loss_of(out)`."""

    def step(model, opt, batch):
        opt.zero_grad()
        loss = loss_of(model(**batch))
        loss.backward()
        opt.step()
        return loss

    return step


def _with_aux(out):
    """The loss plus an auxiliary term whose weight the loop anneals (a KL or a
    load-balancing weight), as a user writes it."""
    return out.loss + SETTINGS.aux_weight * out.logits.float().pow(2).mean()


def _switched(out):
    """An auxiliary term the loop switches off with a zero weight: a branch on the sign."""
    return _with_aux(out) if SETTINGS.aux_weight > 0 else out.loss


def _branching(out):
    # A branch on the float beyond its sign: the graph can only hold one side.
    return out.loss + out.logits.float().abs().mean() if SETTINGS.threshold > 0.15 else out.loss


def _as_tensor(out):
    return out.loss * torch.tensor(1.0 + SETTINGS.aux_weight)  # made in the graph from the float read


_annealed_step = _step_with(_with_aux)
_switched_step = _step_with(_switched)
_branching_step = _step_with(_branching)
_as_tensor_step = _step_with(_as_tensor)


def _compiled(step, budget):
    spec = build_model("bert-tiny", 4)
    opt = make_optimizer("adamw", spec.model.parameters(), foreach=True)  # multi-tensor: a few ops to trace, not ~8 a parameter
    model, o = twin(spec.model, opt)
    eager_model, eager_opt = twin(spec.model, opt)
    compiled = remat.compile(step, model, o, spec.batch, memory_budget=budget, profile_runs=1)
    return compiled, model, o, eager_model, eager_opt, spec.batch


@pytest.fixture(autouse=True)
def _settings_put_back():
    yield
    SETTINGS.aux_weight, SETTINGS.threshold = 0.0, 0.0


def test_a_weight_annealed_at_every_step_compiles_once_more_and_trains_bitwise_under_a_plan(monkeypatch):
    compiled, model, o, eager_model, eager_opt, batch = _compiled(_annealed_step, 0.5)
    assert compiled.report.num_recomputed > 0
    compiles = []
    original = compiled._compile
    monkeypatch.setattr(compiled, "_compile", lambda b: compiles.append(1) or original(b))

    def anneal(i, m, opt):
        SETTINGS.aux_weight = 0.01 * (i + 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile is announced: the weight is not a constant any more
        result = check_against_eager(_annealed_step, eager_model, eager_opt, model, o, compiled, batch, steps=5, between_steps=anneal)
    assert result.match, result.summary()
    assert len(compiles) == 1 and len(compiled._graphs) == 1
    tg = compiled._last.tg
    assert [i.name for i in tg.inputs if i.kind is InputKind.NUMBER] == ["global SETTINGS.aux_weight"]
    assert compiled.report.num_recomputed > 0
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes


def test_a_weight_compared_with_zero_keeps_its_sign_and_compiles_again_only_when_the_sign_changes(monkeypatch):
    compiled, model, o, eager_model, eager_opt, batch = _compiled(_switched_step, None)
    compiles = []
    original = compiled._compile
    monkeypatch.setattr(compiled, "_compile", lambda b: compiles.append(1) or original(b))

    def switch(i, m, opt):
        SETTINGS.aux_weight = [0.1, 0.2, 0.0, 0.3, 0.0, 0.0][i]  # the weight for step i + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = check_against_eager(_switched_step, eager_model, eager_opt, model, o, compiled, batch, steps=6, between_steps=switch)
    assert result.match, result.summary()
    # Positive (the first change: the weight becomes an input, its sign known), then zero
    # (a graph holding 0.0); 0.3 and the later zeros reuse those.
    assert len(compiles) == 2 and len(compiled._graphs) == 2
    assert compiled._keys.signed == {"global SETTINGS.aux_weight"} and not compiled._constant


def test_a_float_the_step_makes_a_tensor_of_is_read_at_every_call():
    """`torch.tensor(1.0 + weight)`: the tensor is made in the graph from the float read at
    every call, the same float32 rounding of the same double as eager's."""
    compiled, model, o, eager_model, eager_opt, batch = _compiled(_as_tensor_step, None)

    def anneal(i, m, opt):
        SETTINGS.aux_weight = 0.01 * (i + 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = check_against_eager(_as_tensor_step, eager_model, eager_opt, model, o, compiled, batch, steps=4, between_steps=anneal)
    assert result.match, result.summary()
    assert len(compiled._graphs) == 1 and compiled._last.tg.call.numbers


def test_a_float_the_step_branches_on_stays_a_constant_compiled_per_value():
    step = _branching_step
    compiled, model, o, eager_model, eager_opt, batch = _compiled(step, None)

    def change(i, m, opt):
        SETTINGS.threshold = SETTINGS.aux_weight = [0.2, 0.3, 0.2, 0.2][i]  # after step i

    with pytest.warns(UserWarning, match="changed since the step was compiled"):
        result = check_against_eager(step, eager_model, eager_opt, model, o, compiled, batch, steps=4, between_steps=change)
    assert result.match, result.summary()
    assert not compiled._last.tg.call.numbers and compiled._constant
    assert len(compiled._graphs) == 2  # 0.2 and 0.3 (0.0's was dropped when it was tried as an input); 0.2 again reuses its graph


def test_a_rate_lowered_on_every_layer_costs_a_few_traces_not_two_per_layer(monkeypatch):
    """Each nn.Dropout's `p` lowered between steps: what the first trace learns of one
    dropout's `p` (F.dropout checks its range, so it cannot be a symbol) is taken for all
    eight, and the step is compiled again once, bitwise."""
    capture_module = importlib.import_module("remat.capture.capture")

    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2))]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))
    batch = (torch.randn(8, 16), torch.randn(8, 1))

    def step(model, opt, b):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(b[0]), b[1])
        loss.backward()
        opt.step()
        return loss

    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    traces = []
    original = capture_module.make_fx
    monkeypatch.setattr(capture_module, "make_fx", lambda *a, **k: traces.append(1) or original(*a, **k))
    compiled = remat.compile(step, model, o, batch, profile_runs=1)

    def lower(i, m, opt):
        if i == 1:
            for module in m.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.1

    result = check_against_eager(step, eager_model, eager_opt, model, o, compiled, batch, steps=4, between_steps=lower)
    assert result.match, result.summary()
    # Every rate a constant of the graph (compiled per value; the first graph was dropped
    # when the rates were tried as inputs), found in at most three traces.
    assert compiled._constant == {f"model.{3 * i + 2}.p" for i in range(8)} and not compiled._last.tg.call.numbers
    assert len(compiled._graphs) == 1
    assert len(traces) <= 4, len(traces)  # one to compile, then at most three for the eight rates


def test_a_weight_in_a_closures_dict_beside_a_distributions_value_check_is_read_at_every_call():
    """A VAE's KL weight annealed in a dict the step reads through its closure, where the
    step also builds a `torch.distributions.Normal` (whose argument checks are checks of
    values the graph makes, decided by tracing again): those retraces keep the weight a
    graph input, so the step compiles once more and never again, quietly, bitwise."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    config = {"beta": 0.0}

    def step(model, opt, x):
        opt.zero_grad()
        mu, log_var = model(x).chunk(2, dim=-1)
        q = torch.distributions.Normal(mu, (0.5 * log_var).exp())
        kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(-1).mean()
        loss = (q.rsample() - x[:, :4]).pow(2).mean() + config["beta"] * kl
        loss.backward()
        opt.step()
        return loss

    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = torch.randn(8, 16)
    compiled = remat.compile(step, model, o, batch, profile_runs=1)

    def anneal(i, m, opt):
        config["beta"] = 0.25 * (i + 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile is announced: the weight is not a constant
        result = check_against_eager(step, eager_model, eager_opt, model, o, compiled, batch, steps=5, between_steps=anneal)
    assert result.match, result.summary()
    assert len(compiled._graphs) == 1 and not compiled._constant
    assert [i.name for i in compiled._last.tg.inputs if i.kind is InputKind.NUMBER] == ["config['beta'] (from the closure of step)"]


@dataclass
class _Loop:
    it: int = 0  # the iteration count a training loop keeps, read by the step


LOOP = _Loop()
_SCHEDULE = [0.5 + 0.1 * i for i in range(16)]


def _mlp_compiled(step, budget=None, steps=8, count=lambda i: i + 1):
    """An MLP with dropout trained by `step` against eager for `steps` steps, the count set
    to `count(i)` after step i; the compiled step, with the compiles it made."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    LOOP.it = 0
    compiled = remat.compile(step, model, o, batch, memory_budget=budget, profile_runs=1)
    compiles = []
    original = compiled._compile
    compiled._compile = lambda b: compiles.append(LOOP.it) or original(b)

    def count_up(i, m, opt):
        LOOP.it = count(i)

    result = check_against_eager(step, eager_model, eager_opt, model, o, compiled, batch, steps=steps, between_steps=count_up)
    assert result.match, result.summary()
    return compiled, compiles


def _warmed_up(model, opt, batch):
    """A warm-up and an auxiliary term every third step, computed in the step from the count."""
    opt.zero_grad()
    out = model(batch[0])
    loss = torch.nn.functional.cross_entropy(out, batch[1]) * min(1.0, (LOOP.it + 1) / 4)
    if LOOP.it % 3 == 0:
        loss = loss + 0.1 * out.pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _accumulated(model, opt, batch):
    """Gradients accumulated over two calls, the update on every second, by the count."""
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) / 2
    loss.backward()
    if (LOOP.it + 1) % 2 == 0:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def test_an_iteration_count_the_step_compares_compiles_once_per_side_not_once_per_value():
    """The count read at every call as an int64 input: a graph for each side of the two
    comparisons the trace made (warming up or not, the third step or not), reused for every
    later value on that side, bitwise, with no warning of a constant changed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled, compiles = _mlp_compiled(_warmed_up, budget=0.9, steps=10)
    name = "global LOOP.it"
    taken = {(i.name, i.dtype) for g in compiled._graphs.values() for i in g.tg.inputs if i.kind is InputKind.NUMBER}
    assert taken == {(name, "int64")}  # warmed up and not a third step, the graph no longer takes it
    assert len(compiled._keys.conditions[name]) == 2 and name in compiled._read and name not in compiled._constant
    # 1: the count becomes an input (warming up, not a third step); 3: warmed up ((3 + 1) / 4
    # is not below 1), a third step; 4: warmed up, not a third step. 5 to 10 reuse those.
    assert compiles == [1, 3, 4], compiles
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes


def test_a_count_at_a_budget_its_input_does_not_fit_stays_constant_and_the_warning_names_the_budget_that_reads_it():
    """At a budget of the very peak the first graph reaches (the figure a refusal advises),
    the graph that reads the count takes one more input and has no plan: the count stays a
    constant, compiled per value, and the warning names the budget that reads it instead;
    at that budget it is read at every call."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    LOOP.it = 0
    with pytest.raises(remat.BudgetError) as refused:
        remat.compile(_warmed_up, net, torch.optim.AdamW(net.parameters()), batch, memory_budget=0.01, profile_runs=1)
    floor = refused.value.reach.best
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, compiles = _mlp_compiled(_warmed_up, budget=floor, steps=4)
    assert compiles == [1, 1, 2, 3] and "global LOOP.it" in compiled._constant  # read, refused; then a constant per value
    advised = {int(m) for w in caught for m in re.findall(r"Raise the budget to at least (\d+) bytes to have it read", str(w.message))}
    assert len(advised) == 1 and min(advised) > floor, [str(w.message) for w in caught]
    compiled, compiles = _mlp_compiled(_warmed_up, budget=min(advised), steps=6)
    assert compiles == [1, 3, 4] and "global LOOP.it" in compiled._read
    assert compiled.report.measured_peak_bytes <= min(advised)


def test_an_update_every_second_call_by_the_count_trains_as_eager_with_a_graph_per_side():
    compiled, compiles = _mlp_compiled(_accumulated, steps=8)
    assert len(compiles) <= 3, compiles  # the count an input, then each side with the gradients set
    assert len(compiled._keys.conditions["global LOOP.it"]) == 1


def _scheduled(model, opt, batch):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) * _SCHEDULE[LOOP.it]  # a list's index needs the value
    loss.backward()
    opt.step()
    return loss.detach()


def _sliced(model, opt, batch):
    opt.zero_grad()
    k = 6 + LOOP.it % 2  # a tensor's size needs the value
    loss = torch.nn.functional.cross_entropy(model(batch[0][:k]), batch[1][:k])
    loss.backward()
    opt.step()
    return loss.detach()


def _labelled(model, opt, batch):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    print(f"step {LOOP.it:03d}", loss.item())  # text needs the value
    return loss.detach()


@pytest.mark.parametrize("step", [_scheduled, _sliced, _labelled], ids=["index", "size", "text"])
def test_an_int_used_where_only_its_value_can_go_stays_a_constant_compiled_per_value(step, capsys):
    with pytest.warns(UserWarning, match="changed since the step was compiled"):
        compiled, compiles = _mlp_compiled(step, steps=4, count=lambda i: i % 2 + 1)  # 1, 2, 1, 2
    assert "global LOOP.it" in compiled._constant and not compiled._last.tg.call.numbers
    assert compiles == [1, 2], compiles  # 1 (tried as an input, left a constant), then 2; 1 and 2 again reuse theirs
    if step is _labelled:
        printed = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
        assert printed == ["000", "000", "001", "001", "002", "002", "001", "001"][: len(printed)] and len(printed) == 8


_PIPED_LOOP = """
import copy, torch, remat
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
eager_model = copy.deepcopy(model)
opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
it = 0

def train_step(model, opt, batch):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch), batch[:, :2]) * (it + 1)
    loss.backward()
    opt.step()
    return loss.detach()

batches = [torch.randn(4, 8) for _ in range(4)]
step = remat.compile(train_step, model, opt, batches[0])
same = True
for it, batch in enumerate(batches):
    same = same and torch.equal(step(batch), train_step(eager_model, eager_opt, batch))
print("bitwise", same, "graphs", len(step._graphs))
"""


def test_a_script_piped_to_python_has_its_loop_count_read_as_a_files_would():
    """Code with no file (`python -`, `python -c`, exec of a string) is the user's too: the
    globals it reads are watched, so the loop's count is read at every call, not held at the
    first step's value (which trained with the first step's count before, silently)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-"], input=_PIPED_LOOP, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-4:] == ["bitwise", "True", "graphs", "1"], done.stdout


def _cosine_rate(it: int, warmup: int = 3, decay: int = 8, top: float = 0.01, bottom: float = 0.001) -> float:
    """A warm-up then a cosine decay to a floor, as nanoGPT's get_lr computes it."""
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    if it > decay:
        return bottom
    return bottom + 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (top - bottom)


def _plain_step(model, opt, batch):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.detach()


def _rate_set_in_step(model, opt, batch):
    """The learning rate set in every param group from a count the step keeps, before the update."""
    for group in opt.param_groups:
        group["lr"] = _cosine_rate(model.iters)
    loss = _plain_step(model, opt, batch)
    model.iters += 1
    return loss


@pytest.mark.parametrize("kind", ["for-loop", "foreach", "fused"])
def test_a_rate_the_step_sets_in_its_param_groups_from_its_count_is_set_at_every_call_and_trains_as_eager(kind):
    """Through the warm-up, the decay and the floor: each step's update uses the rate the step
    computed, the group holds it after the call (compared with eager's, as the optimizer's
    state is), the updates still run in the backward pass, and a graph serves each branch
    of the schedule, not each step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    net.iters = 0
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, **flags)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = (torch.randn(512, 16), torch.randint(0, 4, (512,)))
    compiled = remat.compile(_rate_set_in_step, model, o, batch, memory_budget=0.9, profile_runs=1)
    result = check_against_eager(_rate_set_in_step, eager_model, eager_opt, model, o, compiled, batch, steps=11)
    assert result.match, result.summary()
    assert o.param_groups[0]["lr"] == _cosine_rate(10) and model.iters == eager_model.iters == 11
    assert len(compiled._graphs) <= 4, len(compiled._graphs)  # a graph per branch of the schedule
    assert compiled.report.plan.updates_in_backward and not compiled.report.plan.updates_note.startswith("0 of"), compiled.report.plan.updates_note


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_a_schedule_kept_as_a_numpy_array_set_in_the_groups_between_steps_is_read_at_every_call(foreach):
    """DINO's schedules: `lr_schedule[it]` and `wd_schedule[it]` are numpy float64s, numbers
    the update reads as it reads floats; one graph serves every step (a numpy number was a
    setting compared by value: the step was compiled again at every step)."""
    import numpy as np

    lr_schedule = 1e-6 + 0.5 * (5e-4 - 1e-6) * (1 + np.cos(np.pi * np.arange(8) / 8))
    wd_schedule = 0.4 + 0.5 * (0.04 - 0.4) * (1 + np.cos(np.pi * np.arange(8) / 8))

    def set_schedule(i, model, opt):
        for gi, group in enumerate(opt.param_groups):
            group["lr"] = lr_schedule[i + 1]
            if gi == 0:
                group["weight_decay"] = wd_schedule[i + 1]

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    groups = [{"params": [p for p in net.parameters() if p.ndim > 1]}, {"params": [p for p in net.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, foreach=foreach)
    set_schedule(-1, net, opt)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    compiled = remat.compile(_plain_step, model, o, batch, profile_runs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled again: a warning
        result = check_against_eager(_plain_step, eager_model, eager_opt, model, o, compiled, batch, steps=7, between_steps=set_schedule)
    assert result.match, result.summary()
    assert type(o.param_groups[0]["lr"]) is np.float64 and o.param_groups[0]["weight_decay"] == wd_schedule[7]
    assert len(compiled._graphs) == 1


_WEIGHT: object = 0.1


def _step_with_weight(model, opt, batch):
    opt.zero_grad()
    out = model(batch[0])
    loss = torch.nn.functional.cross_entropy(out, batch[1]) + _WEIGHT * 2 * out.pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_a_global_numpy_float32_the_loop_changes_is_held_by_value_with_advice_that_works():
    """`weight * 2` on a numpy float32 rounds to float32 in Python, which a graph reading it at
    every call would compute as a float64: each value is a graph (bitwise), and the warning
    says to set float(...); set so, one graph serves every step."""
    import numpy as np

    global _WEIGHT
    weights = np.linspace(0.1, 1.0, 8).astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    for convert, graphs in ((lambda w: w, 4), (float, 0)):

        def set_weight(i, model, opt, convert=convert):
            global _WEIGHT
            _WEIGHT = convert(weights[i + 1])

        _WEIGHT = convert(weights[0])
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, o = twin(net, opt)
        eager_model, eager_opt = twin(net, opt)
        compiled = remat.compile(_step_with_weight, model, o, batch, profile_runs=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = check_against_eager(_step_with_weight, eager_model, eager_opt, model, o, compiled, batch, steps=5, between_steps=set_weight)
        assert result.match, result.summary()
        again = [str(w.message) for w in caught if "compiled again" in str(w.message)]
        assert len(again) == graphs, again
        assert all("_WEIGHT is a numpy float" in m and "float(...)" in m for m in again), again[:1]


def test_a_rate_set_as_a_numpy_float32_is_refused_with_advice_that_works():
    """A float32 schedule (`np.linspace(...).astype(np.float32)`): eager's update computes
    with the rate in float32 (`lr / bias_correction` rounds to float32), remat's graph with
    Python floats, so it is refused, at capture and when set between steps, saying to set
    float(...); set so, one graph serves every step, bitwise. (Set between steps it failed
    with "not a float; compile a new step"; from the start it was held by value, and its
    arithmetic with the step count, read at every call, was a float64's: off by 1e-8 after
    five steps.)"""
    import numpy as np

    from remat.errors import CaptureError

    schedule = np.linspace(1e-3, 1e-4, 7).astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))

    def set_rate(i, model, opt):
        opt.param_groups[0]["lr"] = schedule[i + 1]

    model, o = twin(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    compiled = remat.compile(_plain_step, model, o, batch, memory_budget=0.8, profile_runs=1)
    compiled(batch)
    set_rate(0, model, o)
    with pytest.raises(CaptureError, match=r"numpy float32 rounds.*float\(\.\.\.\)"):
        compiled(batch)
    model, o = twin(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=np.float32(0.9)))
    with pytest.raises(CaptureError, match=r"\['momentum'\].*numpy float32"):
        remat.compile(_plain_step, model, o, batch)(batch)

    def set_float(i, model, opt):
        opt.param_groups[0]["lr"] = float(schedule[i + 1])

    opt = torch.optim.AdamW(net.parameters(), lr=float(schedule[0]))
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    compiled = remat.compile(_plain_step, model, o, batch, memory_budget=0.8, profile_runs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled again: a warning
        result = check_against_eager(_plain_step, eager_model, eager_opt, model, o, compiled, batch, steps=6, between_steps=set_float)
    assert result.match, result.summary()
    assert len(compiled._graphs) == 1


@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_the_rate_the_step_reads_and_decays_in_its_groups_is_a_float_as_in_eager(flags):
    """A fused kernel reads its rate from a tensor; the step's own code still reads a float
    there, before the update and after it (returned for logging, decayed by hand)."""

    def step(model, opt, batch):
        seen = opt.param_groups[0]["lr"]
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.9
        loss = _plain_step(model, opt, batch)
        return {"loss": loss, "lr before": seen, "lr after": opt.param_groups[0]["lr"]}

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, **flags)
    model, o = twin(net, opt)
    eager_model, eager_opt = twin(net, opt)
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    compiled = remat.compile(step, model, o, batch, profile_runs=1)
    for _ in range(3):
        ours, theirs = compiled(batch), step(eager_model, eager_opt, batch)
        assert type(ours["lr before"]) is type(ours["lr after"]) is float
        assert (ours["lr before"], ours["lr after"]) == (theirs["lr before"], theirs["lr after"]) and torch.equal(ours["loss"], theirs["loss"])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters())) and o.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]
