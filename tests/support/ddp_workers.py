"""What each rank runs in the data-parallel tests (spawned by remat.launch.run_ranks).

Module-level functions, so that a spawned process can import them. Each builds the same
model twice, wraps both in DistributedDataParallel, trains one eagerly and one through
remat on the same rank-dependent batches, and reports what the test asserts on."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.models import build_model, make_optimizer
from remat.capture.optimizers import as_one
from tests.support.ranks import digest


def _batch(model_name: str, batch_size: int, rank: int, i: int) -> Any:
    return build_model(model_name, batch_size, seed=1000 + 100 * rank + i).batch


def _wrapped(model_name: str, batch_size: int, optimizer: str, **ddp_options: Any) -> tuple[DDP, Any, Any]:
    spec = build_model(model_name, batch_size, seed=0)
    ddp = DDP(spec.model, **ddp_options)
    return ddp, _optimizers(optimizer, list(ddp.parameters())), spec.loss_fn


def _optimizers(name: str, params: list[torch.Tensor]) -> Any:
    """One optimizer ("adamw-foreach": torch's multi-tensor AdamW), or for "sgd+adamw" a
    list of two: SGD on the matrices, AdamW on the rest."""
    if name == "adamw-foreach":
        return make_optimizer("adamw", params, foreach=True)
    if name != "sgd+adamw":
        return make_optimizer(name, params)
    return [make_optimizer("sgd", [p for p in params if p.ndim >= 2]), make_optimizer("adamw", [p for p in params if p.ndim < 2])]


def _each(optimizer: Any) -> list[Any]:
    return optimizer if isinstance(optimizer, list) else [optimizer]


def _step(loss_fn: Any, micro_batches: int) -> Any:
    """A training step; with several micro-batches, all but the last under no_sync()."""

    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        parts = [batch] if micro_batches == 1 else _split(batch, micro_batches)
        total = None
        for i, part in enumerate(parts):
            quiet = model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext()
            with quiet:
                loss = loss_fn(model, part) / len(parts)
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        for o in _each(optimizer):
            o.step()
            o.zero_grad()
        return total

    return train_step


def _split(batch: Any, n: int) -> list[Any]:
    if isinstance(batch, dict):
        chunks = {k: v.chunk(n) for k, v in batch.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(n)]
    return [tuple(t.chunk(n)[i] for t in batch) for i in range(n)]


def _state(model: DDP, optimizer: Any, buffers: bool = True) -> list[torch.Tensor]:
    """Parameters, buffers (each rank's own after its last forward, as in eager DDP) and optimizer state."""
    tensors = [*model.parameters(), *(model.buffers() if buffers else ())]
    state = as_one(optimizer).state
    for p in model.parameters():
        tensors.extend(v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return tensors


def train_like_eager(
    model_name: str, optimizer: str, budget: float, steps: int, micro_batches: int = 1, batch_size: int = 4, bucket_cap_mb: float | None = None
) -> dict[str, Any]:
    """`steps` steps of eager DDP and of remat on the same batches and random stream (DDP's buckets of `bucket_cap_mb`, or its default)."""
    rank = dist.get_rank()
    ddp_options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    eager, eager_opt, loss_fn = _wrapped(model_name, batch_size, optimizer, **ddp_options)
    ours, ours_opt, _ = _wrapped(model_name, batch_size, optimizer, **ddp_options)
    train_step = _step(loss_fn, micro_batches)
    batches = [_batch(model_name, batch_size, rank, i) for i in range(steps)]
    torch.manual_seed(7)
    eager_losses = [train_step(eager, eager_opt, b) for b in batches]
    torch.manual_seed(7)
    step = remat.compile(train_step, ours, ours_opt, batches[0], memory_budget=budget)
    losses = [step(b) for b in batches]
    equal = [torch.equal(a, b) for a, b in zip(_state(eager, eager_opt), _state(ours, ours_opt))]
    report = step.report
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(eager_losses, losses)),
        "state_equal": bool(equal) and all(equal),
        "state_tensors": len(equal),
        "digest": digest(_state(ours, ours_opt, buffers=False)),
        "num_recomputed": report.num_recomputed,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "measured_peak_bytes": report.measured_peak_bytes,
        "largest_gradient_bytes": max(p.numel() * p.element_size() for p in ours.parameters()),
        "collectives": sum(1 for n in step.graph_module.graph.nodes if "all_reduce" in str(n.target)),
        "gradients": sum(1 for p in ours.parameters() if p.requires_grad),
        "collective_order": _collective_order(step.graph_module),
        "updates_in_backward": bool(report.plan and report.plan.updates_in_backward),
        "moved_updates_follow": _moved_updates_follow(step),
    }


def _moved_updates_follow(step: Any) -> dict[str, str]:
    """Where each update that can move into the backward pass goes: the op it follows."""
    from remat.memory.analysis import analyze
    from remat.memory.graph_index import GraphIndex
    from remat.passes.update_placement import moved_index

    tg = step._last.tg
    _, placement = moved_index(GraphIndex.build(tg, analyze(tg)))
    return {param: _target(tg, node) for param, node in placement.moved.items()}


def _target(tg: Any, name: str) -> str:
    return next(str(n.target) for n in tg.gm.graph.nodes if n.name == name)


def _collective_order(gm: torch.fx.GraphModule) -> list[str]:
    """Each collective of the graph in run order, by what it reduces: equal lists mean the ranks pair up."""
    return [f"{n.target}{tuple(n.args[0].meta['val'].shape)}" for n in gm.graph.nodes if n.op == "call_function" and "c10d" in str(n.target)]


def failing_capture() -> str:
    """Rank 1's step raises while it is captured; returns what this rank raised."""
    ddp, opt, loss_fn = _wrapped("mlp", 8, "sgd")

    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise ValueError("rank one's step breaks")
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    try:
        remat.compile(train_step, ddp, opt, _batch("mlp", 8, 0, 0), memory_budget=None)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"
    return "no error"


def diverging_batch() -> list[str]:
    """Both ranks compile together; at the second call rank 1 brings a batch of another
    shape. Returns what this rank raised there, then that a later step still runs."""
    ddp, opt, loss_fn = _wrapped("mlp", 8, "sgd")
    step = remat.compile(_step(loss_fn, 1), ddp, opt, _batch("mlp", 8, 0, 0), memory_budget=None)
    out = []
    size = 4 if dist.get_rank() == 1 else 8
    try:
        step(_batch("mlp", size, dist.get_rank(), 1))
        out.append("no error")
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}: {e}")
    step(_batch("mlp", 8, dist.get_rank(), 2))
    out.append("ran after")
    return out


def refusals() -> dict[str, str]:
    """Settings the graph cannot honour, each refused with a message: what each raised."""
    out: dict[str, str] = {}

    def attempt(name: str, ddp: DDP, opt: Any, train_step: Any, batch: Any, around: Any = contextlib.nullcontext) -> None:
        try:
            with around():
                remat.compile(train_step, ddp, opt, batch, memory_budget=None)
            out[name] = "no error"
        except remat.RematError as e:
            out[name] = str(e)

    ddp, opt, loss_fn = _wrapped("mlp", 8, "sgd")
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    attempt("comm_hook", ddp, opt, _step(loss_fn, 1), _batch("mlp", 8, 0, 0))

    # An unused parameter: DDP without find_unused_parameters would fail; refused at capture.
    ddp_unused, opt_unused, loss_fn = _wrapped("mlp", 8, "sgd")
    unused = torch.nn.Parameter(torch.zeros(3))
    ddp_unused.module.register_parameter("unused", unused)
    ddp_unused = DDP(ddp_unused.module)
    attempt("unused", ddp_unused, make_optimizer("sgd", ddp_unused.parameters()), _step(loss_fn, 1), _batch("mlp", 8, 0, 0))

    # Gradient accumulation across calls: backward only, the loop steps the optimizer.
    ddp, opt, loss_fn = _wrapped("mlp", 8, "sgd")
    attempt("across_calls", ddp, opt, lambda m, o, b: (loss := loss_fn(m, b)).backward() or loss.detach(), _batch("mlp", 8, 0, 0), ddp.no_sync)

    # The same step compiled outside no_sync() and called inside it.
    ddp, opt, loss_fn = _wrapped("mlp", 8, "sgd")
    step = remat.compile(_step(loss_fn, 1), ddp, opt, _batch("mlp", 8, 0, 0), memory_budget=None)
    try:
        with ddp.no_sync():
            step(_batch("mlp", 8, 0, 1))
        out["no_sync_outside"] = "no error"
    except remat.RematError as e:
        out["no_sync_outside"] = str(e)

    # A parameter frozen after a backward, its gradient left set: not read across ranks, named.
    spec = build_model("mlp", 8, seed=0)
    first = next(spec.model.parameters())
    first.grad = torch.ones_like(first)
    first.requires_grad_(False)
    ddp = DDP(spec.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.compile(_step(spec.loss_fn, 1), ddp, make_optimizer("sgd", [p for p in ddp.parameters() if p.requires_grad]), _batch("mlp", 8, 0, 0), memory_budget=None)(_batch("mlp", 8, 0, 0))
    out["frozen_gradient"] = " ".join(str(w.message) for w in caught)
    return out


def unused_found(batch_size: int = 8) -> dict[str, Any]:
    """find_unused_parameters=True: an unused parameter keeps grad None and its value, as in eager DDP."""
    rank = dist.get_rank()
    results = []
    for _ in range(2):
        spec = build_model("mlp", batch_size, seed=0)
        spec.model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
        ddp = DDP(spec.model, find_unused_parameters=True)
        results.append((ddp, make_optimizer("adamw", ddp.parameters()), spec.loss_fn))
    (eager, eager_opt, loss_fn), (ours, ours_opt, _) = results
    return {
        "state_equal": _trained_alike(eager, eager_opt, ours, ours_opt, loss_fn, [_batch("mlp", batch_size, rank, i) for i in range(2)]),
        "unused_grad": ours.module.unused.grad is None and eager.module.unused.grad is None,
    }


def _trained_alike(eager: DDP, eager_opt: Any, ours: DDP, ours_opt: Any, loss_fn: Any, batches: list[Any]) -> bool:
    """Eager DDP and remat (no recomputation) trained on `batches`: whether they end bitwise equal."""
    train_step = _step(loss_fn, 1)
    for b in batches:
        train_step(eager, eager_opt, b)
    step = remat.compile(train_step, ours, ours_opt, batches[0], memory_budget=None)
    for b in batches:
        step(b)
    return all(torch.equal(a, b) for a, b in zip(_state(eager, eager_opt), _state(ours, ours_opt)))


def options_like_eager(batch_size: int = 8) -> dict[str, bool]:
    """static_graph and gradient_as_bucket_view change only DDP's own buffers and speed:
    remat's steps leave bitwise what eager DDP with the same options leaves."""
    rank = dist.get_rank()
    out = {}
    for name, options in {"static_graph": {"static_graph": True}, "gradient_as_bucket_view": {"gradient_as_bucket_view": True}}.items():
        eager, eager_opt, loss_fn = _wrapped("mlp", batch_size, "adamw", **options)
        ours, ours_opt, _ = _wrapped("mlp", batch_size, "adamw", **options)
        out[name] = _trained_alike(eager, eager_opt, ours, ours_opt, loss_fn, [_batch("mlp", batch_size, rank, i) for i in range(3)])
    return out


def _clamped(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-1e-3, 1e-3)


def _halved(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


def hooks_like_eager(batch_size: int = 8) -> dict[str, bool]:
    """Gradient hooks on the parameters: each rank's gradient clamped before DDP averages
    it, and the averaged one halved after it is accumulated, as eager DDP runs them."""
    rank = dist.get_rank()
    eager, eager_opt, loss_fn = _wrapped("mlp", batch_size, "adamw")
    ours, ours_opt, _ = _wrapped("mlp", batch_size, "adamw")
    for model in (eager, ours):
        for i, p in enumerate(model.parameters()):
            p.register_hook(_clamped) if i % 2 == 0 else p.register_post_accumulate_grad_hook(_halved)
    return {"state_equal": _trained_alike(eager, eager_opt, ours, ours_opt, loss_fn, [_batch("mlp", batch_size, rank, i) for i in range(3)])}


def _distilling_step(teacher: torch.nn.Module, ema: list[torch.Tensor]) -> Any:
    """Distillation from a frozen teacher and an EMA of the weights: both outside the model."""

    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        with torch.no_grad():
            soft = teacher(**batch).logits.softmax(-1)
        out = model(**batch)
        loss = out.loss + torch.nn.functional.kl_div(out.logits.log_softmax(-1), soft, reduction="batchmean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)
        return loss.detach()

    return train_step


def distill_like_eager(budget: float, steps: int) -> dict[str, Any]:
    """Eager DDP and remat with a teacher and an EMA outside the model, on the same batches."""
    rank = dist.get_rank()
    teacher = build_model("bert-tiny", 4, seed=7).model.eval().requires_grad_(False)
    eager, eager_opt, _ = _wrapped("bert-tiny", 4, "adamw")
    ours, ours_opt, _ = _wrapped("bert-tiny", 4, "adamw")
    emas = [[p.detach().clone() for p in m.parameters()] for m in (eager, ours)]
    batches = [_batch("bert-tiny", 4, rank, i) for i in range(steps)]
    torch.manual_seed(7)
    eager_losses = [_distilling_step(teacher, emas[0])(eager, eager_opt, b) for b in batches]
    torch.manual_seed(7)
    step = remat.compile(_distilling_step(teacher, emas[1]), ours, ours_opt, batches[0], memory_budget=budget)
    losses = [step(b) for b in batches]
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(eager_losses, losses)),
        "state_equal": all(torch.equal(a, b) for a, b in zip(_state(eager, eager_opt), _state(ours, ours_opt))),
        "ema_equal": all(torch.equal(a, b) for a, b in zip(*emas)),
        "ema_digest": digest(emas[1]),
        "outside_inputs": sum(1 for i in step._last.tg.inputs if i.kind.value == "outside"),
        "num_recomputed": step.report.num_recomputed,
    }


def several(calls: list[tuple[str, tuple]]) -> list[Any]:
    """Each (name of a function of this module, its arguments) run in turn on this rank: the
    results in order. Cases share one spawn, since starting two ranks is most of a small case's time."""
    return [globals()[name](*args) for name, args in calls]
