"""Ops whose kernel returns the workspace its backward reads only while autograd records.

The captured graph runs under `no_grad`, as a step's graph must (nothing it computes is
recorded). oneDNN's LSTM layer (`aten.mkldnn_rnn_layer`, what `nn.LSTM` runs on CPU)
checks the grad mode, not its `train` argument, before it keeps its workspace: under
`no_grad` the workspace is undefined and its backward, which the graph calls with it,
refuses to run. And the op's fake kernel gives the workspace zero bytes, so the memory
model would not see what the backward holds.

`swap_in` replaces each such node with a twin op of the same schema that runs the same
kernel with autograd on (on detached inputs, so nothing is recorded) and whose fake
kernel gives the workspace its real size, measured once per shape by running the kernel
on zeros: the same outputs as eager's, bitwise, and a workspace the simulator counts.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

aten = torch.ops.aten

_LIB = torch.library.Library("remat", "FRAGMENT")
_WORKSPACE_OUTPUT = 3  # mkldnn_rnn_layer -> (output, hy, cy, workspace)


def _define_twin(op: torch._ops.OpOverload, name: str) -> torch._ops.OpOverload:
    schema = str(op._schema)
    _LIB.define(name + schema[schema.index("(") :])
    return getattr(torch.ops.remat, name).default


_RNN_LAYER = _define_twin(aten.mkldnn_rnn_layer.default, "mkldnn_rnn_layer_recording")


def _detached(args: tuple) -> list[Any]:
    return [a.detach() if isinstance(a, torch.Tensor) else a for a in args]


def _rnn_layer_recording(*args: Any) -> tuple[torch.Tensor, ...]:
    with torch.enable_grad():
        return aten.mkldnn_rnn_layer.default(*_detached(args))


@functools.lru_cache(maxsize=None)
def _workspace_bytes(key: tuple) -> int:
    """The workspace's bytes for arguments described by `key` (each tensor's shape and
    dtype, every other argument as is): the kernel run once on zeros."""
    args = [torch.zeros(a[1], dtype=a[2]) if isinstance(a, tuple) and a and a[0] == "tensor" else a for a in key]
    args = [list(a) if isinstance(a, tuple) else a for a in args]
    with torch.no_grad():
        return _rnn_layer_recording(*args)[_WORKSPACE_OUTPUT].numel()


def _key(args: tuple) -> tuple:
    return tuple(("tensor", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (tuple(a) if isinstance(a, list) else a) for a in args)


def _rnn_layer_fake(*args: Any) -> tuple[torch.Tensor, ...]:
    out = aten.mkldnn_rnn_layer.default(*args)
    with unset_fake_temporarily():
        size = _workspace_bytes(_key(args))
    return (*out[:_WORKSPACE_OUTPUT], out[0].new_empty(size, dtype=torch.uint8))


_LIB.impl(_RNN_LAYER.name().split("::")[1], _rnn_layer_recording, "CPU")
torch.library.register_fake(_RNN_LAYER, _rnn_layer_fake, lib=_LIB)

# aten op -> its twin that keeps the workspace under no_grad.
RECORDING_TWINS: dict[Any, torch._ops.OpOverload] = {aten.mkldnn_rnn_layer.default: _RNN_LAYER}


def swap_in(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with each op of `RECORDING_TWINS` replaced by its twin, its values recomputed
    on fake tensors (the workspace's real size), in the node and in the `getitem`s that
    take its outputs apart."""
    from torch._guards import detect_fake_mode

    for node in gm.graph.nodes:
        twin = RECORDING_TWINS.get(node.target)
        if twin is None:
            continue
        node.target = twin
        args = torch.fx.map_arg(node.args, lambda n: n.meta["val"])
        with detect_fake_mode(list(args)) or torch._subclasses.FakeTensorMode():
            node.meta["val"] = twin(*args)
        for user in node.users:
            if user.target is operator.getitem:
                user.meta["val"] = node.meta["val"][user.args[1]]
    gm.recompile()
    return gm
