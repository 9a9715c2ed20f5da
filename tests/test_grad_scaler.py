"""fp16 training with torch.amp.GradScaler: the scaler's unscale, overflow check, skipped
update and scale update are graph ops, so the step is bitwise like eager's over steps that
overflow (the scale backs off, the update is skipped) and steps that grow the scale. A
fused optimizer's kernel skips the update itself; an unfused one, which the scaler skips by
a Python branch, has its writes masked in the graph (ops/masked_writes.py), and
Accelerate's flag of a skipped step is set after each run."""

from __future__ import annotations

import pytest
import torch

import remat


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.1))]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))


def _batches(overflowing: tuple[int, ...] = (2, 5)) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # These steps overflow in fp16 (their inputs are huge): eager skips their updates.
    return [{"x": torch.randn(64, 64, generator=g) * (3e4 if i in overflowing else 1.0), "y": torch.randint(0, 4, (64,), generator=g)} for i in range(8)]


def _run(make_optimizer, compiled: bool, unscale_first: bool, overflowing: tuple[int, ...] = (2, 5), budget: float | None = 0.92, warm_up: bool = False):
    model = _model()
    model.iters = 0
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)

    def train_step(model, optimizer, batch):
        if warm_up:  # nanoGPT's: the rate set from the step's count before the scaler's step, skipped or not
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * min(1.0, (model.iters + 1) / 4)
            model.iters += 1
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    batches = _batches(overflowing)
    step = remat.compile(train_step, model, optimizer, batches[0], memory_budget=budget) if compiled else None
    seen = []
    for batch in batches:
        loss = step(batch) if compiled else train_step(model, optimizer, batch)
        seen.append((loss, scaler._scale.clone(), scaler._growth_tracker.clone()))
    state = [p.detach().clone() for p in model.parameters()] + [t.clone() for s in optimizer.state.values() for t in s.values()]
    return seen, state + [torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)], step


def _assert_same(ran, state, eager, eager_state) -> None:
    for (loss, scale, tracker), (e_loss, e_scale, e_tracker) in zip(ran, eager, strict=True):
        torch.testing.assert_close(loss, e_loss, rtol=0, atol=0, equal_nan=True)  # an overflowing step's loss is inf or nan
        assert torch.equal(scale, e_scale) and torch.equal(tracker, e_tracker)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


@pytest.mark.parametrize(
    "name, make_optimizer, unscale_first",
    [
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), False),
        ("adamw-unscale-clip", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), True),
        ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True), False),
    ],
)
def test_grad_scaler_with_a_fused_optimizer_is_bitwise(name, make_optimizer, unscale_first):
    eager, eager_state, _ = _run(make_optimizer, False, unscale_first)
    ran, state, step = _run(make_optimizer, True, unscale_first)
    scales = [float(s) for _, s, _ in eager]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))  # backs off and grows
    assert step.report.num_recomputed > 0 and len(step._graphs) == 1
    _assert_same(ran, state, eager, eager_state)


@pytest.mark.parametrize(
    "name, make_optimizer, unscale_first, overflowing",
    [
        ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), False, (2, 5)),
        ("adamw-foreach-first-step-skipped", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), False, (0, 1, 4)),
        ("adamw-unscale-clip", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), True, (2, 5)),
        ("adam-decay-writes-grads", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, foreach=True), False, (2, 5)),
        ("sgd-momentum-first-step-skipped", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), False, (0, 3)),
    ],
)
def test_grad_scaler_with_an_unfused_optimizer_is_bitwise(name, make_optimizer, unscale_first, overflowing):
    """The scaler skips an unfused optimizer's step in Python: the graph runs the update and
    keeps the old values of what it writes where the check found an inf. Without the masking
    the overflowing steps would write inf or NaN into the parameters."""
    eager, eager_state, _ = _run(make_optimizer, False, unscale_first, overflowing, budget=None)
    ran, state, step = _run(make_optimizer, True, unscale_first, overflowing, budget=None)
    scales = [2.0**16] + [float(scale) for _, scale, _ in eager]
    assert [i for i in range(len(eager)) if scales[i + 1] < scales[i]] == list(overflowing)  # they overflowed
    assert len(step._graphs) == 1
    _assert_same(ran, state, eager, eager_state)
    assert all(torch.isfinite(t).all() for t in state)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_rate_the_step_sets_before_the_scalers_step_is_set_through_skipped_updates_as_in_eager(fused):
    eager, eager_state, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=fused or None), False, True, budget=None, warm_up=True)
    ran, state, step = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=fused or None), True, True, budget=None, warm_up=True)
    assert eager_state[-1].item() == 1e-3 and len(step._graphs) <= 2  # warmed up; a graph per side of min
    _assert_same(ran, state, eager, eager_state)


class _DecayingSGD(torch.optim.SGD):
    """Lowers its rate in its own step: a skipped update would not have lowered it."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = group["lr"] * 0.9
        return super().step(closure)


def test_a_rate_the_optimizers_own_step_sets_under_a_grad_scaler_is_refused():
    with pytest.raises(remat.CaptureError, match=r"GradScaler may skip this optimizer's update.*set in .*\['lr'\]"):
        _run(lambda ps: _DecayingSGD(ps, lr=1e-2), True, False, budget=None)


def test_accelerate_learns_which_steps_the_scaler_skipped():
    """Accelerate's optimizer records a skipped step (`step_was_skipped`) by whether the
    scaler called `optimizer.step()`, and its scheduler then does not step: remat sets the
    flag from the graph after each run, so the learning rates follow eager's."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.state import AcceleratorState, GradientState

    def run(compiled: bool):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerate.Accelerator(cpu=True)  # the state its wrappers read; on CPU it makes no scaler itself
        model = _model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), device_placement=False, scaler=scaler)
        scheduler = AcceleratedScheduler(torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: 1.0 / (s + 1)), optimizer)

        def train_step(model, optimizer, batch):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            scaler.scale(loss).backward()
            optimizer.step()
            return loss.detach()

        batches = _batches((2, 5))
        step = remat.compile(train_step, model, optimizer, batches[0], memory_budget=None) if compiled else train_step
        seen = []
        for batch in batches:
            step(model, optimizer, batch) if not compiled else step(batch)
            scheduler.step()
            seen.append((optimizer.step_was_skipped, optimizer.param_groups[0]["lr"]))
        return seen, [p.detach().clone() for p in model.parameters()]

    eager, eager_params = run(False)
    ran, params = run(True)
    assert [skipped for skipped, _ in eager] == [i in (2, 5) for i in range(8)]
    assert ran == eager
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
