"""A model wrapped in DistributedDataParallel, captured as DDP trains it.

DDP's own machinery (its reducer's autograd hooks and buckets) lives outside any graph.
The capture therefore traces the wrapped module's forward, and puts the gradient
averaging into the graph as functional collectives (`torch.ops._c10d_functional`): each
gradient, once the last backward pass has finished it, is scaled by 1/world size (the
multiplication DDP applies as it copies a gradient into its bucket) and all-reduced by
sum; the averaged tensor is the parameter's gradient from there on. `place_collectives`
then issues each all-reduce as soon as its gradient is final and waits for it a few
issues later (`IN_FLIGHT`), so communication runs beside the rest of the backward pass,
in the same order on every rank.

What DDP does outside the backward pass is done as DDP does it: its buffer broadcast
from rank 0 before each forward (`before_step`), and `no_sync()` read at each forward of
the step (a backward after a forward under `no_sync()` reduces nothing). Settings whose
behaviour the graph does not reproduce are refused (`data_parallel_of`).

Gradients are reduced one tensor at a time, not in DDP's buckets. Each element's sum
is the same sum, so the values are DDP's bitwise where the ranks' sum does not depend on
the buffer's layout (two ranks; gloo's ring order may differ with more).
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
    group: Any = field(default=None, repr=False, compare=False)  # the ProcessGroup


def data_parallel_of(model: torch.nn.Module) -> DataParallel | None:
    """The DDP settings of `model` (None when it is not wrapped in DDP), or a CaptureError
    naming a setting whose behaviour the captured graph would not reproduce."""
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
        group=group,
    )


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
    """Traced: each gradient times 1/world size, all-reduced by sum; the averaged tensors."""
    scale = 1.0 / dp.world_size
    issued = [ALL_REDUCE(g.mul(scale), "sum", dp.group_name) for g in grads]
    return [WAIT(t) for t in issued]


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
    """Issue each traced all-reduce right after its input is final, and wait for it just
    before the IN_FLIGHT-th next all-reduce is issued (the last ones where they were
    traced, at the end of the backward pass). Returns how many collectives were placed.

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
    scales = {n: n.args[0] for n in issues}
    writers: dict[StorageWeakRef, int] = {}
    for n in nodes[: min(position[scales[n]] for n in issues)]:
        for arg in written_args(n):
            ref = _storage(arg)
            if ref is not None:
                writers[ref] = position[n]

    ready: dict[torch.fx.Node, int] = {}  # issue -> position of the last op its gradient waits for
    for issue in issues:
        grad = scales[issue].args[0]
        ref = _storage(grad)
        ready[issue] = max(position[grad], writers.get(ref, -1) if ref is not None else -1)

    order = sorted(issues, key=lambda n: (ready[n], position[n]))
    after: dict[int, list[torch.fx.Node]] = {}
    for i, issue in enumerate(order):
        block = [waits[order[i - IN_FLIGHT]]] if i >= IN_FLIGHT else []
        after.setdefault(ready[issue], []).extend([*block, scales[issue], issue])
    placed = {m for block in after.values() for m in block} | set(waits.values())
    last_waits = [waits[n] for n in order[-IN_FLIGHT:]]
    new_order: list[torch.fx.Node] = []
    for n in nodes:
        if n in placed:
            if n is last_waits[0]:  # where the traced waits were: the end of the backward pass
                new_order.extend(last_waits)
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


def _storage(node: Any) -> StorageWeakRef | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None
