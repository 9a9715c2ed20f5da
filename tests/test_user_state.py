"""The user's Python state as a new user's code holds it: what the step reads is watched and
nothing else, the model is left as compiling found it, and a library's tensors and
first-call hooks are what eager's later steps see."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import remat
from remat.errors import CaptureError
from remat.measurement.check import model_snapshot, snapshot_differences
from tests.support import architectures, loop_settings


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _mlp(width: int = 128, depth: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)], torch.nn.Linear(width, 10))


def _batches(n: int = 4, rows: int = 256, width: int = 128) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, width, generator=g), "y": torch.randint(0, 10, (rows,), generator=g)} for _ in range(n)]


class _Trainer:
    """A trainer that keeps the compiled step on itself and counts steps in its loop."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], compiled: bool) -> None:
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.global_step, self.losses = model, 0, []
        self.step = remat.compile(self.train_step, model, self.optimizer, batch, memory_budget=0.6) if compiled else None

    def train_step(self, model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return loss

    def fit(self, batches: list[dict[str, torch.Tensor]]) -> None:
        for batch in batches:
            loss = self.step(batch) if self.step is not None else self.train_step(self.model, self.optimizer, batch)
            self.losses.append(float(loss))
            self.global_step += 1


def test_a_step_kept_on_a_trainer_compiles_once_and_trains_bitwise() -> None:
    model, batches = _mlp(), _batches()
    eager_model = copy.deepcopy(model)
    trainer = _Trainer(model, batches[0], compiled=True)
    trainer.fit(batches)
    eager = _Trainer(eager_model, batches[0], compiled=False)
    eager.fit(batches)
    assert len(trainer.step._graphs) == 1, "the trainer's loop counter and the step held on it are not read by the step"
    assert trainer.step.report.num_recomputed > 0
    assert trainer.losses == eager.losses and _same_parameters(model, eager_model)


def _annealed_against_eager(compiled_step, eager_step, set_weight):  # type: ignore[no-untyped-def]
    """An MLP trained for 4 steps by `compiled_step` compiled and by `eager_step`, with
    `set_weight(i)` before step i: bitwise at every step. The compiled step."""
    model, batches = _mlp(width=32, depth=2), _batches(rows=16, width=32)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(eager_model.parameters())
    step = remat.compile(compiled_step, model, opt, batches[0])
    for i, batch in enumerate(batches):
        set_weight(i)
        assert torch.equal(step(batch), eager_step(eager_model, eager_opt, batch)), i
    assert _same_parameters(model, eager_model)
    return step


def _with_aux(model, optimizer, batch, aux: float):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    out = model(batch["x"])
    loss = F.cross_entropy(out, batch["y"]) + aux * out.pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


class _WeightedTrainer:
    """A trainer whose weight is a class attribute (`aux`), read through `self`."""

    aux = 0.0

    def train_step(self, model, optimizer, batch, scale=1.0):  # type: ignore[no-untyped-def]
        return _with_aux(model, optimizer, batch, self.aux * scale)


def test_a_partial_of_a_trainers_method_has_the_trainers_fields_watched() -> None:
    trainer, eager = _WeightedTrainer(), _WeightedTrainer()

    def set_weight(i: int) -> None:
        trainer.aux = eager.aux = 0.1 * i

    _annealed_against_eager(functools.partial(trainer.train_step, scale=0.5), functools.partial(eager.train_step, scale=0.5), set_weight)


@pytest.mark.parametrize("set_on", ["class", "instance"])
def test_a_class_attribute_read_through_self_is_watched_where_the_loop_sets_it(set_on: str) -> None:
    trainer, eager = _WeightedTrainer(), _WeightedTrainer()

    def set_weight(i: int) -> None:
        for target in [_WeightedTrainer] if set_on == "class" else [trainer, eager]:
            target.aux = 0.1 * i

    try:
        step = _annealed_against_eager(trainer.train_step, eager.train_step, set_weight)
    finally:
        _WeightedTrainer.aux = 0.0
    assert len(step._graphs) == 1


class _CFG:
    """Settings kept on a class, as notebooks keep them (`CFG.aux`)."""

    aux = 0.0


@dataclasses.dataclass(slots=True)
class _SlottedOptions:
    aux: float = 0.0


_OPTIONS = types.SimpleNamespace(aux=0.0)
_SLOTTED = _SlottedOptions()
_READS = {  # where the step reads its weight from, as it reads it
    "module": (loop_settings, lambda model, optimizer, batch: _with_aux(model, optimizer, batch, loop_settings.aux)),
    "class": (_CFG, lambda model, optimizer, batch: _with_aux(model, optimizer, batch, _CFG.aux)),
    "getattr": (_OPTIONS, lambda model, optimizer, batch: _with_aux(model, optimizer, batch, getattr(_OPTIONS, "aux", 0.0))),
    "__slots__": (_SLOTTED, lambda model, optimizer, batch: _with_aux(model, optimizer, batch, _SLOTTED.aux)),
}


@pytest.mark.parametrize("where", list(_READS))
def test_a_field_of_the_users_module_class_or_slotted_object_or_read_by_getattr_is_watched(where: str) -> None:
    settings, train_step = _READS[where]
    try:
        step = _annealed_against_eager(train_step, train_step, lambda i: setattr(settings, "aux", 0.1 * i))
    finally:
        settings.aux = 0.0
    assert len(step._graphs) == 1


_LOSS_WEIGHTS = np.array([0.0, 1.0])  # a numpy array of weights the loop changes in place


def _weighted_by_an_array(model, optimizer, batch):  # type: ignore[no-untyped-def]
    return _with_aux(model, optimizer, batch, float(_LOSS_WEIGHTS[0]))


def test_a_numpy_array_changed_in_place_compiles_the_step_again_for_its_values() -> None:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = _annealed_against_eager(_weighted_by_an_array, _weighted_by_an_array, lambda i: _LOSS_WEIGHTS.__setitem__(0, 0.1 * (i // 2)))
    finally:
        _LOSS_WEIGHTS[0] = 0.0
    assert len(step._graphs) == 2  # the same for two steps: one graph each
    assert any("global _LOSS_WEIGHTS (array([0., 1.]) -> array([0.1, 1. ]))" in str(w.message) for w in caught), [str(w.message) for w in caught]


_Weights = collections.namedtuple("_Weights", "aux other")
_NAMED = {"weights": _Weights(0.0, 1.0)}  # a namedtuple in a dict (loguru keeps its levels so)


def _weighted_by_a_namedtuple(model, optimizer, batch):  # type: ignore[no-untyped-def]
    return _with_aux(model, optimizer, batch, _NAMED["weights"].aux)


def test_a_namedtuple_the_loop_replaces_is_watched_and_shown_by_its_values() -> None:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = _annealed_against_eager(
                _weighted_by_a_namedtuple, _weighted_by_a_namedtuple, lambda i: _NAMED.__setitem__("weights", _Weights(0.1 * (i // 2), 1.0))
            )
    finally:
        _NAMED["weights"] = _Weights(0.0, 1.0)
    assert len(step._graphs) == 2
    assert any("global _NAMED ({'weights': _Weights(aux=0.0, other=1.0)} -> {'weights': _Weights(aux=0.1, other=1.0)})" in str(w.message) for w in caught), [str(w.message) for w in caught]


_SCALE = 2


def test_a_value_the_step_reads_is_still_watched_when_others_are_not() -> None:
    """A global the step's code loads keeps its guard: an int changed is seen, and read at every call from then on."""
    global _SCALE
    model, batches = _mlp(depth=3), _batches(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]) * _SCALE, batch["y"])
        loss.backward()
        optimizer.step()
        return loss

    step = remat.compile(train_step, model, opt, batches[0], memory_budget=None, profile_runs=1)
    step(batches[0])
    _SCALE = 3
    step(batches[1])
    assert "global _SCALE" in step._read and "global _SCALE" in step._last.tg.call.numbers
    _SCALE = 2


def _llama(**config: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, **config))


def _compiled_leaving_the_model_as_it_was(train_step, model, seed: int):  # type: ignore[no-untyped-def]
    """The step compiled at budget 0.7 (AdamW, 3 batches of token ids), an eager twin made
    before it, and the model checked unchanged by compiling."""
    eager_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    batches = [{"ids": torch.randint(0, 128, (8, 64), generator=g)} for _ in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    before = model_snapshot(model)
    step = remat.compile(train_step, model, opt, batches[0], memory_budget=0.7, profile_runs=1)
    assert snapshot_differences(before, model_snapshot(model)) == []
    return step, eager_model, eager_opt, batches


def _hidden_states_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    out = model(input_ids=batch["ids"], labels=batch["ids"], output_hidden_states=True)
    loss = out.loss + out.hidden_states[-2].pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_hooks_a_library_installs_on_first_call_train_bitwise_and_leave_the_model_as_it_was() -> None:
    """transformers installs forward hooks the first time a model returns hidden states:
    traced once per capture trace they were duplicated (a shifted hidden_states list)."""
    model = _llama()
    step, eager_model, eager_opt, batches = _compiled_leaving_the_model_as_it_was(_hidden_states_step, model, seed=2)
    for batch in batches:
        assert torch.equal(step(batch), _hidden_states_step(eager_model, eager_opt, batch))
    assert _same_parameters(model, eager_model)
    assert step.report.num_recomputed > 0
    with torch.no_grad():
        assert len(model(input_ids=batches[0]["ids"], output_hidden_states=True).hidden_states) == 3


def test_router_logits_of_a_mixture_of_experts_train_bitwise() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.1)
    model = MixtralForCausalLM._from_config(config, experts_implementation="batched_mm")

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        out = model(input_ids=batch["ids"], labels=batch["ids"])
        out.loss.backward()
        optimizer.step()
        return out.loss, out.aux_loss.detach()

    step, eager_model, eager_opt, batches = _compiled_leaving_the_model_as_it_was(train_step, model, seed=3)
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)  # eager's own expert-gradient index_put accumulates in parallel otherwise
        for batch in batches:
            (loss, aux), (eager_loss, eager_aux) = step(batch), train_step(eager_model, eager_opt, batch)
            assert torch.equal(loss, eager_loss) and torch.equal(aux, eager_aux)
    assert _same_parameters(model, eager_model)


def test_a_diffusion_step_reads_the_noise_schedulers_tables_where_the_library_holds_them() -> None:
    """The diffusers examples' step: a DDPMScheduler in a global, add_noise inside the step
    (it indexes the scheduler's own alphas_cumprod), random noise and timesteps."""
    diffusers = pytest.importorskip("diffusers")
    noise_scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)

    class Denoiser(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t_embed = torch.nn.Embedding(1000, 64)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))

        def forward(self, x, t):  # type: ignore[no-untyped-def]
            return self.net(x + self.t_embed(t))

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        clean = batch["x"]
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.shape[0],))
        noisy = noise_scheduler.add_noise(clean, noise, timesteps)
        loss = F.mse_loss(model(noisy, timesteps), noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    torch.manual_seed(0)
    model = Denoiser()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    batches = [{"x": torch.randn(1024, 64, generator=g)} for _ in range(3)]
    step = remat.compile(train_step, model, opt, batches[0], memory_budget=0.8, profile_runs=1)
    assert any(name.endswith("alphas_cumprod") for name in step._last.tg.call.outside)
    for batch in batches:
        state = torch.get_rng_state()
        loss = step(batch)
        torch.set_rng_state(state)
        assert torch.equal(loss, train_step(eager_model, eager_opt, batch))
    assert _same_parameters(model, eager_model)
    # The scheduler's table is read where it lives at every call: changed there, the step sees it.
    noise_scheduler.alphas_cumprod.mul_(0.5)
    state = torch.get_rng_state()
    loss = step(batches[0])
    torch.set_rng_state(state)
    assert torch.equal(loss, train_step(eager_model, eager_opt, batches[0]))


def test_a_library_objects_counter_the_step_counts_and_reads_is_refused_and_the_advice_works() -> None:
    """diffusers' EMAModel.step() counts its steps in a Python int and computes the decay
    from it: stepped inside train_step, the graph would hold the first step's decay (0.0)
    at every step. Refused, naming the field and saying to step it between steps; stepped
    there, the shadow weights are eager's."""
    training_utils = pytest.importorskip("diffusers.training_utils")

    def setup():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 32))
        ema = training_utils.EMAModel(model.parameters(), decay=0.999, use_ema_warmup=True, power=3 / 4)
        return model, ema, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def make_step(ema, with_ema: bool):  # type: ignore[no-untyped-def]
        def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if with_ema:
                ema.step(model.parameters())
            return loss.detach()

        return train_step

    g = torch.Generator().manual_seed(2)
    batches = [{"x": torch.randn(256, 32, generator=g), "y": torch.randn(256, 32, generator=g)} for _ in range(4)]
    model, ema, opt = setup()
    with pytest.raises(CaptureError, match=r"EMAModel.*ema .*optimization_step.*between steps, outside train_step"):
        remat.compile(make_step(ema, True), model, opt, batches[0], memory_budget=0.8, profile_runs=1)
    assert ema.optimization_step == 0  # the refused capture put the count back

    model, ema, opt = setup()
    eager_model, eager_ema, eager_opt = setup()
    step = remat.compile(make_step(ema, False), model, opt, batches[0], profile_runs=1)
    eager_step = make_step(eager_ema, False)
    for batch in batches:
        state = torch.get_rng_state()
        loss = step(batch)
        ema.step(model.parameters())
        torch.set_rng_state(state)
        assert torch.equal(loss, eager_step(eager_model, eager_opt, batch))
        eager_ema.step(eager_model.parameters())
    assert ema.optimization_step == eager_ema.optimization_step == 4 and ema.cur_decay_value == eager_ema.cur_decay_value > 0
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, eager_ema.shadow_params))


def test_a_progress_bar_updated_inside_the_step_counts_and_times_as_in_eager() -> None:
    """tqdm's update() inside train_step: made again after each run (step_prints records a
    bar's methods), so its count and its timing fields change as eager's do, with nothing
    left behind and no warning."""
    tqdm = pytest.importorskip("tqdm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bar = tqdm.tqdm(total=10, disable=False, mininterval=0)

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        bar.update(1)
        return loss.detach()

    batch = {"x": torch.randn(64, 16), "y": torch.randint(0, 4, (64,))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = remat.compile(train_step, model, opt, batch, profile_runs=1)
    assert bar.n == 0 and bar.last_print_n == 0
    for _ in range(3):
        step(batch)
    assert bar.n == bar.last_print_n == 3  # the bar was drawn at each update (mininterval=0), as in eager
    bar.close()


@pytest.mark.parametrize("name", sorted(architectures.ARCHITECTURES))
def test_compiling_leaves_every_architecture_as_it_found_it(name: str) -> None:
    from remat.models import hf_loss, make_train_step

    model, batch, _ = architectures.build(name, size="tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model_snapshot(model)
    remat.compile(make_train_step(hf_loss, zero_grad_first=True), model, opt, batch, memory_budget=None, profile_runs=1)
    assert snapshot_differences(before, model_snapshot(model)) == []


class _Config:
    def __init__(self) -> None:
        self.scale, self.names = 2, ["a"]


_CONFIG = _Config()
_CALLBACKS: list = []


def test_the_quick_check_at_each_call_fails_on_any_change_the_walk_would_see() -> None:
    """Guards: while they hold, the key is the one walked; each change below is one the walk
    would find (a value rebound, a container changed in place, an attribute added, a module
    replaced, a float read at every call changing sign), and must send the step to walk."""
    from remat.capture.state.guards import Guards
    from remat.capture.state.python_state import state_slots
    from remat.capture.state.read_numbers import KeyRules

    global _CONFIG
    model = _mlp(width=8, depth=2)

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        return model(batch).sum() * _CONFIG.scale * len(_CONFIG.names) * len(_CALLBACKS)

    def guards(read: set[str] = frozenset(), signed: set[str] = frozenset()) -> Guards:
        return Guards.of(model, state_slots(model, train_step), set(), set(read), KeyRules(signed=set(signed)))

    assert guards().hold()
    changes = [
        lambda: setattr(_CONFIG, "scale", 3),
        lambda: _CONFIG.names.append("b"),
        lambda: _CALLBACKS.append(_Config()),
        lambda: setattr(model[0][0], "extra", 1),
        lambda: model[0].__setitem__(1, torch.nn.ReLU()),
    ]
    for change in changes:
        g = guards()
        change()
        assert not g.hold()
    g = guards()
    _CONFIG = _Config()  # the global rebound to another object
    assert not g.hold()
    _CONFIG.scale = 0.5
    (name,) = [slot.name for slot, _ in state_slots(model, train_step) if slot.name.endswith("_CONFIG.scale")]
    g = guards(read={name}, signed={name})
    _CONFIG.scale = 0.25  # a float read at every call: another value, the same sign, still holds
    assert g.hold()
    _CONFIG.scale = -0.25
    assert not g.hold()
    _CONFIG, _CALLBACKS[:] = _Config(), []


def test_the_quick_check_sees_a_field_swapped_for_another_and_a_key_added_to_a_split_dict() -> None:
    from remat.capture.state.guards import Guards
    from remat.capture.state.python_state import state_slots

    model = _mlp(width=8, depth=1)
    holder = _Config()
    holder.unread = 1
    stats = {"steps": 0}

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        return model(batch).sum() * getattr(holder, "scale") * stats["steps"]

    g = Guards.of(model, state_slots(model, train_step), set(), set(), set())
    assert g.hold()
    del holder.unread
    holder.late = 2  # as many fields as before, another one
    assert not g.hold()
    g = Guards.of(model, state_slots(model, train_step), set(), set(), set())
    stats["seen"] = 1  # a new key of a dict of numbers, watched key by key
    assert not g.hold()


def test_under_a_profiler_of_the_users_the_step_watches_all_its_code_can_reach() -> None:
    """Recording the code a trace runs needs the process's profile hook; where the user's
    profiler holds it, it is left alone and the step falls back to the wider watch."""
    import sys

    model, batches = _mlp(), _batches(2)
    eager_model = copy.deepcopy(model)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(event) if len(calls) < 10 else None)
    try:
        trainer = _Trainer(model, batches[0], compiled=True)
    finally:
        sys.setprofile(None)
    assert calls and trainer.step._last.tg.call.code_read is None and trainer.step._ran is None
    eager = _Trainer(eager_model, batches[0], compiled=False)
    for batch in batches:
        loss = trainer.step(batch)
        assert torch.equal(loss, eager.train_step(eager_model, eager.optimizer, batch))
    assert _same_parameters(model, eager_model)


@torch.library.custom_op("remat_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    _in_a_custom_kernel()
    return x * 2


def _in_a_custom_kernel() -> None:
    pass


def test_the_recording_pauses_inside_torchs_own_ops_only_and_sees_the_users_code_around_and_below_others() -> None:
    """The profiler that records which of the user's code a trace runs is paused inside each
    op of torch's own (most of a trace's Python calls), and on again after it; inside a custom
    op's kernel or below a dispatch mode of the user's, either of which may run the user's
    code, it stays on."""
    import importlib
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    from remat.capture.cpu_strides import CpuLikeEager

    user_code = importlib.import_module("remat.capture.state.user_code")
    profiled: list[tuple[str, bool]] = []

    class Probe(TorchDispatchMode):  # the user's mode, below remat's: the profiler on inside it
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            profiled.append((func.namespace, sys.getprofile() is not None))
            return func(*args, **(kwargs or {}))

    def before() -> None:
        pass

    def after() -> None:
        pass

    ran: set = set()
    with user_code.recording_run(ran, "cpu") as recording, Probe(), CpuLikeEager():
        before()
        y = torch.ones(2) + 1
        after()
    assert recording and {before.__code__, after.__code__} <= ran
    assert profiled and all(on for _, on in profiled)  # the user's mode below: never paused

    class TorchsProbe(Probe):  # as a mode of torch's own would see it
        pass

    TorchsProbe.__module__ = "torch.testing._probe"
    profiled.clear()
    ran = set()
    with user_code.recording_run(ran, "cpu"), TorchsProbe(), CpuLikeEager():
        y = torch.ones(2) + 1
        after()
        _doubled(y)
    assert ("aten", False) in profiled and ("remat_test", True) in profiled
    assert {after.__code__, _in_a_custom_kernel.__code__} <= ran  # on again after an op; on in a custom kernel


_TEACHER = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8)))


def test_the_quick_check_sees_a_submodule_of_another_module_replaced() -> None:
    """A teacher held in a global: the walk reads its modules' attributes, so its tree counts."""
    from remat.capture.state.guards import Guards
    from remat.capture.state.python_state import state_slots

    model = _mlp(width=8, depth=1)

    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        return (model(batch) - _TEACHER(batch)).sum()

    g = Guards.of(model, state_slots(model, train_step), set(), set(), set())
    assert g.hold()
    _TEACHER[1][0] = torch.nn.Dropout(0.1)
    assert not g.hold()


FIRST_CALL_SHAPES: dict[tuple[int, ...], str] = {}  # a memo a model's forward fills once per shape


class _SetsUpOnFirstCall(torch.nn.Module):
    """A warn-once flag, a config made at the first call, a module-level memo: state the
    first step sets and later steps leave."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 10)
        self._warned, self._plan = False, None

    def forward(self, x):
        if not self._warned:
            self._warned = True
        if self._plan is None:
            self._plan = {"width": x.shape[-1]}
        FIRST_CALL_SHAPES.setdefault(tuple(x.shape), "seen")
        return self.b(F.gelu(self.a(x)))


def _step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def test_what_the_first_step_sets_once_is_set_when_the_step_first_runs_and_compiles_once() -> None:
    FIRST_CALL_SHAPES.clear()
    model, batches = _SetsUpOnFirstCall(), _batches()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert (model._warned, model._plan, FIRST_CALL_SHAPES) == (False, None, {})  # compiling changes nothing
    for batch in batches:
        assert torch.equal(step(batch), _step(eager_model, eager_opt, batch))
        assert (model._warned, model._plan) == (eager_model._warned, eager_model._plan) == (True, {"width": 128})
    assert FIRST_CALL_SHAPES == {(256, 128): "seen"}
    assert len(step._graphs) == 1, "the first call found the graph its set-up keyed"
    assert _same_parameters(model, eager_model)


class _Toggles(_SetsUpOnFirstCall):
    def forward(self, x):
        self._warned = not self._warned  # changed at every step, and read: not a set-up
        return self.b(F.gelu(self.a(x))) * (2.0 if self._warned else 1.0)


def test_state_the_step_changes_at_every_step_is_still_refused() -> None:
    model = _Toggles()
    with pytest.raises(remat.CaptureError, match=r"model\._warned \(False -> True\)"):
        remat.compile(_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0], memory_budget=None)
    assert model._warned is False


class _CachesATensorInAnObject(_SetsUpOnFirstCall):
    def forward(self, x):
        if self._plan is None:
            self._plan = types.SimpleNamespace(scales=[x.mean()])  # a traced tensor inside an object made at the first call
        return self.b(F.gelu(self.a(x))) * self._plan.scales[0]


def test_an_object_made_at_the_first_call_holding_a_traced_tensor_is_refused_not_set_up() -> None:
    model = _CachesATensorInAnObject()
    with pytest.raises(remat.CaptureError, match=r"kept a tensor .* model\._plan\.scales"):
        remat.compile(_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0], memory_budget=None)
    assert model._plan is None


class _SwapsALayerOnFirstCall(torch.nn.Module):
    """A library's model that builds another layer at its first forward (BigBird switching
    its attention type for short sequences)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 10)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        if isinstance(self.act, torch.nn.ReLU):
            self.act = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.GELU())
        return self.b(self.act(self.a(x)))


def test_a_layer_replaced_at_the_first_call_is_refused_put_back_and_compiles_after_one_eager_step() -> None:
    from remat.measurement.check import check_against_eager, twin

    model, batches = _SwapsALayerOnFirstCall(), _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    relu = model.act
    with pytest.raises(remat.CaptureError, match=r"changed the model.s submodules .*\(model\.act\).* Run one step eagerly before compiling"):
        remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert model.act is relu
    _step(model, opt, batches[0])  # as the error says
    eager_model, eager_opt = twin(model, opt)
    step = remat.compile(_step, model, opt, batches[1], memory_budget=None)
    result = check_against_eager(_step, eager_model, eager_opt, model, opt, step, batches[1], steps=3)
    assert result.match, result.summary()


class _MakesBuffers(torch.nn.Module):
    """Buffers made in a forward: a rotary embedding's cos/sin cache, made at the first call and
    grown for a longer sequence (non-persistent), and a scale initialised from the first batch
    (ActNorm's data-dependent initialisation, persistent)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, 10)
        self.cached = 0

    def forward(self, x):
        n = x.shape[1]
        if n > self.cached:
            angles = torch.outer(torch.arange(n, dtype=torch.float32), torch.linspace(0.1, 1.0, x.shape[-1] // 2))
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
            self.cached = n
        h = self.inp(x)
        h1, h2 = h.chunk(2, -1)
        c, s = self.cos[:n], self.sin[:n]
        h = torch.cat([h1 * c - h2 * s, h1 * s + h2 * c], -1)
        if not hasattr(self, "scale"):
            self.register_buffer("scale", 1.0 / (h.detach().std((0, 1)) + 1e-6))
        return self.out(F.gelu(h * self.scale).mean(1))


def test_buffers_a_forward_makes_are_registered_after_the_first_run_and_the_step_trains_bitwise() -> None:
    model = _MakesBuffers()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, n, 32, generator=g), "y": torch.randint(0, 10, (4,), generator=g)} for n in (8, 8, 12, 8)]
    before = model_snapshot(model)
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert snapshot_differences(before, model_snapshot(model)) == [], "compiling changes nothing in the model"
    assert (dict(model.named_buffers()), model.cached, model._non_persistent_buffers_set) == ({}, 0, set())
    for batch in batches:
        assert torch.equal(step(batch), _step(eager_model, eager_opt, batch))
        assert {n: t.shape for n, t in model.named_buffers()} == {n: t.shape for n, t in eager_model.named_buffers()}
    assert _same_parameters(model, eager_model)
    ours, eagers = model.state_dict(), eager_model.state_dict()
    assert ours.keys() == eagers.keys() and "scale" in ours and "cos" not in ours  # persistent as registered
    assert all(torch.equal(ours[k], eagers[k]) for k in ours)
    # Made at the first run, then read as buffers: the later graphs make none.
    from remat.capture.state.kept_tensors import KeptBuffer

    made = [[u.slot.name for u in g.tg.call.state_updates if isinstance(u, KeptBuffer)] for g in step._graphs.values()]
    assert made[0] == ["model.cos", "model.sin", "model.scale"] and made[-1] == []


def _distilled_step(teacher: torch.nn.Module):  # type: ignore[no-untyped-def]
    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        with torch.no_grad():
            soft = teacher(batch["x"]).softmax(-1)
        out = model(batch["x"].mean(1))  # the student sees the sequence pooled
        loss = F.cross_entropy(out, batch["y"]) + F.kl_div(out.log_softmax(-1), soft, reduction="batchmean")
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def test_buffers_a_teachers_forward_makes_are_registered_on_the_teacher_and_the_step_trains_bitwise() -> None:
    model, teacher = torch.nn.Linear(32, 10), _MakesBuffers().requires_grad_(False)
    eager_model, eager_teacher = copy.deepcopy(model), copy.deepcopy(teacher)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 8, 32, generator=g), "y": torch.randint(0, 10, (4,), generator=g)} for _ in range(3)]
    train_step = lambda m, o, b: _distilled_step(teacher)(m, o, b)  # noqa: E731
    eager_step = lambda m, o, b: _distilled_step(eager_teacher)(m, o, b)  # noqa: E731
    step = remat.compile(train_step, model, opt, batches[0], memory_budget=None)
    assert dict(teacher.named_buffers()) == {}, "compiling changes nothing in the teacher"
    for batch in batches:
        assert torch.equal(step(batch), eager_step(eager_model, eager_opt, batch))
    assert {n: t.shape for n, t in teacher.named_buffers()} == {n: t.shape for n, t in eager_teacher.named_buffers()} != {}
    assert all(torch.equal(a, b) for a, b in zip(teacher.buffers(), eager_teacher.buffers())) and _same_parameters(model, eager_model)


class _ClassHeld(torch.nn.Module):
    """Data its class holds, read through self: a temperature the loop sets on the class,
    and a cache of causal masks by length that every instance shares."""

    temperature = 1.0
    masks: dict[int, torch.Tensor] = {}

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 10)

    def forward(self, x):
        n = x.shape[1]
        if n not in self.masks:
            self.masks[n] = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2)).masked_fill(self.masks[n], float("-inf")).softmax(-1)
        return self.out((a @ v).mean(1)) / self.temperature


def test_data_a_modules_class_holds_is_watched_and_a_cache_there_is_left_as_it_was() -> None:
    _ClassHeld.temperature, _ClassHeld.masks = 1.0, {}
    torch.manual_seed(0)
    model = _ClassHeld()
    eager_model = copy.deepcopy(model)  # the same class: it shares the cache and the temperature
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, n, 32, generator=g), "y": torch.randint(0, 10, (4,), generator=g)} for n in (8, 8, 6, 8, 6)]
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert _ClassHeld.masks == {}, "compiling leaves the class's cache as it was"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache's new key compiles again, with a warning
        for i, batch in enumerate(batches):
            if i == 3:
                _ClassHeld.temperature = 0.5
            assert torch.equal(step(batch), _step(eager_model, eager_opt, batch)), i
    assert sorted(_ClassHeld.masks) == [6, 8] and all(type(t) is torch.Tensor for t in _ClassHeld.masks.values())
    assert _same_parameters(model, eager_model)
    _ClassHeld.temperature, _ClassHeld.masks = 1.0, {}


def test_keys_the_step_sets_in_its_batch_are_named_in_a_warning_and_the_step_trains_bitwise() -> None:
    def labelled(model, optimizer, batch):  # type: ignore[no-untyped-def]
        batch["labels"] = batch["y"]  # set in the user's dict by eager's step, not by the graph
        batch["x"] = batch["x"].to("cpu")  # the same tensor: nothing set
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["labels"])
        loss.backward()
        optimizer.step()
        return loss

    with pytest.warns(UserWarning, match=r"train_step sets batch\['labels'\] in the batch it is given\. .* leaves your batch as it was") as caught:
        step, _, _ = _trained_beside_eager(labelled)
    assert [w.filename for w in caught if "in the batch it is given" in str(w.message)] == [__file__], "named at the user's call"
    assert len(step._graphs) == 1


def test_a_count_kept_on_the_optimizer_is_refused_and_put_back() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.steps_taken = 0

    def counting(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = _step(model, optimizer, batch)
        optimizer.steps_taken += 1
        return loss

    with pytest.raises(remat.CaptureError, match=r"changes optimizer\.steps_taken, a field set on the optimizer \(SGD\).*keep such a count in your own object"):
        remat.compile(counting, model, opt, _batches(1)[0], memory_budget=None)
    assert opt.steps_taken == 0


class _RegistersAParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(128, 10)

    def forward(self, x):
        if not hasattr(self, "gain"):
            self.gain = torch.nn.Parameter(torch.ones(10))
        return self.a(x) * self.gain


def test_a_parameter_a_forward_registers_is_refused_and_the_model_left_as_it_was() -> None:
    model = _RegistersAParameter()
    with pytest.raises(remat.CaptureError, match=r"registers a new parameter, model\.gain, .* Make it in the module's __init__"):
        remat.compile(_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0], memory_budget=None)
    assert not hasattr(model, "gain") and len(list(model.parameters())) == 2


def _with_statistics_hooks(model: torch.nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """A list a forward hook logs a layer's statistic into, and a dict another hook stores a layer's output in."""
    stats: list[torch.Tensor] = []
    features: dict[str, torch.Tensor] = {}
    model[2][0].register_forward_hook(lambda module, args, out: stats.append(out.detach().abs().mean()))
    model[4][0].register_forward_hook(lambda module, args, out: features.__setitem__("fourth", out))
    return stats, features


def _norm_logging_step(norms: list[torch.Tensor], features: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"]) + 1e-3 * features["fourth"].pow(2).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        return loss

    return train_step


def _logs_into_its_defaults(model, optimizer, batch, history=[], *, last={"loss": 0.0}):  # noqa: B006 - the idiom under test
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    history.append(loss.item())
    last["loss"] = loss.item()
    return loss.detach()


def test_a_list_and_a_dict_given_as_default_arguments_log_each_steps_numbers() -> None:
    # A mutable default is one object from call to call: the step's log, as a closure's list is.
    history, last = _logs_into_its_defaults.__defaults__[0], _logs_into_its_defaults.__kwdefaults__["last"]
    batches = _batches()
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step = remat.compile(_logs_into_its_defaults, model, opt, batches[0], memory_budget=None)
    assert history == [] and last == {"loss": 0.0}  # compiling changes nothing
    eager_losses = []
    for batch in batches:
        eager_losses.append(_logs_into_its_defaults(eager_model, eager_opt, batch).item())
        assert step(batch).item() == eager_losses[-1] and last == {"loss": eager_losses[-1]}
    assert history == [x for v in eager_losses for x in (v, v)]
    assert len(step._graphs) == 1 and _same_parameters(model, eager_model)
    history.clear()
    last["loss"] = 0.0


_WINDOW: collections.deque = collections.deque(maxlen=3)  # the last losses, for a smoothed figure in the loop


def _logs_into_a_window(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    _WINDOW.append(loss.item())
    return loss.detach()


def test_a_deque_the_step_appends_to_holds_each_steps_numbers_within_its_maxlen() -> None:
    batches = _batches(5)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step = remat.compile(_logs_into_a_window, model, opt, batches[0], memory_budget=None)
    assert len(_WINDOW) == 0
    for batch in batches:
        expected = _logs_into_a_window(eager_model, eager_opt, batch).item()
        _WINDOW.pop()  # eager's number out again: the compiled step's is the one left
        assert step(batch).item() == expected and _WINDOW[-1] == expected
    assert len(_WINDOW) == 3 and _WINDOW.maxlen == 3 and len(step._graphs) == 1
    _WINDOW.clear()


class _StatefulLSTM(torch.nn.Module):
    """A recurrent model that carries its state from batch to batch (None before the first)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm, self.head, self.state = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.Linear(16, 3), None

    def forward(self, x):  # type: ignore[no-untyped-def]
        out, (h, c) = self.lstm(x, self.state)
        self.state = (h.detach(), c.detach())
        return self.head(out[:, -1])


class _SmoothedLoss:
    smoothed = 0.0  # a class default the first step shadows with the instance's own

    def __init__(self, own: bool) -> None:
        if own:
            self.smoothed = 0.0

    def step(self, model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        self.smoothed = 0.9 * self.smoothed + 0.1 * loss.item()
        return loss.detach()


@pytest.mark.parametrize("own", [True, False])
def test_a_carried_state_and_a_smoothed_loss_the_step_computes_from_its_last_are_eagers_at_every_step(own) -> None:
    # The state starts as None and is a tuple from the first step on; the smoothed loss is a
    # float the step computes anew from itself: read at every call, set after each run.
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    model, eager_model = _StatefulLSTM(), _StatefulLSTM()
    opt, eager_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    user, eager_user = _SmoothedLoss(own), _SmoothedLoss(own)
    step = remat.compile(user.step, model, opt, batches[0], memory_budget=None)
    assert model.state is None and vars(user) == vars(eager_user)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the state's first tuple compiles the step again, as a warning says
        for batch in batches:
            assert torch.equal(step(batch), eager_user.step(eager_model, eager_opt, batch))
            assert all(torch.equal(a, b) for a, b in zip(model.state, eager_model.state))
            assert user.smoothed == eager_user.smoothed
    assert _same_parameters(model, eager_model) and len(step._graphs) == 2, len(step._graphs)


_CACHING_LIBRARY = """
import torch

TABLE = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)  # a solver's coefficients, in the library's module


class CachedScale(torch.nn.Module):  # as rotary-embedding-torch caches its frequencies at the first call
    def __init__(self, width):
        super().__init__()
        self.register_buffer("cached", torch.zeros(16, width), persistent=False)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, width), persistent=False)
        self.cached_len = 0

    def forward(self, x):
        n = x.shape[0]
        if n <= self.cached_len:
            scale = self.cached[:n].detach()
        else:
            scale = (torch.arange(n, dtype=x.dtype)[:, None] * self.freq).cos()
            self.cached[:n] = scale
            self.cached_len = n
        return x * scale * TABLE.to(x.dtype).sum()


GAIN = torch.nn.Parameter(torch.ones(()))  # trained by nobody's optimizer: eager accumulates its .grad


def gained(x):
    return x * GAIN
"""


def _library_module(name: str, source: str) -> types.ModuleType:
    """A module as a library installed among the packages holds it (its file there)."""
    import sys
    import sysconfig

    module = types.ModuleType(name)
    module.__file__ = f"{sysconfig.get_paths()['purelib']}/{name}.py"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), vars(module))
    return module


def test_a_librarys_constant_tensor_and_its_cache_filled_at_the_first_call_train_bitwise() -> None:
    # The cache's length is set once and branched on: read at every call, the first graph
    # fills the buffer, the second reads it; the module-level table is a constant of the graph.
    library = _library_module("a_caching_library_of_the_test", _CACHING_LIBRARY)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), library.CachedScale(8), torch.nn.Linear(8, 3))

    def step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss.detach()

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(4)]
    m, eager_m = model(), model()
    opt, eager_opt = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(eager_m.parameters(), lr=1e-2)
    compiled = remat.compile(step, m, opt, batches[0], memory_budget=None)
    assert m[1].cached_len == 0 and not m[1].cached.any()  # compiling changes nothing
    for batch in batches:
        assert torch.equal(compiled(batch), step(eager_m, eager_opt, batch))
        assert m[1].cached_len == eager_m[1].cached_len and torch.equal(m[1].cached, eager_m[1].cached)
    assert _same_parameters(m, eager_m) and len(compiled._graphs) == 2

    def gained_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = F.cross_entropy(library.gained(model(batch[0])), batch[1])
        loss.backward()
        optimizer.step()
        return loss.detach()

    # A library's tensor that requires a gradient is no constant: the graph would give it none.
    with pytest.raises(remat.CaptureError, match=r"uses a parameter of shape \(\) that is not the model's"):
        remat.compile(gained_step, m, opt, batches[0], memory_budget=None)


def _counts_itself(model, optimizer, batch):  # type: ignore[no-untyped-def]
    _counts_itself.calls += 1  # a count kept on the function
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss.detach()


_counts_itself.calls = 0  # type: ignore[attr-defined]
_TICKS = __import__("itertools").count()


def _ticks(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"]) * (1 + 0.1 * next(_TICKS))
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_a_count_on_the_function_is_counted_and_an_iterator_the_step_advances_is_refused() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = remat.compile(_counts_itself, model, opt, _batches(1)[0], memory_budget=None)
    assert _counts_itself.calls == 0  # compiling changes nothing
    for batch in _batches(3):
        step(batch)
    assert _counts_itself.calls == 3 and len(step._graphs) == 1
    # Python's own iterator, advanced by the trace: every step would take the first number.
    with pytest.raises(remat.CaptureError, match=r"changed Python state while it was traced: global _TICKS \(<count at \(0,\)> -> <count at \(1,\)>\)"):
        remat.compile(_ticks, model, opt, _batches(1)[0], memory_budget=None)


def test_tensors_hooks_and_the_step_log_into_lists_and_dicts_are_each_steps_and_compile_no_more() -> None:
    """What the model's forward hooks (their closures are the user's state too) and the step
    put in a list or a dict holds each step's tensors as eager's does, and a dict the step
    only stores into and reads back does not key the step: one graph for each batch shape."""
    model, batches = _mlp(), _batches(6)
    batches[2], batches[4] = (_batches(1, rows=100)[0],) * 2  # a smaller batch: a second graph, captured while the lists hold tensors
    eager_model = copy.deepcopy(model)
    (stats, features), (eager_stats, eager_features) = _with_statistics_hooks(model), _with_statistics_hooks(eager_model)
    norms, eager_norms = [], []
    step_fn, eager_fn = _norm_logging_step(norms, features), _norm_logging_step(eager_norms, eager_features)
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=0.7)
    assert (stats, features, norms) == ([], {}, [])  # compiling leaves them as they were
    for batch in batches:
        assert torch.equal(step(batch), eager_fn(eager_model, eager_opt, batch))
        assert torch.equal(features["fourth"], eager_features["fourth"]) and not features["fourth"].requires_grad
    assert len(step._graphs) == 2
    for logged, eager_logged in ((stats, eager_stats), (norms, eager_norms)):
        assert len(logged) == len(eager_logged) == len(batches)
        assert all(type(a) is torch.Tensor and torch.equal(a, b) for a, b in zip(logged, eager_logged))
    assert _same_parameters(model, eager_model)


def test_a_log_the_hooks_fill_inside_settings_the_step_reads_does_not_key_the_step() -> None:
    """Backward hooks filling a dict of gradient norms held inside the settings dict the step
    reads a loss weight from: the settings key the step, the log inside them does not (the
    step never reads it), so the step compiles once and the log holds each step's norms."""

    def hooked(model):  # type: ignore[no-untyped-def]
        norms: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_full_backward_hook(lambda m, gi, go, name=name: norms.__setitem__(name, go[0].norm().detach()))
        return {"weight": 0.5, "grad_norms": norms}

    def with_settings(settings):  # type: ignore[no-untyped-def]
        def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(batch["x"]), batch["y"]) * settings["weight"]
            loss.backward()
            optimizer.step()
            return loss

        return train_step

    model, batches = _mlp(depth=2), _batches(4)
    eager_model = copy.deepcopy(model)
    settings, eager_settings = hooked(model), hooked(eager_model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(with_settings(settings), model, opt, batches[0], memory_budget=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="remat")
        for batch in batches:
            assert torch.equal(step(batch), with_settings(eager_settings)(eager_model, eager_opt, batch))
            assert settings["grad_norms"].keys() == eager_settings["grad_norms"].keys()
            assert all(torch.equal(settings["grad_norms"][k], v) for k, v in eager_settings["grad_norms"].items())
    assert len(step._graphs) == 1 and _same_parameters(model, eager_model)
    settings["weight"] = 0.25  # what the step does read still keys it
    with pytest.warns(UserWarning, match="compiled again"):
        assert torch.equal(step(batches[0]), with_settings(eager_settings | {"weight": 0.25})(eager_model, eager_opt, batches[0]))
    assert len(step._graphs) == 2


def test_a_dict_the_step_reads_before_it_stores_keys_the_step_and_a_parameter_appended_is_refused() -> None:
    """A dict read for a key the step had not set (the graph took its absence as it was) keys
    the step: it compiles again once the dict holds one. Appending a tensor the step did not
    compute (a parameter) is refused, naming the list."""
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    cache: dict[str, torch.Tensor] = {}
    eager_cache: dict[str, torch.Tensor] = {}

    def with_cache(store):  # type: ignore[no-untyped-def]
        def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            optimizer.zero_grad()
            logits = model(batch["x"])
            scale = 2.0 if "logits" in store else 1.0  # read before it is set: the first step sees none
            store["logits"] = logits.detach()
            loss = F.cross_entropy(logits * scale, batch["y"])
            loss.backward()
            optimizer.step()
            return loss

        return train_step

    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(with_cache(cache), model, opt, batches[0], memory_budget=None)
    with pytest.warns(UserWarning, match="compiled again"):
        for batch in batches:
            assert torch.equal(step(batch), with_cache(eager_cache)(eager_model, eager_opt, batch))
    assert torch.equal(cache["logits"], eager_cache["logits"]) and len(step._graphs) == 2

    kept: list[torch.Tensor] = []

    def keeps_a_parameter(model, optimizer, batch):  # type: ignore[no-untyped-def]
        kept.append(model[0][0].weight)
        return _step(model, optimizer, batch)

    with pytest.raises(remat.CaptureError, match=r"appends a tensor the step did not compute .* to kept"):
        remat.compile(keeps_a_parameter, model, opt, batches[0], memory_budget=None)
    assert kept == []


def _trained_beside_eager(train_step):  # type: ignore[no-untyped-def]
    """The step compiled on an MLP and trained for 3 batches beside eager, each loss
    equal; the step, the model and eager's."""
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(train_step, model, opt, batches[0], memory_budget=None)
    for batch in batches:
        assert torch.equal(step(batch), train_step(eager_model, eager_opt, batch))
    return step, model, eager_model


_LOSS_TERMS = {"scale": torch.tensor(2.0), "shift": torch.tensor(0.5)}


def _tree_mapping_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    terms = torch.utils._pytree.tree_map(lambda t: t * 1.0, _LOSS_TERMS)  # a library's way through a dict of tensors
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]) * terms["scale"] + terms["shift"], batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def test_a_dict_of_the_users_tensors_goes_through_torchs_pytree_functions_inside_the_step() -> None:
    """While the step is traced the user's dicts are recording copies: torch's pytree
    functions take them as dicts, not as leaves."""
    step, model, eager_model = _trained_beside_eager(_tree_mapping_step)
    assert len(step._graphs) == 1 and _same_parameters(model, eager_model)


_TEACHER_FEATURES: dict[int, torch.Tensor] = {}


def _feature_distillation_step(teacher: torch.nn.Module, features: dict[int, torch.Tensor]):  # type: ignore[no-untyped-def]
    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        with torch.no_grad():
            teacher(batch["x"])  # its hooks fill _TEACHER_FEATURES
        logits = model(batch["x"])
        matched = sum(F.mse_loss(features[i], _TEACHER_FEATURES[i]) for i in (1, 3))
        loss = F.cross_entropy(logits, batch["y"]) + 0.1 * matched
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def _store_outputs(model: torch.nn.Module, store: dict[int, torch.Tensor]) -> None:
    for i in (1, 3):
        model[i].register_forward_hook(lambda module, args, out, i=i: store.__setitem__(i, out))


def test_features_a_teachers_hooks_and_the_models_hooks_store_for_the_loss_train_bitwise_and_compile_once() -> None:
    """Feature distillation: a frozen teacher in a global, whose forward hooks fill a global
    dict, and the student's hooks another; the loss reads both. The teacher's hooks are
    followed as the model's are, so both dicts are the step's state, set after each run."""
    model, batches = _mlp(), _batches(4)
    eager_model = copy.deepcopy(model)
    teacher = _mlp().eval().requires_grad_(False)
    _store_outputs(teacher, _TEACHER_FEATURES)
    features: dict[int, torch.Tensor] = {}
    eager_features: dict[int, torch.Tensor] = {}
    _store_outputs(model, features)
    _store_outputs(eager_model, eager_features)
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    step_fn, eager_fn = _feature_distillation_step(teacher, features), _feature_distillation_step(teacher, eager_features)
    step = remat.compile(step_fn, model, opt, batches[0], memory_budget=0.6)
    assert (features, _TEACHER_FEATURES) == ({}, {})
    for batch in batches:
        assert torch.equal(step(batch), eager_fn(eager_model, eager_opt, batch))
        assert all(torch.equal(features[i], eager_features[i]) for i in (1, 3))
    assert len(step._graphs) == 1 and step.report.num_recomputed > 0
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes
    assert _same_parameters(model, eager_model)
    _TEACHER_FEATURES.clear()


_SETTINGS = {"scale": 2.0}
_HISTORY = [1.0]


def _copying_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    settings = copy.copy(_SETTINGS)
    settings["scale"] = 3.0  # a copy's key: the user's dict stays as it is
    history = copy.deepcopy(_HISTORY)
    history.append(0.5)  # and the copy of a list holds what is appended to it
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]) * settings["scale"] * history[-1], batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def test_the_users_lists_and_dicts_copied_inside_the_step_are_copies_as_in_eager() -> None:
    step, _, _ = _trained_beside_eager(_copying_step)
    assert (_SETTINGS, _HISTORY, len(step._graphs)) == ({"scale": 2.0}, [1.0], 1)


def _history_step(history, logged):  # type: ignore[no-untyped-def]
    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = _step(model, optimizer, batch)
        history["loss"].append(logged(loss))
        return loss

    return train_step


class _Logs:
    """A loop's logs: a defaultdict of lists and one of sums, each made anew or emptied per epoch."""

    def __init__(self) -> None:
        self.history: collections.defaultdict = collections.defaultdict(list)
        self.totals: collections.defaultdict = collections.defaultdict(float)


def _logging_step(logs: _Logs, logged):  # type: ignore[no-untyped-def]
    def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = _step(model, optimizer, batch)
        logs.history["loss"].append(logged(loss))
        logs.totals["loss"] += loss.item()
        logs.totals["steps"] += 1
        return loss

    return train_step


@pytest.mark.parametrize("logged", [torch.Tensor.item, torch.Tensor.detach], ids=["number", "tensor"])
def test_defaultdicts_the_step_logs_and_counts_into_make_their_keys_as_in_eager_with_one_graph(logged) -> None:  # type: ignore[no-untyped-def]
    model, batches = _mlp(), _batches(5)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    logs, eager_logs = _Logs(), _Logs()
    step = remat.compile(_logging_step(logs, logged), model, opt, batches[0], memory_budget=None)
    assert (logs.history, logs.totals) == ({}, {}), "compiling makes no key"
    eager_step = _logging_step(eager_logs, logged)
    for i, batch in enumerate(batches):
        if i == 3:  # a new epoch: a new defaultdict of lists, the sums emptied
            logs.history, eager_logs.history = collections.defaultdict(list), collections.defaultdict(list)
            logs.totals.clear()
            eager_logs.totals.clear()
        assert torch.equal(step(batch), eager_step(eager_model, eager_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))
    assert list(logs.history) == ["loss"] and len(logs.history["loss"]) == 2
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(logs.history["loss"], eager_logs.history["loss"]))
    assert dict(logs.totals) == dict(eager_logs.totals) and logs.totals["steps"] == 2.0
    assert len(step._graphs) == 1


def test_a_dict_of_logged_tensors_copied_between_steps_finds_the_same_graph() -> None:
    """The loop copies the dict the step logs tensors into: the step's key is found again
    from the state walked anew (the dict split by key as when its list was empty)."""
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    logs, eager_logs = _Logs(), _Logs()
    logs.history, eager_logs.history = {"loss": []}, {"loss": []}
    step, eager_step = remat.compile(_logging_step(logs, torch.Tensor.detach), model, opt, batches[0], memory_budget=None), _logging_step(eager_logs, torch.Tensor.detach)
    for batch in batches:
        assert torch.equal(step(batch), eager_step(eager_model, eager_opt, batch))
        logs.history, eager_logs.history = {"loss": list(logs.history["loss"])}, {"loss": list(eager_logs.history["loss"])}
    assert all(torch.equal(a, b) for a, b in zip(logs.history["loss"], eager_logs.history["loss"])) and len(logs.history["loss"]) == 3
    assert len(step._graphs) == 1


def test_a_defaultdict_whose_keys_change_from_step_to_step_is_refused_with_advice_that_works() -> None:
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    by_step = collections.defaultdict(list)

    def keyed_by_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = _step(model, optimizer, batch)
        by_step[f"step {len(by_step)}"].append(loss.item())
        return loss

    with pytest.raises(remat.CaptureError, match=r"made keys in a defaultdict .* a plain dict whose lists you make before compiling"):
        remat.compile(keyed_by_step, model, opt, batches[0], memory_budget=None)
    assert by_step == {}
    history, eager_history = {"loss": []}, {"loss": []}
    step = remat.compile(_history_step(history, torch.Tensor.item), model, opt, batches[0], memory_budget=None)
    for batch in batches:
        assert torch.equal(step(batch), _history_step(eager_history, torch.Tensor.item)(eager_model, eager_opt, batch))
    assert history == eager_history and len(history["loss"]) == 3


def _save_output(module, args, out, name, storage):  # type: ignore[no-untyped-def]
    storage[name] = out


def _log_norm(stats, module, args, out):  # type: ignore[no-untyped-def]
    stats.append(out.detach().norm())


def _hooks_by_partial(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Hooks registered as functools.partial, binding the dict and the list they fill: the
    list is held nowhere else."""
    features: dict[str, torch.Tensor] = {}
    stats: list[torch.Tensor] = []
    for name, module in model.named_children():
        module.register_forward_hook(functools.partial(_save_output, name=name, storage=features))
    model[2].register_forward_hook(functools.partial(_log_norm, stats))
    return features, stats


def test_what_hooks_bound_by_functools_partial_store_and_log_is_each_steps() -> None:
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    (features, stats), (eager_features, eager_stats) = _hooks_by_partial(model), _hooks_by_partial(eager_model)

    def with_features(store):  # type: ignore[no-untyped-def]
        def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(batch["x"]), batch["y"]) + 1e-3 * store["3"].pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss

        return train_step

    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(with_features(features), model, opt, batches[0], memory_budget=0.85)
    assert (features, stats) == ({}, [])
    for batch in batches:
        assert torch.equal(step(batch), with_features(eager_features)(eager_model, eager_opt, batch))
    assert features.keys() == eager_features.keys() and all(torch.equal(features[k], eager_features[k]) for k in features)
    assert len(stats) == 3 and all(type(a) is torch.Tensor and torch.equal(a, b) for a, b in zip(stats, eager_stats, strict=True))
    assert len(step._graphs) == 1


class _FeatureExtractor:
    """Keeps a layer's output and its norms through a hook that is its own method; the
    step never names it, the loop reads it after each step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.features: dict[str, torch.Tensor] = {}
        self.norms: list[torch.Tensor] = []
        model[2].register_forward_hook(self.keep)

    def keep(self, module, args, out):  # type: ignore[no-untyped-def]
        self.features["third"] = out.detach()
        self.norms.append(out.detach().norm())


def test_what_a_hook_that_is_a_method_of_the_users_object_keeps_is_each_steps() -> None:
    model, batches = _mlp(), _batches(3)
    eager_model = copy.deepcopy(model)
    extractor, eager_extractor = _FeatureExtractor(model), _FeatureExtractor(eager_model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert (extractor.features, extractor.norms) == ({}, [])
    for batch in batches:
        assert torch.equal(step(batch), _step(eager_model, eager_opt, batch))
        assert torch.equal(extractor.features["third"], eager_extractor.features["third"])
    assert len(extractor.norms) == 3 and all(torch.equal(a, b) for a, b in zip(extractor.norms, eager_extractor.norms, strict=True))
    assert len(step._graphs) == 1


class _MomentumEncoders(torch.nn.Module):
    """MoCo's pair: a key encoder kept as a moving average of the query encoder, set through
    `.data` inside the forward, and a queue of keys written at a pointer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(16, 64), dim=0))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.query(x), dim=1)
        with torch.no_grad():
            for p_q, p_k in zip(self.query.parameters(), self.key.parameters()):
                p_k.data = p_k.data * 0.9 + p_q.data * 0.1
            k = F.normalize(self.key(x + 0.1), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], dim=1) / 0.2
        with torch.no_grad():
            self.queue.index_copy_(1, (torch.arange(len(x)) + self.pointer) % 64, k.T)
            self.pointer.add_(len(x)).remainder_(64)
        return logits


def _contrastive_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def _clamped_then_trained(model, optimizer, batch):  # type: ignore[no-untyped-def]
    w = model[0][0].weight
    before = w.data
    w.data = w.data.clamp(-0.05, 0.05)  # a trainable weight, rebound before the forward
    loss = F.cross_entropy(model(batch["x"]), batch["y"]) + 1e-3 * before.pow(2).sum()  # the old values, read after
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def _pulled_back_through_a_flat_vector(model, optimizer, batch):  # type: ignore[no-untyped-def]
    """Lookahead's pull towards slow weights, through torch's vector_to_parameters (which
    sets each parameter's .data to a view of one flat vector)."""
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(model.parameters())
        torch.nn.utils.vector_to_parameters(flat * 0.5 + flat.roll(1) * 0.5, model.parameters())
    return loss


class _Counting(torch.nn.Module):
    """A layer that rebinds its buffers in its forward (new tensors, not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 64)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        self.scale = 0.9 * self.scale + 0.1 * x.norm().detach()
        return F.gelu(self.lin(x)) / (1 + self.scale)


@pytest.mark.parametrize("case", ["momentum encoder", "trainable weight", "flat vector", "buffers rebound"])
def test_a_tensors_data_set_in_the_step_is_its_value_from_then_on_and_after_as_in_eager(case: str) -> None:
    model, train_step, budget = {
        "momentum encoder": (_MomentumEncoders(), _contrastive_step, 0.7),
        "trainable weight": (_mlp(), _clamped_then_trained, None),
        "flat vector": (_mlp(width=32, depth=2), _pulled_back_through_a_flat_vector, None),
        "buffers rebound": (torch.nn.Sequential(_Counting(), torch.nn.Linear(64, 10)), _step, None),
    }[case]
    batches = _batches(4, rows=32, width=32) if case != "trainable weight" else _batches(4)
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, foreach=True)
    step = remat.compile(train_step, model, opt, batches[0], memory_budget=budget)
    for batch in batches:
        assert torch.equal(step(batch), train_step(eager_model, eager_opt, batch))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()))
        assert all(torch.equal(a, b) for p, q in zip(model.parameters(), eager_model.parameters()) for a, b in zip(opt.state[p].values(), eager_opt.state[q].values()))
    assert len(step._graphs) == 1
    if budget is not None:
        assert step.report.num_recomputed > 0


def test_setting_data_to_another_inputs_memory_or_another_layout_is_refused_naming_the_line() -> None:
    model = _mlp(width=16, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def tied(model, optimizer, batch):  # type: ignore[no-untyped-def]
        model[1][0].weight.data = model[0][0].weight.data
        return _contrastive_step(lambda x: model(x), optimizer, batch)

    def transposed(model, optimizer, batch):  # type: ignore[no-untyped-def]
        model[1][0].weight.data = model[1][0].weight.data.t()
        return _contrastive_step(lambda x: model(x), optimizer, batch)

    batch = _batches(1, rows=8, width=16)[0]
    with pytest.raises(CaptureError, match=r"memory of another graph input, at test_user_state.py, line \d+: model\[1\]\[0\].weight.data = model\[0\]\[0\].weight.data"):
        remat.compile(tied, model, opt, batch)
    with pytest.raises(CaptureError, match=r"strides \(1, 16\)\), at test_user_state.py, line \d+: .*\.t\(\)"):
        remat.compile(transposed, model, opt, batch)

    def replaced(model, optimizer, batch):  # type: ignore[no-untyped-def]
        model[1][0].weight = torch.nn.Parameter(model[1][0].weight.detach() * 0.5)  # dropped by the trace before
        return _contrastive_step(lambda x: model(x), optimizer, batch)

    with pytest.raises(CaptureError, match=r"replaces the parameter model\.1\.0\.weight with another one .*p\.data = new"):
        remat.compile(replaced, model, opt, batch)
    assert all(p.grad is None for p in model.parameters())  # nothing was changed


class _NoDecaySGD(torch.optim.Optimizer):
    """A user's optimizer that reads a flag the user set on some parameters."""

    def __init__(self, params, lr=0.1, weight_decay=0.1):  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                decay = 0.0 if getattr(p, "no_decay", False) else group["weight_decay"]
                p.add_(p.grad + decay * p, alpha=-group["lr"])


def test_a_flag_on_a_parameter_is_read_as_eager_reads_it_and_a_change_between_steps_compiles_again() -> None:
    """`p.no_decay = True` on the biases, read by the user's optimizer: the traced stand-ins
    hold it too (before, they did not, and every bias decayed, off eager's from the second
    step, silently); the flag is watched, so flipping it between steps compiles again."""
    model, batches = _mlp(depth=2), _batches(4)
    eager_model = copy.deepcopy(model)  # a parameter's deepcopy leaves its attributes behind: set on both
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        if name.endswith("bias"):
            p.no_decay = q.no_decay = True
    opt, eager_opt = _NoDecaySGD(model.parameters()), _NoDecaySGD(eager_model.parameters())
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    for i, batch in enumerate(batches):
        if i == 2:
            model[0][0].bias.no_decay = eager_model[0][0].bias.no_decay = False
            with pytest.warns(UserWarning, match=r"model\.0\.0\.bias\.no_decay \(True -> False\)"):
                loss = step(batch)
        else:
            loss = step(batch)
        assert torch.equal(loss, _step(eager_model, eager_opt, batch))
        assert _same_parameters(model, eager_model)
    assert len(step._graphs) == 2


class _PerSampleGrads(torch.nn.Module):
    """Per-sample gradients kept as opacus keeps them: a forward hook pushes each linear
    layer's input onto the layer's list, a backward hook pops it and sets `p.grad_sample`;
    the step clips each sample's gradient and averages them into `p.grad`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        for layer in (self.net[0], self.net[2]):
            layer.activations = []
            layer.register_forward_hook(lambda m, inputs, out: m.activations.append(inputs[0].detach()))
            layer.register_full_backward_hook(self._grad_sample)

    @staticmethod
    def _grad_sample(layer, grad_input, grad_output):  # type: ignore[no-untyped-def]
        x, g = layer.activations.pop(), grad_output[0]
        layer.weight.grad_sample = torch.einsum("bi,bj->bij", g, x)
        layer.bias.grad_sample = g

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x)


def _clipped_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    loss.backward()
    params = list(model.parameters())
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params], dim=1).norm(dim=1)
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad = torch.einsum("b,b...->...", factor, p.grad_sample) / len(factor)
        prev = getattr(p, "prev_grad", None)  # absent at the first step: a second graph after it
        if prev is not None:
            p.grad.add_(prev, alpha=0.5)
        p.prev_grad = p.grad.clone()
    optimizer.step()
    return loss


def test_tensors_the_step_keeps_on_parameters_are_set_after_each_run_as_eager_sets_them() -> None:
    model, batches = _PerSampleGrads(), _batches(4, rows=8, width=16)
    for b in batches:
        b["y"] = b["y"] % 4
    eager_model = copy.deepcopy(model)
    for layer in (eager_model.net[0], eager_model.net[2]):  # deepcopy does not copy hooks
        layer._forward_hooks.clear()
        layer._backward_hooks.clear()
        layer.register_forward_hook(lambda m, inputs, out: m.activations.append(inputs[0].detach()))
        layer.register_full_backward_hook(_PerSampleGrads._grad_sample)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(_clipped_step, model, opt, batches[0], memory_budget=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the second graph's warning names prev_grad
        for batch in batches:
            assert torch.equal(step(batch), _clipped_step(eager_model, eager_opt, batch))
            for p, q in zip(model.parameters(), eager_model.parameters()):
                assert torch.equal(p, q) and torch.equal(p.grad_sample, q.grad_sample) and torch.equal(p.prev_grad, q.prev_grad)
    assert model.net[0].activations == [] == eager_model.net[0].activations


def test_a_plain_value_the_step_sets_on_a_parameter_is_refused_naming_it() -> None:
    model, batches = _mlp(depth=1), _batches(1)

    def marks(model, optimizer, batch):  # type: ignore[no-untyped-def]
        model[0][0].weight.seen = True
        return _step(model, optimizer, batch)

    with pytest.raises(CaptureError, match=r"sets Python attributes on the model's 0\.0\.weight \(seen\)"):
        remat.compile(marks, model, torch.optim.SGD(model.parameters(), lr=0.1), batches[0], memory_budget=None)


class _Accountant:
    def __init__(self) -> None:
        self.steps = 0
        self.history: list[tuple[float, int]] = []

    def step(self, noise: float) -> None:
        self.steps += 1
        self.history.append((noise, self.steps))


class _DPStyleOptimizer(torch.optim.Optimizer):
    """opacus' DPOptimizer's shape: a wrapper that never calls Optimizer.__init__, whose
    param groups and state are the wrapped optimizer's (properties), and whose step clips
    the gradients, steps the wrapped one, and calls a hook it keeps in a field."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        self.original_optimizer, self.max_norm, self.step_hook = optimizer, max_norm, None

    param_groups = property(lambda self: self.original_optimizer.param_groups)
    state = property(lambda self: self.original_optimizer.state)
    defaults = property(lambda self: self.original_optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none)

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.max_norm)
        if self.step_hook is not None:
            self.step_hook(self)
        return self.original_optimizer.step()


def test_a_wrapper_whose_groups_and_state_are_another_optimizers_trains_bitwise_and_its_hooks_bookkeeping_is_refused_and_put_back() -> None:
    model, batches = _mlp(depth=2), _batches(4)
    eager_model = copy.deepcopy(model)
    opt = _DPStyleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0.5)
    eager_opt = _DPStyleOptimizer(torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9), 0.5)
    accountant = _Accountant()
    opt.step_hook = lambda optimizer: accountant.step(optimizer.max_norm)
    with pytest.raises(CaptureError, match=r"_Accountant\.steps .*_Accountant\.history \(reached through _DPStyleOptimizer\.step_hook"):
        remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert (accountant.steps, accountant.history) == (0, [])  # put back as it was
    opt.step_hook = None  # as the error says: the bookkeeping after each step, outside the step
    step = remat.compile(_step, model, opt, batches[0], memory_budget=None)
    for batch in batches:
        assert torch.equal(step(batch), _step(eager_model, eager_opt, batch))
        accountant.step(opt.max_norm)
    assert _same_parameters(model, eager_model) and accountant.steps == 4
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])


def test_a_step_hook_on_the_optimizer_that_counts_is_refused_and_put_back() -> None:
    model, batches = _mlp(depth=1), _batches(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = {"steps": 0}

    class Log:
        seen: list[float] = []

    log = Log()
    log.seen = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: (log.seen.append(optimizer.param_groups[0]["lr"]), counts.update(steps=counts["steps"] + 1)))
    with pytest.raises(CaptureError, match=r"Log\.seen \(reached through a step hook on SGD"):
        remat.compile(_step, model, opt, batches[0], memory_budget=None)
    assert log.seen == [] and counts["steps"] == 0


def test_a_key_the_step_adds_to_a_dict_of_numbers_with_a_plain_value_is_refused_and_taken_out() -> None:
    """`logs.setdefault("times", []).append(time.perf_counter() - t0)` in a dict of numbers:
    the key was dropped after the trace, so nothing was ever logged, with no error."""
    model, batches = _mlp(depth=1), _batches(1)
    logs = {"epoch": 0}

    def timed(model, optimizer, batch):  # type: ignore[no-untyped-def]
        start = len(batch)  # a plain number, not from a tensor: the trace's, once
        loss = _step(model, optimizer, batch)
        logs.setdefault("times", []).append(float(start))
        return loss

    with pytest.raises(CaptureError, match=r"changed Python state while it was traced: logs\['times'\] \(from the closure of timed\) \(absent -> \[2\.0\]\)"):
        remat.compile(timed, model, torch.optim.SGD(model.parameters(), lr=0.1), batches[0], memory_budget=None)
    assert logs == {"epoch": 0}

    def logged(model, optimizer, batch):  # type: ignore[no-untyped-def]
        loss = _step(model, optimizer, batch)
        logs.setdefault("loss", []).append(loss.item())
        return loss

    with pytest.raises(CaptureError, match=r"logs\['loss'\].*make the key before the first step, or hold a collections\.defaultdict\(list\)"):
        remat.compile(logged, model, torch.optim.SGD(model.parameters(), lr=0.1), batches[0], memory_budget=None)
    logs["loss"] = []  # as the error says: then each step's loss is logged
    step = remat.compile(logged, model, torch.optim.SGD(model.parameters(), lr=0.1), batches[0], memory_budget=None)
    for _ in range(3):
        loss = step(batches[0])
    assert len(logs["loss"]) == 3 and logs["loss"][-1] == loss.item()


def test_tensorboard_scalars_written_in_the_step_are_written_at_every_step_with_its_values(monkeypatch) -> None:
    """A TensorBoard writer's add_scalar and add_scalars in the step (where
    torch.utils.tensorboard is loaded: a stand-in of its writer here) are made again after
    each run with the step's numbers; traced once, they would have been given the trace's
    stand-in once."""
    import sys

    class SummaryWriter:
        def __init__(self) -> None:
            self.written: list[tuple[Any, ...]] = []

        def add_scalar(self, tag, value, step=None):  # type: ignore[no-untyped-def]
            self.written.append((tag, value, step))

        def add_scalars(self, tag, values, step=None):  # type: ignore[no-untyped-def]
            self.written.append((tag, dict(values), step))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard.writer", types.SimpleNamespace(SummaryWriter=SummaryWriter))

    def logging_step(writer, counts):  # type: ignore[no-untyped-def]
        def train_step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            loss = _step(model, optimizer, batch)
            writer.add_scalar("train/loss", loss.item(), counts["step"])
            writer.add_scalars("train/parts", {"lr": optimizer.param_groups[0]["lr"], "loss": loss.item()}, counts["step"])
            counts["step"] += 1
            return loss

        return train_step

    model, batches = _mlp(depth=2), _batches(4)
    eager_model = copy.deepcopy(model)
    writer, eager_writer, counts, eager_counts = SummaryWriter(), SummaryWriter(), {"step": 0}, {"step": 0}
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step = remat.compile(logging_step(writer, counts), model, opt, batches[0], memory_budget=None)
    assert writer.written == []
    for batch in batches:
        assert torch.equal(step(batch), logging_step(eager_writer, eager_counts)(eager_model, eager_opt, batch))
    assert writer.written == eager_writer.written and len(writer.written) == 8 and counts == {"step": 4}
    assert all(type(entry[1]) in (float, dict) for entry in writer.written)
