"""A dropout's mask is held for the backward pass as booleans: the same bits as eager's
float mask, in every floating dtype and for every form of dropout that scales a draw, and a
quarter of the bytes held from the forward pass to the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.capture.capture import capture
from remat.capture.train_graph import Phase
from remat.ops import dropout_masks
from remat.profile.allocator import measure_step_peak

aten = torch.ops.aten


class _Dropouts(nn.Module):
    """Each form of dropout a model uses: a module, the functional form in place, feature
    dropout of a channel map, and a drop of whole rows (stochastic depth)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 5)
        self.drop, self.p = nn.Dropout(p), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.inp(x)))
        h = torch.tanh(nn.functional.dropout(self.hidden(h), self.p, training=True, inplace=True))
        h = nn.functional.dropout2d(h.view(h.shape[0], 16, 4, 4), self.p, training=True).flatten(1)
        keep = h.new_empty(h.shape[0], 1).bernoulli_(1 - self.p).div_(1 - self.p)
        return self.out(h * keep)


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def _batches(dtype: torch.dtype, n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(512, 32, generator=g).to(dtype), "y": torch.randint(0, 5, (512,), generator=g)} for _ in range(n)]


def _compiled_and_compared(model: nn.Module, batches: list[dict[str, torch.Tensor]], budget: float | None) -> tuple[remat.RematStep, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """The step compiled for `model`, trained beside an eager copy on `batches` with the same
    draws: each loss and every parameter bitwise equal."""
    eager_model = copy.deepcopy(model)
    optimizer, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step = remat.compile(_step, model, optimizer, batches[0], memory_budget=budget, profile_runs=1)
    for batch in batches:
        torch.manual_seed(1)
        ours = step(batch)
        torch.manual_seed(1)
        assert torch.equal(ours, _step(eager_model, eager_opt, batch))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))
    return step, optimizer, eager_model, eager_opt


def test_the_backward_pass_reads_booleans_and_the_float_mask_dies_in_the_forward_pass():
    torch.manual_seed(0)
    model = _Dropouts(0.1)
    tg = capture(_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(torch.float32, 1)[0])
    kept = [n for n in tg.gm.graph.nodes if n.name.startswith(dropout_masks.KEPT)]
    assert dropout_masks.held(tg.gm) == len(kept)
    assert len(kept) == 4  # each of the four draws
    for node in kept:
        assert node.meta["val"].dtype == torch.bool and tg.phase[node.name] is Phase.FORWARD
        assert {tg.phase[u.name] for u in node.users} == {Phase.BACKWARD}
    scaled = [n for n in tg.gm.graph.nodes if n.target is aten.div_.Scalar and tg.phase[n.name] is Phase.FORWARD]
    assert scaled and all(tg.phase[u.name] is Phase.FORWARD for n in scaled for u in n.users)


@pytest.mark.parametrize("dtype, p, budget", [(torch.float32, 0.1, None), (torch.float32, 0.5, 0.85), (torch.bfloat16, 0.2, 0.9), (torch.float64, 0.3, 0.85)])
def test_trains_bitwise_like_eager_in_every_dtype_with_and_without_recomputation(dtype, p, budget):
    torch.manual_seed(0)
    model = _Dropouts(p).to(dtype)
    step, optimizer, eager_model, eager_opt = _compiled_and_compared(model, _batches(dtype), budget)
    assert all(torch.equal(optimizer.state[a]["exp_avg_sq"], eager_opt.state[b]["exp_avg_sq"]) for a, b in zip(model.parameters(), eager_model.parameters()))
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    if budget is not None:
        assert step.report.num_recomputed > 0


def test_without_recomputation_the_step_holds_a_quarter_of_eagers_mask_bytes():
    """Eager holds each float mask to its backward, the graph its booleans; the rest of the
    step is the same. At the peak (the large layer's weight gradient, in the backward pass)
    the first dropout's mask is still held: the graph's peak is three bytes an element of it
    below eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4096), nn.Dropout(0.1), nn.ReLU(), nn.Linear(4096, 4096), nn.Dropout(0.1), nn.ReLU(), nn.Linear(4096, 5))
    eager_model = copy.deepcopy(model)
    optimizer, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    batch = {"x": torch.randn(256, 64), "y": torch.randint(0, 5, (256,))}
    step = remat.compile(_step, model, optimizer, batch, memory_budget=None, profile_runs=1)
    step(batch)
    eager = measure_step_peak(lambda: _step(eager_model, eager_opt, batch), "cpu", eager_model).peak_bytes
    ours = step.report.measured_peak_bytes - step.report.persistent_bytes
    assert abs((eager - ours) - 3 * 256 * 4096) <= 64, (eager, ours)


class _MaskWrittenThroughAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = torch.empty_like(h).bernoulli_(0.8).div_(0.8)
        mask[:, :8] = 1.0  # the first features always kept: the backward reads this mask
        return self.b(h * mask)


def test_a_mask_written_through_a_view_is_left_as_it_is_and_trains_bitwise():
    torch.manual_seed(0)
    step = _compiled_and_compared(_MaskWrittenThroughAView(), _batches(torch.float32), None)[0]
    assert dropout_masks.held(step.graph_module) == 0
