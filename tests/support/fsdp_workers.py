"""What each rank runs in the FSDP2 tests (spawned by remat.launch.run_ranks).

Each builds the same model twice, shards both with `fully_shard` (each block of the
model's ModuleLists, then the root: measurement.data_parallel.shard_blocks), trains one
eagerly and one through remat on the same rank-dependent batches, and reports what the
test asserts on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from remat.measurement.data_parallel import shard_blocks

import remat
from remat.errors import CaptureError
from remat.models import build_model, make_optimizer
from tests.support.ranks import digest


def _shard(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """shard_blocks; with FSDP2 options (the refusals' mixed precision), fully_shard on the root alone."""
    if not options:
        return shard_blocks(model)
    fully_shard(model, **options)
    return model


def _sharded(model_name: str, batch_size: int, optimizer: str) -> tuple[Any, Any, Any]:
    spec = build_model(model_name, batch_size, seed=0)
    model = shard_blocks(spec.model)
    return model, make_optimizer(optimizer, list(model.parameters())), spec.loss_fn


def _step(loss_fn: Any, micro_batches: int) -> Any:
    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        parts = [batch] if micro_batches == 1 else [{k: v.chunk(micro_batches)[i] for k, v in batch.items()} for i in range(micro_batches)]
        total = None
        for part in parts:
            loss = loss_fn(model, part) / len(parts)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        return total

    return train_step


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """Parameters (full tensors, gathered) and optimizer state, parameter by parameter."""
    tensors = [_full(p) for p in model.parameters()]
    for p in model.parameters():
        tensors.extend(_full(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return tensors


def train_like_eager(model_name: str, optimizer: str, budget: float, steps: int, micro_batches: int = 1, batch_size: int = 4) -> dict[str, Any]:
    """`steps` steps of eager FSDP2 and of remat on the same batches and random stream, each
    followed by an evaluation of both models through FSDP2 (which leaves the root gathered)."""
    rank = dist.get_rank()
    eager, eager_opt, loss_fn = _sharded(model_name, batch_size, optimizer)
    ours, ours_opt, _ = _sharded(model_name, batch_size, optimizer)
    train_step = _step(loss_fn, micro_batches)
    batches = [build_model(model_name, batch_size, seed=1000 + 100 * rank + i).batch for i in range(steps)]
    step = remat.compile(train_step, ours, ours_opt, batches[0], memory_budget=budget)
    eager_losses, losses = [], []
    for i, batch in enumerate(batches):
        torch.manual_seed(7 + i)
        eager_losses.append(train_step(eager, eager_opt, batch))
        torch.manual_seed(7 + i)
        losses.append(step(batch))
        for model in (eager, ours):  # evaluation between steps, through FSDP2's own hooks
            model.eval()
            with torch.no_grad():
                loss_fn(model, batches[0])
            model.train()
    for model in (eager, ours):
        model.reshard()  # the evaluation left the root gathered: its DTensors back in place, to read the state by
    mine, theirs = _state(ours, ours_opt), _state(eager, eager_opt)
    # FSDP2 itself trains both models on from there: remat left them as it found them.
    then = []
    for m, o in ((eager, eager_opt), (ours, ours_opt)):
        torch.manual_seed(8)
        then.append(train_step(m, o, batches[0]))
    report = step.report
    nodes = list(step.graph_module.graph.nodes)
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(eager_losses, losses)),
        "state_equal": len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)),
        "state_tensors": len(mine),
        "eager_after_equal": torch.equal(*then) and digest(_state(ours, ours_opt)) == digest(_state(eager, eager_opt)),
        "still_dtensors": all(type(p).__name__ == "DTensor" for p in ours.parameters()),
        "state_dtensors": all(type(v).__name__ == "DTensor" for st in ours_opt.state.values() for v in st.values() if v.ndim > 0),
        "digest": digest(mine),
        "num_recomputed": report.num_recomputed,
        "gathers": sum(1 for n in nodes if "all_gather_into_tensor" in str(n.target)),
        "gathered_again": sum(1 for n in nodes if "all_gather_into_tensor" in str(n.target) and "recomputed" in n.name),
        "reduce_scatters": sum(1 for n in nodes if "reduce_scatter_tensor" in str(n.target)),
        "sharded_params": sum(1 for _ in ours.parameters()),
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "budget_bytes": report.budget_bytes,
        "measured_peak_bytes": report.measured_peak_bytes,
        "sharded_modules": len(_gathered_modules(ours)),
        # A module's gradients are reduce-scattered from one buffer (FSDP2's layout)
    }


def failing_capture() -> str:
    """Rank 1's step raises while it is captured; returns what this rank raised."""
    model, opt, loss_fn = _sharded("bert-tiny", 2, "sgd")

    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise ValueError("rank one's step breaks")
        return _step(loss_fn, 1)(model, optimizer, batch)

    try:
        remat.compile(train_step, model, opt, build_model("bert-tiny", 2, seed=1).batch, memory_budget=0.5)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"
    return "no error"


def _gathered_modules(model: torch.nn.Module) -> list[list[Any]]:
    """The parameters of each FSDP2 module that has some of its own (one all-gather each)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [[fp.sharded_param for fp in g.fsdp_params] for g in groups if g is not None]


def _refused(make: Any) -> str:
    try:
        make()
    except CaptureError as e:
        return str(e)
    return "accepted"


def refusals() -> dict[str, str]:
    """What the graph would not reproduce, each refused by name at compile."""
    spec = build_model("mlp-deep", 8, seed=0)
    loss_fn = spec.loss_fn
    step = _step(loss_fn, 1)

    def clipped(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    def penalised(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch) + 1e-4 * sum(p.square().sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        return loss

    def compiled(train_step: Any, optimizer: str = "adamw", **options: Any) -> Any:
        model = _shard(build_model("mlp-deep", 8, seed=0).model, **options)
        return remat.compile(train_step, model, make_optimizer(optimizer, list(model.parameters())), spec.batch, memory_budget=0.5)

    def uneven() -> Any:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
        batch = {"x": torch.randn(2, 4)}
        return remat.compile(lambda m, o, b: _plain(m, o, b), model, torch.optim.SGD(model.parameters(), lr=0.1), batch)

    def adafactor() -> Any:
        model = shard_blocks(build_model("mlp-deep", 8, seed=0).model)
        return remat.compile(step, model, torch.optim.Adafactor(model.parameters()), spec.batch)

    def optimizer_first() -> Any:
        model = build_model("mlp-deep", 8, seed=0).model
        optimizer = make_optimizer("adamw", list(model.parameters()))
        return remat.compile(step, shard_blocks(model), optimizer, spec.batch)

    return {
        "optimizer_first": _refused(optimizer_first),
        "clip": _refused(lambda: compiled(clipped)),
        "penalty": _refused(lambda: compiled(penalised)),
        "mixed_precision": _refused(lambda: compiled(step, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))),
        "uneven": _refused(uneven),
        "adafactor": _refused(adafactor),
    }


def _plain(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(batch["x"]).sum()
    loss.backward()
    optimizer.step()
    return loss
