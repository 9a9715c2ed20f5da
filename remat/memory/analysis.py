"""Static analysis of a captured graph: which storage each node's value lives in, its role,
its size, and when it is created, used and freed.

The unit of memory is the *storage*, not the node: a view or an in-place result shares its
input's storage and costs no new bytes, and a storage lives while any value on it is still
needed. Storage identity is read off the fake tensors that tracing (or fake propagation
after a rewrite) left in `node.meta["val"]`, so ops that alias without saying so in their
schema (`_unsafe_view`, `reshape` of a contiguous tensor) are still counted right.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from remat.ops import rng_replay
from remat.ops.cpu_shape_functions import cpu_kernels_as_shape_functions
from remat.ops.op_facts import aliases_its_input
from remat.capture.train_graph import InputKind, Phase, TrainGraph


class Role(str, Enum):
    PARAMETER = "parameter"  # parameters and buffers (BatchNorm running stats), and tensors outside the model the step reads
    GRADIENT = "gradient"
    ACTIVATION = "activation"
    OPTIMIZER_STATE = "optimizer_state"
    INPUT = "input"
    OTHER = "other"


ROLES: tuple[Role, ...] = tuple(Role)

_INPUT_ROLE = {
    InputKind.PARAMETER: Role.PARAMETER,
    InputKind.BUFFER: Role.PARAMETER,
    InputKind.OPTIMIZER_STATE: Role.OPTIMIZER_STATE,
    InputKind.GRADIENT: Role.GRADIENT,
    InputKind.OUTSIDE: Role.PARAMETER,
    InputKind.HYPERPARAMETER: Role.INPUT,
    InputKind.NUMBER: Role.INPUT,
    InputKind.BATCH: Role.INPUT,
}


@dataclass
class TensorInfo:
    """One storage: the bytes it holds and its life in execution ranks.

    Ranks index `GraphAnalysis.node_names`; inputs are created at -1 and values that
    outlive the step (inputs, outputs) have `last_use == len(node_names)`.
    """

    id: int
    node: str  # the node whose value first holds this storage
    key: str  # stable name: the node, or "node#i" for the i-th tensor of a multi-output node
    nbytes: int
    role: Role
    created: int
    last_use: int
    last_forward_use: int | None = None
    first_backward_use: int | None = None
    persistent: bool = False  # held by the caller before and after the step
    aliases: list[str] = field(default_factory=list)  # every node whose value lives in it

    @property
    def is_activation(self) -> bool:
        return self.role is Role.ACTIVATION


@dataclass
class GraphAnalysis:
    node_names: list[str]  # call_function nodes, in execution order
    phases: list[Phase]
    tensors: list[TensorInfo]
    node_storages: dict[str, list[int]]  # node name -> storages of the tensors its value holds
    new_storages: list[list[int]]  # per rank: storages first allocated by that node
    uses: list[list[int]]  # per rank: storages that node reads or writes (its inputs)
    persistent_bytes: int  # inputs and constants: held before and after the step
    phase_bounds: dict[str, tuple[int, int]]  # phase -> [first rank, last rank + 1)
    # node name -> bytes it holds only while it runs, known from the graph: the generator
    # state a replayed random op sets aside (rng_replay.Replay)
    held_while_running: dict[str, int] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def activations(self) -> list[TensorInfo]:
        return [t for t in self.tensors if t.role is Role.ACTIVATION]

    def rank_of(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.node_names)}

    def storage_by_key(self) -> dict[str, int]:
        return {t.key: t.id for t in self.tensors}


def refresh_fake_values(gm: torch.fx.GraphModule) -> None:
    """Fake values for the nodes of a rewritten graph that need new ones, so that the
    analysis reads each node's storage as the rewritten graph makes it: a node without one
    (a copy the rewriter made), and a node whose value may be, or be on, an input's that got
    a new one (a view of a recomputed activation, an in-place write, an item of a tuple).
    Every other node keeps the value it was traced with: its op makes a tensor of its own,
    of the same size and strides whichever copy of its inputs it reads."""
    fake_inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    renewed: set[torch.fx.Node] = set()
    kept: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if "val" not in node.meta or (node.op != "output" and _may_alias(node) and any(a in renewed for a in node.all_input_nodes)):
            renewed.add(node)
        elif node.op != "output":
            kept[node] = node.meta["val"]
    if not renewed:
        return
    mode = detect_fake_mode(fake_inputs)
    with mode, cpu_kernels_as_shape_functions():
        FakeTensorProp(gm, mode).run(*fake_inputs, initial_env=kept)


def _may_alias(node: torch.fx.Node) -> bool:
    """Whether the node's value may share storage with one of its inputs' (an op not known to
    make a tensor of its own counts as one that may)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return True
    return aliases_its_input(node) or any(r.alias_info is not None for r in target._schema.returns)


def _lean_storages(tg: TrainGraph) -> dict[StorageWeakRef, StorageWeakRef]:
    """Where the values of a graph with lean operator variants live (`TrainGraph.lean_into`):
    the storage such a node's op would allocate is its input's storage, for the node and for
    every value on it (a view of the result, an in-place write to it). An input that is
    itself such a result resolves to where that one lives (graph order)."""
    if not tg.lean_into:
        return {}
    by_name = {n.name: n for n in tg.gm.graph.nodes}
    ref = lambda name: StorageWeakRef(by_name[name].meta["val"].untyped_storage())  # noqa: E731
    merged: dict[StorageWeakRef, StorageWeakRef] = {}
    for node in (n for n in by_name if n in tg.lean_into):
        into = ref(tg.lean_into[node])
        merged[ref(node)] = merged.get(into, into)
    return merged


def _tensors_in(value: Any) -> list[torch.Tensor | None]:
    """The tensors a node's value holds, one slot per output (None where not a tensor)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    return []


# CPU kernels of these losses reduce into their elementwise buffer and return a 0-dim
# tensor on it: with reduction "mean" or "sum", the loss's storage still holds one
# element per input element (torch 2.13), where the fake kernel says one element. The
# loss is an output of the step, so that buffer lives to its end.
_LOSSES_ON_THEIR_BUFFER = {
    torch.ops.aten.mse_loss.default,
    torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.binary_cross_entropy.default,
    torch.ops.aten.soft_margin_loss.default,
}


def _storage_nbytes(node: torch.fx.Node, t: torch.Tensor) -> int:
    """Bytes of the storage `t` lives in, as the real kernel allocates it."""
    nbytes = t.untyped_storage().nbytes()
    if node.op == "call_function" and node.target in _LOSSES_ON_THEIR_BUFFER and t.dim() == 0 and t.device.type == "cpu":
        shapes = [a.meta["val"].shape for a in node.args if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        nbytes = max(nbytes, torch.Size(torch.broadcast_shapes(*shapes)).numel() * t.element_size())
    return nbytes


def _masked_outputs(node: torch.fx.Node) -> list[int]:
    """Outputs an op's `output_mask` turns off (convolution_backward, native_batch_norm_backward,
    native_layer_norm_backward, ...): the real kernel returns an undefined tensor there, the
    fake kernel a full-size one that no node reads."""
    target = node.target
    i = _output_mask_position(target) if isinstance(target, torch._ops.OpOverload) else None
    if i is None:
        return []
    mask = node.args[i] if i < len(node.args) else node.kwargs.get("output_mask")
    return [j for j, on in enumerate(mask or []) if not on]


@functools.lru_cache(maxsize=None)
def _output_mask_position(target: torch._ops.OpOverload) -> int | None:
    return next((i for i, arg in enumerate(target._schema.arguments) if arg.name == "output_mask"), None)


def _unmasked_by_the_kernel(node: torch.fx.Node, vals: list) -> list:
    """Outputs a real kernel makes though its output_mask turns them off, where the fake
    kernel makes none: on CPU, some convolution_backward paths (oneDNN) compute the
    weight's gradient along with the bias's (a frozen weight with a trained bias); others
    (1×1 kernels on small inputs) do not. The real kernel is asked, once per call shape
    (`_cpu_conv_backward_makes_weight_grad`). A meta tensor of that size stands for the
    gradient: made by the node, read by nothing but the node's getitems."""
    if node.target is not torch.ops.aten.convolution_backward.default or len(vals) != 3 or vals[1] is not None:
        return vals
    mask, weight = node.args[10], node.args[2].meta.get("val")
    if not (mask[2] and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"):
        return vals
    if not _cpu_conv_backward_makes_weight_grad(node):
        return vals
    return [vals[0], torch.empty(weight.shape, dtype=weight.dtype, device="meta"), vals[2]]


_CONV_PROBES: dict[tuple, bool] = {}


def _cpu_conv_backward_makes_weight_grad(node: torch.fx.Node) -> bool:
    def spec(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            t = a.meta["val"]
            return ("tensor", tuple(t.shape), tuple(t.stride()), t.dtype)
        return ("value", repr(a))

    key = (tuple(spec(a) for a in node.args), torch.get_num_threads())
    if key not in _CONV_PROBES:
        from torch.utils._mode_utils import no_dispatch

        def real(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                t = a.meta["val"]
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()
            return a

        with no_dispatch(), torch.no_grad():
            out = torch.ops.aten.convolution_backward.default(*[real(a) for a in node.args])
        _CONV_PROBES[key] = out[1] is not None
    return _CONV_PROBES[key]


def _key(node: torch.fx.Node, index: int, vals: list) -> str:
    return node.name if not isinstance(node.meta.get("val"), (list, tuple)) else f"{node.name}#{index}"


def analyze(tg: TrainGraph, gm: torch.fx.GraphModule | None = None, phase: dict[str, Phase] | None = None) -> GraphAnalysis:
    """Storages, roles and liveness of `gm` (default: the captured graph).

    A rewritten graph passes its own `phase` map (copies of forward ops placed in the
    backward pass are backward nodes) and must carry fresh fake values in meta["val"].
    The captured graph's are read in `tg.order` and with `tg.lean_into`, where set.
    """
    phase = phase if phase is not None else tg.phase
    reordered = gm is None and tg.order is not None  # inputs first, then the ops in tg.order, then the output
    gm = gm if gm is not None else tg.gm
    nodes = list(gm.graph.nodes)
    op_nodes = tg.op_nodes() if reordered else [n for n in nodes if n.op == "call_function"]
    if reordered:
        nodes = [n for n in nodes if n.op in ("placeholder", "get_attr")] + op_nodes + [n for n in nodes if n.op == "output"]
    rank = {n.name: i for i, n in enumerate(op_nodes)}
    lean = _lean_storages(tg) if gm is tg.gm else {}

    tensors: list[TensorInfo] = []
    by_ref: dict[StorageWeakRef, int] = {}
    node_storages: dict[str, list[int]] = {}
    undefined: set[StorageWeakRef] = set()  # fake outputs the real kernel does not make
    held: list[list] = []
    placeholder_index = 0

    def storage_id(t: torch.Tensor, node: torch.fx.Node, created: int, role: Role, persistent: bool, key: str) -> int:
        ref = StorageWeakRef(t.untyped_storage())
        ref = lean.get(ref, ref)
        sid = by_ref.get(ref)
        if sid is None:
            sid = len(tensors)
            by_ref[ref] = sid
            tensors.append(
                TensorInfo(id=sid, node=node.name, key=key, nbytes=_storage_nbytes(node, t), role=role, created=created, last_use=created, persistent=persistent)
            )
        tensors[sid].aliases.append(node.name)
        return sid

    for node in nodes:
        if node.op == "placeholder":
            kind = tg.inputs[placeholder_index].kind
            placeholder_index += 1
            t = node.meta["val"]
            node_storages[node.name] = [storage_id(t, node, -1, _INPUT_ROLE[kind], True, node.name)]
        elif node.op == "get_attr":
            t = getattr(gm, str(node.target))
            vals = _tensors_in(node.meta.get("val", t))
            node_storages[node.name] = [
                storage_id(v, node, -1, Role.OTHER, True, _key(node, i, vals)) for i, v in enumerate(vals) if v is not None
            ]
        elif node.op == "call_function":
            vals = _tensors_in(node.meta.get("val"))
            if aliases_its_input(node):  # a collective's wait returns the tensor it was given
                vals = _tensors_in(node.args[0].meta.get("val"))
            for i in _masked_outputs(node):
                if i < len(vals) and vals[i] is not None:
                    undefined.add(StorageWeakRef(vals[i].untyped_storage()))
            if undefined:  # the masked outputs and the getitems that read them hold nothing
                vals = [None if v is not None and StorageWeakRef(v.untyped_storage()) in undefined else v for v in vals]
            vals = _unmasked_by_the_kernel(node, vals)
            held.append(vals)  # storages are told apart by identity: keep stand-ins alive meanwhile
            node_storages[node.name] = [
                storage_id(v, node, rank[node.name], Role.OTHER, False, _key(node, i, vals))
                for i, v in enumerate(vals)
                if v is not None
            ]
    analysis = _with_lifetimes(tg, tensors, node_storages, op_nodes, next(n for n in nodes if n.op == "output"), phase)
    analysis.held_while_running = {
        n.name: rng_replay.held_bytes(n.args[1]) for n in op_nodes if isinstance(n.target, rng_replay.Replay)
    }
    return analysis


def reordered_analysis(tg: TrainGraph, analysis: GraphAnalysis) -> GraphAnalysis:
    """The analysis of `tg`, a reordering (`tg.order`) of the graph `analysis` is of, from that
    one's storages: which storage each node's value lives in does not depend on the order,
    only their numbering (by first holder) and their lifetimes do. Each storage's first
    holder is the op that makes it in every order (any other value on it is read from it,
    directly or not), so its numbering is `analyze`'s of the reordered graph."""
    nodes = list(tg.gm.graph.nodes)
    op_nodes = tg.op_nodes()
    rank = {n.name: i for i, n in enumerate(op_nodes)}
    holders = [n for n in nodes if n.op in ("placeholder", "get_attr")] + op_nodes
    old = analysis.tensors
    renumber: dict[int, int] = {}
    tensors: list[TensorInfo] = []
    for node in holders:
        for s in analysis.node_storages[node.name]:
            sid = renumber.get(s)
            if sid is None:
                t = old[s]
                assert t.node == node.name, f"{t.key} is first held by {node.name} in the new order"
                sid = renumber[s] = len(tensors)
                created = rank[node.name] if t.created >= 0 else -1
                tensors.append(dataclasses.replace(t, id=sid, created=created, last_use=created, last_forward_use=None, first_backward_use=None, aliases=[]))
            tensors[sid].aliases.append(node.name)
    node_storages = {node.name: [renumber[s] for s in analysis.node_storages[node.name]] for node in holders}
    return _with_lifetimes(tg, tensors, node_storages, op_nodes, next(n for n in nodes if n.op == "output"), tg.phase)


def _with_lifetimes(
    tg: TrainGraph,
    tensors: list[TensorInfo],
    node_storages: dict[str, list[int]],
    op_nodes: list[torch.fx.Node],
    output_node: torch.fx.Node,
    phase: dict[str, Phase],
) -> GraphAnalysis:
    """The analysis of the op nodes in the order given, from the storage each value lives in:
    when each storage is made, read and freed, and its role."""
    end = len(op_nodes)
    new_storages: list[list[int]] = [[] for _ in op_nodes]
    for t in tensors:
        if t.persistent:
            t.last_use = end
        elif t.created >= 0:
            new_storages[t.created].append(t.id)
    uses: list[list[int]] = [[] for _ in op_nodes]
    phases = [phase[n.name] for n in op_nodes]
    made_in_forward = [t.created >= 0 and phases[t.created] is Phase.FORWARD for t in tensors]
    for r, node in enumerate(op_nodes):
        seen: set[int] = set()
        for inp in node.all_input_nodes:
            for sid in node_storages.get(inp.name, ()):
                if sid not in seen:
                    seen.add(sid)
                    uses[r].append(sid)
        for sid in node_storages[node.name]:
            # A value with no readers is dropped right after its node; one already
            # alive (an in-place result, a view) keeps its own creation.
            t = tensors[sid]
            t.last_use = max(t.last_use, r)
        in_forward = phases[r] is Phase.FORWARD
        for sid in seen:
            t = tensors[sid]
            t.last_use = max(t.last_use, r)
            if made_in_forward[sid]:
                if in_forward:
                    t.last_forward_use = r if t.last_forward_use is None else max(t.last_forward_use, r)
                elif t.first_backward_use is None:
                    # First read after the forward pass: in the backward, or later (the
                    # optimizer phase, a returned value such as detached logits).
                    t.first_backward_use = r

    output_storages = {sid for inp in output_node.all_input_nodes for sid in node_storages.get(inp.name, [])}
    for sid in output_storages:
        tensors[sid].last_use = end
    _assign_roles(tg, tensors, op_nodes, node_storages, output_node, phase)
    return GraphAnalysis(
        node_names=[n.name for n in op_nodes],
        phases=phases,
        tensors=tensors,
        node_storages=node_storages,
        new_storages=new_storages,
        uses=uses,
        persistent_bytes=sum(persistent_by_role(tensors).values()),
        phase_bounds=_phase_bounds(phases),
    )


def round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity if granularity > 1 else nbytes


# The ops through which a tied weight's gradient sums its partial gradients (add.out: a
# lean variant writing the sum into a dying partial, see lean_ops).
_GRADIENT_SUMS = (torch.ops.aten.add.Tensor, torch.ops.aten.add.out, torch.ops.aten.detach.default)


def _assign_roles(
    tg: TrainGraph,
    tensors: list[TensorInfo],
    op_nodes: list[torch.fx.Node],
    node_storages: dict[str, list[int]],
    output_node: torch.fx.Node,
    phase: dict[str, Phase],
) -> None:
    """Gradient, activation or other, for every storage that is not persistent."""
    _, grad_outputs = output_node.args[0]  # see TrainGraph: (step outputs, grads)
    grad_output_storages = {sid for g in grad_outputs for sid in node_storages.get(g.name, [])}

    grad_storages = {sid for name in tg.grad_nodes.values() if name in node_storages for sid in node_storages[name]}
    # A tied weight's gradient is the sum of partial gradients (one per use): those are
    # gradients too, not temporaries, though they live long before the sum is made.
    by_name = {n.name: n for n in op_nodes}
    todo = [by_name[n] for n in tg.grad_nodes.values() if n in by_name]
    while todo:
        node = todo.pop()
        if node.target not in _GRADIENT_SUMS:
            continue
        for arg in node.all_input_nodes:
            if arg.name in by_name and phase[arg.name] is Phase.BACKWARD:
                grad_storages.update(node_storages[arg.name])
                todo.append(by_name[arg.name])
    for t in tensors:
        if t.persistent:
            continue
        created_phase = phase[op_nodes[t.created].name]
        if t.id in grad_storages or t.id in grad_output_storages:
            t.role = Role.GRADIENT
        elif created_phase is Phase.FORWARD and t.first_backward_use is not None:
            t.role = Role.ACTIVATION
            if t.last_forward_use is None:
                t.last_forward_use = t.created
        else:
            t.role = Role.OTHER


def _phase_bounds(phases: list[Phase]) -> dict[str, tuple[int, int]]:
    """Per phase: [first rank, last rank + 1) of its nodes."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, ph in enumerate(phases):
        first.setdefault(ph.value, i)
        last[ph.value] = i
    return {ph: (first[ph], last[ph] + 1) for ph in first}


def persistent_by_role(tensors: list, granularity: int = 1) -> dict[str, int]:
    """Bytes held before and after the step (parameters, buffers, optimizer state, inputs),
    by role: the one definition of persistent bytes (the analysis, the simulations and the bound use it)."""
    out: dict[str, int] = {}
    for t in tensors:
        if t.persistent:
            out[t.role.value] = out.get(t.role.value, 0) + round_up(t.nbytes, granularity)
    return out
