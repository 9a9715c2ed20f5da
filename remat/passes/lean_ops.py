"""Memory-lean operator variants: a backward op writes its result into an input buffer that
dies at that op, instead of allocating a new one (MONeT's in-place backward operators).

A pass with one job: it replaces such a node's op by the op's `out=` overload, with the
dying input as `out`, and changes nothing else. The kernel is the same and each element is
computed from the same inputs, so the values are bitwise those of the op it replaces. The
variants are kept beside the captured module (`TrainGraph.lean_into`) and emitted by the
rewriter; the analysis reads each result on its input's storage, so the simulator, the
bound and every planner count the variant's real bytes without a rule of their own.

Where a variant applies (each condition checked on the graph, not assumed):
- the op is elementwise (`pointwise` tag: TensorIterator reads each element before writing
  it, which allows out to be an input) or a row-wise backward op whose kernel reads a row
  before writing it (`ROW_WISE`), and has an `out=` overload with the same arguments and a
  kernel of its own on the device (`out_overload`);
- the input is made after the forward pass (a gradient), so no rebuilt copy ever reads it
  and every recomputation plan keeps the variant valid;
- nothing reads the input's storage after the op (through any value on it), nor does the
  op itself through another of its inputs (a transpose of it: the kernel would read
  elements it has already written, and refuses the overlap), the storage is not a graph
  output nor held by the caller, and holds exactly the result's bytes;
- the input has the result's shape, dtype, strides and device, so the result is laid out as
  the op would lay it out.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from remat.ops import op_facts
from remat.memory.analysis import GraphAnalysis
from remat.memory.graph_index import GraphIndex
from remat.capture.train_graph import Phase, TrainGraph

aten = torch.ops.aten

# Row-wise backward kernels that reduce a row of the incoming gradient before writing that
# row of the result (checked bitwise against the op with a separate output in the tests).
ROW_WISE = {aten._log_softmax_backward_data.default, aten._softmax_backward_data.default}


@dataclass(frozen=True)
class LeanOp:
    """One node that writes its result into a dying input."""

    node: str
    op: str  # the op it replaces, e.g. "aten._log_softmax_backward_data.default"
    into: str  # the input node whose buffer holds the result
    nbytes: int  # bytes no longer allocated while the op runs


@dataclass
class LeanOps:
    applied: list[LeanOp] = field(default_factory=list)

    @property
    def applies(self) -> bool:
        return bool(self.applied)

    @property
    def nodes(self) -> list[str]:
        return [v.node for v in self.applied]

    def summary(self) -> str:
        if not self.applied:
            return "no op can write its result into a dying input"
        saved = sum(v.nbytes for v in self.applied)
        kinds = sorted({v.op.split(".")[1] for v in self.applied})
        return f"{len(self.applied)} backward ops write their result into a dying input ({', '.join(kinds)}; {saved:,} bytes not allocated)"


@functools.lru_cache(maxsize=None)
def out_overload(op: Any, device_type: str) -> tuple[Any, str] | None:
    """The `out=` overload of `op` taking the same arguments, and its out argument's name,
    where it has a kernel of its own on `device_type` ("cpu", "cuda"). A generated out=
    wrapper (CompositeExplicitAutograd) allocates the result and copies it into out: no
    byte saved, so it does not count."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return None
    own = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        overload = getattr(op.overloadpacket, name)
        args = overload._schema.arguments
        outs = [a for a in args if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in args if a not in outs]
        if len(outs) == 1 and rest == own and len(overload._schema.returns) == 1:
            qualified = f"{overload._schema.name}.{overload._overloadname}"
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
                return overload, outs[0].name
            return None
    return None


def _eligible_op(node: torch.fx.Node) -> bool:
    target, value = node.target, node.meta.get("val")
    if not isinstance(target, torch._ops.OpOverload) or not isinstance(value, torch.Tensor):
        return False
    if op_facts.is_random(node) or op_facts.written_args(node):
        return False
    return (torch.Tag.pointwise in target.tags or target in ROW_WISE) and out_overload(target, value.device.type) is not None


def _same_layout(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
    )  # fmt: skip


def find_lean_ops(tg: TrainGraph, analysis: GraphAnalysis) -> LeanOps:
    """Every node after the forward pass that can write its result into a dying input."""
    tensors = analysis.tensors
    rank = analysis.rank_of()
    outputs = {s for n in next(n for n in tg.gm.graph.nodes if n.op == "output").all_input_nodes for s in analysis.node_storages.get(n.name, [])}
    # A storage that takes over a result's storage lives until the result's last use.
    merged: dict[int, int] = {}
    last_use = {t.id: t.last_use for t in tensors}

    def root(s: int) -> int:
        while s in merged:
            s = merged[s]
        return s

    applied: list[LeanOp] = []
    for node in tg.gm.graph.nodes:
        if node.op != "call_function" or tg.phase[node.name] is Phase.FORWARD or not _eligible_op(node):
            continue
        own = analysis.node_storages.get(node.name, [])
        if len(own) != 1 or tensors[own[0]].node != node.name:
            continue  # the result is not one fresh storage
        result = node.meta.get("val")
        for arg in node.args:
            if not isinstance(arg, torch.fx.Node) or not _same_layout(arg.meta.get("val"), result) or arg.meta["val"].is_inference():
                continue  # an inference tensor (torch.inference_mode() in the step) takes no out= write outside that mode
            sids = analysis.node_storages.get(arg.name, [])
            if len(sids) != 1:
                continue
            s = root(sids[0])
            t = tensors[s]
            if (
                t.persistent or s in outputs or t.created < 0 or tg.phase[analysis.node_names[t.created]] is Phase.FORWARD
                or last_use[s] != rank[node.name] or t.nbytes != tensors[own[0]].nbytes
                or any(root(x) == s for other in node.all_input_nodes if other is not arg for x in analysis.node_storages.get(other.name, []))
            ):  # fmt: skip
                continue
            merged[own[0]] = s
            last_use[s] = last_use[own[0]]
            applied.append(LeanOp(node.name, str(node.target), arg.name, tensors[own[0]].nbytes))
            break
    return LeanOps(applied)


def apply_lean_ops(tg: TrainGraph, lean: LeanOps) -> TrainGraph:
    """`tg` with its nodes in `lean` writing their result into the named input: the same
    module, the variants kept beside it (`TrainGraph.lean_into`). The analysis reads each
    such result on its input's storage (`analysis.analyze`), and the rewriter emits the
    out= call (`out_call`)."""
    return dataclasses.replace(tg, lean_into={**tg.lean_into, **{v.node: v.into for v in lean.applied}})


def out_call(node: torch.fx.Node, into: Any) -> tuple[Any, dict[str, Any]]:
    """The target and kwargs of `node` writing its result into `into` (its out= overload)."""
    overload, out_name = out_overload(node.target, node.meta["val"].device.type)  # type: ignore[misc]
    return overload, {**node.kwargs, out_name: into}


def lean_index(index: GraphIndex) -> tuple[GraphIndex | None, LeanOps]:
    """`index`'s graph with every backward op that can write its result into a dying input
    doing so, indexed; None where no op can. Computed once, on the graph as captured (then
    update_placement.moved_index of the result may move its updates)."""
    if index.lean_ops or index.updates_moved:
        return None, LeanOps()

    def derive() -> tuple[GraphIndex | None, LeanOps]:
        lean = find_lean_ops(index.tg, index.analysis)
        if not lean.applies:
            return None, lean
        derived = index.indexed(apply_lean_ops(index.tg, lean))
        derived.lean_ops = lean.nodes
        return derived, lean

    return index.derived("_with_lean_ops", derive)
