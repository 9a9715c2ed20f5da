"""Numbers a step keeps in the user's Python state (a step count, tokens seen, a sum of
losses, the last loss): done again after every run, from one compiled graph, as eager
does them; a step that also uses such a number is refused, naming it."""

from __future__ import annotations

import collections
import copy
import logging
import math
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.errors import BudgetError, CaptureError


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 48)
        self.b = torch.nn.Linear(48, 10)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _batch(seed: int, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


_GLOBAL_STEPS = 0


class _Trainer:
    """Counts in every way the runtime does again: an int and a float added to (constants,
    a batch size, `loss.item()` twice per step, a subtraction), a value set from None, a
    field the step creates, a global and a closure cell."""

    def __init__(self) -> None:
        self.global_step = 0
        self.samples = 0
        self.loss_sum = 0.0
        self.budget_left = 100
        self.last_loss = None
        self.micro = 0

        calls = 0

        def count() -> None:
            nonlocal calls
            calls += 1

        self.count = count
        self.calls = lambda: calls

    def train_step(self, model, opt, batch):
        global _GLOBAL_STEPS
        x, y = batch
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):  # two micro-batches: two additions per step
            loss = _loss(model, xs, ys)
            loss.backward()
            self.micro += 1
            self.loss_sum += loss.item()
        opt.step()
        self.global_step += 1
        self.samples = self.samples + x.shape[0]
        self.budget_left -= 1
        self.last_loss = loss.item()
        self.done_once = True  # a field the step creates
        _GLOBAL_STEPS += 1
        self.count()
        return loss


def _state(trainer: _Trainer) -> dict:
    return {**{k: v for k, v in vars(trainer).items() if k not in ("count", "calls")}, "calls": trainer.calls()}


def _tightest(step, model, opt, batch) -> remat.RematStep:
    profiles: dict = {}
    try:
        return remat.compile(step, model, opt, batch, memory_budget=0.01, profile_runs=1, profile_cache=profiles)
    except BudgetError as e:
        return remat.compile(step, model, opt, batch, memory_budget=e.reach.best, profile_runs=1, profile_cache=profiles)


def test_numbers_a_trainer_keeps_are_done_again_at_every_step_as_eager_does_them():
    global _GLOBAL_STEPS
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager, mine = _Trainer(), _Trainer()
    _GLOBAL_STEPS = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile again once the None and the missing field hold numbers
        compiled = _tightest(mine.train_step, model, opt, _batch(0))
        assert _state(mine) == _state(_Trainer()) and _GLOBAL_STEPS == 0  # compiling changes none of it
        for i in range(4):
            if i == 2:  # the loop resets a count between steps: the next step adds to what is there then
                eager.loss_sum = mine.loss_sum = 0.0
            torch.manual_seed(i)
            loss_e = eager.train_step(eager_model, eager_opt, _batch(i))
            torch.manual_seed(i)
            loss_r = compiled(_batch(i))
            assert torch.equal(loss_e, loss_r), i
            assert _state(mine) == _state(eager), (i, _state(mine), _state(eager))
            assert [type(v) for v in _state(mine).values()] == [type(v) for v in _state(eager).values()]
    assert _GLOBAL_STEPS == 8 and mine.global_step == 4 and mine.micro == 8 and mine.done_once is True
    assert len(compiled._graphs) == 1
    for pe, pr in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(pe, pr)
    report = compiled.report
    assert report.num_recomputed > 0 and report.measured_peak_bytes == report.predicted_peak_bytes, report.to_dict()


class _Uses:
    def __init__(self) -> None:
        self.step = 0
        self.other = 0
        self.total = 0.0

    def branches(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        self.step += 1
        if self.step % 10 == 0:  # a log every 10 steps: traced once, it would be the first step's choice
            print("step", self.step)
        return loss

    def scales(self, model, opt, batch):
        self.step += 1
        return _plain(model, opt, batch, weight=min(1.0, self.step / 4))

    def feeds_torch(self, model, opt, batch):
        self.step += 1
        return _plain(model, opt, batch, weight=torch.tensor(self.step).clamp(max=4) / 4)

    def indexes(self, model, opt, batch):
        self.step += 1
        return _plain(model, opt, batch, weight=[1.0, 0.5][self.step % 2])

    def decays(self, model, opt, batch):  # a gradient-reversal weight of DANN's schedule
        self.step += 1
        return _plain(model, opt, batch, weight=2.0 / (1.0 + math.exp(-10 * self.step / 100)) - 1)

    def copies(self, model, opt, batch):
        self.step += 1
        self.other = self.step + 1
        return _plain(model, opt, batch)

    def averages(self, model, opt, batch):
        self.total += 1.0
        return _plain(model, opt, batch, weight=self.total / 4)


def _plain(model, opt, batch, weight=1.0):
    x, y = batch
    opt.zero_grad()
    loss = _loss(model, x, y) * weight
    loss.backward()
    opt.step()
    return loss


def test_a_count_the_step_keeps_and_makes_a_tensor_of_is_read_at_every_call_bitwise():
    """`torch.tensor(self.step)` of a count the step adds to: the tensor is made in the graph
    from the count read at every call, so one graph trains bitwise as the count goes on."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    mine, eager = _Uses(), _Uses()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile again: the count is an input
        step = remat.compile(mine.feeds_torch, model, opt, _batch(0), memory_budget=None, profile_runs=1)
        for i in range(6):  # the weight climbs to 1 at the fourth step, then holds
            torch.manual_seed(i)
            ours = step(_batch(i))
            torch.manual_seed(i)
            assert torch.equal(ours, eager.feeds_torch(eager_model, eager_opt, _batch(i))), i
    assert mine.step == eager.step == 6 and len(step._graphs) == 1
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "method,use",
    [("indexes", r"_Uses\.step \(0 -> 1\), which it also uses \(mod\)"), ("decays", r"_Uses\.step \(0 -> 1\), which it also uses \(rmul\)")],
)  # fmt: skip
def test_a_number_the_step_keeps_and_also_uses_where_only_its_value_can_go_is_refused_naming_the_use(method, use):
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    user = _Uses()
    with pytest.raises(CaptureError, match=rf"changed Python state while it was traced: {use}\. Its Python code runs once") as refused:
        remat.compile(getattr(user, method), model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert "a math function torch cannot trace on a number read at every call (math.exp" in str(refused.value)
    assert vars(user) == {"step": 0, "other": 0, "total": 0.0}  # put back


@pytest.mark.parametrize("method", ["branches", "scales", "copies", "averages"])
def test_an_int_the_step_counts_up_and_computes_with_is_read_at_every_call_and_counted_again(method, capsys):
    """`self.step += 1`, then a branch on it, a weight from it, or another field set from it:
    the int is read at every call (a graph per side of what the step compares), counted up
    after each run, and what the step sets from it is set again: as eager, over 12 steps.
    A float the step adds to and computes with (`self.total / 4`) is read so too."""
    torch.manual_seed(0)
    model = _Net()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    user, eager_user = _Uses(), _Uses()
    step = remat.compile(getattr(user, method), model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    for i in range(12):
        torch.manual_seed(i)  # the same dropout on each side
        loss = step(_batch(i))
        torch.manual_seed(i)
        assert torch.equal(loss, getattr(eager_user, method)(eager_model, eager_opt, _batch(i)))
        assert vars(user) == vars(eager_user)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))
    assert ("_Uses.total" if method == "averages" else "_Uses.step") in step._read and len(step._graphs) <= 3
    if method == "branches":  # printed at step 10, by each side
        assert capsys.readouterr().out.splitlines() == ["step 10", "step 10"]


class _Smoothed:
    """A running loss started from None: the step branches on `is None`, then uses the number."""

    def __init__(self) -> None:
        self.smoothed = None

    def step(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        if self.smoothed is None:
            self.smoothed = loss.item()
        else:
            self.smoothed = 0.9 * self.smoothed + 0.1 * loss.item()
        return loss


class _FirstStepDoubled:
    """A step that branches on `is None` alone: its graph differs once the slot holds a number."""

    def __init__(self) -> None:
        self.last = None

    def step(self, model, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = _loss(model, x, y) * (2.0 if self.last is None else 1.0)
        loss.backward()
        opt.step()
        self.last = loss.item()
        return loss


def test_a_slot_that_held_none_stays_in_the_cache_key_when_the_step_depends_on_it():
    # Its first step is traced with None; once it holds a number the step compiles again
    # (the graph differs), and a step that then computes from the number is refused.
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager, mine = _FirstStepDoubled(), _FirstStepDoubled()
    compiled = remat.compile(mine.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    for i in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(i)
            loss_r = compiled(_batch(i))
        torch.manual_seed(i)
        assert torch.equal(eager.step(eager_model, eager_opt, _batch(i)), loss_r)
        assert mine.last == eager.last
        assert (i == 1) == any("_FirstStepDoubled.last (None -> " in str(w.message) for w in caught), (i, caught)
    assert len(compiled._graphs) == 2
    # A running loss that then computes from itself: read at every call from the second step.
    (smoothed, model), (eager, eager_model) = (_Smoothed(), _Net()), (_Smoothed(), _Net())
    eager_model.load_state_dict(model.state_dict())
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager_model.parameters(), lr=0.1)
    compiled = remat.compile(smoothed.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            torch.manual_seed(i)
            loss_r = compiled(_batch(i))
            torch.manual_seed(i)
            assert torch.equal(eager.step(eager_model, eager_opt, _batch(i)), loss_r)
            assert isinstance(smoothed.smoothed, float) and smoothed.smoothed == eager.smoothed


HISTORY: dict = {"loss": [], "lr": []}


class _Tracker:
    """Metrics kept by key in dicts: counts, a sum, the last loss, a key the step adds, and
    a global history of lists logged into."""

    def __init__(self) -> None:
        self.stats = {"steps": 0, "samples": 0, "loss_sum": 0.0}
        self.metrics = {"last": 0.0}

    def step(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        HISTORY["loss"].append(loss.item())
        HISTORY["lr"].append(opt.param_groups[0]["lr"])
        self.stats["steps"] += 1
        self.stats["samples"] += batch[0].shape[0]
        self.stats["loss_sum"] += loss.item()
        self.metrics["last"] = loss.item()
        self.metrics["doubled"] = 2 * loss.item()  # a key the first step adds
        return loss


def test_numbers_kept_and_logged_by_key_in_dicts_are_updated_as_eager_updates_them():
    global HISTORY
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager, mine = _Tracker(), _Tracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = remat.compile(mine.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
        assert vars(mine) == vars(_Tracker()) and HISTORY == {"loss": [], "lr": []}
        logs = []
        for i in range(4):
            if i == 2:  # a new epoch: a new history dict, and a lower learning rate
                logs.append(HISTORY)
                HISTORY = {"loss": [], "lr": []}
                opt.param_groups[0]["lr"] = eager_opt.param_groups[0]["lr"] = 0.05
            torch.manual_seed(i)
            loss_e = eager.step(eager_model, eager_opt, _batch(i))
            torch.manual_seed(i)
            assert torch.equal(loss_e, compiled(_batch(i)))
            assert vars(mine) == vars(eager), (i, vars(mine), vars(eager))
    logs.append(HISTORY)
    for log in logs:  # eager's entry, then remat's, at each step
        assert log["loss"][0::2] == log["loss"][1::2] and len(log["loss"]) == 4, log
        assert log["lr"] == [log["lr"][0]] * 4, log
    assert [log["lr"][0] for log in logs] == [0.1, 0.05]
    assert len(compiled._graphs) == 1


class _Refused:
    def __init__(self) -> None:
        self.metrics = {"last": 0.0}
        self.hist = {"loss": [1.0]}

    def keeps_a_tensor(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        self.metrics["out"] = loss.detach()
        return loss

    def reads_its_log(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        self.hist["loss"].append(loss.item())
        return loss * len(self.hist["loss"])

    def deletes_a_key(self, model, opt, batch):
        loss = _plain(model, opt, batch)
        self.metrics["last"] += loss.item()
        del self.hist["loss"]
        return loss


@pytest.mark.parametrize(
    "method,message",
    [("keeps_a_tensor", r"kept a tensor \(or a number computed from one\) in Python state: _Refused\.metrics"),
     ("reads_its_log", r"reads _Refused\.hist\['loss'\] \(list\.__len__\), a list it also logs numbers to"),
     ("deletes_a_key", r"changed Python state while it was traced: _Refused\.hist\['loss'\] \(\[1\.0\] -> deleted\)")],
)  # fmt: skip
def test_what_a_step_does_to_a_dict_by_key_that_no_graph_repeats_is_refused_and_put_back(method, message):
    user = _Refused()
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics, hist = user.metrics, user.hist
    with pytest.raises(CaptureError, match=message):
        remat.compile(getattr(user, method), model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert user.metrics is metrics and user.hist is hist and vars(user) == vars(_Refused())


class _Callback:
    def __init__(self) -> None:
        self.calls = 0
        self.total = 0.0

    def on_step(self, loss: float) -> None:
        self.calls += 1
        self.total += loss


def _counting_function():
    calls = 0

    def on_step(loss: float) -> None:
        nonlocal calls
        calls += 1

    return on_step, lambda: calls


def _step_with(callbacks: list):
    def step(model, opt, batch):
        loss = _plain(model, opt, batch)
        callbacks[0].on_step(loss.item())
        callbacks[1](loss.item())
        return loss

    return step, callbacks[0]


def test_callbacks_held_in_a_list_count_at_every_step():
    # Objects and functions in a list were not watched: the counts stopped at the trace's,
    # and the sum held a traced placeholder.
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    sides = []
    for _ in range(2):
        function, calls = _counting_function()
        sides.append((_step_with([_Callback(), function]), calls))
    ((eager_step, eager_cb), eager_calls), ((step, cb), calls) = sides
    compiled = remat.compile(step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert vars(cb) == {"calls": 0, "total": 0.0} and calls() == 0
    for i in range(3):
        torch.manual_seed(i)
        loss_e = eager_step(eager_model, eager_opt, _batch(i))
        torch.manual_seed(i)
        assert torch.equal(loss_e, compiled(_batch(i)))
        assert vars(cb) == vars(eager_cb) and calls() == eager_calls() == i + 1


class _Router(torch.nn.Module):
    """A mixture-of-experts layer that leaves its load-balancing loss in an attribute for
    the step to add (and its last routing weights, for logging)."""

    def __init__(self, initialised: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.out = torch.nn.Linear(16, 10)
        if initialised:
            self.aux_loss = torch.zeros(())
            self.last_weights = torch.zeros(64, 4)

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        self.aux_loss = (weights.mean(0) ** 2).sum() * 4
        self.last_weights = weights.detach()
        return self.out(sum(weights[:, i : i + 1] * torch.tanh(e(x)) for i, e in enumerate(self.experts)))


def _moe_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = _loss(model, x, y) + 0.01 * model.aux_loss
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("initialised", [True, False])
def test_tensors_a_layer_leaves_in_its_attributes_hold_each_steps_values(initialised):
    # Before, the attribute kept its value from before the capture (or a traced placeholder) with no error.
    torch.manual_seed(0)
    model = _Router(initialised)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    compiled = _tightest(_moe_step, model, opt, _batch(0))
    for i in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_r = compiled(_batch(i))
        assert torch.equal(_moe_step(eager_model, eager_opt, _batch(i)), loss_r)
        assert torch.equal(model.aux_loss, eager_model.aux_loss) and torch.equal(model.last_weights, eager_model.last_weights)
        # A field the step creates stays in the cache key: compiled again once, at the step after it first holds a tensor.
        assert any("changed since the step was compiled" in str(w.message) for w in caught) == (i == 1 and not initialised)
    assert compiled.report.measured_peak_bytes == compiled.report.predicted_peak_bytes


class _Timed:
    def __init__(self, clock) -> None:
        self.seconds = 0.0
        self.clock = clock

    def step(self, model, opt, batch):
        start = self.clock()
        loss = _plain(model, opt, batch)
        self.seconds = self.clock() - start  # a clock: set once, it would be the trace's time at every step
        return loss


def test_a_number_set_from_outside_the_steps_inputs_is_refused():
    # time.perf_counter() read by the step's code is refused as it is read; a clock bound
    # before (from time import perf_counter) is found by what the step sets from it.
    from time import perf_counter

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timed = _Timed(lambda: time.perf_counter())
    with pytest.raises(CaptureError, match=r"reads the clock with time\.perf_counter\(\), at test_kept_numbers\.py, line \d+: .*Time the call of the step"):
        remat.compile(timed.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    timed = _Timed(perf_counter)
    with pytest.raises(CaptureError, match=r"sets _Timed\.seconds to a number that differs from one trace to the next"):
        remat.compile(timed.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert timed.seconds == 0.0


class _HfTrainer:
    """A trainer using all of it at once: a scheduler stepped inside, clipping, an EMA, a
    step count, tokens, a history dict the loop also logs into, a sum, the last loss, a
    print and a log line."""

    def __init__(self, model, opt) -> None:
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        self.global_step = 0
        self.tokens = 0
        self.history = {"loss": [], "grad_norm": [], "lr": []}
        self.stats = {"loss_sum": 0.0}
        self.last_loss = None
        self.ema = [p.detach().clone() for p in model.parameters()]

    def train_step(self, model, opt, batch):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        self.sched.step()
        with torch.no_grad():
            for e, p in zip(self.ema, model.parameters()):
                e.lerp_(p, 0.1)
        self.global_step += 1
        self.tokens += batch["input_ids"].numel()
        self.history["loss"].append(loss.item())
        self.history["grad_norm"].append(norm.item())
        self.stats["loss_sum"] += loss.item()
        self.last_loss = loss.item()
        print("step", self.global_step, "loss", loss.item())
        logging.getLogger("remat-test-trainer").warning("grad norm %.5f", norm.item())
        return loss


def test_a_trainer_using_all_of_it_on_a_transformer_trains_and_keeps_what_eager_keeps():
    import contextlib
    import io

    from remat.models import build_model

    sides = []
    for compiled in (False, True):
        spec = build_model("bert-tiny", 4)
        opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, weight_decay=0.01)
        trainer = _HfTrainer(spec.model, opt)
        step = remat.compile(trainer.train_step, spec.model, opt, spec.batch, memory_budget=0.5, profile_runs=1) if compiled else None
        printed = io.StringIO()
        handler = logging.StreamHandler(printed)
        logging.getLogger("remat-test-trainer").addHandler(handler)
        try:
            with contextlib.redirect_stdout(printed), warnings.catch_warnings():
                warnings.simplefilter("error")  # one compile: the loop's own log list is not part of the key
                for i in range(4):
                    torch.manual_seed(i)
                    step(spec.batch) if compiled else trainer.train_step(spec.model, opt, spec.batch)
                    trainer.history["lr"].append(opt.param_groups[0]["lr"])  # the loop logs into the same dict
        finally:
            logging.getLogger("remat-test-trainer").removeHandler(handler)
        sides.append((spec.model, trainer, printed.getvalue(), step))
    (eager_model, eager, eager_printed, _), (model, mine, printed, step) = sides
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(eager.ema, mine.ema))
    for key in ("global_step", "tokens", "history", "stats", "last_loss"):
        assert getattr(mine, key) == getattr(eager, key), key
    assert printed == eager_printed and printed.count("grad norm") == 4
    assert len(step._graphs) == 1 and step.report.num_recomputed > 0
    assert step.report.measured_peak_bytes == step.report.predicted_peak_bytes


def _loop_state() -> dict:
    """A loop's state as one dict, as scripts keep it: a window of recent losses, counts in an
    OrderedDict and a Counter, sums in a defaultdict, a running count, and a model beside them
    (which leaves the dict impossible to compare whole)."""
    return {
        "recent": collections.deque(maxlen=3),
        "counts": collections.OrderedDict(steps=0),
        "seen": collections.Counter(batches=0),
        "sums": collections.defaultdict(float),
        "samples": 0,
        "history": [],
        "teacher": _Net(),
    }


def _stateful_step(state: dict):
    def train_step(model, opt, batch):
        x, y = batch
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        value = loss.item()
        state["recent"].append(value)
        state["counts"]["steps"] += 1
        state["seen"]["batches"] += 1
        state["sums"]["loss"] += value
        state["samples"] = state["samples"] + x.shape[0]
        state["history"].append({"loss": value, "accuracy": (logits.argmax(-1) == y).float().mean().item()})
        return loss

    return train_step


def _shown(state: dict) -> dict:
    return {k: (v if k != "recent" else (list(v), v.maxlen)) for k, v in state.items() if k != "teacher"}


def test_a_loops_state_kept_in_one_dict_beside_objects_is_counted_and_logged_key_by_key_as_eager():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager, mine = _loop_state(), _loop_state()
    kinds = {k: type(v) for k, v in mine.items()}
    compiled = remat.compile(_stateful_step(mine), model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert _shown(mine) == _shown(_loop_state())  # compiling changes none of it
    assert {k: type(v) for k, v in mine.items()} == kinds  # and leaves each container of its own type
    eager_step = _stateful_step(eager)
    for i in range(5):
        torch.manual_seed(i)
        loss_e = eager_step(eager_model, eager_opt, _batch(i))
        torch.manual_seed(i)
        assert torch.equal(loss_e, compiled(_batch(i)))
        assert _shown(mine) == _shown(eager), (i, _shown(mine), _shown(eager))
    assert mine["counts"]["steps"] == 5 and mine["samples"] == 5 * 64 and len(mine["recent"]) == 3
    assert {k: type(v) for k, v in mine.items()} == kinds
    assert all(isinstance(r, dict) and type(r["loss"]) is float for r in mine["history"])
    assert len(compiled._graphs) == 1
    for pe, pr in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(pe, pr)


def test_a_number_counted_or_logged_in_a_container_that_also_holds_a_module_is_not_left_at_the_traces_value():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"teacher": _Net(), "n": 0, "window": collections.deque(maxlen=2)}
    pair = [_Net(), 0]  # a head and its count, held together
    held = (_Net(), {"n": 0})
    model.stats = {"n": 0, "window": collections.deque(maxlen=2)}  # a module's own attribute

    def train_step(model, opt, batch):
        loss = _plain(model, opt, batch)
        state["n"] += batch[0].shape[0]  # in a dict beside a module
        state["window"].append(loss.item())
        pair[1] += 1  # in a list beside a module
        held[1]["n"] += 1  # in a dict in a tuple
        model.stats["n"] += 1  # in a module's dict beside a deque
        model.stats["window"].append(loss.item())
        return loss

    compiled = remat.compile(train_step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert state["n"] == 0 and not state["window"] and pair[1] == 0 and held[1] == {"n": 0}
    losses = [compiled(_batch(i)).item() for i in range(3)]
    assert state["n"] == 3 * 64 and list(state["window"]) == losses[1:]
    assert pair[1] == 3 and held[1]["n"] == 3
    assert model.stats["n"] == 3 and list(model.stats["window"]) == losses[1:]


@pytest.mark.parametrize("clock", ["perf_counter", "datetime.now", "datetime_module"])
def test_a_clock_the_users_module_bound_to_its_own_name_is_refused_as_it_is_read(clock, capsys):
    from tests.support import bound_clocks

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(model, opt, batch):
        started = bound_clocks.read(clock)
        loss = _plain(model, opt, batch)
        print("step started at", started)  # printed again after each run: it would be the trace's time
        return loss

    with pytest.raises(CaptureError, match=r"reads the clock with (time\.perf_counter|datetime\.now)\(\), at bound_clocks\.py.*Time the call of the step"):
        remat.compile(train_step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert bound_clocks.perf_counter is time.perf_counter and bound_clocks.datetime.now().year >= 2024  # put back


def test_counts_in_an_ordered_dict_and_a_counter_of_the_closure_are_kept_in_those_containers():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ordered, counter = collections.OrderedDict(steps=0), collections.Counter(steps=0)

    def train_step(model, opt, batch):
        loss = _plain(model, opt, batch)
        ordered["steps"] += 1
        counter["steps"] += 1
        return loss

    compiled = remat.compile(train_step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    for i in range(3):
        compiled(_batch(i))
    assert type(ordered) is collections.OrderedDict and ordered == collections.OrderedDict(steps=3)
    assert type(counter) is collections.Counter and counter == collections.Counter(steps=3)
    assert len(compiled._graphs) == 1
