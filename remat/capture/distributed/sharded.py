"""A model sharded with FSDP2 (`fully_shard`), captured as FSDP2 trains it.

FSDP2 keeps each parameter as a DTensor sharded on dim 0 across the ranks; before a
sharded module's forward it all-gathers the module's parameters, after its backward it
reduce-scatters their gradients (averaged), and the optimizer updates each rank's shard.
Its hooks issue eager collectives outside any graph. remat instead:

- **reads and writes the local shards** (`local_view`, around compiling and every call):
  in the model's tables, the optimizers' param groups and their state, each DTensor
  parameter stands for the while as a plain parameter on its local shard's storage (the
  same object at every call), its state as the state's local tensors; on the way out the
  gradients the step leaves become DTensors again, as FSDP2 leaves them. The graph's
  persistent inputs are then the shards: parameters, gradients and optimizer state at
  1/world size.
- **gathers in the graph** (`gathered_in_forward`, while tracing): FSDP2's forward hooks
  give way to hooks that swap the module's parameters for full ones gathered by one
  `wait(all_gather_into_tensor(...))` of their shards, through an autograd function whose
  backward is one `wait(reduce_scatter_tensor(..., "avg"))` of their gradients: FSDP2's
  collectives, on FSDP2's flat buffers. A gathered parameter is made in the forward pass and read in
  the backward pass, so the planner treats it as an activation: kept, or gathered again
  before its backward reader (FSDP2's `reshard_after_forward`, chosen per parameter
  under the budget). Every rank runs the same plan, so the copies' collectives pair up.

A dim 0 that the world size does not divide (a vocabulary of 50,257 rows) is sharded
unevenly: the last ranks hold fewer rows, or none. FSDP2 keeps each shard padded to the
first rank's rows, gathers the padded shards and pads each gradient before reducing it;
the graph does the same on the padded shards (`ShardedParam.local` is the padded shard),
so every rank's graph has the same shapes and one plan serves them all. The padding rows
stay zero: their gradient is zero, and the updates allowed are elementwise.

A MixedPrecisionPolicy's casts are made in the graph where FSDP2 makes them (`Precision`):
the shards before their gather, a module's inputs and outputs, the gradients before their
reduce-scatter and back after it. What the graph would not reproduce is refused
(`sharding_of`): CPU offload, HSDP, gradient sync turned off, custom collectives, and
optimizers whose update reads more than one element of a parameter. A step that reads a
sharded parameter or its gradient outside the gathered forward and the elementwise update
(a weight penalty) is refused after capture: on a shard it would see one rank's part. The
gradients' 2-norm and their scaling by it (`clip_grad_norm_`) are captured as DTensor
computes them (`sharded_norms`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx

from remat.capture.distributed.data_parallel import DataParallel
from remat.capture.optimizers import each
from remat.capture.distributed.sharded_norms import NORM_OPS, SCALING_OPS
from remat.capture.distributed.sharded_precision import Precision, cast_floats, precision_of
from remat.capture.train_graph import InputKind, Phase
from remat.errors import CaptureError

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default

# Their updates read and write each element of a parameter on its own: on a shard they do
# what they do on the DTensor. (Adafactor's factored moments, LBFGS and the like read across
# the parameter, which DTensor does with collectives the local view does not make.)
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
)  # fmt: skip


@dataclass
class ShardedParam:
    """One FSDP2 parameter: where the model holds it, its DTensor and its local stand-in."""

    fsdp_param: Any  # FSDP2's FSDPParam
    places: list[tuple[torch.nn.Module, str]]  # (module, attribute): the first is its owner, the rest share it
    local: torch.nn.Parameter  # a plain parameter on the DTensor's local shard's storage, padded as FSDP2 pads it

    @property
    def dtensor(self) -> torch.nn.Parameter:
        return self.fsdp_param.sharded_param

    @property
    def full_rows(self) -> int:
        """The parameter's rows, whole (its dim 0 before sharding)."""
        return int(self.fsdp_param._orig_size[0])

    @property
    def rows(self) -> int:
        """This rank's rows of the parameter: fewer than the padded shard's on the last ranks of an uneven one."""
        return int(self.fsdp_param.sharded_size[0])

    @property
    def padded(self) -> bool:
        return tuple(self.fsdp_param.sharded_size) != tuple(self.fsdp_param.padded_sharded_param_size)

    def as_padded(self, local: torch.Tensor) -> torch.Tensor:
        """The padded tensor of a gradient's or a state's local shard: itself where the shard
        is not padded; the one `unpadded` made it from; else a padded copy (a state made
        eagerly or loaded: after the step it is replaced by one on the copy)."""
        if not self.padded:
            return local
        made = getattr(local, _PADDED, None)
        if made is not None and _starts_at(local, made):
            return made
        out = local.new_zeros(self.fsdp_param.padded_sharded_param_size)
        out[: self.rows].copy_(local)
        return out

    def unpadded(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a padded tensor, remembering it (`as_padded` finds it again)."""
        if not self.padded:
            return padded
        local = padded[: self.rows]
        setattr(local, _PADDED, padded)
        return local


_PADDED = "_remat_padded_shard"  # on a local shard `unpadded` made: the padded tensor it is the rows of


def _starts_at(rows: torch.Tensor, padded: torch.Tensor) -> bool:
    """Whether `rows` starts where `padded` does, in its storage (a rank's shard of no rows too)."""
    return rows.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr() and rows.storage_offset() == padded.storage_offset()


@dataclass
class Sharding:
    """An FSDP2 model's parameters and process group, as the graph shards them."""

    group_name: str
    world_size: int
    rank: int
    group: Any = field(repr=False)
    params: list[ShardedParam] = field(default_factory=list)
    by_module: dict[int, list[ShardedParam]] = field(default_factory=dict)  # id(FSDP module) -> the parameters it gathers
    modules: list[Any] = field(default_factory=list)  # (module, FSDPState) of each fully_shard call
    precision: dict[int, Precision] = field(default_factory=dict)  # id(FSDP module) -> its mixed precision

    def ranks(self) -> DataParallel:
        """The process group, for the ranks' agreement at each stage (remat.ranks)."""
        return DataParallel(group_name=self.group_name, world_size=self.world_size, rank=self.rank, group=self.group)


# FSDP2's FSDPParam -> the stand-in of its DTensor parameter (tensors cannot be weak keys: they compare by value)
_LOCALS: "weakref.WeakKeyDictionary[Any, torch.nn.Parameter]" = weakref.WeakKeyDictionary()


def _local_of(fsdp_param: Any, model: torch.nn.Module) -> torch.nn.Parameter:
    """The stand-in of an FSDP2 parameter, its padded shard (FSDP2's `_sharded_param_data`,
    of which the DTensor's local tensor is the first rows): the same object while that is
    the same storage."""
    dtensor = fsdp_param.sharded_param
    local_tensor = dtensor._local_tensor
    padded = fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size)
    if not _starts_at(local_tensor, padded):
        raise CaptureError(
            f"the FSDP2 parameter {_name(model, fsdp_param)} no longer lies on FSDP2's own padded shard (it was replaced, not copied into); "
            "load new values with param.copy_(...) or load_state_dict, which copy into the shard"
        )
    found = _LOCALS.get(fsdp_param)
    if found is None or found.data_ptr() != padded.data_ptr() or found.shape != padded.shape:
        found = _LOCALS[fsdp_param] = torch.nn.Parameter(padded, requires_grad=dtensor.requires_grad)
    return found


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def sharding_of(model: torch.nn.Module) -> Sharding | None:
    """The FSDP2 sharding of `model` (None where no module of it is sharded), or a
    CaptureError naming what the graph would not reproduce and what to do instead."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
    from torch.distributed.tensor import Shard

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    if not isinstance(model, FSDPModule):
        raise CaptureError(
            "some submodules are sharded with fully_shard but the model itself is not; call fully_shard(model) on the "
            "root too, as FSDP2 asks, so that every parameter is sharded"
        )

    def refuse(why: str) -> CaptureError:
        return CaptureError(f"remat cannot capture this FSDP2 (fully_shard) model: {why}")

    found: Sharding | None = None
    for module in sharded:
        state = module._get_fsdp_state()
        if len(state._modules) != 1:
            raise refuse("fully_shard was called on a list of modules together; call it on each module (or on their parent)")
        pg = state._fsdp_param_group
        if pg is None:  # a module without parameters of its own: its process group is read from the others
            found = found or Sharding("", 0, 0, None)
            found.modules.append((module, state))
            found.precision[id(module)] = precision_of(state, None, refuse)
            continue
        checks = [
            (isinstance(pg.offload_policy, CPUOffloadPolicy), "CPUOffloadPolicy moves shards between devices outside the graph; remove it"),
            (isinstance(pg.mesh_info, HSDPMeshInfo), "HSDP (a 2-D mesh) is not supported; shard over one process group"),
            (not pg.reduce_grads, "gradient sync is turned off (set_requires_gradient_sync(False)); accumulate micro-batches inside train_step instead"),
            (not isinstance(pg._all_gather_comm, DefaultAllGather) or not isinstance(pg._reduce_scatter_comm, DefaultReduceScatter), "custom all-gather or reduce-scatter collectives are set"),
            (pg.gradient_divide_factor is not None or pg.force_sum_reduction_for_comms or pg._all_reduce_hook is not None, "the gradient reduction is customised (set_gradient_divide_factor, set_force_sum_reduction_for_comms or an all-reduce hook)"),
        ]  # fmt: skip
        for bad, why in checks:
            if bad:
                raise refuse(why)
        group = pg.mesh_info.shard_process_group
        if found is None:
            found = Sharding(group.group_name, pg.mesh_info.shard_mesh_size, pg.mesh_info.shard_mesh_rank, group)
        elif found.group is None:
            found.group_name, found.world_size, found.rank, found.group = group.group_name, pg.mesh_info.shard_mesh_size, pg.mesh_info.shard_mesh_rank, group
        elif group.group_name != found.group_name:
            raise refuse("modules are sharded over different process groups; shard them over one")
        found.modules.append((module, state))
        found.precision[id(module)] = precision_of(state, pg, refuse)
        mine = found.by_module.setdefault(id(module), [])
        for fp in pg.fsdp_params:
            if fp.is_dtensor or fp.fsdp_placement != Shard(0):
                raise refuse(f"{_name(model, fp)} is sharded on {fp.fsdp_placement} or is already a DTensor (tensor parallel); remat gathers shards on dim 0 only")
            info = fp._module_info
            places = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
            sp = ShardedParam(fp, places, _local_of(fp, model))
            found.params.append(sp)
            mine.append(sp)
    assert found is not None
    return found


def _name(model: torch.nn.Module, fp: Any) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is fp.sharded_param or p is _LOCALS.get(fp):
            return name
    return fp._module_info.param_name


def check_optimizers(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse an optimizer made before fully_shard (it holds the replaced tensors) or one whose update reads across a parameter."""
    params = {id(p) for p in model.parameters()}
    for opt in each(optimizer):
        if any(id(p) not in params for group in opt.param_groups for p in group["params"]):
            raise CaptureError(
                f"the {type(opt).__name__} holds tensors that are not the model's parameters: fully_shard replaces each "
                "parameter with a sharded one, so make the optimizer after fully_shard(model), from model.parameters()"
            )
        if not isinstance(opt, ELEMENTWISE_OPTIMIZERS):
            raise CaptureError(
                f"remat cannot capture {type(opt).__name__} on an FSDP2 model: its update may read across a parameter, which "
                "on a shard sees one rank's part; use an elementwise optimizer (SGD, Adam, AdamW, ...) or leave the model unsharded"
            )


@contextlib.contextmanager
def local_view(sharding: Sharding | None, optimizer: Any) -> Iterator[None]:
    """While inside, the model and the optimizers hold each sharded parameter's stand-in,
    its state's local tensors and its gradient's local tensor; on the way out, the
    DTensors again, with the gradients and new state the step left as DTensors."""
    if sharding is None:
        yield
        return
    from torch.distributed.tensor import DTensor

    optimizers = each(optimizer)
    # A module an eager forward left gathered (FSDP2 keeps the root's parameters gathered
    # after a forward under no_grad) would keep its gathered copies, stale after the update:
    # sharded first, its tables hold the DTensors, as after FSDP2's own backward.
    for module, _ in sharding.modules:
        module.reshard()
    swapped_groups: list[tuple[list[Any], int, Any]] = []
    by_id = {id(sp.dtensor): sp for sp in sharding.params}
    by_local = {id(sp.local): sp for sp in sharding.params}
    originals: dict[int, dict[str, Any]] = {}  # id(stand-in) -> its state as FSDP2 held it
    for sp in sharding.params:
        dt = sp.dtensor
        sp.local.requires_grad_(dt.requires_grad)
        sp.local.grad = sp.as_padded(dt.grad._local_tensor) if dt.grad is not None else None
        for module, name in sp.places:
            module._parameters[name] = sp.local
    for opt in optimizers:
        for group in opt.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                sp = by_id.get(id(p))
                if sp is not None:
                    params[i] = sp.local
                    swapped_groups.append((params, i, p))
        entries = []
        for p, state in opt.state.items():  # rebuilt in place and in order: the same table, as eager left it
            sp = by_id.get(id(p))
            if sp is not None:
                originals[id(sp.local)] = dict(state)
                state.update({k: sp.as_padded(v._local_tensor) for k, v in state.items() if isinstance(v, DTensor)})
                p = sp.local
            entries.append((p, state))
        opt.state.clear()
        opt.state.update(entries)
    try:
        yield
    finally:
        for params, i, p in swapped_groups:
            params[i] = p
        for opt in optimizers:
            entries = []
            for p, state in opt.state.items():
                sp = by_local.get(id(p))
                if sp is not None:  # a state the step made (a first step) too: DTensors, as eager makes it
                    state, p = _as_dtensors(sp, state, originals.get(id(p), {})), sp.dtensor
                entries.append((p, state))
            opt.state.clear()
            opt.state.update(entries)
        for sp in sharding.params:
            for module, name in sp.places:
                module._parameters[name] = sp.dtensor
            grad = sp.local.grad
            sp.dtensor.grad = None if grad is None else sp.fsdp_param.to_sharded_dtensor(sp.unpadded(grad))
            sp.local.grad = None


def _as_dtensors(sp: ShardedParam, state: dict[str, Any], originals: dict[str, Any]) -> dict[str, Any]:
    """The state as FSDP2's optimizer keeps it: each tensor the size of the shard a DTensor
    (the same one where the step kept its local tensor), the others (a step count) as they are."""
    from torch.distributed.tensor import DTensor

    for k, v in state.items():
        was = originals.get(k)
        if isinstance(was, DTensor) and (was._local_tensor is v or getattr(was._local_tensor, _PADDED, None) is v):
            state[k] = was
        elif isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == sp.local.shape:
            state[k] = sp.fsdp_param.to_sharded_dtensor(sp.unpadded(v))
    return state


class _Gathered(torch.autograd.Function):
    """A module's shards, all-gathered as FSDP2 gathers them (one flat buffer: each rank's
    shards flattened one after the other) and copied out into each full parameter; in the
    backward pass their gradients reduce-scattered as FSDP2 does (each gradient's rank-r
    rows in rank r's part of one flat buffer, averaged), each shard's gradient a view of
    this rank's part. Under a MixedPrecisionPolicy the shards are cast before the gather and the
    gradients before the reduction, the reduced gradient cast back to the shards' dtype, as FSDP2 does."""

    @staticmethod
    def forward(ctx: Any, world_size: int, group_name: str, full_rows: tuple[int, ...], precision: Precision, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.world_size, ctx.group_name, ctx.full_rows, ctx.precision = world_size, group_name, full_rows, precision
        ctx.shapes = [s.shape for s in shards]
        ctx.like = [(s.dtype, s.device) for s in shards]
        gather_dtype = precision.gather_dtype
        flat = torch.cat([(s if gather_dtype in (None, s.dtype) else s.to(gather_dtype)).reshape(-1) for s in shards])
        rows = _WAIT(ALL_GATHER(flat, world_size, group_name)).view(world_size, -1)
        full, start = [], 0
        for s, n_rows in zip(shards, full_rows):
            n = s.numel()
            gathered = rows[:, start : start + n].reshape(world_size * s.shape[0], *s.shape[1:])
            full.append(gathered if n_rows == gathered.shape[0] else gathered[:n_rows])  # the padding rows dropped
            start += n
        return tuple(full)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        world, precision = ctx.world_size, ctx.precision
        parts = []
        for g, shape, n_rows, (dtype, device) in zip(grads, ctx.shapes, ctx.full_rows, ctx.like):
            padded_rows = world * shape[0]
            if g is None:
                g = torch.zeros((padded_rows, *shape[1:]), dtype=precision.gather_dtype or dtype, device=device)
            elif n_rows != padded_rows:  # zeros where the padding was, as FSDP2 pads each rank's chunk
                g = torch.cat([g, g.new_zeros((padded_rows - n_rows, *shape[1:]))])
            if precision.reduce_dtype not in (None, g.dtype):  # as FSDP2's copy into its reduce buffer casts
                g = g.to(precision.reduce_dtype)
            parts.append(g.reshape(world, -1))
        flat = torch.cat(parts, dim=1).reshape(-1)
        if precision.predivide not in (None, 1):
            flat = flat / precision.predivide
        local = _WAIT(REDUCE_SCATTER(flat, precision.reduce_op, world, ctx.group_name))
        if precision.postdivide not in (None, 1):
            local = local / precision.postdivide
        if local.dtype != ctx.like[0][0]:
            local = local.to(ctx.like[0][0])
        out, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            out.append(local[start : start + n].view(shape))
            start += n
        return (None, None, None, None, *out)


@contextlib.contextmanager
def gathered_in_forward(sharding: Sharding | None) -> Iterator[None]:
    """While tracing: FSDP2's forward hooks give way to ones that swap each of a module's
    parameters (the traced shard) for its gathered full tensor during the module's forward."""
    if sharding is None:
        yield
        return
    from torch.nn.utils._named_member_accessor import swap_tensor

    put_back: list[tuple[dict[int, Any], int, Any]] = []
    for module, state in sharding.modules:
        own = sharding.by_module.get(id(module), [])
        precision = sharding.precision[id(module)]
        held: list[list[tuple[torch.nn.Module, str, torch.Tensor]]] = []

        def pre(mod: Any, args: Any, kwargs: Any, own: list[ShardedParam] = own, precision: Precision = precision, held: list[Any] = held) -> Any:
            swapped = []
            shards = [getattr(*sp.places[0]) for sp in own]
            full_rows = tuple(sp.full_rows for sp in own)
            fulls = _Gathered.apply(sharding.world_size, sharding.group_name, full_rows, precision, *shards) if own else ()
            for sp, full in zip(own, fulls):
                for m, n in sp.places:
                    swapped.append((m, n, swap_tensor(m, n, full)))
            held.append(swapped)
            return cast_floats(precision.inputs_dtype, (args, kwargs))

        def post(mod: Any, args: Any, output: Any, precision: Precision = precision, held: list[Any] = held) -> Any:
            for m, n, shard in reversed(held.pop()):
                swap_tensor(m, n, shard)
            return cast_floats(precision.output_dtype, output)

        for table, handle, hook in ((module._forward_pre_hooks, state._pre_forward_hook_handle, pre), (module._forward_hooks, state._post_forward_hook_handle, post)):
            put_back.append((table, handle.id, table[handle.id]))
            table[handle.id] = hook
    try:
        yield
    finally:
        for table, key, hook in put_back:
            table[key] = hook


def check_shard_reads(tg: Any, sharding: Sharding | None) -> None:
    """Refuse a step that reads a sharded parameter, or its final gradient, anywhere but in
    its all-gather and in the optimizer's elementwise update: there it would see one shard."""
    if sharding is None:
        return
    nodes = {n.name: n for n in tg.gm.graph.nodes}
    placeholders = {name: n for name, n in nodes.items() if n.op == "placeholder"}
    aten = torch.ops.aten
    gathered_from = {ALL_GATHER, aten.cat.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default}

    def outside(node: torch.fx.Node) -> list[torch.fx.Node]:
        found = []
        for u in node.users:
            if u.op != "call_function" or tg.phase.get(u.name) is Phase.OPTIMIZER or u.target in gathered_from:
                continue
            # A MixedPrecisionPolicy's cast of the shard before its gather: what reads the cast is judged
            found.extend(outside(u) if u.target is aten._to_copy.default and node.op == "placeholder" else [u])
        return found

    for inp, (name, node) in zip(tg.inputs, placeholders.items()):
        if inp.kind is InputKind.PARAMETER and outside(node):
            raise CaptureError(
                f"train_step reads the parameter {inp.name} outside its module's forward ({outside(node)[0].target}); under FSDP2 "
                "remat holds it as this rank's shard there, so the value would be one rank's part: read it inside a sharded "
                "module's forward, or leave the model unsharded"
            )
    for param, grad_name in tg.grad_nodes.items():
        # Its 2-norm (reduced across the ranks while tracing: sharded_norms) and its scaling
        # by a number (clip_grad_norm_) read it as a DTensor would; nothing else may.
        users = [u for u in outside(nodes[grad_name]) if u.target not in NORM_OPS + SCALING_OPS]
        if users:
            raise CaptureError(
                f"train_step reads the gradient of {param} before the optimizer's update ({users[0].target}); under FSDP2 "
                "it is this rank's shard of it, so the value would be one rank's part: remat captures its 2-norm and scaling "
                "it (clip_grad_norm_) and nothing else yet; drop that read, or leave the model unsharded"
            )
