"""One rank of a data-parallel measurement: remat beside eager DDP (and DDP with HF's
checkpointing) on the same model, batch and process group; with `fsdp`, the same beside
eager FSDP2 (and FSDP2 with HF's checkpointing), each model sharded by `shard_blocks`.

Each rank builds the workload, wraps independent copies in DistributedDataParallel,
compiles remat's step (every rank together: remat.ranks), optionally checks 3 steps
bitwise against eager DDP, measures each step's peak with the allocator, and times them
in alternation. Every rank runs the same sequence of steps, so their collectives pair up.

Eager DDP also holds its gradient buckets for the whole run (one buffer per gradient's
bytes, allocated when DDP is built): they are outside any step's peak and are reported
on their own (`eager_bucket_bytes`); remat's graph reduces each gradient in a buffer of
its own that lives only as long as that gradient.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel as DDP
from remat.defaults import DEFAULT_PLANNER


@dataclass
class RankConfig:
    model: str
    batch_size: int  # per rank
    budget: Any
    planner: str = DEFAULT_PLANNER
    optimizer: str = "sgd"
    steps: int = 3
    pairs: int = 5
    check: bool = False
    seed: int = 0
    lean_ops: bool = True
    baselines: tuple[str, ...] = ()  # "hf": eager DDP with Hugging Face's per-block checkpointing
    fsdp: bool = False  # shard with FSDP2 (shard_blocks) instead of wrapping in DDP
    fsdp_precision: str | None = None  # with fsdp: a MixedPrecisionPolicy (PRECISION_POLICIES) on every module


# `--fsdp-precision`: parameters gathered in the low precision, gradients reduced in float32
# (torchtitan's default policy, and its float16 counterpart)
PRECISION_POLICIES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_blocks(model: torch.nn.Module, mp_policy: Any = None) -> torch.nn.Module:
    """FSDP2 as torchtitan and Accelerate apply it: fully_shard on each block (each item of
    the model's ModuleLists: a transformer's layers), then on the root, each under `mp_policy`
    (a MixedPrecisionPolicy) where one is given."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def precision_policy(name: str | None) -> Any:
    """The MixedPrecisionPolicy `--fsdp-precision name` shards with (None: none)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return None if name is None else MixedPrecisionPolicy(param_dtype=PRECISION_POLICIES[name], reduce_dtype=torch.float32)


def _wrapped(model: torch.nn.Module, like: Any, fsdp: bool, precision: str | None = None) -> tuple[torch.nn.Module, Any]:
    """A copy of `model`, in DDP or sharded (under the `precision` policy), with an optimizer
    like `like` on its parameters (FSDP2 replaces the parameters, so the optimizer is made after it)."""
    model = copy.deepcopy(model)
    wrapped = shard_blocks(model, precision_policy(precision)) if fsdp else DDP(model)
    # Its defaults as its constructor takes them: AdamW keeps `decoupled_weight_decay` there, a setting it does not take
    takes = inspect.signature(type(like)).parameters
    return wrapped, type(like)(wrapped.parameters(), **{k: v for k, v in like.defaults.items() if k in takes})


def _local(t: Any) -> Any:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _sharded_match(step_fn: Any, eager: Any, eager_opt: Any, ours: Any, opt: Any, step: Any, batch: Any, seed: int) -> bool:
    """3 steps of eager FSDP2 and of remat: losses, this rank's shards of the parameters and the optimizer state, bitwise."""
    same = True
    for i in range(3):
        torch.manual_seed(seed + i)
        a = step_fn(eager, eager_opt, batch)
        torch.manual_seed(seed + i)
        b = step(batch)
        same = same and torch.equal(a, b)
    for p, q in zip(eager.parameters(), ours.parameters()):
        same = same and torch.equal(_local(p), _local(q))
        for (k, v), (_, w) in zip(eager_opt.state[p].items(), opt.state[q].items()):
            same = same and torch.equal(_local(v), _local(w))
    return bool(same)


def measure_rank(config: RankConfig) -> dict[str, Any]:
    """What this rank measured (see the module docstring); run it on every rank."""
    import remat
    from remat.measurement.baselines import NotSupported, hf_checkpointing
    from remat.measurement.check import check_against_eager, time_alternating, twin
    from remat.profile.allocator import measure_step_peak
    from remat.workloads import load

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load(config.model, config.batch_size, config.optimizer, seed=config.seed)
    if config.fsdp:
        plain_hf = copy.deepcopy(spec.model) if "hf" in config.baselines else None
        eager, eager_opt = _wrapped(spec.model, spec.optimizer, True, config.fsdp_precision)
        ours, optimizer = _wrapped(spec.model, spec.optimizer, True, config.fsdp_precision)
    else:
        plain_eager, eager_opt = twin(spec.model, spec.optimizer)
        plain_hf, hf_opt = twin(spec.model, spec.optimizer) if "hf" in config.baselines else (None, None)
        ours, eager, optimizer = DDP(spec.model), DDP(plain_eager), spec.optimizer
    step_fn = spec.train_step
    step = remat.compile(step_fn, ours, optimizer, spec.batch, memory_budget=config.budget, planner=config.planner, lean_ops=config.lean_ops)
    report = step.report

    grads_match = None
    if config.check and config.fsdp:
        grads_match = _sharded_match(step_fn, eager, eager_opt, ours, optimizer, step, spec.batch, config.seed)
    elif config.check:
        result = check_against_eager(step_fn, eager, eager_opt, ours, spec.optimizer, step, spec.batch, steps=3, seed=config.seed)
        grads_match = result.match
    else:
        step_fn(eager, eager_opt, spec.batch)
    persistent = report.persistent_bytes
    for p in ours.parameters():
        p.grad = None
    eager_peak = measure_step_peak(lambda: step_fn(eager, eager_opt, spec.batch), "cpu", eager).peak_bytes
    timing = time_alternating(lambda: step_fn(eager, eager_opt, spec.batch), lambda: step(spec.batch), pairs=config.pairs)
    out: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "wrapper": "FSDP2" if config.fsdp else "DDP",
        "fsdp_precision": config.fsdp_precision,
        "model": config.model,
        "batch_size_per_rank": config.batch_size,
        "budget": config.budget,
        "budget_bytes": report.budget_bytes,
        "persistent_bytes": persistent,
        "eager_bucket_bytes": 0 if config.fsdp else sum(p.numel() * p.element_size() for p in eager.parameters() if p.requires_grad),
        "eager_activation_peak_bytes": eager_peak,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "peak_bytes_measured": report.measured_peak_bytes,
        "activation_peak_bytes_measured": (report.measured_peak_bytes or 0) - persistent,
        "predicted_activation_peak_bytes": report.predicted_peak_bytes - persistent,
        "eager_iteration_seconds": timing.a_seconds,
        "iteration_seconds": timing.b_seconds,
        "overhead_ratio": timing.ratio,
        "overhead_ratio_spread": list(timing.ratio_spread),
        "num_recomputed": report.num_recomputed,
        "updates_in_backward": bool(report.plan and report.plan.updates_in_backward),
        "lean_ops": len(report.plan.lean_ops) if report.plan else 0,
        "collectives": sum(1 for n in step.graph_module.graph.nodes if any(c in str(n.target) for c in ("all_reduce", "all_gather", "reduce_scatter"))),
        "grads_match": grads_match,
    }
    if plain_hf is not None:
        try:
            hf_step = hf_checkpointing(plain_hf, spec.loss_fn)
        except NotSupported as e:
            out["hf_error"] = str(e)
        else:
            hf, hf_opt = _wrapped(plain_hf, spec.optimizer, True, config.fsdp_precision) if config.fsdp else (DDP(plain_hf), hf_opt)
            hf_step(hf, hf_opt, spec.batch)
            out["hf_activation_peak_bytes"] = measure_step_peak(lambda: hf_step(hf, hf_opt, spec.batch), "cpu", hf).peak_bytes
            hf_timing = time_alternating(lambda: step_fn(eager, eager_opt, spec.batch), lambda: hf_step(hf, hf_opt, spec.batch), pairs=config.pairs)
            out["hf_overhead_ratio"] = hf_timing.ratio
            out["hf_overhead_ratio_spread"] = list(hf_timing.ratio_spread)
    losses = [float(pytree.tree_leaves(step(spec.batch))[0]) for _ in range(config.steps)]
    out["losses"] = losses
    return out
