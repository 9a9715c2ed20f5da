"""Tensors outside the model that a step uses: a frozen teacher (distillation), an EMA copy
updated in place, a global class-weight tensor, a list of the model's own parameters. The
step runs bitwise like eager with a plan that recomputes, writes the user's own tensors,
follows what the loop changes between steps, and refuses what eager would do otherwise."""

from __future__ import annotations

import copy
import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.errors import BudgetError, CaptureError
from remat.capture.train_graph import InputKind


class _Net(torch.nn.Module):
    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, width)
        self.b = torch.nn.Linear(width, width)
        self.c = torch.nn.Linear(width, 10)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.c(self.drop(torch.tanh(self.b(torch.relu(self.a(x))))))


def _batch(n: int = 128):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _cross_entropy_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _tightest(step, model, opt, batch, headroom: float = 1.0) -> remat.RematStep:
    """The step compiled at the smallest peak the planner reaches from one profile (which
    plans reach it depends on the node times), times `headroom`: activations recomputed."""
    profiles: dict = {}
    try:
        return remat.compile(step, model, opt, batch, memory_budget=0.01, profile_runs=1, profile_cache=profiles)
    except BudgetError as e:
        budget = int(e.reach.best * headroom)
        return remat.compile(step, model, opt, batch, memory_budget=budget, profile_runs=1, profile_cache=profiles)


def _pair(make_step, steps: int = 4, between=None, headroom: float = 1.0):
    """Eager and remat side by side from equal copies, each with its own step (and outside
    state); returns the two steps' outside state after the last step and the compiled step."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager_step, eager_state = make_step(eager_model)
    remat_step, remat_state = make_step(model)
    compiled = _tightest(remat_step, model, opt, _batch(), headroom)
    for i in range(steps):
        batch = _batch()
        torch.manual_seed(i)
        loss_e = eager_step(eager_model, eager_opt, batch)
        torch.manual_seed(i)
        loss_r = compiled(batch)
        assert torch.equal(loss_e, loss_r), (i, loss_e, loss_r)
        for (name, pe), pr in zip(eager_model.named_parameters(), model.parameters()):
            assert torch.equal(pe, pr), (i, name)
        if between is not None:  # what the loop does between steps, to both sides' state
            between(i, eager_state, remat_state)
    report = compiled.report
    assert report.num_recomputed > 0 and report.measured_peak_bytes == report.predicted_peak_bytes, report.to_dict()
    return eager_state, remat_state, compiled


TEACHER = _Net(96).eval()
CLASS_WEIGHTS = torch.rand(10) + 0.5


def _distill(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    with torch.no_grad():
        soft = TEACHER(x).softmax(-1)
    logits = model(x)
    loss = F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean") + F.cross_entropy(logits, y, weight=CLASS_WEIGHTS)
    loss.backward()
    opt.step()
    return loss


def test_a_teacher_and_a_class_weight_tensor_in_globals_are_read_from_where_they_are_at_each_step():
    saved = copy.deepcopy(TEACHER.state_dict())

    def between(i, eager_state, remat_state):
        if i == 1:  # the loop changes the shared teacher's weights in place, as a later stage of training would
            with torch.no_grad():
                TEACHER.a.weight.mul_(0.5)

    try:
        _, _, compiled = _pair(lambda m: (_distill, None), between=between)
    finally:
        TEACHER.load_state_dict(saved)
    tg = compiled._last.tg
    outside = [i.name for i in tg.inputs if i.kind is InputKind.OUTSIDE]
    assert "global CLASS_WEIGHTS" in outside and "global TEACHER.a.weight" in outside, outside
    assert len(outside) == 1 + len(list(TEACHER.parameters()))
    outside_bytes = sum(p.numel() * 4 for p in TEACHER.parameters()) + CLASS_WEIGHTS.numel() * 4
    model_bytes = sum(p.numel() * 4 for p in compiled.model.parameters())
    assert compiled.report.persistent_bytes >= outside_bytes + 3 * model_bytes  # the model, AdamW's two states, and these


class _EmaTrainer:
    """A trainer whose method is the step, keeping an EMA of the weights in a dict field."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def train_step(self, model, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.shadow[n].lerp_(p, 1 - self.decay)
        return loss


def test_an_ema_copy_updated_inside_the_step_is_the_users_own_tensor_bitwise_with_updates_in_backward():
    made: list[tuple[_EmaTrainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def make(model):
        trainer = _EmaTrainer(model, 0.9)
        made.append((trainer, dict(trainer.shadow), {n: t.clone() for n, t in trainer.shadow.items()}))
        return trainer.train_step, trainer

    def between(i, eager, remat_trainer):
        for n, e in eager.shadow.items():
            assert torch.equal(e, remat_trainer.shadow[n]), (i, n)
        if i == 0:  # the loop changes the decay: read at every call from then on, or a constant compiled again
            eager.decay = remat_trainer.decay = 0.8

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, compiled = _pair(make, between=between)
    # Whether `lerp_` takes the decay as a symbol depends on what torch has loaded (its
    # scalar argument may be specialized); either way the step follows the new decay, bitwise.
    recompiled = any("_EmaTrainer.decay (0.9 -> 0.8) changed since the step was compiled" in str(w.message) for w in caught)
    assert recompiled or "_EmaTrainer.decay" in compiled._read, [str(w.message) for w in caught]
    trainer, tensors, start = made[1]
    assert all(trainer.shadow[n] is t for n, t in tensors.items())  # the user's tensors, written in place
    assert not any(torch.equal(start[n], t) for n, t in tensors.items())  # and every one of them moved
    assert compiled.report.plan.updates_in_backward


def test_compiling_leaves_an_ema_copy_as_it_was():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _EmaTrainer(model, 0.5)
    before = {n: t.clone() for n, t in trainer.shadow.items()}
    remat.compile(trainer.train_step, model, opt, _batch(), memory_budget=0.9, profile_runs=2)
    assert all(torch.equal(before[n], t) for n, t in trainer.shadow.items())  # the profiler ran on copies


_DECAYED: list[torch.Tensor] = []  # the model's own weights, listed by the loop


def _regularized(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) + 1e-3 * sum(w.pow(2).sum() for w in _DECAYED)
    loss.backward()
    opt.step()
    return loss


def test_a_list_of_the_models_own_parameters_stands_for_them():
    def make(model):
        _DECAYED[:] = [model.a.weight, model.b.weight]  # each side's own, set before its steps run
        return _regularized, model

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    make(model)
    compiled = _tightest(_regularized, model, opt, _batch())
    assert not [i for i in compiled._last.tg.inputs if i.kind is InputKind.OUTSIDE]  # the model's placeholders
    for i in range(3):
        make(eager_model)
        torch.manual_seed(i)
        loss_e = _regularized(eager_model, eager_opt, _batch())
        make(model)
        torch.manual_seed(i)
        loss_r = compiled(_batch())
        assert torch.equal(loss_e, loss_r), i
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), model.parameters()))
    _DECAYED.clear()


TRAINED_TEACHER = _Net(32)


def _distill_without_no_grad(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(model(x), TRAINED_TEACHER(x))
    loss.backward()
    opt.step()
    return loss


def test_a_teacher_the_backward_reaches_is_refused_and_left_without_gradients():
    model = _Net()
    with pytest.raises(CaptureError, match=r"computes a gradient for global TRAINED_TEACHER\.\w+\.\w+, a tensor outside the model.*torch\.no_grad"):
        remat.compile(_distill_without_no_grad, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch())
    assert all(p.grad is None for p in TRAINED_TEACHER.parameters())
    assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in TRAINED_TEACHER.parameters())


_SETTINGS = types.SimpleNamespace(class_weights=torch.ones(10), offset=torch.zeros(10), teacher=_Net(64))


def _weighted_distill(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    with torch.no_grad():
        target = _SETTINGS.teacher(x).argmax(-1)
    logits = model(x) + _SETTINGS.offset
    loss = F.cross_entropy(logits, torch.where(y > 4, y, target), weight=_SETTINGS.class_weights)
    loss.backward()
    opt.step()
    return loss


def test_what_the_loop_changes_outside_the_model_between_steps_is_followed_or_compiled_again():
    """The teacher put in eval mode (its dropout off) and an offset of another shape compile
    the step again; new class weights of the same shape are read without compiling."""

    def between(i, eager_state, remat_state):
        if i == 0:
            _SETTINGS.teacher.eval()
        elif i == 1:
            _SETTINGS.class_weights = torch.linspace(0.5, 2.0, 10)
        elif i == 2:
            _SETTINGS.offset = torch.full((1,), 0.25)

    _SETTINGS.teacher.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The graphs compiled again are profiled again, and their smallest reachable peaks
        # move with the node times (by 1% on a busy machine): some room above the first's.
        _, _, compiled = _pair(lambda m: (_weighted_distill, None), steps=4, between=between, headroom=1.05)
    again = [str(w.message) for w in caught if "compiled again" in str(w.message)]
    assert len(again) == 2, again
    assert "global _SETTINGS.teacher.training (True -> False)" in again[0], again
    assert "_SETTINGS.offset (tensor[10] float32 -> tensor[1] float32)" in again[1], again
    assert len(compiled._graphs) == 3


_ENSEMBLE = {"teachers": [_Net(32).train(), _Net(64).eval()]}


def _ensemble_distill(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    with torch.no_grad():
        soft = sum(t(x).softmax(-1) for t in _ENSEMBLE["teachers"]) / len(_ENSEMBLE["teachers"])
    logits = model(x)
    loss = F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean") + F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    return loss


def test_teachers_in_a_list_in_a_dict_are_read_where_they_are_and_their_train_flags_watched():
    """Modules held in containers (an ensemble of teachers, a list of metrics): their
    parameters are read from where they are at each call, and a teacher put in eval mode
    (its dropout off) compiles the step again."""
    saved = [copy.deepcopy(t.state_dict()) for t in _ENSEMBLE["teachers"]]

    def between(i, eager_state, remat_state):
        if i == 0:
            with torch.no_grad():
                _ENSEMBLE["teachers"][1].b.weight.mul_(0.5)
        elif i == 1:
            _ENSEMBLE["teachers"][0].eval()

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, _, compiled = _pair(lambda m: (_ensemble_distill, None), between=between, headroom=1.05)
    finally:
        for t, state in zip(_ENSEMBLE["teachers"], saved):
            t.load_state_dict(state)
        _ENSEMBLE["teachers"][0].train()
    outside = [i.name for i in compiled._last.tg.inputs if i.kind is InputKind.OUTSIDE]
    assert "global _ENSEMBLE['teachers'][1].b.weight" in outside, outside
    again = [str(w.message) for w in caught if "compiled again" in str(w.message)]
    assert len(again) == 1 and "_ENSEMBLE['teachers'][0].training (True -> False)" in again[0], again


def test_a_tensor_outside_the_model_sharing_a_parameters_memory_is_refused_by_name():
    model = _Net()
    head = model.c.weight.detach()  # the parameter's memory: updated in place by the step

    def step(m, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y) + head.sum()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(CaptureError, match=r"reads head \(from the closure of step\), a tensor outside the model that shares its memory with c\.weight"):
        remat.compile(step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch())


def _ema_before_the_update(model):
    """An EMA of the weights before the update: it reads each parameter's old value, so that
    parameter's update may not move into the backward pass ahead of it."""
    ema = [p.detach().clone() for p in model.parameters()]

    def step(m, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        with torch.no_grad():
            for e, p in zip(ema, m.parameters()):
                e.lerp_(p, 0.1)
        opt.step()
        return loss

    return step, ema


def _running_statistic(model):
    """A running mean of the logits kept in a closure's list, written in the forward pass and read by the loss."""
    stat = [torch.zeros(10)]

    def step(m, opt, batch):
        x, y = batch
        opt.zero_grad()
        logits = m(x)
        with torch.no_grad():
            stat[0].mul_(0.9).add_(logits.mean(0), alpha=0.1)
        loss = F.cross_entropy(logits - stat[0], y)
        loss.backward()
        opt.step()
        return loss

    return step, stat


@pytest.mark.parametrize("make", [_ema_before_the_update, _running_statistic])
def test_tensors_outside_the_model_written_in_place_before_the_update_or_in_the_forward_pass(make):
    def between(i, eager_state, remat_state):
        assert all(torch.equal(a, b) for a, b in zip(eager_state, remat_state)), i

    _pair(make, between=between)


def _averaged(ema: bool):
    def make(model):
        swa = torch.optim.swa_utils
        average = swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9) if ema else None)

        def step(m, opt, batch):
            loss = _cross_entropy_step(m, opt, batch)
            average.update_parameters(m)
            return loss

        return step, average

    return make


@pytest.mark.parametrize("ema", [True, False], ids=["ema", "running mean"])
def test_averaged_model_updated_inside_the_step_copies_then_averages_as_eager(ema):
    # update_parameters copies the weights while n_averaged == 0 and averages after: the
    # count (an outside tensor) is followed, the branch held and checked at every call.
    def between(i, eager_average, remat_average):
        assert int(eager_average.n_averaged) == int(remat_average.n_averaged) == i + 1
        assert all(torch.equal(a, b) for a, b in zip(eager_average.parameters(), remat_average.parameters())), i

    with pytest.warns(UserWarning, match=r"branches on the value of average .*n_averaged.* the step is compiled again for it"):
        _, _, compiled = _pair(_averaged(ema), between=between)
    assert len(compiled._graphs) == 1


class _WithPlainTensors(_Net):
    """Plain tensor attributes (not buffers): one the forward reads, one sparse it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.mixing = torch.eye(16) * 0.5
        self.adjacency = torch.eye(16).to_sparse()

    def forward(self, x):
        return super().forward(x @ self.mixing)


def test_a_plain_tensor_attribute_of_the_model_is_an_input_and_an_unread_sparse_one_is_left_alone():
    torch.manual_seed(0)
    model = _WithPlainTensors()
    compiled = _tightest(_cross_entropy_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch())
    assert [i.name for i in compiled._last.tg.inputs if i.kind is InputKind.OUTSIDE] == ["model.mixing"]
    with torch.no_grad():
        model.mixing.mul_(2.0)  # read at the next call, as eager reads it
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    expected = F.cross_entropy(eager(_batch()[0]), _batch()[1])
    torch.manual_seed(1)
    assert torch.equal(compiled(_batch()), expected)


@functools.lru_cache(maxsize=None)
def _cached_scale(width: int) -> torch.Tensor:
    """A tensor made once per width by the user's cached function (as a causal mask by length is)."""
    return torch.linspace(0.5, 1.5, width)


class _Scales:
    @functools.lru_cache(maxsize=8)
    def of(self, width: int) -> torch.Tensor:
        return torch.linspace(0.5, 1.5, width)


_SCALES = _Scales()
_BY_SHAPE: dict = {}


def _scale_by_shape(n: int, width: int) -> torch.Tensor:
    """The same, cached in a global dict under a tuple key (as positional encodings often are)."""
    if (n, width) not in _BY_SHAPE:
        _BY_SHAPE[(n, width)] = torch.linspace(0.5, 1.5, width).expand(n, width).contiguous()
    return _BY_SHAPE[(n, width)]


@pytest.mark.parametrize("cache", ["lru_cache", "lru_cache method", "dict"])
def test_a_tensor_the_users_code_caches_is_eagers_and_the_cache_holds_only_what_eager_put_there(cache):
    def make_step(model):
        def train_step(model, opt, batch):
            x, y = batch
            opt.zero_grad()
            scale = _cached_scale(16) if cache == "lru_cache" else _SCALES.of(16) if cache == "lru_cache method" else _scale_by_shape(x.shape[0], 16)
            loss = F.cross_entropy(model(x * scale), y)
            loss.backward()
            opt.step()
            return loss

        return train_step, None

    cached = _cached_scale if cache == "lru_cache" else _Scales.of
    cached.cache_clear()
    _BY_SHAPE.clear()
    _pair(make_step, steps=4)
    if cache.startswith("lru_cache"):  # eager's four calls: one miss, then hits; none of remat's traces left a placeholder
        assert cached.cache_info().misses == 1 and cached.cache_info().hits == 3
        assert type(_cached_scale(16) if cache == "lru_cache" else _SCALES.of(16)) is torch.Tensor
    else:
        assert list(_BY_SHAPE) == [(128, 16)] and type(_BY_SHAPE[(128, 16)]) is torch.Tensor
