"""The batch's plain values (paths and ids as strings, an int, a flag, None): one the step
never reads takes any value with one graph; an int it computes with is read at every call;
one it reads otherwise is held as a constant and keys the graph; a text the step leaves in
the user's state is set again after each run. Each case is trained beside eager and compared bitwise after every step."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.capture.batch_leaves import BatchValues, _StandIn


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "x": torch.randn(4, 8, generator=g), "y": torch.randint(0, 4, (4,), generator=g),
        "paths": [f"img{i}_{j}.jpg" for j in range(4)], "idx": i, "mask": None, "augmented": i % 2 == 0,
        "lang": "en" if i % 2 else "de", "rows": 3 + i % 2,
    }  # fmt: skip


def _twins(
    step_of: Callable[[dict[str, Any]], Callable[..., Any]], steps: int = 6, state: Callable[[dict[str, Any]], Any] | None = None,
    between: Callable[[list[dict[str, Any]], int], None] | None = None, batches: list[dict[str, Any]] | None = None,
) -> tuple[Any, list[str]]:  # fmt: skip
    """Train the step in eager and compiled (each with its own `env`, the user's state the
    step reaches) over `steps` batches (`batches`, or `_batch(i)`), `between(envs, i)` before each; assert losses,
    parameters, optimizer state and the user's `state` equal after every step. The
    compiled step and its warnings."""
    envs = [{}, {}]
    steps_made = [step_of(env) for env in envs]
    (model, opt), (twin, twin_opt) = _model(), _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = batches or [_batch(i) for i in range(steps)]
        compiled = remat.compile(steps_made[1], twin, twin_opt, batches[0], memory_budget=0.7)
        for i, batch in enumerate(batches):
            if between is not None:
                between(envs, i)
            eager_loss = steps_made[0](model, opt, copy.deepcopy(batch))
            loss = compiled(batch)
            assert torch.equal(eager_loss.detach(), loss), i
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q), i
            for p, q in zip(model.parameters(), twin.parameters()):
                assert all(torch.equal(opt.state[p][k], twin_opt.state[q][k]) for k in opt.state[p]), i
            if state is not None:
                assert state(envs[0]) == state(envs[1]), (i, state(envs[0]), state(envs[1]))
    return compiled, [str(w.message) for w in caught if str(w.message).startswith("remat:")]


def _loss(model: torch.nn.Module, batch: dict[str, Any], x: torch.Tensor | None = None) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"] if x is None else x), batch["y"])


def _finish(loss: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_plain_values_the_step_never_reads_take_any_value_in_one_graph():
    def step_of(env):
        def train_step(model, opt, batch):
            x, y, paths = batch["x"], batch["y"], batch["paths"]  # unpacked, passed over
            inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}  # isinstance sees a str as a str
            assert isinstance(paths[0], str) and batch["mask"] is None
            return _finish(F.cross_entropy(model(inputs["x"]), y), opt)
        return train_step

    compiled, _ = _twins(step_of)
    # The paths, ids and language changed at every step, one graph for any; a bool is held as
    # itself (`flag is True` reads nothing a stand-in could see): a graph for each of its two.
    assert len(compiled._graphs) == 2


def test_plain_values_the_step_reads_key_the_graph():
    weights = {"en": 1.0, "de": 0.5}

    def step_of(env):
        def train_step(model, opt, batch):
            rows = batch["rows"]  # an int as a size
            loss = F.cross_entropy(model(batch["x"][:rows]), batch["y"][:rows]) * weights[batch["lang"]]  # a str as a key
            if batch["augmented"]:  # a bool
                loss = loss * 2
            return _finish(loss, opt)
        return train_step

    compiled, _ = _twins(step_of)
    assert len(compiled._graphs) == 2  # (3, "de", True) and (4, "en", False), each compiled once


def test_a_value_read_by_c_code_is_held_too():
    def step_of(env):
        def train_step(model, opt, batch):
            name = "-".join(batch["paths"])  # str.join reads each item without a method call
            scale = 2.0 if os.path.basename(batch["paths"][0]).startswith("img1") else 1.0
            return _finish(_loss(model, batch) * (scale + len(name) * 0.0), opt)
        return train_step

    _, notes = _twins(step_of, steps=5)
    assert any("reads batch['paths'][0]" in n and "graphs of this shape so far" in n for n in notes), notes


def test_a_batch_value_left_in_the_users_state_is_set_there_after_each_run():
    def step_of(env):
        def train_step(model, opt, batch):
            env["last_path"] = batch["paths"][0]
            return _finish(_loss(model, batch), opt)
        return train_step

    compiled, _ = _twins(step_of, steps=3, state=lambda env: env.get("last_path"))
    assert not any(isinstance(v, _StandIn) for g in compiled._graphs.values() for v in g.step_values)


class _Log:
    mode = None  # a class default: the step sets the instance's field


def test_a_text_the_step_sets_is_set_again_whatever_the_loop_left():
    flags = {"flag": True}

    def step_of(env):
        env["log"] = _Log()

        def train_step(model, opt, batch):
            env["log"].mode = "even" if flags["flag"] else "odd"
            return _finish(_loss(model, batch), opt)
        return train_step

    def between(envs, i):
        flags["flag"] = i % 3 != 1
        for env in envs:
            env["log"].mode = None  # the loop clears it: the step sets it again

    _twins(step_of, steps=5, state=lambda env: env["log"].mode, between=between)


@pytest.mark.parametrize("value", [b"raw", "name"])
def test_a_text_appended_is_refused_as_a_constant(value):
    logged: list[Any] = []

    def train_step(model, opt, batch):
        logged.append(batch["tag"])
        return _finish(_loss(model, batch), opt)

    model, opt = _model()
    batch = {**_batch(0), "tag": value}
    with pytest.raises(remat.CaptureError, match="appends the Python value"):
        remat.compile(train_step, model, opt, batch, memory_budget=0.7)


def test_an_int_the_step_computes_with_is_read_at_every_call_in_one_graph():
    def step_of(env):
        env["counts"], env["tokens"] = [], 0

        def train_step(model, opt, batch):
            kept = batch["rows"] + batch["idx"] * 0  # ints that change at every step
            loss = F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum") / kept * (batch["idx"] / 8 + 1)
            env["counts"].append(batch["idx"])  # logged, and counted up in the user's state
            env["tokens"] += kept
            return _finish(loss, opt)
        return train_step

    compiled, notes = _twins(step_of, state=lambda env: (env["counts"], env["tokens"]))
    assert len(compiled._graphs) == 2, notes  # one per value of the bool `augmented`; idx 0..5 and rows 3, 4 read at every call
    assert not notes


def test_an_int_returned_is_each_calls_own():
    model, opt = _model()
    batch = lambda i: {k: v for k, v in _batch(i).items() if k != "augmented"}  # noqa: E731 - a bool keys the graph
    step = remat.compile(lambda m, o, b: (_finish(_loss(m, b), o), b["idx"]), model, opt, batch(0), memory_budget=0.7)
    returned = [step(batch(i))[1] for i in range(4)]
    assert returned == [0, 1, 2, 3] and all(type(r) is int for r in returned)
    assert len(step._graphs) == 1


def test_an_int_compared_keys_the_graph_by_the_side_it_is_on():
    def step_of(env):
        def train_step(model, opt, batch):
            n = batch["ntokens"]
            scale = 2.0 if n > 12 else 1.0  # a side of 12, whatever the count
            return _finish(F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum") / max(n, 1) * scale, opt)
        return train_step

    batches = [{"x": _batch(i)["x"], "y": _batch(i)["y"], "ntokens": 10 + i} for i in range(6)]
    compiled, notes = _twins(step_of, batches=batches)
    assert len(compiled._graphs) == 2, notes  # 10-12 and 13-15 (max(n, 1): the same side for all)


@pytest.mark.parametrize("use", ["formatted", "size"])
def test_an_int_used_where_its_value_is_needed_keys_the_graph(use):
    scales = {f"rows{r}": float(r) for r in (3, 4)}

    def step_of(env):
        def train_step(model, opt, batch):
            rows = batch["rows"] * 1  # computed with first: the trace makes it a symbol, then needs its value
            if use == "formatted":
                scale = scales[f"rows{rows}"]
            else:
                scale = 1.0 + batch["x"][:rows].sum().item() * 0
            return _finish(_loss(model, batch) * scale, opt)
        return train_step

    compiled, _ = _twins(step_of)
    assert len(compiled._graphs) == 2  # rows 3 and 4


def test_a_float_of_the_batch_formatted_into_text_is_refused_saying_to_pass_it_to_print():
    def train_step(model, opt, batch):
        print(f"weight {batch['w']}")
        return _finish(_loss(model, batch) * batch["w"], opt)

    model, opt = _model()
    with pytest.raises(remat.CaptureError, match=r"formats batch\['w'\], a float of the batch, into text.*print\('w', w\)"):
        remat.compile(train_step, model, opt, {**_batch(0), "w": 0.5}, memory_budget=0.7)


def test_a_stand_in_looks_like_its_value_to_isinstance_and_abstract_base_classes():
    import collections.abc
    import numbers

    from remat.capture.batch_leaves import _TextStandIn

    marks = BatchValues({}, {}, set())
    for stand_in, value in [(_TextStandIn(str, 0, marks), "a"), (_TextStandIn(bytes, 1, marks), b"a"), (_StandIn(int, 2, marks), 3)]:
        for kind in (str, bytes, int, collections.abc.Iterable, collections.abc.Sized, collections.abc.Sequence, collections.abc.Callable,
                     os.PathLike, numbers.Number, collections.abc.Hashable):  # fmt: skip
            assert isinstance(stand_in, kind) == isinstance(value, kind), (value, kind)
        assert callable(stand_in) == callable(value)
    assert not marks.touched and not marks.computed  # telling its type is no read
    with pytest.raises(AttributeError):
        _ = _StandIn(int, 2, marks) + 1
    assert marks.computed == {2} and not marks.touched  # arithmetic: a symbolic int can take it
    with pytest.raises(AttributeError):
        _ = f"{_StandIn(int, 3, marks)}"
    assert marks.touched == {3}  # text needs the value
