"""Compiled regions: runs of the planned graph's ops compiled by Inductor, in the plan's order.

The graph a plan made (its order, its recompute copies, its frees) is cut into regions:
the longest runs of consecutive ops of one kind (forward, backward, update, or recompute
copies) that Inductor may take: tensor ops with no side effect (no in-place or out=
variants, no random draws, no collectives, no Python numbers out). Every other op runs as
before and ends a region. Each region becomes one call, where its ops were, of a function
Inductor compiled for it alone, so fusion stays inside the region: a recomputed op is never
fused with its original or moved next to it, and what runs between regions (replayed random
ops on eager's generator, in-place updates) keeps its place. A region takes its inputs boxed
(a list that Inductor's code empties and frees as it goes), so an input whose last use is in
the region is freed there rather than held to the region's end.

A view that leaves its region is made again, eagerly, right after the region's call, so that
it aliases what it aliased in the graph (a parameter's transpose read after its update).

Not bitwise: fused kernels round differently from eager's; `measurement.check` compares a
compiled step with eager under a tolerance.
"""

from __future__ import annotations

import functools
import operator
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from remat.capture.train_graph import Phase
from remat.ops import op_facts
from remat.passes.region_compiler import CompiledRegion, Region, inductor as _inductor

RECOMPUTE = "recompute"
MIN_OPS = 2  # a region of one op is left to eager: nothing to fuse, and a call's host cost to pay


@dataclass
class Regions:
    """What `compile_regions` made, kept on the compiled module as `gm.meta["regions"]`."""

    regions: list[Region] = field(default_factory=list)
    splits: int = 0  # regions split in two because the step's measured peak was in them, over the bound
    slower: int = 0  # regions left to run op by op because, compiled, they took longer (timed)
    measured_peak_bytes: int | None = None  # the step's, above the level before it, where measured

    @property
    def ops(self) -> int:
        return sum(len(r.ops) for r in self.regions)


def node_kinds(gm: torch.fx.GraphModule, phase: dict[str, Phase], copies: set[str]) -> dict[str, str]:
    """Each call_function node's kind: RECOMPUTE for a copy, else its phase (a node of no phase,
    added by a pass, is of the kind of the ops after it, as the rewriter does)."""
    kinds: dict[str, str] = {}
    following = Phase.OPTIMIZER.value
    for node in reversed([n for n in gm.graph.nodes if n.op == "call_function"]):
        if node.name in copies:
            kinds[node.name] = RECOMPUTE
        elif node.name in phase:
            kinds[node.name] = following = Phase(phase[node.name]).value
        else:
            kinds[node.name] = following
    return kinds


def _tensor_value(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


# BatchNorm in training mode writes its running statistics in place. In a region it runs as
# its functional form, which returns the new statistics, copied into the buffers right after
# the region (nothing in between reads them: a buffer read by any other op keeps it eager).
_BATCH_NORMS = (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default)
_RUNNING_STATS = (3, 4)  # running_mean, running_var


def _functional_batch_norm(node: torch.fx.Node, kinds: dict[str, str]) -> bool:
    """A BatchNorm whose statistics nothing else of its kind reads (its backward reads them,
    unused in training, in another region: after the copy)."""
    if node.target not in _BATCH_NORMS:
        return False
    stats = [node.args[i] for i in _RUNNING_STATS]
    others = [u for s in stats if isinstance(s, torch.fx.Node) for u in s.users if u is not node]
    return all(isinstance(s, torch.fx.Node) for s in stats) and all(kinds.get(u.name) != kinds[node.name] for u in others)


@functools.lru_cache(maxsize=None)
def functional_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of an out= op that returns its result instead (threshold_backward.grad_input:
    threshold_backward.default), or None."""
    wanted = [(a.name, str(a.type)) for a in target._schema.arguments if not a.is_out]
    for name in target.overloadpacket.overloads():
        op = getattr(target.overloadpacket, name)
        if not op._schema.is_mutable and [(a.name, str(a.type)) for a in op._schema.arguments] == wanted:
            return op
    return None


@functools.lru_cache(maxsize=None)
def _out_of_place(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """add_.Tensor's add.Tensor: the same op returning a new tensor, or None."""
    name = target.overloadpacket.__name__
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    op = getattr(packet, target._overloadname, None) if packet is not None else None
    return op if op is not None and not op._schema.is_mutable else None


def _private_in_place(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place form of an in-place op on an activation nothing else reads (a residual's
    `out += identity`, an in-place ReLU): in a region, nothing can tell the two apart."""
    written = op_facts.written_args(node)
    if len(written) != 1 or not node.args or written[0] is not node.args[0]:
        return None
    w = written[0]
    made_by = w.args[0] if op_facts.is_getitem(w) else w
    if made_by.op != "call_function" or not isinstance(made_by.target, torch._ops.OpOverload) or _is_view(made_by):
        return None
    # Made fresh, or by an in-place op on such an activation (`relu_` after `+=`); never an
    # in-place result on another tensor's storage (a momentum buffer's).
    fresh = not made_by.target._schema.is_mutable or _private_in_place(made_by) is not None
    return _out_of_place(node.target) if fresh and set(w.users) == {node} else None


def _out_names(node: torch.fx.Node) -> list[str]:
    """The names of the out= arguments this call passes (a lean variant writing into a dying input)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [a.name for a in node.target._schema.arguments if a.is_out and a.name in node.kwargs]


def compilable(node: torch.fx.Node, kinds: dict[str, str]) -> bool:
    """Whether Inductor may take this op into a region: an aten op on tensors with no side
    effect, one whose side effect is its running statistics (a BatchNorm), or an out= call
    that has a functional form (a lean variant: in a region, Inductor places the buffers)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not all(_tensor_value(a) for a in node.all_input_nodes):
        # A Python number made at run time (an update's bias correction from its step count):
        # a region traced with it would keep the first value as a constant.
        return False
    if _out_names(node):
        return target.namespace == "aten" and functional_overload(target) is not None and not op_facts.is_random(node)
    if target._schema.is_mutable and target.namespace == "aten" and not op_facts.is_random(node) and _private_in_place(node) is not None:
        return True
    side_effect = op_facts.written_args(node) and not _functional_batch_norm(node, kinds)
    if target.namespace != "aten" or target._schema.is_mutable or op_facts.is_random(node) or side_effect:
        return False
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # a tuple (some None: outputs not asked for) read by getitem
        return all(v is None or isinstance(v, torch.Tensor) for v in val) and all(op_facts.is_getitem(u) for u in node.users)
    return isinstance(val, torch.Tensor) and val.device.type in ("cpu", "cuda")


def _written_by_out_calls(gm: torch.fx.GraphModule, compiled: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The values an out= call writes into (lean variants), with the op that made each. They
    stay eager's: the out= call was planned for the layout eager's kernel gives, and a buffer
    of another layout (Inductor's) would make the kernel allocate a new one."""
    written: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node in compiled:  # in a region: its functional form, which writes into nothing
            continue
        for name in _out_names(node):
            out = node.kwargs[name]
            if isinstance(out, torch.fx.Node):
                base = op_facts.viewed_base(out)
                written.add(base)
                if op_facts.is_getitem(base):
                    written.add(base.args[0])
    return written


@dataclass
class _Run:
    nodes: list[torch.fx.Node] = field(default_factory=list)
    # Ops that read nothing the region makes and that nothing else depends on in order: an
    # in-place op on a buffer nothing else reads (BatchNorm's batch count), arithmetic on
    # Python numbers (an update's step size). Run just before the region, they do not cut it.
    hoisted: list[torch.fx.Node] = field(default_factory=list)

    def compiles(self) -> bool:
        return sum(1 for n in self.nodes if not op_facts.is_getitem(n) and not _is_view(n)) >= MIN_OPS


def _hoistable(node: torch.fx.Node, members: set[torch.fx.Node]) -> bool:
    if any(a in members for a in node.all_input_nodes) or op_facts.is_random(node):
        return False
    written = op_facts.written_args(node)
    if written:
        return all(a.op == "placeholder" for a in node.all_input_nodes) and all(len(w.users) == 1 for w in written)
    if isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        return False
    if isinstance(node.target, torch._ops.OpOverload):  # a tensor's number (_local_scalar_dense)
        return not node.target._schema.is_mutable
    return getattr(node.target, "__module__", None) in ("_operator", "math", "builtins")  # Python arithmetic


def _runs(gm: torch.fx.GraphModule, kinds: dict[str, str], starts: set[str], eager: set[str]) -> list[_Run]:
    """The regions, none holding an op named in `eager`: cut, then cut again while an out=
    call left outside every region writes into a value a region would make (that value
    must then be eager's)."""
    eager_made = {n for n in gm.graph.nodes if n.name in eager}
    while True:
        runs = _cut(gm, kinds, starts, eager_made)
        more = _written_by_out_calls(gm, {n for r in runs for n in r.nodes}) - eager_made
        if not more:
            return runs
        eager_made |= more


def _cut(gm: torch.fx.GraphModule, kinds: dict[str, str], starts: set[str], eager_made: set[torch.fx.Node]) -> list[_Run]:
    runs: list[_Run] = []
    run, members = _Run(), set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        joins = node not in eager_made and (
            compilable(node, kinds) or (op_facts.is_getitem(node) and node.args[0] in members and _tensor_value(node))
        )
        if joins and run.nodes and (kinds[node.name] != kinds[run.nodes[0].name] or node.name in starts) and not op_facts.is_getitem(node):
            runs.append(run)
            run, members = _Run(), set()
        if joins:
            run.nodes.append(node)
            members.add(node)
        elif run.nodes and _hoistable(node, members):
            run.hoisted.append(node)
        elif run.nodes:
            runs.append(run)
            run, members = _Run(), set()
    runs.append(run)
    return [r for r in runs if r.compiles()]


def _is_view(node: torch.fx.Node) -> bool:
    return op_facts._returns_view(node.target)


def _box(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The inputs of a region in a list the region empties (its own reference is the only one)."""
    return list(tensors)


def _nodes_in(args: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


@dataclass
class _RegionGraph:
    module: torch.fx.GraphModule
    inputs: list[torch.fx.Node]  # the outer graph's values it reads
    outputs: list[torch.fx.Node]  # the outer graph's values it makes, its first outputs
    views: list[torch.fx.Node]  # views of them read outside, made again after the region
    writes: list[tuple[torch.fx.Node, int]]  # (buffer, output position): copied into the buffer after the region


# Inside a region a view is a value (nothing in it writes in place), so it may copy: a
# decomposition can lay a tensor out otherwise than eager's kernel did (a cat with a legacy
# empty tensor keeps its other input's transposed strides), and the captured view of it is
# then impossible. A view that leaves the region is made again from its base, eagerly.
_VIEWS_AS_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _region_module(owner: torch.fx.GraphModule, run: list[torch.fx.Node]) -> _RegionGraph:
    """The run as a graph of its own."""
    inside = set(run)
    escaping_views = [n for n in run if _is_view(n) and any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.fx.Node] = []

    def read(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            env[n] = graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
            inputs.append(n)
        return env[n]

    new_stats: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (buffer, its new value in the region)
    for node in run:
        outs = _out_names(node)
        kwargs = {k: v for k, v in node.kwargs.items() if k not in outs}
        for a in _nodes_in((node.args, kwargs)):
            if a not in inside:
                read(a)
        if outs:  # a lean variant: its functional form
            env[node] = graph.create_node(
                "call_function", functional_overload(node.target), *torch.fx.node.map_arg((node.args, kwargs), lambda a: env[a]), name=node.name
            )
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
            if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
                env[node].target = _private_in_place(node)  # an in-place op on a private activation
                continue
            if node.target in _VIEWS_AS_RESHAPES:
                env[node].target = torch.ops.aten.reshape.default
        if not outs and op_facts.written_args(node):  # a BatchNorm: its functional form (compilable says which)
            env[node].target = torch.ops.aten._native_batch_norm_legit_functional.default
            for k, i in enumerate(_RUNNING_STATS):
                new_stats.append((node.args[i], graph.call_function(operator.getitem, (env[node], 3 + k))))
    outputs: list[torch.fx.Node] = []
    for node in run:
        needed = [u for u in node.users if u not in inside] if node not in escaping_views else []
        needed_by_views = any(v.args[0] is node for v in escaping_views)
        if (needed or needed_by_views) and node not in escaping_views and node not in outputs:
            outputs.append(node)
    graph.output(tuple(env[o] for o in outputs) + tuple(new for _, new in new_stats))
    writes = [(buffer, len(outputs) + k) for k, (buffer, _) in enumerate(new_stats)]
    return _RegionGraph(torch.fx.GraphModule(owner, graph), inputs, outputs, escaping_views, writes)


def _call(compiled: CompiledRegion, name: str) -> Callable[[list[torch.Tensor]], Any]:
    def region(args: list[torch.Tensor]) -> Any:  # fx's code calls functions
        return compiled(args)

    region.__name__ = region.__qualname__ = name
    return region


def compile_regions(
    gm: torch.fx.GraphModule,
    kinds: dict[str, str],
    starts: set[str] = frozenset(),
    compiler: Callable[..., Any] = _inductor,
    compiled: dict[tuple[str, ...], CompiledRegion] | None = None,
    eager: set[str] = frozenset(),
) -> torch.fx.GraphModule:
    """A new module that runs `gm` with its regions compiled (`gm` is left as it was); a
    region never runs across an op named in `starts` nor holds one named in `eager`. Each
    region compiles at its first call; `compiled` (by the region's ops) keeps them for a
    later cut of the same graph."""
    runs = _runs(gm, kinds, starts, eager)
    compiled = {} if compiled is None else compiled
    first_of = {run.nodes[0]: i for i, run in enumerate(runs)}
    in_run = {n: i for i, run in enumerate(runs) for n in run.nodes + run.hoisted}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    made = Regions()
    for node in gm.graph.nodes:
        if node in in_run and node not in first_of:
            continue
        if node not in first_of:
            env[node] = graph.node_copy(node, lambda a: env[a])
            continue
        i = first_of[node]
        run = runs[i]
        for op in run.hoisted:
            env[op] = graph.node_copy(op, lambda a: env[a])
        region = _region_module(gm, run.nodes)
        name = f"region_{i}_{kinds[run.nodes[0].name]}"
        key = tuple(n.name for n in run.nodes)
        if key not in compiled:
            compiled[key] = CompiledRegion(region.module, compiler, Region(name, kinds[node.name], list(key)))
        box = graph.call_function(_box, tuple(env[a] for a in region.inputs), name=name + "_inputs")
        call = graph.call_function(_call(compiled[key], name), (box,), name=name)
        compiled[key].region.name = call.name
        made.regions.append(compiled[key].region)
        for j, out in enumerate(region.outputs):
            env[out] = graph.call_function(operator.getitem, (call, j), name=out.name)
            env[out].meta = dict(out.meta)
        for view in region.views:
            env[view] = graph.node_copy(view, lambda a: env[a])
        for buffer, j in region.writes:
            graph.call_function(torch.ops.aten.copy_.default, (env[buffer], graph.call_function(operator.getitem, (call, j))))
    new = torch.fx.GraphModule(gm, graph)
    new.meta["regions"] = made
    return new


BACKENDS = ("eager", "inductor")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        from remat.errors import RematError

        raise RematError(f"backend {backend!r} is not one remat runs: pick one of {', '.join(map(repr, BACKENDS))}")


MAX_SPLITS = 16


def for_backend(
    backend: str,
    gm: torch.fx.GraphModule,
    phase: dict[str, Phase],
    *,
    bound_bytes: int | None = None,
    node_peaks: Callable[[torch.fx.GraphModule], dict[str, int]] | None = None,
    node_seconds: Callable[[torch.fx.GraphModule], dict[str, float]] | None = None,
    progress: bool = False,
    compiler: Callable[..., Any] | None = None,
) -> torch.fx.GraphModule:
    """The module that runs `gm` on `backend`: `gm` itself on eager; on Inductor, `gm` with its
    regions compiled. Given `node_peaks` (a measured run: each node's peak of step memory),
    a region whose measured peak is over `bound_bytes` is split in two and the step compiled
    again, until the step's peak is within the bound or the region holding it is too small
    to compile (its ops then run eagerly, as planned). Given `node_seconds` (a timed run:
    each node's seconds), a region that took at least as long compiled as its ops one by one
    in `gm` runs them one by one (on a CPU, Inductor calls the same library kernels for
    convolutions and matrix products, and a region of a few small ops costs its call).
    `compiler(region_module, input_nodes)` returns a function of the boxed inputs
    (`_inductor` by default)."""
    if backend == "eager":
        return gm
    from remat.passes.rewriter import RECOMPUTED_SUFFIX

    kinds = node_kinds(gm, phase, {n.name for n in gm.graph.nodes if n.name.endswith(RECOMPUTED_SUFFIX)})
    made_before: dict[tuple[str, ...], CompiledRegion] = {}

    def cut(starts: set[str], eager: set[str]) -> torch.fx.GraphModule:
        return compile_regions(gm, kinds, starts, compiler=compiler or _inductor, compiled=made_before, eager=eager)

    starts: set[str] = set()
    compiled = _fit(cut, starts, gm, bound_bytes, node_peaks, progress)
    if node_seconds is None:
        return compiled
    slower = _slower_regions(compiled, node_seconds(compiled), node_seconds(gm))
    if not slower:
        return compiled
    if progress:
        print(f"remat: {len(slower)} regions ran slower compiled than op by op: they run op by op", file=sys.stderr, flush=True)
    kept = cut(starts, {op for region in slower for op in region.ops})
    made: Regions = kept.meta["regions"]
    made.splits, made.slower = len(starts), len(slower)
    if node_peaks is not None:  # op by op as planned, the peak can only fall: measured for the report
        made.measured_peak_bytes = max(node_peaks(kept).values(), default=0)
    return kept


def _fit(
    cut: Callable[[set[str], set[str]], torch.fx.GraphModule],
    starts: set[str],
    gm: torch.fx.GraphModule,
    bound_bytes: int | None,
    node_peaks: Callable[[torch.fx.GraphModule], dict[str, int]] | None,
    progress: bool,
) -> torch.fx.GraphModule:
    """The regions, each split (its middle op added to `starts`) while the step's measured
    peak is inside it and over `bound_bytes`."""
    while True:
        compiled = cut(starts, set())
        made: Regions = compiled.meta["regions"]
        made.splits = len(starts)
        if node_peaks is None:
            return compiled
        if progress:
            print(f"remat: compiling {len(made.regions)} regions with Inductor ...", file=sys.stderr, flush=True)
        node_peaks(compiled)  # the first run compiles the new regions: measured in the next
        peaks = node_peaks(compiled)
        at = max(peaks, key=peaks.__getitem__)
        made.measured_peak_bytes = peaks[at]
        region = next((r for r in made.regions if r.name == at), None)
        if bound_bytes is None or peaks[at] <= bound_bytes or region is None or len(starts) >= MAX_SPLITS:
            return compiled
        nodes = {n.name: n for n in gm.graph.nodes}
        ops = [n for n in region.ops if not op_facts.is_getitem(nodes[n])]
        starts.add(ops[len(ops) // 2])


def _slower_regions(compiled: torch.fx.GraphModule, compiled_seconds: dict[str, float], op_seconds: dict[str, float]) -> list[Region]:
    """The regions whose call (with the boxing of its inputs) took at least as long as their
    ops one by one."""
    calls = {n.name: n for n in compiled.graph.nodes if n.op == "call_function"}
    slower = []
    for region in compiled.meta["regions"].regions:
        call = calls[region.name]
        box = call.args[0].name if isinstance(call.args[0], torch.fx.Node) else None
        seconds = compiled_seconds[region.name] + compiled_seconds.get(box, 0.0)
        if seconds >= sum(op_seconds.get(op, 0.0) for op in region.ops):
            slower.append(region)
    return slower
