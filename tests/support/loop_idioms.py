"""The idioms of real training loops, each run in eager PyTorch and under remat
(bert-tiny cut to one layer, AdamW(foreach=True), budget 0.9, 6 steps) and compared bitwise after every step:
`run_idiom` gives its outcome. An idiom either works (bitwise equal to eager over every
step) or is refused with a CaptureError naming it; anything else ("WRONG": a mismatch,
or another error) is a bug. tests/test_training_loops.py runs each;
benchmarks/training_loops.py writes the table of them.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import remat
from remat.errors import BudgetError, RematError
from remat.measurement.check import check_against_eager, twin
from remat.models import build_model

STEPS = 6
Step = Callable[[torch.nn.Module, Any, Any], Any]


def one_layer_bert(seed: int = 0):
    """bert-tiny (batch 4) cut to its first encoder layer: every idiom is about the loop
    around the model, and one layer halves the model's trace, which is most of a run's time."""
    spec = build_model("bert-tiny", 4, seed=seed)
    encoder = spec.model.bert.encoder
    encoder.layer = encoder.layer[:1]
    spec.model.config.num_hidden_layers = 1
    return spec


def plain_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def _with(before_step: Callable[[torch.nn.Module], None] = lambda m: None, *, scale=None, ctx=None, zero_at_end=False) -> Step:
    """plain_step with something done between backward and the update, or around the forward."""

    def step(model, optimizer, batch):
        if not zero_at_end:
            optimizer.zero_grad()
        if ctx is not None:
            with ctx():
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        loss.backward()
        before_step(model)
        optimizer.step()
        if zero_at_end:
            optimizer.zero_grad(set_to_none=False)
        return loss

    return step


def _accumulate(k: int) -> Step:
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        n = batch["input_ids"].shape[0]
        total = 0.0
        for i in range(k):
            loss = model(**{key: v[i * n // k : (i + 1) * n // k] for key, v in batch.items()}).loss / k
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    return step


def _hidden_states_step(model, optimizer, batch):
    """transformers installs forward hooks on the model the first time it is asked for hidden states."""
    optimizer.zero_grad()
    out = model(**batch, output_hidden_states=True)
    loss = out.loss + out.hidden_states[-2].pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def _closure_step(model, optimizer, batch):
    def closure():
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss

    return optimizer.step(closure).detach()


def _no_zero_grad(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def _backward_only(model, optimizer, batch):
    loss = model(**batch).loss / 3
    loss.backward()
    return loss.detach()


def _update_every_third(i, m, o):
    if (i + 1) % 3 == 0:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        o.zero_grad()


def _add_scaler(model):
    # A scale this large overflows at first: the scaler skips the update and backs off.
    model.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=1)


def _grad_scaler(model, optimizer, batch):
    scaler = model.scaler
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def _outputs(model, optimizer, batch):
    optimizer.zero_grad()
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    return out.loss, out.logits.detach()


def _numbers_out(model, optimizer, batch):
    """Python numbers returned for logging: the loss and the learning rate of this step."""
    loss = plain_step(model, optimizer, batch)
    return {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]}


@dataclass
class Idiom:
    name: str
    expect: str  # "works" or "refused"
    step: Step = plain_step
    # (step index, model, optimizer) after each step, on each side; made per side by `between`.
    between: Callable[[torch.nn.Module, Any], Callable[[int, torch.nn.Module, Any], None]] | None = None
    setup: Callable[[torch.nn.Module], Any] | None = None  # on the model before the optimizer is built
    outside: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None  # each side's tensors outside the model, compared too
    logged: list[float] | None = None  # a list both sides log into, eager's entry then remat's at each step: compared
    kept: Callable[[torch.nn.Module], Any] | None = None  # each side's Python values the step keeps, compared
    batches: Callable[[dict[str, torch.Tensor]], list[Any]] | None = None  # the steps' batches, made from the example's


def _sched(make: Callable[[Any], Any], *, metric: bool = False, every: int = 1):
    def per_side(model, opt):
        sched = make(opt)

        def hook(i, m, o):
            if (i + 1) % every == 0:
                sched.step(1.0) if metric else sched.step()

        return hook

    return per_side


def _hook(fn: Callable[[int, torch.nn.Module, Any], None]):
    return lambda model, opt: fn


@functools.cache
def _resume_state():
    """A checkpoint a loop resumes from: model and optimizer after one eager step elsewhere."""
    spec = one_layer_bert(seed=1)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    plain_step(spec.model, opt, spec.batch)
    return copy.deepcopy(spec.model.state_dict()), copy.deepcopy(opt.state_dict())


def _resume(i, m, o):
    if i == 1:
        model_sd, opt_sd = copy.deepcopy(_resume_state())
        m.load_state_dict(model_sd)
        o.load_state_dict(opt_sd)


def _evaluate(train_after: bool):
    def fn(i, m, o):
        m.eval()
        with torch.no_grad():
            m(input_ids=torch.zeros(2, 8, dtype=torch.long))
        if train_after:
            m.train()

    return fn


def _ema_in_place(i, m, o):
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.999)


def _dropout_schedule(i, m, o):
    """Dropout lowered after the third step, by setting each nn.Dropout's p (a plain attribute)."""
    if i == 2:
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = max(0.0, module.p - 0.05)


_LOOP = {"step": 0}  # a loop's iteration count, which the step below reads


def _count_from_zero(model):
    _LOOP["step"] = 0


def _count_up(i, m, o):
    _LOOP["step"] = i + 1


def _warm_up_by_count(model, optimizer, batch):
    """A warm-up weight and a term on every other step, computed in the step from the loop's count."""
    optimizer.zero_grad()
    out = model(**batch)
    loss = out.loss * min(1.0, (_LOOP["step"] + 1) / 3)
    if _LOOP["step"] % 2 == 0:
        loss = loss + 1e-3 * out.logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def _rate_set_by_count(model, optimizer, batch):
    """nanoGPT's: a warm-up then a cosine decay, set in the param groups from the loop's count before the update."""
    it, warmup, decay = _LOOP["step"], 2, 5
    rate = 1e-3 * (it + 1) / (warmup + 1) if it < warmup else 1e-4 + 0.5 * (1.0 + math.cos(math.pi * min(1.0, (it - warmup) / (decay - warmup)))) * 9e-4
    for group in optimizer.param_groups:
        group["lr"] = rate
    return plain_step(model, optimizer, batch)


def _freeze(model):
    for name, p in model.named_parameters():
        if "embeddings" in name:
            p.requires_grad_(False)


def _set_lr(i, m, o):
    for g in o.param_groups:
        g["lr"] = 1e-3 * (i + 2) / 3


def _freeze_embeddings(model):
    model.bert.embeddings.requires_grad_(False)


def _unfreeze_embeddings(i, m, o):
    if i == 1:
        m.bert.embeddings.requires_grad_(True)
        o.add_param_group({"params": list(m.bert.embeddings.parameters()), "lr": 1e-4})


_INNER_SCHEDULERS: dict[int, Any] = {}


def _inner_scheduler_step(model, optimizer, batch):
    """optimizer.step() then scheduler.step(), both inside the step."""
    loss = plain_step(model, optimizer, batch)
    _INNER_SCHEDULERS[id(optimizer)].step()
    return loss


def _inner_scheduler_rate_step(model, optimizer, batch):
    """optimizer.step(), scheduler.step() and the scheduler's new rate returned for logging."""
    loss = plain_step(model, optimizer, batch)
    scheduler = _INNER_SCHEDULERS[id(optimizer)]
    scheduler.step()
    return {"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}


def _timed_step(model, optimizer, batch):
    """The step's own time measured inside it and returned for logging."""
    start = time.perf_counter()
    loss = plain_step(model, optimizer, batch)
    return {"loss": loss.item(), "seconds": time.perf_counter() - start}


def _made_before_the_loop(make: Callable[[Any], Any]):
    """A scheduler for each side's optimizer, made before the loop (nothing to do between steps)."""

    def per_side(model, opt):
        _INNER_SCHEDULERS[id(opt)] = make(opt)
        return lambda i, m, o: None

    return per_side


def _clamp_gradient(g):
    return g.clamp(-1e-3, 1e-3)


def _halve_gradient(p):
    p.grad.mul_(0.5)


def _with_gradient_hooks(model, opt):
    """Hooks on each side's parameters (a deep copy leaves them behind): every other one's
    gradient clamped before it is accumulated, the others' halved after."""
    for i, p in enumerate(model.parameters()):
        p.register_hook(_clamp_gradient) if i % 2 == 0 else p.register_post_accumulate_grad_hook(_halve_gradient)
    return lambda i, m, o: None


def _hook_added(i, m, o):
    if i == 1:
        next(m.parameters()).register_hook(_clamp_gradient)


def _plateau_inside(model, optimizer, batch):
    loss = plain_step(model, optimizer, batch)
    _INNER_SCHEDULERS[id(optimizer)].step(loss)
    return loss


def _checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _seeded_step(model, optimizer, batch):
    torch.manual_seed(0)
    return plain_step(model, optimizer, batch)


def _count_calls(model):
    model.calls = 0  # on the model: each side counts its own calls


def _warmed_up_loss(model, optimizer, batch):
    """A loss weight warmed up from a Python counter the step keeps (a KL-weight schedule)."""
    model.calls += 1
    optimizer.zero_grad()
    loss = model(**batch).loss * min(1.0, model.calls / 4)
    loss.backward()
    optimizer.step()
    return loss


_FEATURES: dict[str, torch.Tensor] = {}


def _hook_features(model):
    """A forward hook that stores a layer's output for the loss (a feature-matching term)."""
    layer = model.bert.encoder.layer[0].output
    layer.register_forward_hook(lambda module, args, out: _FEATURES.__setitem__("first", out))


def _feature_loss_step(model, optimizer, batch):
    """The stored features in the loss, and dropped before the step returns."""
    optimizer.zero_grad()
    loss = model(**batch).loss + 1e-3 * _FEATURES["first"].pow(2).mean()
    loss.backward()
    optimizer.step()
    _FEATURES.clear()
    return loss


def _hook_statistics(model):
    """A forward hook that logs a layer's output statistic into a list, and another that
    stores a layer's output in a dict, both held by the layer (each twin has its own)."""
    stats_layer, features_layer = model.bert.encoder.layer[0].output, model.bert.encoder.layer[0].intermediate
    stats_layer.stats, features_layer.features = [], {}
    stats_layer.register_forward_hook(lambda module, args, out: module.stats.append(out.detach().abs().mean()))
    features_layer.register_forward_hook(lambda module, args, out: module.features.__setitem__("second", out))


def _stored_features_step(model, optimizer, batch):
    """The stored features in the loss, left in the dict after the step."""
    optimizer.zero_grad()
    loss = model(**batch).loss + 1e-3 * model.bert.encoder.layer[0].intermediate.features["second"].pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def _hooks_kept(model):
    layers = model.bert.encoder.layer
    return [*layers[0].output.stats, layers[0].intermediate.features["second"]]


class _Ema:
    """An EMA copy of the weights, held by the model as a plain attribute (as a Lightning
    module holds its helpers), so that each side of the comparison has its own."""

    def __init__(self, model, decay=0.99):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def update(self, model):
        with torch.no_grad():
            for e, p in zip(self.shadow, model.parameters()):
                e.mul_(self.decay).add_(p, alpha=1 - self.decay)


def _keep_ema(model):
    model.ema = _Ema(model)


def _keep_library_ema(model):
    from diffusers.training_utils import EMAModel  # a test extra

    model.library_ema = EMAModel(model.parameters(), decay=0.999, use_ema_warmup=True)


def _library_ema_inside(model, optimizer, batch):
    """diffusers' EMAModel stepped inside the step: its decay follows a step count it keeps in Python."""
    loss = plain_step(model, optimizer, batch)
    model.library_ema.step(model.parameters())
    return loss


class _Holder:
    """A plain object holding a module beside the model (not a submodule of it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


def _keep_averaged(model):
    swa = torch.optim.swa_utils
    model.averaged = _Holder(swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.99)))


def _averaged_inside(model, optimizer, batch):
    """torch's AveragedModel updated inside the step: a copy at its first update, an average after."""
    loss = plain_step(model, optimizer, batch)
    model.averaged.module.update_parameters(model)
    return loss


def _ema_inside(model, optimizer, batch):
    """The EMA updated inside the step, after the optimizer's."""
    loss = plain_step(model, optimizer, batch)
    model.ema.update(model)
    return loss


_TEACHER: torch.nn.Module | None = None


def _make_teacher(model):
    """A frozen teacher (another one-layer bert-tiny) in a global, shared by both sides: read, never written."""
    global _TEACHER
    if _TEACHER is None:
        _TEACHER = one_layer_bert(seed=7).model.eval().requires_grad_(False)


def _distill(model, optimizer, batch):
    """Distillation from the teacher, its soft targets added to the loss."""
    teacher = _TEACHER
    optimizer.zero_grad()
    with torch.no_grad():
        soft = teacher(**batch).logits.softmax(-1)
    out = model(**batch)
    loss = out.loss + torch.nn.functional.kl_div(out.logits.log_softmax(-1), soft, reduction="batchmean")
    loss.backward()
    optimizer.step()
    return loss


_LOSSES: list[float] = []


def _logging_step(model, optimizer, batch):
    """The loss logged into a Python list inside the step (appended after each run)."""
    loss = plain_step(model, optimizer, batch)
    _LOSSES.append(loss.item())
    return loss


_LOSS_SETTINGS = types.SimpleNamespace(weight=1.0)


def _weighted_step(model, optimizer, batch):
    """The loss scaled by a field of a settings object the loop anneals."""
    optimizer.zero_grad()
    loss = model(**batch).loss * _LOSS_SETTINGS.weight
    loss.backward()
    optimizer.step()
    return loss


def _anneal_weight(i, m, o):
    _LOSS_SETTINGS.weight = 0.5 ** (i // 3 + 1)


def _train_mode_first(model, optimizer, batch):
    """The step puts the model in training mode itself, as many loops' train functions do."""
    model.train()
    return plain_step(model, optimizer, batch)


def _dropout_frozen(model):
    """Fine-tuning with some layers' dropout off: those modules kept in eval mode."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and ".0." in name:
            module.eval()


def _refreeze(i, m, o):
    m.train()
    _dropout_frozen(m)


def _first_run_flags(model):
    model.warned_once, model.first_shape = False, None


def _warn_once_step(model, optimizer, batch):
    """Flags the step sets on its first run and reads at every run: a warning given once, a
    shape noted at the first batch."""
    if not model.warned_once:
        warnings.warn("the first step runs: this is said once")
        model.warned_once = True
    if model.first_shape is None:
        model.first_shape = tuple(batch["input_ids"].shape)
    return plain_step(model, optimizer, batch)


def _checked_step(model, optimizer, batch):
    """Checks on tensor values that raise where they fail: the labels against the
    vocabulary, the loss and the gradient norm finite."""
    if batch["labels"].max() >= model.config.vocab_size:
        raise ValueError("a label is out of the vocabulary")
    optimizer.zero_grad()
    loss = model(**batch).loss
    assert torch.isfinite(loss), "the loss is not finite"
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    return loss


class _Trainer:
    """A trainer object whose method is the step: it counts steps and tokens, sums the
    losses and keeps the last one."""

    def __init__(self):
        self.global_step = 0
        self.tokens_seen = 0
        self.loss_sum = 0.0
        self.last_loss = None

    def train_step(self, model, optimizer, batch):
        loss = plain_step(model, optimizer, batch)
        self.global_step += 1
        self.tokens_seen += batch["input_ids"].numel()
        self.loss_sum += loss.item()
        self.last_loss = loss.item()
        return loss


class _SmoothingTrainer:
    """A trainer that keeps a smoothed loss, computed from itself at every step, and the
    last hidden summary as a tuple, read by the next step's loss."""

    smoothed = 0.0  # a class default, shadowed by the first step

    def __init__(self):
        self.carry = (torch.zeros(()), torch.zeros(()))

    def train_step(self, model, optimizer, batch):
        optimizer.zero_grad()
        out = model(**batch)
        loss = out.loss + 0.01 * (self.carry[0] - self.carry[1]).square()
        loss.backward()
        optimizer.step()
        self.smoothed = 0.9 * self.smoothed + 0.1 * loss.item()
        self.carry = (out.logits.detach().mean(), out.logits.detach().std())
        return loss.detach()


class _LoopState:
    """A loop's state as scripts keep it: one dict holding a window of recent losses, counts
    in a Counter, sums in a defaultdict, a record of each step's numbers, and a module."""

    def __init__(self):
        self.state = {"recent": collections.deque(maxlen=3), "counts": collections.Counter(steps=0),
                      "sums": collections.defaultdict(float), "records": [], "probe": torch.nn.Linear(2, 2)}  # fmt: skip


def _give_loop_state(model):
    model.loop = _LoopState()


def _loop_state_step(model, optimizer, batch):
    loss = plain_step(model, optimizer, batch)
    state = model.loop.state
    state["recent"].append(loss.item())
    state["counts"]["steps"] += 1
    state["sums"]["loss"] += loss.item()
    state["records"].append({"loss": loss.item(), "half": (loss.detach() / 2).item()})
    return loss


def _kept_loop_state(model):
    state = model.loop.state
    return list(state["recent"]), dict(state["counts"]), dict(state["sums"]), state["records"]


@functools.lru_cache(maxsize=None)
def _class_scale(n: int) -> torch.Tensor:
    """A tensor the user's code caches by size (as a causal mask by length is)."""
    return torch.linspace(0.9, 1.1, n)


def _cached_scale_step(model, optimizer, batch):
    optimizer.zero_grad()
    out = model(**batch)
    loss = (out.loss * _class_scale(out.logits.shape[0])).mean()
    loss.backward()
    optimizer.step()
    return loss


def _give_smoothing_trainer(model):
    model.trainer = _SmoothingTrainer()


def _smoothing_step(model, optimizer, batch):
    return model.trainer.train_step(model, optimizer, batch)


def _give_trainer(model):
    model.trainer = _Trainer()  # each side's own, copied with its model


def _trainer_step(model, optimizer, batch):
    return model.trainer.train_step(model, optimizer, batch)


def _other_sizes(batch):
    small = {k: v[:2] for k, v in batch.items()}
    return [batch, batch, small, batch, small, batch]


_TASK_WEIGHTS = {"nli": 1.0, "qa": 0.5}


def _with_metadata(batch):
    """Batches as a dataset's collate gives them: ids, file names and raw text beside the
    tensors (new at every step), and a task name of two."""
    rows = len(batch["input_ids"])
    return [
        {**batch, "id": [100 * i + r for r in range(rows)], "file": [f"shard-{i:03d}.jsonl"] * rows,
         "text": [f"example {i}.{r}" for r in range(rows)], "task": "qa" if i % 2 else "nli"}
        for i in range(STEPS)
    ]  # fmt: skip


def _metadata_step(model, optimizer, batch):
    optimizer.zero_grad()
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    loss = model(**inputs).loss * _TASK_WEIGHTS[batch["task"]]
    loss.backward()
    optimizer.step()
    return loss.detach()


def _with_token_counts(batch):
    """Batches as a fairseq-style collate gives them: the count of target tokens and of
    sentences as Python ints beside the tensors, the count new at every step."""
    rows = len(batch["input_ids"])
    return [{**batch, "ntokens": batch["input_ids"].numel() - i, "nsentences": rows} for i in range(STEPS)]


def _token_count_step(model, optimizer, batch):
    optimizer.zero_grad()
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    loss = model(**inputs).loss * batch["nsentences"] / batch["ntokens"]
    loss.backward()
    optimizer.step()
    return {"loss": loss.detach(), "ntokens": batch["ntokens"], "sample_size": batch["nsentences"]}


IDIOMS = [
    Idiom("learning-rate scheduler stepped every step (LambdaLR warm-up from 0)", "works",
          between=_sched(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, s / 3)))),
    Idiom("scheduler stepped every epoch (StepLR, an epoch = 2 steps)", "works",
          between=_sched(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), every=2)),
    Idiom("OneCycleLR (changes lr and betas)", "works",
          between=_sched(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS + 1))),
    Idiom("ReduceLROnPlateau on a metric", "works",
          between=_sched(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, threshold=10.0), metric=True)),
    Idiom("learning rate set by hand in param_groups", "works", between=_hook(_set_lr)),
    Idiom("gradient clipping: clip_grad_norm_", "works", step=_with(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))),
    Idiom("gradient clipping: clip_grad_value_", "works", step=_with(lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3))),
    Idiom("torch.autocast, bfloat16 on CPU", "works", step=_with(ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))),
    Idiom("zero_grad(set_to_none=False) at the end of the step", "works", step=_with(zero_at_end=True)),
    Idiom("evaluation between steps (eval(), no_grad, train())", "works", between=_hook(_evaluate(True))),
    Idiom("evaluation between steps, train() forgotten", "refused", between=_hook(_evaluate(False))),
    Idiom("evaluation between steps, train() called first thing in train_step", "works", step=_train_mode_first, between=_hook(_evaluate(False))),
    Idiom("some modules kept in eval mode (first layer's dropout off), set again between steps", "works", setup=_dropout_frozen, between=_hook(_refreeze)),
    Idiom("resuming: load_state_dict into model and optimizer after compiling", "works", between=_hook(_resume)),
    Idiom("weights changed in place between steps (decay, EMA-style)", "works", between=_hook(_ema_in_place)),
    Idiom("dropout rate lowered between steps (nn.Dropout.p)", "works", between=_hook(_dropout_schedule)),
    Idiom("a warm-up and a term every other step computed in train_step from the loop's iteration count", "works",
          step=_warm_up_by_count, setup=_count_from_zero, between=_hook(_count_up)),
    Idiom("a warm-up then cosine learning rate set in param_groups inside train_step from the loop's iteration count (nanoGPT's get_lr)",
          "works", step=_rate_set_by_count, setup=_count_from_zero, between=_hook(_count_up)),
    Idiom("a last batch of another size", "works", batches=_other_sizes),
    Idiom("the dataset's ids, file names and raw text in the batch beside the tensors, filtered out in train_step; "
          "a task name the loss weight is looked up by", "works", step=_metadata_step, batches=_with_metadata),
    Idiom("a token count as a Python int in the batch (fairseq's ntokens), the loss divided by it, returned for logging",
          "works", step=_token_count_step, batches=_with_token_counts),
    Idiom("frozen parameters (fine-tuning a part)", "works", setup=_freeze),
    Idiom("train_step returns (loss, logits)", "works", step=_outputs),
    Idiom("train_step returns loss.item() and the learning rate (a LambdaLR warm-up)", "works", step=_numbers_out,
          between=_sched(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3)))),
    Idiom("gradient accumulation in one step (4 micro-batches)", "works", step=_accumulate(4)),
    Idiom("optimizer.step(closure): forward and backward in the closure (as Lightning's loop steps)", "works", step=_closure_step),
    Idiom("no zero_grad anywhere: each step adds its gradients to the last one's", "works", step=_no_zero_grad),
    Idiom("gradient accumulation across calls: backward in the step, optimizer.step() every 3rd call outside", "works",
          step=_backward_only, between=_hook(_update_every_third)),
    Idiom("fp16 autocast with torch.amp.GradScaler and an unfused AdamW (updates skipped on overflow)", "works", step=_grad_scaler,
          setup=_add_scaler, outside=lambda m: [m.scaler._scale, m.scaler._growth_tracker]),
    Idiom("a frozen layer unfrozen and given to the optimizer (add_param_group) after compiling: compiled again", "works",
          setup=_freeze_embeddings, between=_hook(_unfreeze_embeddings)),
    Idiom("scheduler stepped inside train_step, after optimizer.step() (StepLR)", "works", step=_inner_scheduler_step,
          between=_made_before_the_loop(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))),
    Idiom("scheduler stepped inside train_step, its new rate returned (scheduler.get_last_lr()[0], a cosine schedule)",
          "works", step=_inner_scheduler_rate_step,
          between=_made_before_the_loop(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4))),
    Idiom("ReduceLROnPlateau stepped on the loss inside train_step", "refused", step=_plateau_inside,
          between=_made_before_the_loop(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o))),
    Idiom("the model's own activation checkpointing (gradient_checkpointing_enable, dropout inside)", "works", setup=_checkpointing),
    Idiom("torch.manual_seed inside train_step", "refused", step=_seeded_step),
    Idiom("the step's time measured inside train_step (time.perf_counter()) and returned", "refused", step=_timed_step),
    Idiom("a loss weight warmed up from a Python counter the step counts up (model.calls += 1)", "works", step=_warmed_up_loss,
          setup=_count_calls, kept=lambda m: m.calls),
    Idiom("an EMA copy of the weights updated inside train_step (a helper object the model holds)", "works", step=_ema_inside,
          setup=_keep_ema, outside=lambda m: m.ema.shadow),
    Idiom("torch's AveragedModel (an EMA) updated inside train_step: compiled again once, when its count leaves 0", "works",
          step=_averaged_inside, setup=_keep_averaged,
          outside=lambda m: [*m.averaged.module.parameters(), m.averaged.module.n_averaged]),
    Idiom("a library's EMA helper (diffusers' EMAModel, its decay from a step count it keeps) stepped inside train_step", "refused",
          step=_library_ema_inside, setup=_keep_library_ema),
    Idiom("gradient hooks on the parameters (register_hook clamping, register_post_accumulate_grad_hook scaling)", "works",
          between=_with_gradient_hooks),
    Idiom("a gradient hook added to a parameter after compiling: compiled again", "works", between=_hook(_hook_added)),
    Idiom("distillation from a frozen teacher held in a global", "works", step=_distill, setup=_make_teacher),
    Idiom("hidden states a library collects through forward hooks it installs on the first forward (output_hidden_states)",
          "works", step=_hidden_states_step),
    Idiom("features stored by a forward hook for the loss, cleared before the step returns", "works", step=_feature_loss_step,
          setup=_hook_features),
    Idiom("forward hooks logging a layer's statistic into a list and storing a layer's output in a dict, read by the loss "
          "and left there", "works", step=_stored_features_step, setup=_hook_statistics, outside=_hooks_kept),
    Idiom("losses logged into a list inside train_step (losses.append(loss.item()))", "works", step=_logging_step, logged=_LOSSES),
    Idiom("a loss weight in a settings object, annealed between steps", "works", step=_weighted_step, between=_hook(_anneal_weight)),
    Idiom("a warning given once from a flag the step sets on its first run (if not model.warned_once: ...), a shape noted at the first batch",
          "works", step=_warn_once_step, setup=_first_run_flags, kept=lambda m: (m.warned_once, m.first_shape)),
    Idiom("a trainer's method as train_step, counting steps and summing losses (self.global_step += 1, self.loss_sum += loss.item())",
          "works", step=_trainer_step, setup=_give_trainer, kept=lambda m: vars(m.trainer)),
    Idiom("a smoothed loss computed from itself (self.smoothed = 0.9 * self.smoothed + 0.1 * loss.item(), a class default "
          "at first) and a tuple of tensors carried to the next step's loss", "works", step=_smoothing_step,
          setup=_give_smoothing_trainer, kept=lambda m: (m.trainer.smoothed, *map(float, m.trainer.carry))),
    Idiom("a loop's state in one dict beside a module: a deque of recent losses, a Counter, a defaultdict of sums, "
          "records of each step's numbers appended", "works", step=_loop_state_step, setup=_give_loop_state, kept=_kept_loop_state),
    Idiom("a tensor from the user's functools.lru_cache function in the loss (a scale cached by size)", "works",
          step=_cached_scale_step, kept=lambda m: _class_scale.cache_info().currsize),
    Idiom("checks that raise inside train_step: labels against the vocabulary, assert torch.isfinite(loss), "
          "clip_grad_norm_(error_if_nonfinite=True)", "works", step=_checked_step),
]


def run_idiom(idiom: Idiom) -> dict[str, Any]:
    spec = one_layer_bert()
    if idiom.setup is not None:
        idiom.setup(spec.model)
    # foreach=True (the multi-tensor update, CUDA's default): its update traces as a few ops
    # where the per-parameter one traces as ~8 a parameter, and the idioms are about the loop.
    opt = torch.optim.AdamW([p for p in spec.model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01, foreach=True)
    eager_model, eager_opt = twin(spec.model, opt)
    model, o = twin(spec.model, opt)
    hooks = {}
    if idiom.between is not None:
        hooks = {id(eager_opt): idiom.between(eager_model, eager_opt), id(o): idiom.between(model, o)}
    between = (lambda i, m, optimizer: hooks[id(optimizer)](i, m, optimizer)) if hooks else None
    batches = idiom.batches(spec.batch) if idiom.batches is not None else None
    example = batches[0] if batches else spec.batch
    outcome: dict[str, Any] = {"idiom": idiom.name, "expected": idiom.expect}
    try:
        try:
            step = remat.compile(idiom.step, model, o, example, memory_budget=0.9, profile_runs=1, measure=False)
        except BudgetError as e:  # a memory budget out of reach is no verdict on the idiom: plan at the reachable peak
            if getattr(e, "reach", None) is None:
                raise
            step = remat.compile(idiom.step, model, o, example, memory_budget=e.reach.best, profile_runs=1, measure=False)
        result = check_against_eager(idiom.step, eager_model, eager_opt, model, o, step, example, steps=STEPS,
                                     between_steps=between, batches=batches)
    except RematError as e:
        outcome.update(outcome="refused", detail=str(e))
    except Exception as e:  # noqa: BLE001 - any other failure is a bug, and reported as one
        outcome.update(outcome="WRONG", detail=f"{type(e).__name__}: {e}")
    else:
        if idiom.logged is not None:
            eager_log, remat_log = idiom.logged[0::2], idiom.logged[1::2]
            if eager_log != remat_log or len(remat_log) != STEPS:
                result.mismatches.append(f"logged {remat_log}, eager {eager_log}")
            result.match = result.match and not result.mismatches
            idiom.logged.clear()
        if idiom.kept is not None and idiom.kept(eager_model) != idiom.kept(model):
            result.mismatches.append(f"kept {idiom.kept(model)}, eager {idiom.kept(eager_model)}")
            result.match = False
        if idiom.outside is not None:
            pairs = list(zip(idiom.outside(eager_model), idiom.outside(model), strict=True))
            result.mismatches += [f"outside tensor {i} differs" for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
            result.match = result.match and not result.mismatches
        if result.match:
            graphs = f"{len(step._graphs)} graph{'s' if len(step._graphs) > 1 else ''}"
            outcome.update(outcome="works", detail=f"bitwise equal to eager over {STEPS} steps ({step.report.num_recomputed} activations recomputed; {graphs})")
        else:
            outcome.update(outcome="WRONG", detail=result.summary())
    outcome["as_expected"] = outcome["outcome"] == idiom.expect
    return outcome
