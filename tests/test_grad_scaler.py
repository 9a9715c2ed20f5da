"""fp16 training with torch.amp.GradScaler: with a fused optimizer, the scaler's unscale,
overflow check, skipped update and scale update are graph ops (the fused kernel skips the
update when it finds an inf), so the step is bitwise like eager's over steps that overflow
(the scale backs off, the update is skipped) and steps that grow the scale. An unfused
optimizer, which the scaler skips by a Python branch, is refused with what to do."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.errors import CaptureError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.1))]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # Steps 2 and 5 overflow in fp16 (their inputs are huge): eager skips their updates.
    return [{"x": torch.randn(64, 64, generator=g) * (3e4 if i in (2, 5) else 1.0), "y": torch.randint(0, 4, (64,), generator=g)} for i in range(8)]


def _run(make_optimizer, compiled: bool, unscale_first: bool):
    model = _model()
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)

    def train_step(model, optimizer, batch):
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

    batches = _batches()
    step = remat.compile(train_step, model, optimizer, batches[0], memory_budget=0.92) if compiled else None
    seen = []
    for batch in batches:
        loss = step(batch) if compiled else train_step(model, optimizer, batch)
        seen.append((loss, scaler._scale.clone(), scaler._growth_tracker.clone()))
    state = [p.detach().clone() for p in model.parameters()] + [t.clone() for s in optimizer.state.values() for t in s.values()]
    return seen, state, step


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
    for (loss, scale, tracker), (e_loss, e_scale, e_tracker) in zip(ran, eager):
        torch.testing.assert_close(loss, e_loss, rtol=0, atol=0, equal_nan=True)  # an overflowing step's loss is inf or nan
        assert torch.equal(scale, e_scale) and torch.equal(tracker, e_tracker)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))


def test_grad_scaler_with_an_unfused_optimizer_is_refused_with_what_to_do():
    with pytest.raises(CaptureError, match="fused=True"):
        _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3), True, False)
