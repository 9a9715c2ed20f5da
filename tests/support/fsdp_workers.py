"""What each rank runs in the FSDP2 tests (spawned by remat.launch.run_ranks).

Each builds the same model twice, shards both with `fully_shard` (each block of the
model's ModuleLists, then the root: measurement.data_parallel.shard_blocks), trains one
eagerly and one through remat on the same rank-dependent batches, and reports what the
test asserts on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from remat.measurement.data_parallel import precision_policy, shard_blocks

import remat
from remat.errors import CaptureError
from remat.models import build_model, hf_loss, make_optimizer
from remat.workloads import build_hf
from tests.support.ranks import digest


def _shard(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """shard_blocks; with FSDP2 options (the refusals' CPU offload), fully_shard on the root alone."""
    if not options:
        return shard_blocks(model)
    fully_shard(model, **options)
    return model


# A GPT-2 whose vocabulary (1,001 rows) two ranks do not divide: FSDP2 shards its embedding unevenly.
UNEVEN = "hf:gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=1001,n_positions=32"
# Sharded at the root alone: its layers' 63 rows split 32 and 31, the last layer's 1 row 1 and 0.
UNEVEN_MLP = "uneven-mlp"


def _built(model_name: str, batch_size: int, seed: int) -> tuple[torch.nn.Module, Any, Any]:
    """A built-in model, or an hf: one, or UNEVEN_MLP, with its batch and loss."""
    if model_name == UNEVEN_MLP:
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 63), torch.nn.Sigmoid(), torch.nn.Linear(63, 63), torch.nn.Sigmoid(), torch.nn.Linear(63, 1)
            )
        return model, {"x": torch.randn(batch_size, 8, generator=gen)}, lambda m, b: m(b["x"]).square().mean()
    if model_name.startswith("hf:"):
        model, batch = build_hf(model_name[3:], batch_size, seed=seed)
        return model, batch, hf_loss
    spec = build_model(model_name, batch_size, seed=seed)
    return spec.model, spec.batch, spec.loss_fn


def _sharded(model_name: str, batch_size: int, optimizer: str, mp: MixedPrecisionPolicy | None = None) -> tuple[Any, Any, Any]:
    """The model sharded as shard_blocks shards it; with `mp`, each block and the root under that policy."""
    model, _, loss_fn = _built(model_name, batch_size, 0)
    model = shard_blocks(model, mp)
    return model, make_optimizer(optimizer, list(model.parameters())), loss_fn


def _step(loss_fn: Any, micro_batches: int, clip: float | None = None) -> Any:
    """Forward and backward over `micro_batches` parts, optionally the gradients clipped to a
    2-norm of `clip` (returned after the loss, whole: as torchtitan reads a DTensor norm), the update."""

    def train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        parts = [batch] if micro_batches == 1 else [{k: v.chunk(micro_batches)[i] for k, v in batch.items()} for i in range(micro_batches)]
        total = None
        for part in parts:
            loss = loss_fn(model, part) / len(parts)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        norm = None if clip is None else _full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad()
        return total if norm is None else (total, norm)

    return train_step


def _same(a: Any, b: Any) -> bool:
    """Two steps' returns (a loss, or a loss and a norm) bitwise equal."""
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """Parameters (full tensors, gathered) and optimizer state, parameter by parameter."""
    tensors = [_full(p) for p in model.parameters()]
    for p in model.parameters():
        tensors.extend(_full(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return tensors


def train_like_eager(
    model_name: str, optimizer: str, budget: float, steps: int, micro_batches: int = 1, eager_first: bool = False,
    clip: float | None = None, batch_size: int = 4, mp: MixedPrecisionPolicy | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`steps` steps of eager FSDP2 and of remat on the same batches and random stream, each
    followed by an evaluation of both models through FSDP2 (which leaves the root gathered).
    `eager_first`: both models first take one eager FSDP2 step, so that remat starts from
    the optimizer state FSDP2 made."""
    rank = dist.get_rank()
    eager, eager_opt, loss_fn = _sharded(model_name, batch_size, optimizer, mp)
    ours, ours_opt, _ = _sharded(model_name, batch_size, optimizer, mp)
    train_step = _step(loss_fn, micro_batches, clip)
    batches = [_built(model_name, batch_size, 1000 + 100 * rank + i)[1] for i in range(steps)]
    if eager_first:
        for m, o in ((eager, eager_opt), (ours, ours_opt)):
            torch.manual_seed(6)
            train_step(m, o, batches[-1])
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
        "losses_equal": all(_same(a, b) for a, b in zip(eager_losses, losses)),
        "state_equal": len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs)),
        "state_tensors": len(mine),
        "eager_after_equal": _same(*then) and digest(_state(ours, ours_opt)) == digest(_state(eager, eager_opt)),
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
        "largest_module_bytes": max(sum(p.numel() * p.element_size() for p in ps) for ps in _gathered_modules(ours)),
        "uneven_params": sum(1 for p in ours.parameters() if p.shape[0] % dist.get_world_size()),
        "loss_dtype": str(losses[0][0].dtype if isinstance(losses[0], tuple) else losses[0].dtype),
        "gathered_dtypes": sorted({str(n.meta["val"].dtype) for n in nodes if "all_gather_into_tensor" in str(n.target)}),
        "reduced_dtypes": sorted({str(n.meta["val"].dtype) for n in nodes if "reduce_scatter_tensor" in str(n.target)}),
    }


def mixed_precision_cases() -> tuple[dict[str, Any], dict[str, Any]]:
    """train_like_eager under a MixedPrecisionPolicy: torchtitan's (parameters gathered in
    bfloat16, gradients reduced in float32; AdamW at 0.6, clipped), and float16 throughout
    (reduced in float16, with FSDP2's divide factors before and after; SGD at 0.8, two micro-batches)."""
    titan = precision_policy("bf16")
    half = MixedPrecisionPolicy(param_dtype=torch.float16)
    return (
        train_like_eager("bert-tiny", "adamw", 0.6, 3, 1, False, 0.05, mp=titan),
        train_like_eager("bert-tiny", "sgd", 0.8, 3, 2, False, mp=half),
    )


def uneven_cases() -> tuple[dict[str, Any], dict[str, Any]]:
    """train_like_eager on the two unevenly sharded models, in one process group: UNEVEN
    (SGD at 0.6, two micro-batches, from the state FSDP2 made) and UNEVEN_MLP (no recomputation)."""
    return train_like_eager(UNEVEN, "sgd", 0.6, 3, 2, True), train_like_eager(UNEVEN_MLP, "sgd", 1.0, 3, 1)


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

    def clipped_by_1_norm(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
        optimizer.step()
        return loss

    def mixed_norms(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        norms = torch._foreach_norm([p.grad for p in model.parameters()] + [loss.detach().reshape(1)])
        optimizer.step()
        return loss + norms[0]

    def gradient_sum(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        total = sum(p.grad.sum() for p in model.parameters())
        optimizer.step()
        return total

    def penalised(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model, batch) + 1e-4 * sum(p.square().sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        return loss

    def compiled(train_step: Any, optimizer: str = "adamw", **options: Any) -> Any:
        model = _shard(build_model("mlp-deep", 8, seed=0).model, **options)
        return remat.compile(train_step, model, make_optimizer(optimizer, list(model.parameters())), spec.batch, memory_budget=0.5)

    def uneven_clipped() -> Any:
        model, opt, uneven_loss = _sharded(UNEVEN, 2, "adamw")
        return remat.compile(_step(uneven_loss, 1, clip=1.0), model, opt, _built(UNEVEN, 2, 1)[1])

    def adafactor() -> Any:
        model = shard_blocks(build_model("mlp-deep", 8, seed=0).model)
        return remat.compile(step, model, torch.optim.Adafactor(model.parameters()), spec.batch)

    def sync_off() -> Any:
        model = shard_blocks(build_model("mlp-deep", 8, seed=0).model)
        model.set_requires_gradient_sync(False)
        return remat.compile(step, model, make_optimizer("adamw", list(model.parameters())), spec.batch)

    def optimizer_first() -> Any:
        model = build_model("mlp-deep", 8, seed=0).model
        optimizer = make_optimizer("adamw", list(model.parameters()))
        return remat.compile(step, shard_blocks(model), optimizer, spec.batch)

    return {
        "optimizer_first": _refused(optimizer_first),
        "one_norm": _refused(lambda: compiled(clipped_by_1_norm)),
        "gradient_sum": _refused(lambda: compiled(gradient_sum)),
        "mixed_norms": _refused(lambda: compiled(mixed_norms)),
        "uneven_clip": _refused(uneven_clipped),
        "penalty": _refused(lambda: compiled(penalised)),
        "adafactor": _refused(adafactor),
        "cpu_offload": _refused(lambda: compiled(step, offload_policy=CPUOffloadPolicy(pin_memory=False))),
        "sync_off": _refused(sync_off),
    }
