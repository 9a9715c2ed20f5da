"""What the user's loop does around the step takes effect exactly as in eager: schedulers
and hand-set hyperparameters, frozen parameters, extra outputs; what cannot be
followed is refused by name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remat
from remat.measurement.check import check_against_eager, twin
from remat.errors import CaptureError
from remat.models import ModelSpec, build_model, make_train_step, mse_loss

STEPS = 6


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _schedule(kind: str, opt: torch.optim.Optimizer):
    """A loop's per-step hook for this optimizer: what it does between steps."""
    if kind == "lambda-warmup":  # lr is 0 at the first step, as a linear warm-up from zero gives
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
        return lambda i, loss: sched.step()
    if kind == "onecycle":  # changes momentum (SGD) or betas (Adam) too
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
        return lambda i, loss: sched.step()
    if kind == "warmup-cosine":
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
        return lambda i, loss: sched.step()
    if kind == "plateau":
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
        return lambda i, loss: sched.step(loss)
    if kind == "hand":

        def edit(i, loss):
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.7 + 1e-4 * i
                if "weight_decay" in g:
                    g["weight_decay"] = g["weight_decay"] * 1.1
                if "betas" in g:
                    g["betas"] = (0.9 - 0.02 * i, 0.999 - 1e-4 * i)
                if "momentum" in g:
                    g["momentum"] = 0.9 - 0.05 * i
                g["eps"] = 1e-8 * (i + 1) if "eps" in g else None
                if g["eps"] is None:
                    del g["eps"]

        return edit
    raise ValueError(kind)


def _check_loop(spec, opt, kind: str, budget: float = 0.85) -> None:
    step_fn = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    hooks = {id(eager_opt): _schedule(kind, eager_opt), id(o): _schedule(kind, o)}

    def between(i, m, optimizer):
        hooks[id(optimizer)](i, 1.0)  # a metric that never improves: the plateau scheduler cuts lr at every step

    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=budget, profile_runs=1, measure=False)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=STEPS, between_steps=between)
    assert result.match, f"{kind}: {result.summary()}"
    lrs = [g["lr"] for g in o.param_groups]
    assert lrs == [g["lr"] for g in eager_opt.param_groups]


# Every schedule on AdamW; on SGD and Adam the one that also changes momentum or betas.
@pytest.mark.parametrize(
    "optimizer, kind",
    [("adamw", k) for k in ("lambda-warmup", "onecycle", "warmup-cosine", "plateau", "hand")] + [("sgd", "onecycle"), ("adam", "onecycle")],
)
def test_hyperparameters_changed_between_steps_take_effect_bitwise(optimizer, kind):
    spec = build_model("mlp-deep", 512)
    opt = _optimizer(optimizer, spec.model.parameters())
    _check_loop(spec, opt, kind)


_OTHER_OPTIMIZERS = {
    # momentum > 0 is a branch of RMSprop's update: its sign is fixed, its value read at every call
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True, weight_decay=1e-4),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=1e-4),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3, weight_decay=1e-4),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, weight_decay=1e-4),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    # ns_steps is a count its update loops over: its value is fixed, its floats read at every call
    "muon": lambda ps: _muon(ps, weight_decay=1e-4),
}


def _for_muon(batch_size: int) -> ModelSpec:
    """mlp-deep's chain of 8 linear layers at width 64 instead of 256: Muon's Newton-Schulz
    iterations run in bfloat16, whose matrix products are slow on a CPU (at width 256, 40 s a test)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for i in range(8) for m in ([nn.Sigmoid()] if i else []) + [nn.Linear(64, 64)]])
        gen = torch.Generator().manual_seed(0)
        batch = (torch.randn(batch_size, 64, generator=gen), torch.randn(batch_size, 64, generator=gen))
    return ModelSpec("mlp-deep at width 64", model, batch, mse_loss)


def _muon(params, **kwargs) -> torch.optim.Optimizer:
    """Muon on the matrices; the biases, which it does not take, frozen (left to another
    optimizer, their gradients would add up across steps)."""
    params = list(params)
    for p in params:
        if p.ndim != 2:
            p.requires_grad_(False)
    return torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-3, **kwargs)


# From the first step on for each; after an eager first step for those whose state the
# first step makes in a way of its own (Adagrad's in __init__, Rprop's step sizes, Muon's).
@pytest.mark.parametrize(
    "optimizer, first_step",
    [(o, "remat") for o in sorted(_OTHER_OPTIMIZERS)] + [(o, "eager") for o in ("adagrad", "rprop", "muon")],
)
def test_other_torch_optimizers_follow_hand_set_hyperparameters_bitwise(optimizer, first_step):
    """Every torch.optim optimizer whose update does not branch on its state runs as eager
    does, with its numbers read at every call: after an eager first step, or from the
    first step on (its first-step state made by its own _init_group)."""
    spec = _for_muon(512) if optimizer == "muon" else build_model("mlp-deep", 512)
    opt = _OTHER_OPTIMIZERS[optimizer](spec.model.parameters())
    if first_step == "eager":
        make_train_step(spec.loss_fn, zero_grad_first=True)(spec.model, opt, spec.batch)
    else:
        assert not opt.state or optimizer == "adagrad"  # Adagrad makes its state in __init__
    _check_loop(spec, opt, "hand")


def _compiled_again_after(make_optimizer, change, warning: str, eager_first: bool = False) -> None:
    """A step compiled and run beside eager; after its first step `change(optimizer)` on both
    sides, which the graph holds fixed: the next call warns naming it, compiles again, and
    every step stays bitwise eager's."""
    spec = _for_muon(8) if make_optimizer is _muon else build_model("mlp-deep", 8)
    opt = make_optimizer(spec.model.parameters())
    if eager_first:  # state an optimizer makes only in its own first step (RMSprop's)
        make_train_step(spec.loss_fn)(spec.model, opt, spec.batch)
    eager_model, eager_opt = twin(spec.model, opt)
    step_fn = make_train_step(spec.loss_fn)
    step = remat.compile(step_fn, spec.model, opt, spec.batch, profile_runs=1, measure=False)

    def between(i, m, o):
        if i == 0:
            change(o)

    with pytest.warns(UserWarning, match=warning):
        result = check_against_eager(step_fn, eager_model, eager_opt, spec.model, opt, step, spec.batch, steps=3, between_steps=between)
    assert result.match, result.summary()


def test_a_fused_optimizers_beta_changed_compiles_again_naming_what_reads_it_at_every_call():
    """A fused kernel reads only its learning rate at every call (a changed rate is no new
    graph): a beta changed between steps is held fixed, so the step is compiled again."""
    _compiled_again_after(
        lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), lambda o: o.param_groups[0].update(betas=(0.8, 0.999), lr=5e-4),
        r"'betas\[0\]'\] changed from 0.9 to 0.8, .*fused kernel.*foreach=True.*compiled again",
    )


def test_a_float_an_optimizer_branches_on_changing_sign_compiles_again():
    _compiled_again_after(
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5), lambda o: o.param_groups[0].update(momentum=0.0),
        r"'momentum'\] changed from positive to 0.0, and the update skips or runs a whole term", eager_first=True,
    )


def test_a_count_an_optimizer_loops_over_changed_compiles_again():
    _compiled_again_after(_muon, lambda o: o.param_groups[0].update(ns_steps=3), r"\['ns_steps'\] changed from 5 to 3, which the captured update takes as a fixed number")


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda ps: torch.optim.RAdam(ps, lr=1e-3),
        lambda ps: torch.optim.RAdam(ps, lr=1e-3, foreach=True, weight_decay=0.1, decoupled_weight_decay=True),
        lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2),
    ],
    ids=["radam", "radam-foreach", "asgd"],
)
def test_an_optimizer_branching_on_its_step_count_compiles_again_where_the_branch_turns(make_optimizer):
    """RAdam's update branches on its step count after counting it up (`step_t += 1`, then `if
    rho_t > 5.0:`, turning at its sixth step); ASGD's on its averaging factor (`max(1, step -
    t0)`, `mu.item() != 1`). Each check runs first, on copies of the counts moved on as the
    update moves them: where the side turns, the step compiles again before changing
    anything, and every step is bitwise eager's."""
    spec = build_model("mlp-deep", 8)
    opt = make_optimizer(spec.model.parameters())
    eager_model, eager_opt = twin(spec.model, opt)
    step_fn = make_train_step(spec.loss_fn)
    step = remat.compile(step_fn, spec.model, opt, spec.batch, profile_runs=1, measure=False)
    with pytest.warns(UserWarning, match=r"branches on the value of the optimizer's '(step|mu)' of .*: the step is compiled again") as said:
        result = check_against_eager(step_fn, eager_model, eager_opt, spec.model, opt, step, spec.batch, steps=8)
    assert result.match, result.summary()
    assert 1 <= sum("compiled again" in str(w.message) for w in said) <= 3


def test_an_optimizer_branching_on_its_parameters_values_is_refused_naming_the_line():
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.Adafactor(spec.model.parameters(), lr=1e-2)
    with pytest.raises(CaptureError, match=r"optimizer's update branches on a value .* \(torch/optim/_adafactor.py, line \d+: alpha = max\(eps2, param.norm"):
        remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1, measure=False)


def _each_step(loss_fn):
    """A step that steps every optimizer of the list it gets."""

    def step(model, optimizers, batch):
        for o in optimizers:
            o.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        for o in optimizers:
            o.step()
        return loss

    return step


def test_several_optimizers_stepped_in_one_step_train_bitwise():
    """Muon on the weight matrices and AdamW on the rest, passed as a list: the step gets
    the list, each optimizer's state and learning rate are read and updated as eager does,
    and the updates of both move into the backward pass."""
    spec = _for_muon(512)
    params = list(spec.model.parameters())
    opts = [torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-3, weight_decay=1e-4),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-3)]  # fmt: skip
    step_fn = _each_step(spec.loss_fn)
    eager_model, eager_opts = twin(spec.model, opts)
    model, o = twin(spec.model, opts)

    def between(i, m, optimizers):
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] *= 0.5

    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.85, profile_runs=1)
    result = check_against_eager(step_fn, eager_model, eager_opts, model, o, step, spec.batch, steps=4, between_steps=between)
    assert result.match, result.summary()
    report = step.report
    assert report.num_recomputed > 0 and report.measured_peak_bytes == report.predicted_peak_bytes
    # The updates of both can move (all but the first layer's, which must follow the last
    # backward op); whether they do depends on the predicted cost, which the node times move.
    note = report.plan.updates_note if report.plan is not None else ""
    assert note.startswith(f"{len(params) - 1} of {len(params)} parameter updates run in the backward pass") or "predicted no better" in note, note
    assert all(o[k].state and len(o[k].state) == len(eager_opts[k].state) for k in range(2))
    assert [sorted(g) for g in o[0].param_groups] == [sorted(g) for g in eager_opts[0].param_groups]  # Muon has no "foreach"


class _Wrapping(torch.optim.Optimizer):
    """SAM's shape: an optimizer with state of its own that steps the one it holds, over the same param groups."""

    def __init__(self, params):
        super().__init__(params, {})
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=0.1, momentum=0.9)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["old_p"] = p.detach().clone()
        self.base_optimizer.step()


def test_an_optimizer_stepped_but_not_passed_is_refused_saying_to_pass_a_list():
    spec = build_model("mlp-deep", 8)
    params = list(spec.model.parameters())
    first, other = torch.optim.AdamW(params[:2], lr=1e-3), torch.optim.SGD(params[2:], lr=1e-2)
    step = _each_step(spec.loss_fn)
    with pytest.raises(CaptureError, match=r"steps a SGD \(over \d+ parameters\) that was not passed to remat.compile.*as a list \(AdamW, SGD\)"):
        remat.compile(lambda m, opt, b: step(m, [opt, other], b), spec.model, first, spec.batch, profile_runs=1, measure=False)
    with pytest.raises(CaptureError, match=r"a parameter of shape .* is in two of the optimizers passed \(AdamW and SGD\)"):
        remat.compile(step, spec.model, [first, torch.optim.SGD(params[:1], lr=1e-2)], spec.batch, profile_runs=1)
    with pytest.raises(CaptureError, match=r"optimizer must be a torch.optim.Optimizer, a list of them .* got a list of AdamW, str"):
        remat.compile(step, spec.model, [first, "sgd"], spec.batch, profile_runs=1)
    # An optimizer that steps another over the same param groups (SAM): the advice above would
    # give each parameter to both, so it is refused by what it is.
    wrapping = _Wrapping(params)
    step(spec.model, [wrapping], spec.batch)  # an eager step first: the wrapper's state is made by its own code
    with pytest.raises(CaptureError, match=r"steps the SGD that the _Wrapping passed holds .* \(SAM, Lookahead\)"):
        remat.compile(step, spec.model, [wrapping], spec.batch, profile_runs=1)
    # A change the graph holds fixed names the optimizer of the list it was made to.
    compiled = remat.compile(step, spec.model, [first, other], spec.batch, profile_runs=1, measure=False)
    other.param_groups[0]["nesterov"] = True
    with pytest.warns(UserWarning, match=r"optimizer\[1\]\.param_groups\[0\]\['nesterov'\] changed from False to True"):
        compiled(spec.batch)


def test_a_backward_pass_after_an_update_is_refused():
    """Updates in turns (a GAN's discriminator, then its generator) put a backward pass
    after an update: refused, not captured as one update phase; as the error says, each
    turn compiled as a step of its own trains bitwise."""

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)

    model = Pair()
    opts = [torch.optim.Adam(model.g.parameters()), torch.optim.Adam(model.d.parameters())]

    def step(m, optimizers, batch):
        opt_g, opt_d = optimizers
        fake = m.g(batch)
        opt_d.zero_grad()
        m.d(fake.detach()).mean().backward()
        opt_d.step()
        opt_g.zero_grad()
        loss = -m.d(fake).mean()
        loss.backward()
        opt_g.step()
        return loss

    with pytest.raises(CaptureError, match="runs a backward pass after an optimizer update.*model.zero_grad"):
        remat.compile(step, model, opts, torch.randn(4, 8), profile_runs=1)

    # The advice: each turn a step of its own, clearing the model's gradients first.
    def d_step(m, opt_d, batch):
        m.zero_grad()
        loss = m.d(m.g(batch).detach()).mean()
        loss.backward()
        opt_d.step()
        return loss

    def g_step(m, opt_g, batch):
        m.zero_grad()
        loss = -m.d(m.g(batch)).mean()
        loss.backward()
        opt_g.step()
        return loss

    eager_model = copy.deepcopy(model)
    eager_opts = [torch.optim.Adam(eager_model.g.parameters()), torch.optim.Adam(eager_model.d.parameters())]
    batches = [torch.randn(4, 8) for _ in range(3)]
    turns = [remat.compile(d_step, model, opts[1], batches[0], profile_runs=1), remat.compile(g_step, model, opts[0], batches[0], profile_runs=1)]
    for batch in batches:
        turns[0](batch)
        d_step(eager_model, eager_opts[1], batch)
        assert torch.equal(turns[1](batch), g_step(eager_model, eager_opts[0], batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


def test_learning_rate_change_on_a_transformer_with_recomputation():
    spec = build_model("bert-tiny", 4)
    _check_loop(spec, _optimizer("adamw", spec.model.parameters()), "hand", budget=0.9)


def test_learning_rate_is_not_a_constant_of_the_graph():
    """Without reading it at every call, the second step would use the first lr: the
    parameters after a step at lr 0 must equal those before it."""
    spec = build_model("mlp-deep", 16)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    step = remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1, measure=False)
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in spec.model.parameters()]
    step(spec.batch)
    assert all(torch.equal(a, p) for a, p in zip(before, spec.model.parameters()))
    opt.param_groups[0]["lr"] = 0.1
    step(spec.batch)
    assert not all(torch.equal(a, p) for a, p in zip(before, spec.model.parameters()))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda o: o.param_groups[0].update(nesterov=True), r"param_groups\[0\]\['nesterov'\] changed from False to True"),
        (lambda o: o.param_groups[0].update(weight_decay=0.0), r"'weight_decay'\] changed from positive to 0.0"),
        (lambda o: o.param_groups[0].update(maximize=True), r"'maximize'\] changed from False to True"),
    ],
)
def test_a_setting_the_graph_holds_fixed_changed_compiles_again_naming_it(change, message):
    _compiled_again_after(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4), change, message)


def test_a_parameter_frozen_or_unfrozen_after_compiling_compiles_again_and_trains_bitwise():
    spec = build_model("mlp-deep", 8)
    first = next(spec.model.parameters()).requires_grad_(False)  # frozen, and not given to the optimizer yet
    opt = torch.optim.SGD([p for p in spec.model.parameters() if p is not first], lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(spec.model, opt)
    step_fn = make_train_step(spec.loss_fn)
    step = remat.compile(step_fn, spec.model, opt, spec.batch, profile_runs=1, measure=False)

    def between(i, m, o):
        params = list(m.parameters())
        if i == 0:  # the last layer's bias frozen: no gradient, no update
            params[-1].requires_grad_(False)
        if i == 2:  # the first layer's weight unfrozen, in a group of its own
            params[0].requires_grad_(True)
            o.add_param_group({"params": [params[0]], "lr": 0.01})

    with pytest.warns(UserWarning, match=r"requires_grad of 1 parameters changed since the step was compiled .*compiled again"):
        result = check_against_eager(step_fn, eager_model, eager_opt, spec.model, opt, step, spec.batch, steps=5, between_steps=between)
    assert result.match, result.summary()
    assert len(opt.param_groups) == 2 and opt.state[first]


def test_amsgrad_switched_on_before_the_first_step_makes_its_state_as_eager_would():
    """The state compiling made for the first step, without AMSGrad's, is made again for the
    new graph (eager, switched on after its first step, raises a KeyError there)."""
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.Adam(spec.model.parameters(), lr=1e-3)
    eager_model, eager_opt = twin(spec.model, opt)
    step = remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1, measure=False)
    opt.param_groups[0]["amsgrad"] = eager_opt.param_groups[0]["amsgrad"] = True
    with pytest.warns(UserWarning, match=r"'amsgrad'\] changed from False to True"):
        result = check_against_eager(make_train_step(spec.loss_fn), eager_model, eager_opt, spec.model, opt, step, spec.batch, steps=2)
    assert result.match, result.summary()
    assert "max_exp_avg_sq" in opt.state[next(spec.model.parameters())]


@pytest.mark.parametrize("kind,before_update", [("step", False), ("step", True), ("warmup-cosine", False)])
def test_a_scheduler_stepped_inside_train_step_is_stepped_at_every_call_bitwise(kind, before_update):
    # Stepped before optimizer.step(), the new rate is this step's; after it, the next one's.
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)

    def make(optimizer):
        if kind == "step":
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[2])

    scheds = {id(eager_opt): make(eager_opt), id(o): make(o)}

    def step_fn(m, optimizer, batch):
        optimizer.zero_grad()
        loss = spec.loss_fn(m, batch)
        loss.backward()
        if before_update:
            scheds[id(optimizer)].step()
        optimizer.step()
        if not before_update:
            scheds[id(optimizer)].step()
        return loss

    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=None)
    assert [c.before_update for c in step.compiled_for(spec.batch).tg.call.scheduler_calls] == [before_update]
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=STEPS)
    assert result.match, result.summary()
    assert o.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"] != 0.1
    assert scheds[id(o)].last_epoch == scheds[id(eager_opt)].last_epoch == STEPS


def test_a_scheduler_stepped_on_a_metric_made_inside_train_step_or_before_returning_the_rate_is_refused():
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    inner = make_train_step(spec.loss_fn)

    def on_metric(model, optimizer, batch):
        loss = inner(model, optimizer, batch)
        plateau.step(loss)
        return loss

    with pytest.raises(CaptureError, match=r"steps a learning-rate scheduler with an argument \(ReduceLROnPlateau\.step"):
        remat.compile(on_metric, spec.model, opt, spec.batch, profile_runs=1, measure=False)

    def made_inside(model, optimizer, batch):
        loss = inner(model, optimizer, batch)
        torch.optim.lr_scheduler.StepLR(optimizer, 1).step()
        return loss

    with pytest.raises(CaptureError, match=r"makes a learning-rate scheduler \(StepLR\): make it once, before the loop"):
        remat.compile(made_inside, spec.model, opt, spec.batch, profile_runs=1, measure=False)
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]

    # The rate read after scheduler.step() is the next one in eager; the graph has this step's.
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    def returns_the_rate(model, optimizer, batch):
        loss = inner(model, optimizer, batch)
        sched.step()
        return loss, optimizer.param_groups[0]["lr"]

    with pytest.raises(CaptureError, match=r"returns a number computed from an optimizer setting \(output 1\) and steps a learning-rate scheduler after the update.*Use scheduler.get_last_lr\(\)\[i\] instead"):
        remat.compile(returns_the_rate, spec.model, opt, spec.batch, profile_runs=1, measure=False)

    def logs_the_rate(model, optimizer, batch):
        loss = inner(model, optimizer, batch)
        sched.step()
        _RATES.append(optimizer.param_groups[0]["lr"])
        return loss

    with pytest.raises(CaptureError, match=r"logs a number computed from an optimizer setting \(into global _RATES\) and steps"):
        remat.compile(logs_the_rate, spec.model, opt, spec.batch, profile_runs=1, measure=False)
    assert _RATES == []


_RATES: list[float] = []  # a log of learning rates


def test_tensor_learning_rate_is_refused():
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=torch.tensor(0.1))
    with pytest.raises(CaptureError, match=r"param_groups\[0\]\['lr'\] is a tensor"):
        remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1, measure=False)


def test_sgd_dampening_without_state_is_refused():
    spec = build_model("mlp-deep", 8)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(CaptureError, match="dampening"):
        remat.compile(make_train_step(spec.loss_fn), spec.model, opt, spec.batch, profile_runs=1, measure=False)


# ---------------------------------------------------------------------- frozen parameters


def _frozen_bert():
    spec = build_model("bert-tiny", 4)
    for name, p in spec.model.named_parameters():
        if "embeddings" in name or ".layer.0." in name:
            p.requires_grad_(False)
    return spec


def test_frozen_parameters_get_no_gradient_and_train_bitwise():
    spec = _frozen_bert()
    frozen = {n for n, p in spec.model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in spec.model.parameters() if p.requires_grad], lr=1e-3)
    step_fn = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.9, profile_runs=1)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=5)
    assert result.match, result.summary()
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    grad_names = set(step.compiled_for(spec.batch).tg.grad_names)
    assert grad_names and not grad_names & frozen
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes

    # The planner's numbers come from the smaller graph: less than with every parameter trained.
    full = build_model("bert-tiny", 4)
    full_step = remat.compile(step_fn, full.model, torch.optim.AdamW(full.model.parameters(), lr=1e-3), full.batch, profile_runs=1, measure=False)
    assert step.report.baseline_peak_bytes < full_step.report.baseline_peak_bytes


def _halve_gradient(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


def test_gradient_hooks_on_the_parameters_run_in_the_graph_bitwise_with_a_plan():
    """register_hook and register_post_accumulate_grad_hook on the parameters change the
    gradients in eager; the graph runs without autograd, so they must be traced into it.
    """
    spec = _frozen_bert()
    opt = torch.optim.AdamW([p for p in spec.model.parameters() if p.requires_grad], lr=1e-3)
    step_fn = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    for m in (eager_model, model):  # a deep copy leaves hooks behind: each side gets its own
        for i, p in enumerate(p for p in m.parameters() if p.requires_grad):
            p.register_hook(lambda g: g.clamp(-1e-3, 1e-3)) if i % 2 else p.register_post_accumulate_grad_hook(_halve_gradient)
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.5, profile_runs=1)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=3)
    assert result.match, result.summary()
    assert step.report.num_recomputed > 0 and step.report.plan.updates_in_backward
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes


def test_a_step_zeroing_gradients_in_place_compiles_after_an_eager_step_and_trains_bitwise():
    """After an eager step the parameters hold gradients; a step that zeroes them in place
    (set_to_none=False) was traced with fake copies of them as constants of the graph,
    and failed on its first run."""
    spec = build_model("bert-tiny", 4)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=False)
        loss = spec.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    step_fn(spec.model, opt, spec.batch)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    for m in (eager_model, model):  # a deep copy leaves gradients behind
        for p, q in zip(m.parameters(), spec.model.parameters()):
            p.grad = q.grad.clone()
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.5, profile_runs=1)
    assert not [n for n in step.graph_module.graph.nodes if n.op == "get_attr"]
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=3)
    assert result.match, result.summary()


def test_frozen_parameters_in_the_optimizer_get_no_state():
    spec = _frozen_bert()
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9)  # all parameters, some frozen
    step_fn = make_train_step(spec.loss_fn, zero_grad_first=True)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    step = remat.compile(step_fn, model, o, spec.batch, profile_runs=1, measure=False)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=3)
    assert result.match, result.summary()
    assert len(o.state) == len(eager_opt.state) == sum(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------- outputs


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_extra_outputs_come_back_as_eager_returns_them(form):
    spec = build_model("bert-tiny", 4)

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        if form == "tuple":
            return out.loss, out.logits.detach()
        return {"loss": out.loss, "logits": out.logits.detach(), "hidden": out.logits.detach().argmax(-1)}

    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.9, profile_runs=1)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=5)
    assert result.match, result.summary()
    out = step(spec.batch)
    assert isinstance(out, tuple if form == "tuple" else dict)
    # The returned logits live to the end of the step: the prediction counts them.
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes


def test_a_step_returning_python_numbers_runs_a_plan_bitwise_with_the_numbers_in_its_peak():
    spec = build_model("mlp-deep", 64)
    inner = make_train_step(spec.loss_fn)

    def step_fn(m, o, b):
        loss = inner(m, o, b)
        return loss, o.param_groups[0]["lr"], loss.item()

    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.4, profile_runs=1)
    assert step.report.num_recomputed > 0
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=3)
    assert result.match, result.summary()
    loss, lr, number = step(spec.batch)
    assert lr == 0.1 and number == loss.item() and type(number) is float
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes


# ---------------------------------------------------------------------- accumulation


def accumulation_step(k: int):
    """k micro-batches, each with its own backward(), then one update (a common loop)."""

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        n = next(iter(batch.values())).shape[0]
        total = 0.0
        for i in range(k):
            part = {key: v[i * n // k : (i + 1) * n // k] for key, v in batch.items()}
            loss = model(**part).loss / k
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    return step_fn


def test_gradient_accumulation_in_one_step_is_bitwise_and_frees_each_micro_batch():
    k = 2  # 4 micro-batches: the loop idioms' table
    spec = build_model("bert-tiny", 8)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3)
    step_fn = accumulation_step(k)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    step = remat.compile(step_fn, model, o, spec.batch, memory_budget=0.8, profile_runs=1)
    assert step.compiled_for(spec.batch).tg.backward_passes == k
    assert step.report.num_recomputed > 0
    result = check_against_eager(step_fn, eager_model, eager_opt, model, o, step, spec.batch, steps=5)
    assert result.match, result.summary()
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    # Each micro-batch's activations die before the next forward: less than one batch of 8.
    whole = remat.compile(accumulation_step(1), *twin(spec.model, opt), spec.batch, profile_runs=1, measure=False)
    assert step.report.baseline_peak_bytes < whole.report.baseline_peak_bytes


def test_exact_planner_refuses_accumulation_by_name():
    spec = build_model("bert-tiny", 4)
    opt = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    with pytest.raises(remat.errors.PlanError, match="exact planner models one forward and one backward pass; this step runs 2"):
        remat.compile(accumulation_step(2), spec.model, opt, spec.batch, memory_budget=0.8, planner="milp", profile_runs=1, measure=False)


# ---------------------------------------------------------------------- the idioms table

from tests.support import loop_idioms  # noqa: E402


@pytest.mark.parametrize("idiom", loop_idioms.IDIOMS, ids=lambda i: i.name)
def test_each_loop_idiom_works_bitwise_or_is_refused_by_name(idiom):
    """What docs/training_loops/idioms.md and docs/training-loops.md say of each idiom."""
    outcome = loop_idioms.run_idiom(idiom)
    assert outcome["outcome"] == idiom.expect, outcome


def _gradient_penalty(model, opt, batch):
    """A penalty on the input gradient (WGAN-GP, R1): differentiated twice."""
    x, y = batch
    opt.zero_grad()
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = nn.functional.cross_entropy(out, y) + 0.1 * g.pow(2).sum(1).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _adversarial(model, opt, batch):
    """FGSM adversarial training: a backward for the batch's gradient, then a step on the perturbed batch."""
    x, y = batch
    opt.zero_grad()
    x = x.clone().requires_grad_(True)
    nn.functional.cross_entropy(model(x), y).backward()
    x_adv = (x + 0.05 * x.grad.sign()).detach()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x_adv), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _clipped_by_hand(model, opt, batch):
    """The parameters' gradients from torch.autograd.grad, clipped and set as .grad by the step (no backward())."""
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    scale = torch.clamp(0.5 / (torch.sqrt(sum(g.pow(2).sum() for g in grads)) + 1e-6), max=1.0)
    for p, g in zip(params, grads):
        p.grad = g * scale
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("step_fn", [_gradient_penalty, _adversarial, _clipped_by_hand], ids=["gradient-penalty", "fgsm", "autograd-grad"])
def test_steps_that_differentiate_twice_or_for_the_batch_train_bitwise_at_the_tightest_plan(step_fn):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(128, 16), torch.randint(0, 10, (128,)))
    eager_model, eager_opt = twin(model, opt)
    profiles: dict = {}
    try:
        step = remat.compile(step_fn, model, opt, batch, memory_budget=0.01, profile_runs=1, profile_cache=profiles)
    except remat.errors.BudgetError as e:
        step = remat.compile(step_fn, model, opt, batch, memory_budget=e.reach.best, profile_runs=1, profile_cache=profiles)
    result = check_against_eager(step_fn, eager_model, eager_opt, model, opt, step, batch, steps=4)
    assert result.match, result.summary()
    assert step.report.num_recomputed > 0 and step.report.measured_peak_bytes == step.report.predicted_peak_bytes


class _Pix2Pix(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 32))
        self.D = nn.Sequential(nn.Linear(48, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))


def _discriminator_turn(model, opt_d, batch):
    a, b = batch
    model.D.requires_grad_(True)  # pix2pix's set_requires_grad(netD, True)
    model.zero_grad()
    fake = model.G(a).detach()
    real_logits, fake_logits = model.D(torch.cat((a, b), 1)), model.D(torch.cat((a, fake), 1))
    loss = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits)) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
    loss.backward()
    opt_d.step()
    return loss


def _generator_turn(model, opt_g, batch):
    a, b = batch
    model.D.requires_grad_(False)  # frozen for the generator's turn, and left so
    model.zero_grad()
    fake = model.G(a)
    logits = model.D(torch.cat((a, fake), 1))
    loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)) + 10 * F.l1_loss(fake, b)
    loss.backward()
    opt_g.step()
    return loss


def test_a_gan_whose_turns_set_requires_grad_leaves_the_flags_as_eager_and_trains_bitwise():
    model, eager = _Pix2Pix(), _Pix2Pix()
    opts = [torch.optim.Adam(m.D.parameters() if k == 0 else m.G.parameters(), lr=2e-4, betas=(0.5, 0.999)) for m in (model, eager) for k in range(2)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g), torch.randn(32, 32, generator=g)) for _ in range(4)]
    d_turn = remat.compile(_discriminator_turn, model, opts[0], batches[0], profile_runs=1, measure=False)
    g_turn = remat.compile(_generator_turn, model, opts[1], batches[0], profile_runs=1, measure=False)
    for batch in batches:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the discriminator's turn, compiled with D thawed, is compiled again for D frozen
            torch.manual_seed(7)
            d = d_turn(batch)
        torch.manual_seed(7)
        assert torch.equal(d, _discriminator_turn(eager, opts[2], batch))
        torch.manual_seed(8)
        gl = g_turn(batch)
        torch.manual_seed(8)
        assert torch.equal(gl, _generator_turn(eager, opts[3], batch))
        assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in eager.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values()))
    assert len(d_turn._graphs) == len(g_turn._graphs) == 1


def _fine_tuned_head(stale: bool):
    """An MLP whose backbone was trained, then frozen with its last gradients left set
    (`stale`), and an optimizer for the head."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    F.mse_loss(net(torch.randn(8, 16)), torch.randn(8, 1)).backward()
    for p in net[0].parameters():
        p.requires_grad_(False)
        if not stale:
            p.grad = None
    return net, torch.optim.SGD(net[2].parameters(), lr=0.1)


def _clipped_step(model, opt, batch):
    opt.zero_grad()
    loss = F.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # over every parameter: eager counts a frozen one's gradient
    opt.step()
    return loss


def test_a_frozen_parameter_holding_a_gradient_is_clipped_and_kept_as_eager_keeps_it():
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    model, opt = _fine_tuned_head(stale=True)
    stale = [p.grad.clone() for p in model[0].parameters()]
    eager, eager_opt = twin(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = remat.compile(_clipped_step, model, opt, batch, profile_runs=1, measure=False)
        result = check_against_eager(_clipped_step, eager, eager_opt, model, opt, compiled, batch, steps=3)
    assert result.match, result.summary()
    for p, e, s in zip(model[0].parameters(), eager[0].parameters(), stale):
        assert torch.equal(p.grad, e.grad) and not torch.equal(p.grad, s)  # scaled at every step, as eager's
    assert len(compiled._graphs) == 1
    for m in (model, eager):
        m[0].zero_grad()  # cleared: the step finds none, and compiles again
    for _ in range(2):
        assert torch.equal(compiled(batch), _clipped_step(eager, eager_opt, batch))
    assert all(p.grad is None for p in model[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    assert len(compiled._graphs) == 2


def test_a_frozen_parameter_holding_a_gradient_in_the_optimizer_is_updated_with_it_as_eager_does():
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    model, _ = _fine_tuned_head(stale=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the frozen ones too: step() applies their gradient

    def step_then_clear(model, opt, batch):
        loss = F.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager, eager_opt = twin(model, opt)
    compiled = remat.compile(step_then_clear, model, opt, batch, profile_runs=1, measure=False)
    result = check_against_eager(step_then_clear, eager, eager_opt, model, opt, compiled, batch, steps=3)
    assert result.match, result.summary()
    assert not torch.equal(model[0].weight, _fine_tuned_head(stale=True)[0][0].weight)  # moved by its stale gradient
