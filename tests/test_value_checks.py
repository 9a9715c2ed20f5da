"""Branches on a tensor's value one side of which raises (a library's input check, an
`assert` on the loss, clip_grad_norm_'s error_if_nonfinite, a distribution's argument
validation) are held in the graph as checks: the step trains bitwise like eager, and a
batch that fails a check raises what eager raises, with the parameters and the optimizer's
state as eager leaves them."""

from __future__ import annotations

import copy
import itertools
import math
import sys
import types

import pytest
import torch
from torch import nn

import remat
from remat.errors import CaptureError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 5))


def _checked_step(model, optimizer, batch):
    if batch["y"].max() >= 5:  # a library's check of its input: one side raises
        raise ValueError("labels must be < 5")
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    assert torch.isfinite(loss), "the loss is not finite"
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    return loss


def _gradient_checked_step(model, optimizer, batch):
    optimizer.zero_grad()
    (model(batch["x"]).pow(2).mean() * batch["scale"]).backward()
    # A check on the gradients: the updates cannot run before it.
    if not torch.cat([p.grad.flatten() for p in model.parameters()]).isfinite().all():
        raise FloatingPointError("a gradient is not finite")
    optimizer.step()
    return batch["scale"] * 1.0


def _updated_checked_step(model, optimizer, batch):
    optimizer.zero_grad()
    (model(batch["x"]).pow(2).mean() * batch["scale"]).backward()
    optimizer.step()
    # A check after the update: it reads the updated weights, once every update has run.
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a weight is not finite"
    return batch["scale"] * 1.0


_LOGGED: list[float] = []


def _item_checked_step(model, optimizer, batch):
    """MAE's, DeiT's and DINO's loop: the loss as a number, logged, and the run stopped where it is not finite."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"]) * batch["scale"]
    loss_value = loss.item()
    if loss_value > 1e6:  # inf: a comparison of the number
        raise FloatingPointError("the loss exploded")
    if not math.isfinite(loss_value):  # NaN
        print(f"Loss is {loss_value}, stopping training")
        sys.exit(1)
    loss.backward()
    optimizer.step()
    _LOGGED.append(loss_value)
    return loss


def _batch(g: torch.Generator, **change) -> dict[str, torch.Tensor]:
    b = {"x": torch.randn(256, 16, generator=g), "y": torch.randint(0, 5, (256,), generator=g), "scale": torch.ones(())}
    b.update(change)
    return b


def _failure(fn):
    try:
        fn()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - compared between eager and remat
        return type(e), str(e).splitlines()[0], e.args if isinstance(e, SystemExit) else ()  # sys.exit's code  # (pytest adds the values an assert saw on later lines)
    return None


def _bitwise(x: torch.Tensor, y: torch.Tensor) -> bool:  # NaN where the other has NaN (an update the check stops after)
    return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())


def _same_state(a: nn.Module, b: nn.Module, opt_a, opt_b) -> bool:
    same = all(_bitwise(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = opt_a.state[p], opt_b.state[q]
        same &= sa.keys() == sb.keys() and all(_bitwise(sa[k], sb[k]) for k in sa)
    return same


@pytest.mark.parametrize("step_fn", [_checked_step, _gradient_checked_step, _updated_checked_step, _item_checked_step],
                         ids=["input-and-loss-checks", "gradient-check", "check-after-the-update", "math.isfinite-sys.exit"])
def test_a_checked_step_trains_bitwise_and_a_failing_batch_raises_what_eager_raises(step_fn):
    model, ref = _model(), _model()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    step = remat.compile(step_fn, model, opt, _batch(g), memory_budget=0.9)
    bad = [_batch(g, x=torch.full((256, 16), float("nan"))), _batch(g, scale=torch.tensor(float("inf")))]
    if step_fn is _checked_step:
        bad.append(_batch(g, y=torch.full((256,), 7)))
    for i in range(6):
        b = _batch(g) if i % 2 == 0 else bad[(i // 2) % len(bad)]
        state = torch.get_rng_state()
        got = _failure(lambda: step(b))
        torch.set_rng_state(state)
        want = _failure(lambda: step_fn(ref, ref_opt, b))
        assert got == want, (i, got, want)
        assert _same_state(model, ref, opt, ref_opt), i
    # Checks on the input and the loss come before the backward pass, and the updates move
    # into it; a check on every gradient keeps them after it.
    assert step.report.plan.updates_in_backward == (step_fn in (_checked_step, _item_checked_step)) and len(step._graphs) == 1
    if step_fn is _item_checked_step:  # each side's good steps logged their loss, the same numbers
        assert len(_LOGGED) == 6 and _LOGGED[1::2] == _LOGGED[0::2], _LOGGED


def test_the_failed_check_names_where_the_step_checks():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    step = remat.compile(_checked_step, model, opt, _batch(g), memory_budget=0.9)
    with pytest.raises(ValueError, match="labels must be < 5") as caught:
        step(_batch(g, y=torch.full((256,), 9)))
    assert "test_value_checks.py, line" in caught.value.__notes__[0] and "no update run that eager's had not run" in caught.value.__notes__[0]


def _item_named_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"]) * batch["scale"]
    loss_value = loss.item()
    if loss_value > 1e6:
        raise FloatingPointError(f"the loss exploded: {loss_value}")
    if loss_value < 0:
        raise ValueError(f"a negative loss: {loss_value:.3f}")
    loss.backward()
    optimizer.step()
    return loss


def test_a_failed_checks_message_shows_no_traced_value():
    """The trace knew no value to write into the message: a placeholder shows where, and a
    message it could not format at all says so."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    step = remat.compile(_item_named_step, model, opt, _batch(g), memory_budget=0.9)
    with pytest.raises(FloatingPointError, match=r"^the loss exploded: <a value the step computed>(\n|$)"):
        step(_batch(g, scale=torch.tensor(float("inf"))))
    with pytest.raises(RuntimeError, match="formats a number the step computed with a format spec"):
        step(_batch(g, scale=torch.tensor(-1.0)))


def test_a_distribution_that_validates_its_arguments_trains_bitwise():
    model, ref = _model(), _model()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(batch["x"])
        z = torch.distributions.Normal(out[:, :2], nn.functional.softplus(out[:, 2:4]) + 1e-3).rsample()  # validate_args on
        loss = z.pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    g = torch.Generator().manual_seed(3)
    batches = [_batch(g) for _ in range(4)]
    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=0.9)
    for b in batches:
        state = torch.get_rng_state()
        got = step(b)
        torch.set_rng_state(state)
        assert torch.equal(got, step_fn(ref, ref_opt, b))
    assert _same_state(model, ref, opt, ref_opt)


def test_a_branch_that_goes_on_either_way_is_still_refused():
    model = _model()

    def step_fn(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(batch["x"])
        loss = out.mean() if out.sum() > 0 else out.pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(CaptureError, match=r"data-dependent.*line \d+: loss = out\.mean\(\) if out\.sum\(\) > 0.*goes on either way"):
        remat.compile(step_fn, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(torch.Generator().manual_seed(4)))


def test_checks_hold_under_compiled_regions():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    step = remat.compile(_checked_step, model, opt, _batch(g), memory_budget=0.9, backend="inductor")
    assert torch.isfinite(step(_batch(g)))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(AssertionError, match="the loss is not finite"):
        step(_batch(g, x=torch.full((256, 16), float("nan"))))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.report.backend == "inductor"


def test_a_check_beside_a_tensor_the_step_keeps_in_the_users_object():
    # One side of the check is traced to its failure: what that trace kept is put back.
    model, ref = _model(), _model()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    kept, ref_kept = types.SimpleNamespace(), types.SimpleNamespace()

    def keeping(into):
        def step_fn(model, optimizer, batch):
            optimizer.zero_grad()
            logits = model(batch["x"])
            into.logits = logits.detach()
            loss = nn.functional.cross_entropy(logits, batch["y"])
            assert torch.isfinite(loss)
            loss.backward()
            optimizer.step()
            return loss

        return step_fn

    g = torch.Generator().manual_seed(6)
    batches = [_batch(g) for _ in range(3)]
    step = remat.compile(keeping(kept), model, opt, batches[0], memory_budget=None)
    assert not hasattr(kept, "logits")
    for b in batches:
        state = torch.get_rng_state()
        got = step(b)
        torch.set_rng_state(state)
        assert torch.equal(got, keeping(ref_kept)(ref, ref_opt, b)) and torch.equal(kept.logits, ref_kept.logits)


class _LayerDrop(nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.layers, self.rate = nn.ModuleList(nn.Linear(16, 16) for _ in range(3)), rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # as Hugging Face's models drop layers
            skip = False
            if self.training and self.rate > 0:
                skip = torch.rand([]) < self.rate
            if not skip:
                x = torch.tanh(layer(x))
        return x


def _layerdrop_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(batch["x"]).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_layerdrop_is_refused_as_a_random_branch_and_its_advice_works():
    model = _LayerDrop(0.1)
    batch = {"x": torch.randn(64, 16)}
    with pytest.raises(CaptureError, match=r"branches on a random draw.*line \d+: if not skip:.*Set the rate to 0"):
        remat.compile(_layerdrop_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, memory_budget=None)
    model.rate = 0.0  # the advice
    ref = _LayerDrop(0.0)
    ref.load_state_dict(model.state_dict())
    step = remat.compile(_layerdrop_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, memory_budget=None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        assert torch.equal(step(batch), _layerdrop_step(ref, ref_opt, batch))


class _ActNorm(nn.Module):
    """Glow's ActNorm: set from the first batch's statistics, then trained (a buffer flag)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.loc, self.logs = nn.Parameter(torch.zeros(width)), nn.Parameter(torch.zeros(width))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if not self.initialized:  # a branch on the model's own state that goes on either way
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-(x.std(0) + 1e-6).log())
                self.initialized.fill_(1)
        return (x + self.loc) * self.logs.exp()


class _Curriculum(nn.Module):
    """A model whose phase, a buffer the loop sets between steps, picks its loss's path."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), _ActNorm(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 5))
        self.register_buffer("phase", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = self.net(x)
        return out * 0.5 if self.phase.item() < 1 else out


def _plain_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def test_a_branch_on_the_models_buffers_takes_their_side_and_compiles_again_when_they_change():
    """The first step sets ActNorm up from its batch and raises its flag; the second finds
    the flag raised and the step compiled again for it; the loop moves the phase on at the
    fourth. Bitwise with eager at every step, each change named in a warning."""
    torch.manual_seed(0)
    model = _Curriculum()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    batches = [_batch(torch.Generator().manual_seed(i)) for i in range(6)]
    step = remat.compile(_plain_step, model, opt, batches[0], memory_budget=0.9)
    with pytest.warns(UserWarning, match=r"model\.net\.1\.initialized, at test_value_checks.py, line \d+: if not self.initialized:.*went False .* goes True now: the step is compiled again"):
        for i, b in enumerate(batches):
            if i == 3:
                model.phase.fill_(1)
                eager_model.phase.fill_(1)
            torch.manual_seed(i)
            ours = step(b)
            torch.manual_seed(i)
            assert torch.equal(ours, _plain_step(eager_model, eager_opt, b)), i
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(model.buffers(), eager_model.buffers()):
        assert torch.equal(a, b)
    assert len(step._graphs) == 1 and step.report.measured_peak_bytes == step.report.predicted_peak_bytes


class _Warmup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 5)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += 1  # written before the branch reads it: the check cannot run first
        return self.lin(x) * (0.5 if self.seen <= 2 else 1.0)


def _first_check_runs_before_any_write(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph's first value check comes before its first write to one of its inputs."""
    from remat.ops import op_facts

    nodes = list(gm.graph.nodes)
    checks = [i for i, n in enumerate(nodes) if n.target is torch.ops.remat.value_check.default]
    writes = [i for i, n in enumerate(nodes) if any(op_facts.viewed_base(w).op == "placeholder" for w in op_facts.written_args(n))]
    return bool(checks) and (not writes or checks[0] < writes[0])


def test_a_branch_on_a_buffer_the_step_writes_before_it_is_checked_first_on_a_copy_and_compiles_again():
    """`self.seen += 1`, then a branch on `seen`: the check runs first, on a copy of the buffer
    moved on as the step moves it, so where its side changes the step compiles again before
    it has changed anything, and trains bitwise like eager."""
    torch.manual_seed(0)
    model = _Warmup()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(_plain_step, model, opt, _batch(torch.Generator().manual_seed(0)), memory_budget=None)
    assert _first_check_runs_before_any_write(step.compiled_for(_batch(torch.Generator().manual_seed(0))).gm)
    with pytest.warns(UserWarning, match=r"model\.seen, at test_value_checks.py, line \d+: return self.lin.*went True .* goes False now: the step is compiled again") as said:
        for seed in range(1, 6):  # seen: 1, 2, then 3 from the third step on
            b = _batch(torch.Generator().manual_seed(seed))
            assert torch.equal(step(b), _plain_step(eager_model, eager_opt, b)), seed
    assert sum("compiled again" in str(w.message) for w in said) == 1
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(model.seen, eager_model.seen) and int(model.seen) == 5


_SET_UP_CALLS = itertools.count()  # counts the set-up's runs and traces alike: no watch puts it back


class _SetUpOnce(nn.Module):
    """A layer whose set-up is skipped while its flag is raised."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 5)
        self.register_buffer("ready", torch.ones((), dtype=torch.bool))

    def forward(self, x):
        if not self.ready:
            next(_SET_UP_CALLS)
            self.ready.fill_(True)
        return self.lin(x)


def test_the_side_of_a_branch_the_buffers_do_not_take_is_never_traced():
    model = _SetUpOnce()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(_plain_step, model, opt, _batch(torch.Generator().manual_seed(0)), memory_budget=None)
    for seed in range(3):
        b = _batch(torch.Generator().manual_seed(seed))
        assert torch.equal(step(b), _plain_step(eager_model, eager_opt, b))
    assert next(_SET_UP_CALLS) == 0
