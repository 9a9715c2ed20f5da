"""Repeated blocks: found where a model repeats a layer, in each phase, and nowhere else;
the profiler lists them, and on request prices a node and its counterparts alike."""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from remat.cli import main as cli_main
from remat.models import make_optimizer, make_train_step
from remat.capture.capture import capture
from remat.profile.profiler import profile
from remat.profile.repeats import Block, Repeats, find_repeats, forward_counterparts, pooled_medians


class _Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.lin(self.norm(x)))


def _stack(widths: list[int]) -> nn.Module:
    """An input projection, then one residual layer per width (a projection between widths)."""
    parts: list[nn.Module] = [nn.Linear(6, widths[0])]
    for i, w in enumerate(widths):
        if i and w != widths[i - 1]:
            parts.append(nn.Linear(widths[i - 1], w))
        parts.append(_Layer(w))
    return nn.Sequential(*parts)


def _captured(widths: list[int]):
    torch.manual_seed(0)
    model = _stack(widths)
    opt = make_optimizer("adamw", model.parameters())
    batch = (torch.randn(4, 6), torch.randn(4, widths[-1]))
    step = make_train_step(lambda m, b: (m(b[0]) - b[1]).pow(2).mean())
    return model, opt, batch, capture(step, model, opt, batch)


def test_equal_layers_repeat_in_every_phase_and_each_node_stands_for_its_counterparts():
    model, opt, batch, tg = _captured([16] * 5)
    repeats = find_repeats(tg)
    ops = tg.op_nodes()
    forward = [b for b, ph in zip(repeats.blocks, repeats.phases) if ph == "forward"]
    assert {"forward", "backward", "optimizer"} <= set(repeats.phases)
    # Five layers: at least four repeats of one layer's forward ops in a row (where the
    # first layer reads the input projection, it may start one repeat later).
    layer_ops = sum(1 for n in ops if tg.phase[n.name].value == "forward") // 5
    assert any(b.count >= 4 and abs(b.length - layer_ops) <= 2 for b in forward), (forward, layer_ops)
    spans = sorted((b.start, b.start + b.length * b.count) for b in repeats.blocks)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    for rep, members in repeats.classes().items():
        assert len(members) >= 2
        for r in members:
            assert ops[r].target == ops[rep].target
            assert tg.phase[ops[r].name] == tg.phase[ops[rep].name]
            val, ref = ops[r].meta.get("val"), ops[rep].meta.get("val")
            if isinstance(val, torch.Tensor):
                assert val.shape == ref.shape and val.dtype == ref.dtype


def test_each_forward_op_of_a_repeated_layer_has_its_counterpart_in_the_first_layer():
    _, _, _, tg = _captured([16] * 5)
    ops = {n.name: n for n in tg.op_nodes()}
    rank = {n: i for i, n in enumerate(ops)}
    counterpart = forward_counterparts(tg)
    forward_ops = sum(1 for n in ops if tg.phase[n].value == "forward")
    assert len(counterpart) >= 4 * forward_ops // 5  # four layers or more, each op with its counterpart
    stand_ins = set(counterpart.values())
    assert len(stand_ins) * 4 <= len(counterpart)  # each counterpart stands for at least four ops
    for node, first in counterpart.items():
        assert tg.phase[node].value == "forward" and ops[node].target == ops[first].target
        assert rank[first] <= rank[node] and counterpart[first] == first
    _, _, _, uneven = _captured([8, 12, 16, 20, 24])
    assert len(forward_counterparts(uneven)) < forward_ops // 5  # a few ops at most, no layer


def test_layers_of_different_widths_do_not_repeat():
    _, _, _, tg = _captured([8, 12, 16, 20, 24])
    repeats = find_repeats(tg)
    ops = tg.op_nodes()
    # Nothing a layer long repeats in the forward pass: every repeat found is a few ops.
    forward_ops = sum(1 for n in ops if tg.phase[n.name].value == "forward")
    assert all(b.length < forward_ops // 5 for b, ph in zip(repeats.blocks, repeats.phases) if ph == "forward")


def test_pooled_medians_take_every_repeat_and_run():
    samples = np.array([[1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 7.0], [4.0, 40.0, 5.0, 50.0, 6.0, 60.0, 9.0]])
    repeats = Repeats([Block(start=0, length=2, count=3)], np.array([0, 1, 0, 1, 0, 1, 6]), ["forward"])
    got = pooled_medians(samples, repeats)
    assert got.tolist() == [3.5, 35.0, 3.5, 35.0, 3.5, 35.0, 8.0]


def test_a_pooled_profile_prices_counterparts_alike_and_both_say_where_the_repeats_are():
    model, opt, batch, tg = _captured([16] * 4)
    repeats = find_repeats(tg)
    pooled = profile(tg, model, opt, batch, runs=2, progress=False, pool_repeats=True)
    alone = profile(tg, model, opt, batch, runs=2, progress=False)
    assert repeats.blocks
    for prof, is_pooled in ((pooled, True), (alone, False)):
        assert prof.meta["repeats"] == repeats.summary() and prof.meta["pooled_repeats"] is is_pooled
    for rep, members in repeats.classes().items():
        assert len({pooled.node_seconds[r] for r in members}) == 1
    # Its own samples: counterparts differ somewhere (timer noise alone makes them differ).
    assert any(len({alone.node_seconds[r] for r in members}) > 1 for members in repeats.classes().values())


def test_cli_profile_lists_the_repeated_blocks(tmp_path, capsys):
    rc = cli_main(["profile", "--model", "gpt-narrow-6", "--batch-size", "1", "--runs", "1", "--out", str(tmp_path), "--json", "--pool-repeats"])
    assert rc == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    blocks = out["repeated_blocks"]
    assert [b["count"] for b in blocks if b["phase"] == "forward"] == [6]  # six equal decoder layers
    assert any(b["phase"] == "backward" and b["count"] == 6 for b in blocks)
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["meta"]["repeats"] == blocks and saved["meta"]["pooled_repeats"] is True
    assert "Repeated blocks (node times pooled over the repeats)" in captured.err
