"""An FSDP2 module's MixedPrecisionPolicy, as the graph applies it (`sharded`).

FSDP2 casts outside any graph: a module's shards to `param_dtype` before their all-gather,
its floating inputs to it (`cast_forward_inputs`) and its outputs to `output_dtype`, the
gradients to `reduce_dtype` on their way into the reduce-scatter's buffer (divided before
and after the reduction where it risks overflow, float16), the reduced shard back to the
parameter's dtype. `Precision` holds what one module casts, read from FSDP2's own rules,
and `sharded._Gathered` and the forward hooks make the same casts as ops of the graph."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Precision:
    """A fully_shard module's MixedPrecisionPolicy as FSDP2 applies it (`FSDPParam.init_dtype_attrs`,
    `foreach_reduce`); the defaults are a module without one."""

    gather_dtype: torch.dtype | None = None  # its shards cast to it before the all-gather (param_dtype): the full parameters' dtype
    reduce_dtype: torch.dtype | None = None  # the gradients cast to it before the reduce-scatter, the sharded gradient cast back after
    predivide: float | None = None  # FSDP2's divide factors around a reduction at risk of overflow (float16); else it averages
    postdivide: float | None = None
    reduce_op: str = "avg"
    inputs_dtype: torch.dtype | None = None  # floating forward inputs cast to it (cast_forward_inputs)
    output_dtype: torch.dtype | None = None  # floating forward outputs cast to it


def precision_of(state: Any, pg: Any, refuse: Any) -> Precision:
    """What a module's MixedPrecisionPolicy casts, as FSDP2 reads it: its parameters' dtypes
    clamped as FSDP2 clamps them at its lazy init (which this runs early; it is idempotent),
    and the divide factors of its reduce-scatter (`_get_gradient_divide_factors`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    mp = state._mp_policy
    inputs_dtype = mp.param_dtype if mp.cast_forward_inputs else None
    if pg is None:
        return Precision(inputs_dtype=inputs_dtype, output_dtype=mp.output_dtype)
    pg._init_mp_dtypes()
    gathered = {fp.param_dtype or fp.orig_dtype for fp in pg.fsdp_params}
    if len(gathered) != 1:
        raise refuse(
            f"a MixedPrecisionPolicy leaves one fully_shard module's parameters in several dtypes ({sorted(map(str, gathered))}); "
            "shard the parameters of each dtype in a module of their own"
        )
    (gather_dtype,) = gathered
    reduce_dtype = pg._reduce_dtype or gather_dtype
    pre, post, op, _ = _get_gradient_divide_factors(
        pg.mesh_info.shard_process_group, None, reduce_dtype, pg.device.type, pg.gradient_divide_factor, pg.force_sum_reduction_for_comms
    )
    return Precision(gather_dtype, reduce_dtype, pre, post, "avg" if op == torch.distributed.ReduceOp.AVG else "sum", inputs_dtype, mp.output_dtype)


def cast_floats(dtype: torch.dtype | None, tree: Any) -> Any:
    """`tree` with its floating tensors cast to `dtype`, as FSDP2 casts a module's inputs and outputs."""
    if dtype is None:
        return tree
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), tree)
