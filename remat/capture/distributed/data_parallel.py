"""A model wrapped in DistributedDataParallel, captured as DDP trains it.

DDP's own machinery (its reducer's autograd hooks and buckets) lives outside any graph.
The capture therefore traces the wrapped module's forward, and puts the gradient
averaging into the graph as functional collectives (`torch.ops._c10d_functional`): the
gradients the last backward pass finishes are copied bucket by bucket into one flat
tensor, scaled by 1/world size and all-reduced by sum; a view of the result is each
parameter's gradient from there on. `place_collectives` then issues each bucket's
all-reduce as soon as its gradients are final and waits for it a few issues later
(`IN_FLIGHT`), so communication runs beside the rest of the backward pass, in the same
order on every rank.

What DDP does outside the backward pass is done as DDP does it: its buffer broadcast
from rank 0 before each forward (`before_step`), and `no_sync()` read at each forward of
the step (a backward after a forward under `no_sync()` reduces nothing). Settings whose
behaviour the graph does not reproduce are refused (`data_parallel_of`).

Gradients are reduced in buckets as DDP's are (`buckets`: DDP's `bucket_cap_mb`, its
smaller first bucket, reverse parameter order), one all-reduce per bucket. Each
element's sum is the same sum however the buckets are cut, so the values are DDP's
bitwise where the ranks' sum does not depend on the buffer's layout (two ranks; gloo's
ring order may differ with more).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat.errors import CaptureError
from remat.ops.op_facts import written_args

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
COLLECTIVES = frozenset({ALL_REDUCE})


def is_collective(node: torch.fx.Node) -> bool:
    """A node that talks to the other ranks: never copied, dropped or reordered against another."""
    return node.op == "call_function" and (node.target in COLLECTIVES or node.target is WAIT)


@dataclass
class DataParallel:
    """What a DDP-wrapped model's step does across ranks, as captured."""

    group_name: str
    world_size: int
    rank: int
    reduced: tuple[str, ...] = ()  # parameters whose gradients the graph averages
    sync_at_entry: bool = True  # ddp.require_backward_grad_sync when the step was called (no_sync() around it: False)
    last_forward_synced: bool = True  # whether the step's last forward ran with gradient sync on
    find_unused_parameters: bool = False
    bucket_bytes: int = 25 * 2**20  # DDP's bucket_cap_mb
    first_bucket_bytes: int = 2**20  # the first bucket's (DDP's default: 1 MiB)
    group: Any = field(default=None, repr=False, compare=False)  # the ProcessGroup


def refuse_other_wrappers(model: torch.nn.Module) -> None:
    """A CaptureError for the data-parallel wrappers whose communication runs in their own
    Python outside any graph, naming the one remat captures instead."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, m in model.named_modules():
        where = f"the model's {name!r}" if name else "the model"
        if isinstance(m, FullyShardedDataParallel):
            raise CaptureError(
                f"{where} is wrapped in FullyShardedDataParallel (FSDP1), which gathers and frees the parameters in hooks of "
                "its own, outside any graph; shard with FSDP2's torch.distributed.fsdp.fully_shard instead (on each block, "
                "then the root), which remat captures (Accelerate: FullyShardedDataParallelPlugin(fsdp_version=2))"
            )
        if isinstance(m, torch.nn.DataParallel) and len(m.device_ids) > 1:
            raise CaptureError(
                f"{where} is wrapped in torch.nn.DataParallel over {len(m.device_ids)} devices, which copies the model to each "
                "in threads at every forward, outside any graph; use DistributedDataParallel (a process per device), which remat captures"
            )


def data_parallel_of(model: torch.nn.Module, in_buckets: bool = True) -> DataParallel | None:
    """The DDP settings of `model` (None when it is not wrapped in DDP), or a CaptureError
    naming a setting whose behaviour the captured graph would not reproduce. Not
    `in_buckets`: each gradient all-reduced on its own (buckets of no bytes)."""
    refuse_other_wrappers(model)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    ddp: Any = model
    refused = [
        (ddp.mixed_precision is not None, "DDP's mixed_precision casts parameters outside the graph; use torch.autocast inside train_step instead"),
        (bool(getattr(ddp, "_comm_hooks", [])), "a communication hook (register_comm_hook) changes how gradients are reduced; remove it (remat averages them as DDP's default does)"),
        (hasattr(ddp, "buffer_hook"), "a buffer communication hook is registered; remove it (remat broadcasts buffers as DDP's default does)"),
        (bool(getattr(ddp, "_delay_all_reduce_params", [])), "delay_all_reduce_named_params reduces some gradients after the backward pass in a hook of its own"),
        (bool(getattr(ddp, "_use_python_reducer", False)), "torch._dynamo's python_reducer mode is on"),
        (any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()), "SyncBatchNorm communicates in the forward pass, which remat does not capture; use BatchNorm"),
    ]  # fmt: skip
    for bad, why in refused:
        if bad:
            raise CaptureError(f"remat cannot capture this DistributedDataParallel model: {why}")
    group = ddp.process_group
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    reduced = [f"module.{name}" for name, p in ddp.module.named_parameters() if name not in ignored and p.requires_grad]
    return DataParallel(
        group_name=group.group_name,
        world_size=torch.distributed.get_world_size(group),
        rank=torch.distributed.get_rank(group),
        reduced=tuple(reduced),
        sync_at_entry=bool(ddp.require_backward_grad_sync),
        find_unused_parameters=bool(ddp.find_unused_parameters),
        bucket_bytes=int(ddp.bucket_bytes_cap) if in_buckets else 0,
        first_bucket_bytes=_first_bucket_bytes(ddp) if in_buckets else 0,
        group=group,
    )


def reduces_in_buckets(gm: torch.fx.GraphModule) -> bool:
    """Whether some all-reduce of the graph reduces more than one gradient."""
    return any(n.target is ALL_REDUCE and _bucket_parts(n)[0][0].target is torch.ops.aten.view.default for n in gm.graph.nodes)


def _first_bucket_bytes(ddp: Any) -> int:
    config = getattr(ddp, "_bucket_config", None)  # torch 2.13; earlier versions use the default
    first = getattr(config, "first_bucket_bytes_cap", torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    return int(min(first, ddp.bucket_bytes_cap))


@contextlib.contextmanager
def traced_forward(model: torch.nn.Module, synced: list[bool]) -> Iterator[None]:
    """While tracing, DDP's forward runs the wrapped module only (no reducer, no buffer
    broadcast) and appends to `synced` whether this forward would sync gradients."""
    ddp: Any = model

    def forward(*args: Any, **kwargs: Any) -> Any:
        synced.append(bool(ddp.require_backward_grad_sync and torch.is_grad_enabled()))
        return ddp.module(*args, **kwargs)

    ddp.forward = forward
    try:
        yield
    finally:
        del ddp.forward


def reduce_gradients(grads: list[torch.Tensor], dp: DataParallel) -> list[torch.Tensor]:
    """Traced: the gradients averaged over the ranks in DDP's buckets (`buckets`): each
    bucket's gradients copied into one flat tensor, times 1/world size, all-reduced by
    sum, and each gradient from there on a view of the result. All buckets are issued
    before any is waited for (`place_collectives` then moves each as early as it can go)."""
    scale = 1.0 / dp.world_size
    issued = []
    for bucket in buckets(grads, dp):
        if len(bucket) == 1:
            flat = grads[bucket[0]].mul(scale)
        else:
            flat = torch.cat([grads[i].view(-1) for i in bucket]).mul_(scale)
        issued.append((bucket, ALL_REDUCE(flat, "sum", dp.group_name)))
    out: list[torch.Tensor] = list(grads)
    for bucket, pending in issued:
        reduced = WAIT(pending)
        if len(bucket) == 1:
            out[bucket[0]] = reduced
            continue
        parts = torch.split(reduced, [grads[i].numel() for i in bucket])
        for i, part in zip(bucket, parts):
            out[i] = part.view(grads[i].shape)
    return out


def buckets(grads: list[torch.Tensor], dp: DataParallel) -> list[list[int]]:
    """Positions of `grads` (in the order of the model's parameters) in DDP's buckets:
    taken in reverse order (about the order the backward pass finishes them), one dtype
    to a bucket, each bucket closed once it holds its limit (the first, whose gradients
    come last, `first_bucket_bytes`; the others `bucket_bytes`, DDP's `bucket_cap_mb`).
    A gradient that is not contiguous is a bucket alone (it has no flat view)."""
    out: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(grads))):
        g = grads[i]
        if not g.is_contiguous():
            out.append([i])
            continue
        members, size = open_.get(g.dtype, ([], 0))
        members, size = [*members, i], size + g.numel() * g.element_size()
        limit = dp.first_bucket_bytes if not out else dp.bucket_bytes
        if size >= limit:
            out.append(members)
            open_.pop(g.dtype, None)
        else:
            open_[g.dtype] = (members, size)
    out.extend(members for members, _ in open_.values() if members)
    return out


def check_unused(dp: DataParallel, with_grads: list[str]) -> None:
    """DDP without find_unused_parameters fails when a reduced parameter gets no gradient;
    with it, such a parameter's gradient stays None, as in the graph."""
    missing = [n for n in dp.reduced if n not in set(with_grads)]
    if missing and not dp.find_unused_parameters:
        raise CaptureError(
            f"{len(missing)} parameters get no gradient in this step (first: {missing[0]}); DistributedDataParallel "
            "fails on that unless it was built with find_unused_parameters=True. Pass that, or freeze them "
            "(requires_grad_(False)) before wrapping the model."
        )


def check_unchanged(model: torch.nn.Module, dp: DataParallel) -> None:
    """Refuse a step called under another no_sync() setting than the one it was captured with."""
    now = bool(model.require_backward_grad_sync)  # type: ignore[union-attr]
    if now != dp.sync_at_entry:
        inside = "inside" if not dp.sync_at_entry else "outside"
        raise CaptureError(
            f"this step was compiled {inside} model.no_sync(), so its graph {'does not reduce' if inside == 'inside' else 'reduces'} "
            "gradients across ranks; compile one step per setting (e.g. one for accumulation steps, one for the step that syncs)"
        )


def before_step(model: torch.nn.Module) -> None:
    """DDP's buffer broadcast from rank 0 at the start of a forward, where DDP would do it."""
    ddp: Any = model
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()


def attach(tg: Any, dp: DataParallel, synced_last: bool) -> None:
    """A captured TrainGraph of a DDP model: its data-parallel facts on it, its collectives placed."""
    dp.last_forward_synced = synced_last
    tg.call.data_parallel = dp
    place_collectives(tg.gm)


def after_step(model: torch.nn.Module, dp: DataParallel) -> None:
    """What DDP's forward leaves for the next one: whether buffers are broadcast then."""
    model.require_forward_param_sync = dp.last_forward_synced  # type: ignore[union-attr]


# All-reduces issued and not yet waited for, at most. More hides more latency (the main
# thread blocks in a wait less often); each one in flight holds its gradient's buffer until
# its wait, and the update that frees it cannot run before.
IN_FLIGHT = 4


def place_collectives(gm: torch.fx.GraphModule) -> int:
    """Issue each traced all-reduce right after its bucket's gradients are final, and wait
    for it just before the IN_FLIGHT-th next all-reduce is issued (the last ones where they
    were traced, at the end of the backward pass); each wait is followed at once by the
    views of its result that are the gradients. Returns how many collectives were placed.

    A gradient is final after its producer and after every earlier op that writes its
    storage in place (accumulation into a gradient left from a previous step). The
    issue order follows readiness, so it is the same on every rank running this graph.
    """
    nodes = list(gm.graph.nodes)
    issues = [n for n in nodes if n.op == "call_function" and n.target is ALL_REDUCE]
    if not issues:
        return 0
    position = {n: i for i, n in enumerate(nodes)}
    waits = {n: next(u for u in n.users if u.target is WAIT) for n in issues}
    parts = {n: _bucket_parts(n) for n in issues}  # issue -> (the ops that fill its bucket, its gradients)
    unpacked = {waits[n]: _unpacked(waits[n]) for n in issues}
    writers: dict[StorageWeakRef, int] = {}
    for n in nodes[: min(position[parts[n][0][0]] for n in issues)]:
        for arg in written_args(n):
            ref = _storage(arg)
            if ref is not None:
                writers[ref] = position[n]

    ready: dict[torch.fx.Node, int] = {}  # issue -> position of the last op its gradients wait for
    for issue in issues:
        refs = [_storage(g) for g in parts[issue][1]]
        ready[issue] = max(max(position[g] for g in parts[issue][1]), *(writers.get(r, -1) for r in refs if r is not None))

    def waited(wait: torch.fx.Node) -> list[torch.fx.Node]:
        return [wait, *unpacked[wait]]

    order = sorted(issues, key=lambda n: (ready[n], position[n]))
    after: dict[int, list[torch.fx.Node]] = {}
    for i, issue in enumerate(order):
        block = waited(waits[order[i - IN_FLIGHT]]) if i >= IN_FLIGHT else []
        after.setdefault(ready[issue], []).extend([*block, *parts[issue][0], issue])
    placed = {m for block in after.values() for m in block} | {m for w in unpacked for m in waited(w)}
    last_waits = [waits[n] for n in order[-IN_FLIGHT:]]
    new_order: list[torch.fx.Node] = []
    for n in nodes:
        if n in placed:
            if n is last_waits[0]:  # where the traced waits were: the end of the backward pass
                new_order.extend(m for w in last_waits for m in waited(w))
            continue
        new_order.append(n)
        new_order.extend(after.get(position[n], []))
    assert len(new_order) == len(nodes), (len(new_order), len(nodes))
    previous = new_order[0]
    for n in new_order[1:]:
        previous.append(n)
        previous = n
    gm.graph.lint()
    gm.recompile()
    return len(issues)


def _bucket_parts(issue: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The ops that fill an all-reduce's input, in order, and the gradients they read, as
    `reduce_gradients` traced them: `grad * scale` for a bucket of one; for more, each
    gradient's flat view, their concatenation, and its scaling in place."""
    scaled = issue.args[0]
    assert isinstance(scaled, torch.fx.Node)
    filled = scaled.args[0]
    if isinstance(filled, torch.fx.Node) and filled.target is torch.ops.aten.cat.default:
        flats = list(filled.args[0])
        return [*flats, filled, scaled], [f.args[0] for f in flats]
    return [scaled], [filled]


def _unpacked(wait: torch.fx.Node) -> list[torch.fx.Node]:
    """The views of a bucket's reduced tensor that are its gradients: the split, its
    items and their reshapes (none for a bucket of one)."""
    out: list[torch.fx.Node] = []
    for split in wait.users:
        if split.target is torch.ops.aten.split_with_sizes.default:
            out.append(split)
            for item in split.users:
                out.append(item)
                out.extend(v for v in item.users if v.target is torch.ops.aten.view.default)
    return out


def _storage(node: Any) -> StorageWeakRef | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None
