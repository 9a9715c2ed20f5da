"""Random small models for the randomized tests, and the check each one must pass.

A model is a `RandomSpec`: its inputs and a list of ops over a pool of values, each op
reading earlier values and adding one (or two) to the pool. `RandomNet(spec)` builds the
parameters and interprets the ops; its forward returns the loss. Ops cover what the
captured graphs of real models are made of, and especially what aliases storage: views,
reshapes, transposes, slices, chunks, broadcasts, in-place ops on fresh values and on
slices of them. The hypothesis strategy `random_specs()` draws specs that always train in
eager PyTorch (in-place ops are only drawn where autograd allows them), except for the
rare "hostile" construct that remat must refuse to capture.

`check_example(spec)` compiles the model with remat and checks it against eager; it
returns an `Outcome`, and raises AssertionError on anything wrong. The tests
(tests/test_randomized.py) and the long run (benchmarks/long_randomized.py) share it.
"""

from __future__ import annotations

import functools

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import remat
import remat.build as pipeline_build
import remat.runtime
from remat.capture.optimizers import as_one
from remat.ops.rng_replay import Replay
from remat.memory.analysis import analyze
from remat.capture.train_graph import Phase
from remat.measurement.check import check_against_eager, model_snapshot, snapshot_differences, twin
from remat.errors import BudgetError, CaptureError
from remat.memory.simulator import simulate
from remat.passes.update_buckets import made_from

try:  # the strategy needs hypothesis (the `test` extra); the rest of the module does not
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None  # type: ignore[assignment]

# Kernels allocate scratch of their own that no graph shows (oneDNN convolutions, GEMM
# packing buffers, the allocator's alignment): up to ~100 KiB seen on these graphs, where
# a peak is a few hundred KiB, so 3% alone would be noise. The measured peak must be
# within max(3% of the prediction, SCRATCH_SLACK) of it, and at most SCRATCH_SLACK over
# the budget.
SCRATCH_SLACK = 128 * 1024
REL_TOL = 0.03
MAX_NUMEL = 1 << 15  # 128 KiB of float32: the largest value an op may make

WIDTHS = (8, 16, 32, 64)
HOSTILE = ("branch", "mask", "item")


# ---------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class Op:
    kind: str
    ins: tuple[int, ...]  # indices into the value pool
    arg: tuple = ()  # op-specific settings

    def __repr__(self) -> str:
        a = f", {self.arg}" if self.arg else ""
        return f"Op({self.kind!r}, {self.ins}{a})"


@dataclass(frozen=True)
class RandomSpec:
    batch: int
    seq: int
    features: int  # width of the float input "x" (B, T, features); 0: no such input
    image: tuple[int, int] = (0, 0)  # (channels, side) of "img" (B, C, S, S); (0, 0): none
    vocab: int = 0  # "ids" (B, T) in [0, vocab); 0: none
    ops: tuple[Op, ...] = ()
    loss: str = "meansq"  # "meansq" | "mse" | "ce"
    extra_loss: bool = False  # add the mean of every value no op reads to the loss
    # "sgd" (momentum 0.9) | "adamw" | either with "-foreach" (torch's multi-tensor update) |
    # "adamw-fused" (its fused kernel) |
    # "split": SGD on matrices, AdamW on the rest, passed as a list
    optimizer: str = "sgd"
    zero_grad_first: bool = True
    budget: float = 0.5
    retry: float = 0.0  # where to retry a refused budget: 0 the reachable peak .. 1 the baseline
    hostile: str | None = None  # a construct capture must refuse (see HOSTILE)
    seed: int = 0
    micro_batches: int = 1  # forward+backward passes per step, accumulating gradients (the batch scaled per pass)
    schedule: bool = False  # the loop changes lr, momentum/betas and weight decay between steps (with `outside`, a loss weight too)
    frozen: int = 0  # every frozen-th parameter (by order) has requires_grad=False; 0: none
    clip: bool = False  # clip_grad_norm_ before the update: it reads every gradient together
    # Tensors outside the model: the loss scaled by a 0-dim tensor in the step's closure, and
    # an EMA of the parameters (a list the model holds as a plain attribute) updated in place;
    # and numbers the step keeps in a tracker object the model holds (a count, a sum of
    # losses, the last loss, a history dict of lists logged into).
    outside: bool = False
    # Gradient hooks on the trainable parameters (clamped before accumulation, or halved after),
    # and forward hooks on the first layer logging a statistic of its output into a list and
    # storing the output in a dict, both the layer's.
    hooks: bool = False
    # Gradient accumulation across calls: the step runs forward and backward only, adding to
    # the gradients it finds (set to zeros before the first call, so its first graph is the
    # one that adds); the loop steps the optimizer and clears them after every second call.
    across_calls: bool = False

    def input_names(self) -> list[str]:
        return [n for n, on in (("x", self.features), ("img", self.image[0]), ("ids", self.vocab)) if on]

    def describe(self) -> str:
        ins = {"x": (self.batch, self.seq, self.features), "img": (self.batch, self.image[0], self.image[1], self.image[1]),
               "ids": (self.batch, self.seq)}
        lines = [f"inputs {[f'{n}{ins[n]}' for n in self.input_names()]}, loss {self.loss}"
                 f"{' + extra' if self.extra_loss else ''}, {self.optimizer}, budget {self.budget:g} (retry {self.retry:g})"
                 f"{'' if self.zero_grad_first else ', zero_grad after step'}"
                 f"{f', {self.micro_batches} micro-batches' if self.micro_batches > 1 else ''}"
                 f"{', hyperparameters changed between steps' if self.schedule else ''}"
                 f"{' (and a loss weight)' if self.schedule and self.outside else ''}"
                 f"{f', every {self.frozen}th parameter frozen' if self.frozen else ''}"
                 f"{', a scale, an EMA and kept numbers outside the model' if self.outside else ''}"
                 f"{', gradient and forward hooks' if self.hooks else ''}"
                 f"{', gradients accumulated across calls' if self.across_calls else ''}"
                 f"{', hostile ' + self.hostile if self.hostile else ''}, seed {self.seed}"]
        lines += [f"  v{len(self.input_names()) + i}: {op!r}" for i, op in enumerate(self.ops)]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the model


class RandomNet(nn.Module):
    """Interprets a RandomSpec; `forward(batch)` returns the loss."""

    def __init__(self, spec: RandomSpec):
        super().__init__()
        self.spec = spec
        shapes = value_shapes(spec)
        mods: dict[str, nn.Module] = {}
        for i, op in enumerate(spec.ops):
            src = shapes[op.ins[0]] if op.ins else None
            if op.kind == "linear":
                mods[f"m{i}"] = nn.Linear(src[-1], op.arg[0], bias=op.arg[1])
            elif op.kind == "conv":
                mods[f"m{i}"] = nn.Conv2d(src[1], op.arg[0], op.arg[1], padding=op.arg[1] // 2, bias=op.arg[2])
            elif op.kind == "layer_norm":
                mods[f"m{i}"] = nn.LayerNorm(src[-1])
            elif op.kind == "batch_norm":
                mods[f"m{i}"] = nn.BatchNorm1d(src[-1]) if len(src) == 3 else nn.BatchNorm2d(src[1])
            elif op.kind == "embedding":
                mods[f"m{i}"] = nn.Embedding(spec.vocab, op.arg[0])
            elif op.kind == "dropout":
                mods[f"m{i}"] = nn.Dropout(op.arg[0])
        self.mods = nn.ModuleDict(mods)
        if spec.hostile:  # the construct reads a model's value: one the batch alone decides is held, checked (ops/known_values.py)
            self.hostile_weight = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        spec = self.spec
        vals: list[torch.Tensor] = [batch[n] for n in spec.input_names()]
        read: set[int] = set()
        for i, op in enumerate(spec.ops):
            read.update(op.ins)
            xs = [vals[j] for j in op.ins]
            out = _apply(op, xs, self.mods[f"m{i}"] if f"m{i}" in self.mods else None)
            if op.kind == "chunk":
                vals.extend(out)
            else:
                vals.append(out)
            if spec.hostile and i == len(spec.ops) // 2:
                vals[-1] = _hostile(spec.hostile, vals[-1] * self.hostile_weight)
        out = vals[-1]
        if spec.loss == "mse":
            loss = F.mse_loss(out, batch["target"])
        elif spec.loss == "ce":
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), batch["labels"])
        else:
            loss = out.pow(2).mean()
        if spec.extra_loss:
            stale = stale_values(spec)
            for j, v in enumerate(vals[:-1]):
                if j not in read and j not in stale and v.is_floating_point():
                    loss = loss + v.mean()
        return loss


def _apply(op: Op, xs: list[torch.Tensor], mod: nn.Module | None) -> Any:
    k = op.kind
    x = xs[0] if xs else None
    if k in ("linear", "conv", "layer_norm", "embedding", "dropout"):
        return mod(x)
    if k == "batch_norm":  # arg: make the input contiguous first (BatchNorm1d: else it is a transpose)
        if x.dim() == 3:
            x = x.transpose(1, 2)
            return mod(x.contiguous() if op.arg[0] else x).transpose(1, 2)
        return mod(x.contiguous() if op.arg[0] else x)
    if k == "noise":  # a random factory op (its device a keyword of the traced call), drawn again by a copy
        if op.arg[0] == "randint":
            return x * torch.randint(0, 2, x.shape, device=x.device)
        return x + 0.1 * torch.randn(x.shape, device=x.device)
    if k == "relu":
        return torch.relu(x)
    if k == "relu_":
        return x.relu_()
    if k == "gelu":
        return F.gelu(x)
    if k == "sigmoid":
        return torch.sigmoid(x)
    if k == "tanh":
        return torch.tanh(x)
    if k == "softmax":
        return torch.softmax(x, dim=op.arg[0])
    if k == "add":
        return x + xs[1]
    if k == "mul":
        return x * xs[1]
    if k == "add_":
        return x.add_(xs[1])
    if k == "cat":
        return torch.cat([x, xs[1]], dim=-1)
    if k == "matmul":
        return torch.matmul(x, xs[1].transpose(1, 2)) * (1.0 / math.sqrt(x.shape[-1]))
    if k == "bmm":  # arg: multiply by the transpose of the second
        return torch.bmm(x, xs[1].transpose(1, 2) if op.arg and op.arg[0] else xs[1])
    if k == "transpose":
        return x.transpose(1, 2)
    if k == "reshape":
        b, t, d = x.shape
        return x.reshape(b, t * 2, d // 2)
    if k == "flatten":
        return x.flatten(2)
    if k == "to_seq":
        return x.flatten(2).transpose(1, 2)
    if k == "slice":
        lo, hi = op.arg
        return x[..., lo:hi]
    if k == "stride":
        return x[:, ::2]
    if k == "chunk":
        return list(x.chunk(2, dim=-1))
    if k == "expand":
        return x[:, :1].expand_as(x)
    if k == "slice_relu_":
        x[..., : op.arg[0]].relu_()
        return x
    if k == "slice_mul_":
        x[..., : op.arg[0]].mul_(0.5)
        return x
    if k == "pool":
        return F.max_pool2d(x, 2) if op.arg[0] == "max" else F.avg_pool2d(x, 2)
    raise ValueError(f"unknown op {k}")


def _hostile(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "branch":  # Python control flow on a tensor's value
        return x * 2 if x.sum() > 0 else x
    if kind == "mask":  # boolean-mask indexing: the output's shape depends on values
        return x + x[x > 0].sum()
    if kind == "item":  # a tensor's value read into Python
        return x * float(x.mean().item())
    raise ValueError(kind)


# ---------------------------------------------------------------------------- shapes


def input_shapes(spec: RandomSpec) -> list[tuple[int, ...]]:
    shapes = {"x": (spec.batch, spec.seq, spec.features), "img": (spec.batch, spec.image[0], spec.image[1], spec.image[1]),
              "ids": (spec.batch, spec.seq)}
    return [shapes[n] for n in spec.input_names()]


def out_shapes(op: Op, ins: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes of the values `op` adds to the pool."""
    k, s = op.kind, ins[0] if ins else ()
    if k == "linear":
        return [(*s[:-1], op.arg[0])]
    if k == "conv":
        return [(s[0], op.arg[0], s[2], s[3])]
    if k == "embedding":
        return [(*s, op.arg[0])]
    if k == "cat":
        return [(*s[:-1], s[-1] + ins[1][-1])]
    if k == "matmul":
        return [(s[0], s[1], s[1])]
    if k == "bmm":
        return [(s[0], s[1], ins[1][1] if op.arg and op.arg[0] else ins[1][2])]
    if k == "transpose":
        return [(s[0], s[2], s[1], *s[3:])]
    if k == "reshape":
        return [(s[0], s[1] * 2, s[2] // 2)]
    if k == "flatten":
        return [(s[0], s[1], s[2] * s[3])]
    if k == "to_seq":
        return [(s[0], s[2] * s[3], s[1])]
    if k == "slice":
        return [(*s[:-1], op.arg[1] - op.arg[0])]
    if k == "stride":
        return [(s[0], (s[1] + 1) // 2, *s[2:])]
    if k == "chunk":
        return [(*s[:-1], s[-1] // 2)] * 2
    if k == "pool":
        return [(s[0], s[1], s[2] // 2, s[3] // 2)]
    return [s]


def value_shapes(spec: RandomSpec) -> list[tuple[int, ...]]:
    shapes = input_shapes(spec)
    for op in spec.ops:
        shapes.extend(out_shapes(op, [shapes[i] for i in op.ins]))
    return shapes


def stale_values(spec: RandomSpec) -> set[int]:
    """Values that are views made before a later in-place write to their storage."""
    group: list[int] = list(range(len(spec.input_names())))
    epoch: list[int] = [0] * len(group)
    writes: dict[int, int] = {g: 0 for g in group}
    for op in spec.ops:
        g = group[op.ins[0]] if op.ins else -1
        if op.kind in _VIEWS:
            n = 2 if op.kind == "chunk" else 1
            group += [g] * n
            epoch += [writes[g]] * n
        elif op.kind in ("relu_", "add_", "slice_relu_", "slice_mul_"):
            writes[g] += 1
            group.append(g)
            epoch.append(writes[g])
        else:
            writes[len(group)] = 0
            group.append(len(group))
            epoch.append(0)
    return {i for i, (g, e) in enumerate(zip(group, epoch)) if e < writes[g]}


def make_batch(spec: RandomSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    batch: dict[str, torch.Tensor] = {}
    for name, shape in zip(spec.input_names(), input_shapes(spec)):
        if name == "ids":
            batch[name] = torch.randint(0, spec.vocab, shape, generator=gen)
        else:
            batch[name] = torch.randn(shape, generator=gen)
    out = value_shapes(spec)[-1]
    if spec.loss == "mse":
        batch["target"] = torch.randn(out, generator=gen)
    elif spec.loss == "ce":
        batch["labels"] = torch.randint(0, out[-1], (math.prod(out[:-1]),), generator=gen)
    return batch


def build(spec: RandomSpec) -> tuple[RandomNet, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = RandomNet(spec).train()
    batch = make_batch(spec)
    if spec.frozen:
        params = list(model.parameters())
        for p in params[:: spec.frozen]:
            p.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            trains = model(batch).requires_grad
        if not trains:  # the loss depends on no trainable parameter: nothing to train
            for p in params:
                p.requires_grad_(True)
    if spec.outside:
        model.ema = [p.detach().clone() for p in model.parameters()]
        model.tracker = Tracker()
        if spec.schedule:
            model.loss_weight = 1.0  # a float the loop anneals: read at every call after its first change (read_numbers)
    return model, make_optimizer(spec.optimizer, list(model.parameters())), batch


def _clamp_gradient(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.05, 0.05)


def _halve_gradient(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


def add_gradient_hooks(model: nn.Module) -> None:
    """Every other trainable parameter's gradient clamped before it is accumulated, the
    others' halved after. On each side after copying: a deep copy leaves hooks behind."""
    for i, p in enumerate(p for p in model.parameters() if p.requires_grad):
        p.register_hook(_clamp_gradient) if i % 2 == 0 else p.register_post_accumulate_grad_hook(_halve_gradient)


def _log_output(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    module.logged.append(out.detach().float().abs().mean())
    module.stored["output"] = out.detach()


def add_forward_hooks(model: nn.Module) -> None:
    """A forward hook on the model's first layer (if any), logging a statistic of its
    output into the layer's list and storing the output in its dict."""
    layer = next(iter(model.mods.values()), None)
    if layer is not None:
        layer.logged, layer.stored = [], {}
        layer.register_forward_hook(_log_output)


def make_optimizer(kind: str, params: list[torch.Tensor]) -> Any:
    """One optimizer, or for "split" a list of two (one where either part is empty)."""
    foreach = kind.endswith("-foreach")
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind.startswith("adamw"):
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if kind.startswith("sgd"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    matrices, rest = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    parts = [torch.optim.SGD(matrices, lr=1e-3, momentum=0.9)] if matrices else []
    return parts + ([torch.optim.AdamW(rest, lr=1e-3)] if rest else [])


def each(optimizer: Any) -> list[torch.optim.Optimizer]:
    return optimizer if isinstance(optimizer, list) else [optimizer]


def change_hyperparameters(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, anneal: bool = True) -> None:
    """What a loop's scheduler does between steps (a zero weight decay stays zero: the
    update branches on it; a fused kernel's settings but the learning rate stay as they
    are: it takes them as fixed numbers), and, with `anneal`, a loss weight the model holds, where it
    holds one (the step is then compiled once more, for it: see check_example)."""
    if anneal and hasattr(model, "loss_weight"):
        model.loss_weight = 1.0 - 0.15 * (step + 1)
    for g in (g for o in each(optimizer) for g in o.param_groups):
        g["lr"] = g["lr"] * (0.5 + 0.3 * step)
        if g.get("fused"):
            continue
        if g.get("weight_decay"):
            g["weight_decay"] = g["weight_decay"] * 1.5
        if "betas" in g:
            g["betas"] = (g["betas"][0] - 0.05, g["betas"][1])
        if g.get("momentum"):
            g["momentum"] = g["momentum"] * 0.9


class Tracker:
    """Numbers a step keeps (capture.state.kept_numbers, logged_numbers)."""

    def __init__(self) -> None:
        self.steps = 0
        self.loss_sum = 0.0
        self.last_loss = None
        self.history: dict[str, list[float]] = {"loss": []}


def make_train_step(spec: RandomSpec):
    scale = torch.rand((), generator=torch.Generator().manual_seed(spec.seed)) + 0.5

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if spec.zero_grad_first and not spec.across_calls:
            for o in each(optimizer):
                o.zero_grad()
        loss = model(batch) * scale if spec.outside else model(batch)
        if spec.outside and spec.schedule:
            loss = loss * model.loss_weight
        loss.backward()
        for i in range(1, spec.micro_batches):  # another pass, on a scaled batch, adding to the gradients
            part = {k: v * (1.0 + 0.5 * i) if v.is_floating_point() else v for k, v in batch.items()}
            more = model(part)
            more.backward()
            loss = loss + more.detach()
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for o in each(optimizer) if not spec.across_calls else ():
            o.step()
        if spec.outside:
            with torch.no_grad():
                for e, p in zip(model.ema, model.parameters()):
                    e.lerp_(p, 0.25)
            model.tracker.steps += 1
            model.tracker.loss_sum += loss.item()
            model.tracker.last_loss = loss.item()
            model.tracker.history["loss"].append(loss.item())
        if not spec.zero_grad_first and not spec.across_calls:
            for o in each(optimizer):
                o.zero_grad()
        return loss

    return train_step


# ---------------------------------------------------------------------------- the strategy


@dataclass
class _Value:
    shape: tuple[int, ...]
    group: int  # storage group: views and in-place results share their input's
    is_float: bool = True
    expanded: bool = False  # a stride-0 view or one of chunk's views: never written in place
    grad: bool = False  # depends on a parameter
    epoch: int = 0  # in-place writes to its group before it was made


class _Pool:
    """The values drawn so far, and where autograd allows an in-place op.

    An in-place op is legal on a group (a storage and its views) only while nothing has
    saved it for backward: its maker does not save its output (relu, sigmoid, tanh and
    softmax do) and no op other than a view has read it yet. Inputs are never written.

    A view made before an in-place write to its group is *stale* after it, and never
    read again (see STALE_VIEW in tests/test_randomized.py: a known limitation).
    """

    def __init__(self) -> None:
        self.values: list[_Value] = []
        self.writable: dict[int, bool] = {}
        self.writes: dict[int, int] = {}  # group -> in-place writes so far

    def add(self, shape: tuple[int, ...], group: int | None = None, writable: bool = False, **kw: Any) -> int:
        if group is None:
            group = len(self.writable)
            self.writable[group] = writable
            self.writes[group] = 0
        self.values.append(_Value(shape, group, epoch=self.writes[group], **kw))
        return len(self.values) - 1

    def stale(self, v: _Value) -> bool:
        return v.epoch < self.writes[v.group]


_PARAMETRIZED = {"linear", "conv", "layer_norm", "batch_norm", "embedding"}
_SAVES_OUTPUT = {"relu", "sigmoid", "tanh", "softmax", "relu_", "slice_relu_"}
_VIEWS = {"transpose", "slice", "stride", "chunk", "expand", "to_seq", "flatten", "reshape"}


if st is not None:

    @st.composite
    def _pick(draw: Any, pool: _Pool, ok: Any) -> int | None:
        """An index of a value satisfying `ok`, the most recent first (shrinks to chains)."""
        cands = [i for i, v in enumerate(pool.values) if v.is_float and not pool.stale(v) and ok(v)]
        if not cands:
            return None
        back = draw(st.integers(0, len(cands) - 1))
        return cands[-1 - back]

    @st.composite
    def random_specs(draw: Any, max_ops: int = 14, hostile: bool = True) -> RandomSpec:
        """A random model, loss, optimizer and budget (see the module docstring)."""
        batch = draw(st.sampled_from([4, 2, 8]))
        seq = draw(st.sampled_from([8, 4, 16]))
        kinds = draw(st.sampled_from([("x",), ("ids",), ("img",), ("x", "ids"), ("img", "x")]))
        features = draw(st.sampled_from(WIDTHS)) if "x" in kinds else 0
        image = (draw(st.sampled_from([3, 8])), draw(st.sampled_from([8, 4, 16]))) if "img" in kinds else (0, 0)
        vocab = draw(st.sampled_from([50, 7])) if "ids" in kinds else 0
        spec0 = RandomSpec(batch, seq, features, image, vocab)
        pool = _Pool()
        for name, shape in zip(spec0.input_names(), input_shapes(spec0)):
            pool.add(shape, is_float=name != "ids")
        ops: list[Op] = []
        if vocab:
            ops.append(Op("embedding", (len(pool.values) - 1,), (draw(st.sampled_from(WIDTHS)),)))
            pool.add(out_shapes(ops[-1], [pool.values[-1].shape])[0], writable=True, grad=True)
        n_ops = draw(st.integers(min(3, max_ops), max_ops))
        for _ in range(n_ops):
            op = draw(_op(pool))
            if op is None:
                continue
            ins = [pool.values[i] for i in op.ins]
            shapes = out_shapes(op, [v.shape for v in ins])
            grad = op.kind in _PARAMETRIZED or any(v.grad for v in ins)
            if op.kind not in _VIEWS or op.kind == "chunk":
                # Read (and maybe saved for backward): no more in-place writes. Views made
                # by chunk (a multi-view op) may not be written, nor their base after them.
                for v in ins:
                    pool.writable[v.group] = False
            if op.kind in _VIEWS:
                for s in shapes:
                    pool.add(s, group=ins[0].group, expanded=ins[0].expanded or op.kind in ("expand", "chunk"), grad=grad)
            elif op.kind in ("relu_", "add_", "slice_relu_", "slice_mul_"):
                pool.writable[ins[0].group] = op.kind not in _SAVES_OUTPUT
                pool.writes[ins[0].group] += 1
                pool.add(shapes[0], group=ins[0].group, grad=grad)
            else:
                pool.add(shapes[0], writable=op.kind not in _SAVES_OUTPUT, grad=grad)
            ops.append(op)
        if not pool.values[-1].grad:  # the loss must depend on a parameter
            ops.append(Op("linear", (len(pool.values) - 1,), (16, True)))
        loss = draw(st.sampled_from(["meansq", "mse", "ce"]))
        hostile = draw(st.sampled_from(HOSTILE)) if ops and hostile and draw(st.integers(0, 9)) == 9 else None
        return RandomSpec(
            batch,
            seq,
            features,
            image,
            vocab,
            ops=tuple(ops),
            loss=loss,
            extra_loss=draw(st.booleans()),
            optimizer=draw(st.sampled_from(["sgd", "adamw", "split", "sgd-foreach", "adamw-foreach", "adamw-fused"])),
            zero_grad_first=draw(st.booleans()),
            budget=draw(st.one_of(st.sampled_from([0.5, 1.0, 0.1]), st.floats(0.02, 1.0))),
            retry=draw(st.sampled_from([0.0, 0.5, 0.2, 0.8])),
            hostile=hostile,
            seed=draw(st.integers(0, 2**16)),
            micro_batches=draw(st.sampled_from([1, 1, 2, 3])),
            schedule=draw(st.booleans()),
            frozen=draw(st.sampled_from([0, 0, 2, 3])),
            clip=draw(st.sampled_from([False, False, False, True])),
            outside=draw(st.sampled_from([False, False, True])),
            hooks=draw(st.sampled_from([False, False, False, True])),
            across_calls=draw(st.sampled_from([False, False, False, True])),
        )

    def _fits(shape: tuple[int, ...]) -> bool:
        return math.prod(shape) <= MAX_NUMEL

    @st.composite
    def _op(draw: Any, pool: _Pool) -> Op | None:
        kind = draw(st.sampled_from(OP_KINDS))
        p = lambda ok: draw(_pick(pool, ok))  # noqa: E731
        if kind in ("relu", "gelu", "sigmoid", "tanh", "dropout", "noise", "layer_norm", "softmax", "transpose"):
            i = p(lambda v: kind != "transpose" or len(v.shape) >= 3)
            if i is None:
                return None
            if kind == "dropout":
                return Op(kind, (i,), (draw(st.sampled_from([0.1, 0.5])),))
            if kind == "noise":
                return Op(kind, (i,), (draw(st.sampled_from(["randn", "randint"])),))
            if kind == "softmax":
                return Op(kind, (i,), (draw(st.sampled_from([-1, 1])),))
            return Op(kind, (i,))
        if kind == "linear":
            i = p(lambda v: True)
            if i is None:
                return None
            d = draw(st.sampled_from(WIDTHS))
            if not _fits((*pool.values[i].shape[:-1], d)):
                return None
            return Op(kind, (i,), (d, draw(st.booleans())))
        if kind == "conv":
            i = p(lambda v: len(v.shape) == 4)
            if i is None:
                return None
            c = draw(st.sampled_from([4, 8, 16]))
            s = pool.values[i].shape
            if not _fits((s[0], c, s[2], s[3])):
                return None
            return Op(kind, (i,), (c, draw(st.sampled_from([3, 1])), draw(st.booleans())))
        if kind == "batch_norm":
            i = p(lambda v: len(v.shape) in (3, 4))
            return None if i is None else Op(kind, (i,), (draw(st.sampled_from([True, True, True, False])),))
        if kind in ("relu_", "slice_relu_", "slice_mul_"):
            i = p(lambda v: pool.writable[v.group] and not v.expanded)
            if i is None:
                return None
            if kind == "relu_":
                return Op(kind, (i,))
            d = pool.values[i].shape[-1]
            return Op(kind, (i,), (draw(st.integers(1, d)),))
        if kind in ("add", "mul", "add_", "cat", "matmul"):
            first = (lambda v: pool.writable[v.group] and not v.expanded) if kind == "add_" else (lambda v: len(v.shape) == 3 if kind == "matmul" else True)
            i = p(first)
            if i is None:
                return None
            a = pool.values[i].shape
            if kind == "cat":
                j = p(lambda v: v.shape[:-1] == a[:-1])
                if j is None or not _fits((*a[:-1], a[-1] + pool.values[j].shape[-1])):
                    return None
            else:
                j = p(lambda v: v.shape == a)
                if kind == "add_" and j is not None and pool.values[j].group == pool.values[i].group:
                    j = None  # x.add_(view of x): reads what it writes
                if j is None:
                    return None
            return Op(kind, (i, j))
        if kind == "bmm":
            i = p(lambda v: len(v.shape) == 3)
            if i is None:
                return None
            a = pool.values[i].shape
            transposed = draw(st.booleans())
            if transposed:  # x @ y^T: y is (B, S, a[2])
                j = p(lambda v: len(v.shape) == 3 and v.shape[0] == a[0] and v.shape[2] == a[2])
            else:  # x @ y: y is (B, a[2], D)
                j = p(lambda v: len(v.shape) == 3 and v.shape[:2] == (a[0], a[2]))
            if j is None:
                return None
            b = pool.values[j].shape
            if not _fits((a[0], a[1], b[1] if transposed else b[2])):
                return None
            return Op(kind, (i, j), (transposed,))
        if kind == "reshape":
            i = p(lambda v: len(v.shape) == 3 and v.shape[2] % 2 == 0)
            return None if i is None else Op(kind, (i,))
        if kind in ("flatten", "to_seq", "pool"):
            i = p(lambda v: len(v.shape) == 4 and (kind != "pool" or all(d % 2 == 0 and d >= 2 for d in v.shape[2:])))
            if i is None:
                return None
            return Op(kind, (i,), (draw(st.sampled_from(["max", "avg"])),) if kind == "pool" else ())
        if kind == "slice":
            i = p(lambda v: v.shape[-1] >= 2)
            if i is None:
                return None
            d = pool.values[i].shape[-1]
            lo = draw(st.integers(0, d - 1))
            return Op(kind, (i,), (lo, draw(st.integers(lo + 1, d))))
        if kind == "stride":
            i = p(lambda v: len(v.shape) >= 3 and v.shape[1] >= 2)
            return None if i is None else Op(kind, (i,))
        if kind == "chunk":
            i = p(lambda v: v.shape[-1] % 2 == 0)
            return None if i is None else Op(kind, (i,))
        if kind == "expand":
            i = p(lambda v: len(v.shape) >= 3)
            return None if i is None else Op(kind, (i,))
        raise AssertionError(kind)


OP_KINDS = (
    "linear", "relu", "add", "relu_", "gelu", "sigmoid", "tanh", "softmax", "layer_norm", "batch_norm",
    "dropout", "mul", "add_", "cat", "matmul", "bmm", "transpose", "reshape", "slice", "stride", "chunk",
    "expand", "slice_relu_", "slice_mul_", "conv", "pool", "flatten", "to_seq", "noise",
)


# ---------------------------------------------------------------------------- the check


@dataclass
class Outcome:
    """What one example did. `kind`: "ran"; "ran_after_refusal" (the budget was refused, and
    a budget between the reachable peak and the baseline ran instead); "capture_error" (a
    hostile construct refused)."""

    kind: str
    budget_bytes: int | None = None
    predicted_peak: int | None = None
    measured_peak: int | None = None
    storages_peak: int | None = None  # simulated without the measured kernel scratch
    baseline_peak: int | None = None
    num_recomputed: int = 0
    copies: int = 0
    nodes: int = 0
    updates_in_backward: bool = False  # the plan ran optimizer updates in the backward pass
    replayed: int = 0  # copies of random ops (replaying the generator state)
    lean_ops: int = 0  # backward ops that wrote their result into a dying input
    message: str = ""
    notes: list[str] = field(default_factory=list)


_BUDGET_ERROR = re.compile(r"budget of .*?\((\d+) bytes\): the smallest peak it could reach is [^(]*\((\d+) bytes\)")


def parse_budget_error(message: str) -> tuple[int, int]:
    """(budget bytes, smallest reachable peak) from a planner's BudgetError message."""
    m = _BUDGET_ERROR.search(message)
    assert m, f"a BudgetError must say the budget and the smallest reachable peak in bytes: {message}"
    return int(m.group(1)), int(m.group(2))


@contextlib.contextmanager
def reuse_profiles(cache: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Make `remat.compile` capture and profile each model once and reuse both after.

    The greedy's picks depend on the measured node times; replanning the same graph at
    another budget must see the same times, or "the smallest peak it could reach" would
    not be reproducible. (Reusing the capture only saves time: nothing between the two
    compiles changes the model.) Yields {"profiles": by graph fingerprint, "captures": ...}:
    `cache`, where given (one that an earlier block yielded: its profiles reused).
    """
    from remat.profile.profiles import graph_fingerprint

    real_profile, real_capture = pipeline_build.profile, pipeline_build.capture
    profiles: dict[str, Any] = {} if cache is None else cache["profiles"]
    captures: dict[tuple[int, int], Any] = {} if cache is None else cache["captures"]

    def profile(tg, *args, **kwargs):  # type: ignore[no-untyped-def]
        key = graph_fingerprint(tg)
        if key not in profiles:
            profiles[key] = real_profile(tg, *args, **kwargs)
        return profiles[key]

    def capture(train_step, model, optimizer, batch):  # type: ignore[no-untyped-def]
        key = (id(model), id(optimizer))
        if key not in captures:
            captures[key] = real_capture(train_step, model, optimizer, batch)
        return captures[key]

    pipeline_build.profile, pipeline_build.capture = profile, capture
    try:
        yield {"profiles": profiles, "captures": captures}
    finally:
        pipeline_build.profile, pipeline_build.capture = real_profile, real_capture


def rewritten_phases(tg: remat.TrainGraph, gm: torch.fx.GraphModule) -> dict[str, Phase]:
    """Phases of a rewritten graph: a recompute copy belongs to the phase of the op it precedes."""
    phase: dict[str, Phase] = {}
    following = Phase.OPTIMIZER
    for node in reversed([n for n in gm.graph.nodes if n.op == "call_function"]):
        following = tg.phase.get(node.name, following)
        phase[node.name] = following
    return phase


def _refused_by_the_bound(tg: remat.TrainGraph, prof: Any, budget: int) -> bool:
    """Whether μ-TWO's greedy fits `budget` when it simulates every pick (no lower bound)."""
    from remat.planners.mutwo import plan_mutwo
    from remat.memory.schedule import GraphIndex

    index = GraphIndex.build(tg, analyze(tg))
    index.scratch = prof.scratch_by_node()
    try:
        plan_mutwo(index, prof.seconds_by_node(), budget, simulate_every_pick=True)
    except BudgetError:
        return False
    return True


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or not t.is_floating_point():
        return t
    return t.detach().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bit for bit (NaN included), or both None."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(_bits(a), _bits(b)))


def bitwise_equal_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def bitwise_equal_state(model_a: nn.Module, opt_a: Any, model_b: nn.Module, opt_b: Any) -> bool:
    """Parameters, gradients, buffers and optimizer state equal bit for bit (NaN included)."""
    same = _same
    pairs = list(zip(model_a.parameters(), model_b.parameters()))
    ok = all(same(a, b) and same(a.grad, b.grad) for a, b in pairs)
    ok = ok and all(same(a, b) for a, b in zip(model_a.buffers(), model_b.buffers()))
    opt_a, opt_b = as_one(opt_a), as_one(opt_b)
    for a, b in pairs:
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        ok = ok and set(sa) == set(sb) and all(same(sa[k], sb[k]) for k in sa)
    return ok


def original_name(node_name: str) -> str:
    """The node of the captured graph a rewritten graph's node copies (itself, unless it
    is a recompute copy or a bucket's part of a multi-tensor op)."""
    return made_from(re.sub(r"_recomputed(_\d+)?$", "", node_name))


def _compile(spec: RandomSpec, model: nn.Module, opt: torch.optim.Optimizer, batch: Any, budget: Any) -> remat.RematStep:
    return remat.compile(make_train_step(spec), model, opt, batch, memory_budget=budget, profile_runs=1)


def _check_memory(compiled: Any) -> int:
    """One compiled graph that ran: its predicted peak within its budget and the simulator's
    on the graph that runs, its measured peak as predicted, and the allocator node by node
    against the simulated storages. Returns the peak of the storages alone."""
    report = compiled.report
    budget = report.budget_bytes
    assert budget is not None and report.plan is not None
    assert report.predicted_peak_bytes <= budget, f"predicted {report.predicted_peak_bytes} over the budget {budget}"
    assert report.predicted_peak_bytes == report.plan.predicted_peak_bytes
    # The simulator on the graph that actually runs: its own storages, its own order (and
    # the kernel scratch the profile measured per node, a copy's being its original's).
    scratch = report.profile.scratch_by_node() if hasattr(report.profile, "scratch_by_node") else {}
    analysis = analyze(compiled.tg, compiled.gm, rewritten_phases(compiled.tg, compiled.gm))
    copy_scratch = {n: scratch.get(original_name(n), 0) for n in analysis.node_names}
    actual = simulate(analysis, scratch=copy_scratch) if scratch else simulate(analysis)
    assert actual.peak_bytes == report.predicted_peak_bytes, (
        f"simulated peak of the rewritten graph {actual.peak_bytes} != plan's prediction {report.predicted_peak_bytes}"
    )
    measured = report.measured_peak_bytes
    assert measured is not None
    predicted = report.predicted_peak_bytes
    tol = max(REL_TOL * predicted, SCRATCH_SLACK)
    assert abs(measured - predicted) <= tol, f"measured peak {measured} vs predicted {predicted} (tolerance {tol:.0f})"
    assert measured <= budget + SCRATCH_SLACK, f"measured peak {measured} over the budget {budget}"
    # The storages alone, against the allocator, node by node on the captured graph (the
    # profile ran it so): never fewer bytes held than simulated, and every byte held above
    # the simulated storages allocated by that very node (its kernel's scratch: oneDNN
    # workspaces, a matmul's copy of a transposed operand). A storage the analysis missed,
    # or sized too small, is held across nodes that allocate nothing, and shows.
    captured = analyze(compiled.tg)
    base = simulate(captured).during
    for i, node in enumerate(report.profile.nodes):
        held, simulated = node.peak_bytes, int(base[i])
        assert simulated <= held, f"the simulator holds {simulated - held} bytes more than the allocator at {node.name}"
        made = sum(captured.tensors[sid].nbytes for sid in captured.new_storages[i])
        assert held - simulated <= max(0, node.allocated_bytes - made), (
            f"at {node.name} the allocator held {held - simulated} bytes more than the simulated storages, "
            f"more than the node's own scratch ({node.allocated_bytes - made} bytes)"
        )
    return simulate(analysis).peak_bytes


def _between_steps(spec: RandomSpec, annealed: bool) -> Any:
    """What the loop does after step i: with accumulation across calls, the optimizer's
    step and zero_grad() after every second call; then the scheduler's changes."""
    if not spec.schedule and not spec.across_calls:
        return None

    def between(i: int, model: nn.Module, optimizer: Any) -> None:
        if spec.across_calls and i % 2 == 1:
            for o in each(optimizer):
                o.step()
                o.zero_grad()
        if spec.schedule:
            change_hyperparameters(i, model, optimizer, anneal=annealed)

    return between


def _prepared(spec: RandomSpec) -> tuple[nn.Module, Any, dict[str, torch.Tensor], nn.Module, Any]:
    """The model, optimizer and batch of `spec`, and the eager twins of the first two."""
    model, opt, batch = build(spec)
    eager_model, eager_opt = twin(model, opt)
    if spec.hooks:
        for m in (model, eager_model):
            add_gradient_hooks(m)
            add_forward_hooks(m)
    if spec.across_calls:  # the first call adds to zeros: its graph takes them (the others' is compiled later)
        for p in (p for m in (model, eager_model) for p in m.parameters() if p.requires_grad):
            p.grad = torch.zeros_like(p)
    return model, opt, batch, eager_model, eager_opt


def check_example(spec: RandomSpec, steps: int = 3) -> Outcome:
    """Compile `spec` with remat and check it against eager PyTorch (see the module docstring).

    - A hostile construct: remat must refuse it with a CaptureError that names it.
    - Otherwise, a BudgetError must be right: the smallest peak it names is above the
      budget, and a plan at that peak exists (same profile); that plan is then run.
    - Whatever runs: loss, gradients, parameters, buffers and optimizer state bitwise
      equal to eager over `steps` steps; predicted peak within the budget; the simulator
      on the graph that runs gives exactly the predicted peak; the measured peak within
      max(3%, SCRATCH_SLACK) of the prediction and at most SCRATCH_SLACK over the budget.
    """
    model, opt, batch, eager_model, eager_opt = _prepared(spec)
    kind = "ran"
    notes: list[str] = []
    before = model_snapshot(model)
    with reuse_profiles() as cache:
        try:
            step = _compile(spec, model, opt, batch, spec.budget)
        except CaptureError as e:
            msg = str(e)
            if spec.hostile:
                assert "data-dependent" in msg or "depends on tensor values" in msg, f"unclear refusal of {spec.hostile}: {msg}"
                return Outcome("capture_error", message=msg)
            raise AssertionError(f"remat refused a model with no unsupported construct: {e}") from e
        except BudgetError as e:
            assert not spec.hostile, f"{spec.hostile} was captured: {e}"
            budget_bytes, reachable = parse_budget_error(str(e))
            assert reachable > budget_bytes, f"refused a budget above the peak it says it can reach: {e}"
            # Any budget from the reachable peak up must fit (the same picks reach it);
            # `spec.retry` places the retry between the reachable and the baseline peak.
            (prof,) = cache["profiles"].values()
            retry = reachable + int(spec.retry * max(0, prof.simulated_peak_bytes - reachable))
            try:
                step = _compile(spec, model, opt, batch, retry)
            except BudgetError as e2:
                (tg,) = cache["captures"].values()
                # plan.PeakLowerBound once exceeded the simulated peak (kernel scratch,
                # shared copies) and the greedy then skipped a plan that fits; say which.
                why = "the lower bound skipped it" if _refused_by_the_bound(tg, prof, retry) else "no plan without the bound either"
                raise AssertionError(f"the planner said it could reach {reachable} bytes, but refused {retry} ({why}): {e2}") from e2
            kind = "ran_after_refusal"
            notes.append(f"budget {budget_bytes} refused, reachable {reachable}, ran at {retry}")
    assert not spec.hostile, f"{spec.hostile} was captured without complaint"
    changed = snapshot_differences(before, model_snapshot(model))
    assert not changed, f"compiling changed the model: {changed[:5]}"

    report = step.report
    compiled = step._last
    assert compiled is not None
    # The loss weight is annealed where the step leaves no gradients behind (zero_grad after
    # the update) and ran at its first budget: its second graph then starts as its first.
    # With gradients left set, the second step starts with them alive (as eager's does) and
    # its floor can be above a budget the first graph met.
    annealed = kind == "ran" and not spec.zero_grad_first and not spec.across_calls
    between = _between_steps(spec, annealed)
    with reuse_profiles(cache):
        try:
            result = check_against_eager(make_train_step(spec), eager_model, eager_opt, model, opt, step, batch, steps=steps, between_steps=between)
        except BudgetError as e:
            # Across calls, the graph for a call that finds no gradients set is planned at the third
            # call, and its floor can be above the budget the first graph met (a gradient held as a
            # view of a larger storage, where the other copies it into the one it finds): a right
            # refusal, then the whole run again at that floor (both profiles reused: both plans fit;
            # the captures are not: the models are new).
            cache["captures"].clear()
            if not spec.across_calls:
                raise
            budget_bytes, reachable = parse_budget_error(str(e))
            assert reachable > budget_bytes, f"refused a budget above the peak it says it can reach: {e}"
            model, opt, batch, eager_model, eager_opt = _prepared(spec)
            step = _compile(spec, model, opt, batch, max(reachable, report.budget_bytes or 0))
            report, compiled = step.report, step._last
            kind = "ran_after_refusal"
            notes.append(f"the second graph's budget {budget_bytes} refused, reachable {reachable}: all ran again at that")
            result = check_against_eager(make_train_step(spec), eager_model, eager_opt, model, opt, step, batch, steps=steps, between_steps=between)
    if not result.match and all("nan" in m for m in result.mismatches):
        # Both sides overflowed (a chain of products trains to inf/nan): torch.equal calls
        # NaN unequal to itself, so compare the bits instead.
        assert bitwise_equal_state(eager_model, eager_opt, model, opt), result.summary()
        notes.append("trained to nan on both sides, bitwise equal")
    else:
        assert result.match, result.summary()
    if between is not None and annealed and spec.outside:
        # The annealed loss weight is read at every call: one more graph, its peak as predicted.
        # Where its input's few bytes do not fit a budget at the very peak, it stays a
        # constant instead: a graph per value it took.
        last = step._last.report
        if "model.loss_weight" in step._constant:
            weights = {dict(g.step_values).get("model.loss_weight") for g in step._graphs.values()}
            assert len(weights) == len(step._graphs) > 1, f"the loss weight held as a constant, but graphs for {weights}"
            notes.append("a loss weight held as a constant (a budget at the very peak)")
        else:
            assert "model.loss_weight" in step._last.tg.call.numbers, "the annealed loss weight is neither read at every call nor a constant"
            notes.append("a loss weight read at every call")
        assert last.measured_peak_bytes is not None and last.budget_bytes is not None
        assert abs(last.measured_peak_bytes - last.predicted_peak_bytes) <= max(REL_TOL * last.predicted_peak_bytes, SCRATCH_SLACK)
        assert last.predicted_peak_bytes <= last.budget_bytes
    layer, eager_layer = (next(iter(m.mods.values()), None) for m in (model, eager_model))
    if spec.hooks and layer is not None:
        assert len(layer.logged) == len(eager_layer.logged) > 0, f"forward hooks logged {len(layer.logged)} values, eager {len(eager_layer.logged)}"
        assert bitwise_equal_tensors(layer.logged, eager_layer.logged), "what the forward hook logged differs from eager's"
        assert bitwise_equal_tensors([layer.stored["output"]], [eager_layer.stored["output"]]), "what the forward hook stored differs"
    if spec.outside:
        assert bitwise_equal_tensors(eager_model.ema, model.ema), "the EMA outside the model differs from eager's"
        kept, eager_kept = repr(vars(model.tracker)), repr(vars(eager_model.tracker))  # repr: nan equals nan
        assert kept == eager_kept and model.tracker.steps == steps, f"the numbers kept differ from eager's: {kept} against {eager_kept}"

    storages_only = _check_memory(compiled)
    if spec.across_calls:  # the graph for calls that find none set, compiled at the third call
        others = [g for g in step._graphs.values() if g is not compiled]
        assert len(others) == 1 and others[0].report.measured_peak_bytes is not None, f"{len(others)} other graphs"
        _check_memory(others[0])
        notes.append(f"accumulated across calls: the second graph's peak {others[0].report.measured_peak_bytes} as predicted")
    budget, predicted, measured = report.budget_bytes, report.predicted_peak_bytes, report.measured_peak_bytes
    return Outcome(
        kind,
        budget_bytes=budget,
        predicted_peak=predicted,
        measured_peak=measured,
        storages_peak=storages_only,
        baseline_peak=report.baseline_peak_bytes,
        num_recomputed=report.num_recomputed,
        copies=report.copies,
        nodes=len(compiled.tg.op_nodes()),
        updates_in_backward=report.plan.updates_in_backward,
        replayed=sum(1 for n in compiled.gm.graph.nodes if isinstance(n.target, Replay)),
        lean_ops=len(report.plan.lean_ops),
        notes=notes,
    )
