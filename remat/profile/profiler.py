"""Run-time profile of a captured training iteration: time and memory of every node.

The captured graph is run node by node, the way fx's generated code runs it (each value
dropped right after its last use), on *clones* of the parameters, buffers and optimizer
state, with the global RNG saved and restored: profiling must not train the user's
model, nor move the RNG stream that the user's next step will draw dropout masks from.

Per node: the median time over several runs after a warm-up (or, on request, pooled with
the same node's in the other repeats of a repeated block: profile.repeats), the bytes it allocated,
the bytes the step held after it and the most it held while it ran. The step's peak is
also measured on the compiled GraphModule itself (not the interpreter loop), and set
beside the simulator's prediction from the static analysis (DESIGN.md, "Memory:
simulate, then measure")."""

from __future__ import annotations

import bisect
import operator
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.fx
from torch.fx.node import map_arg

from remat.memory.analysis import ROLES, GraphAnalysis, Role, analyze
from remat.capture.step_inputs import flat_inputs
from remat.capture.train_graph import InputKind, TrainGraph
from remat.capture.cpu_strides import CORRECTED_STRIDES
from remat.errors import CaptureError, PlanError, RematError
from remat.profile.allocator import cpu_memory_events, cpu_memory_profile, measure_peak
from remat.progress import progress_bar
from remat.profile.repeats import find_repeats, pooled_medians
from remat.memory.simulator import Timeline, simulate

from remat.profile.profiles import PHASES, NodeProfile, Profile, TensorProfile, graph_fingerprint, target_name




_LABEL = "remat.node:"  # record_function label prefix of the memory run; index follows


_CUDA_GRANULARITY = 512  # the CUDA caching allocator rounds every block up to this




@dataclass
class _Step:
    node: torch.fx.Node
    free_after: list[torch.fx.Node]  # values whose last use is this node (codegen's `x = None`)


def _schedule(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], list[_Step], torch.fx.Node]:
    """Placeholders, the op steps with what each frees, and the output node.

    Mirrors fx codegen: a value is dropped right after its last user, and a value no one
    uses right after it is made.
    """
    nodes = list(gm.graph.nodes)
    last_user: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in reversed(nodes):
        for inp in node.all_input_nodes:
            last_user.setdefault(inp, node)
    frees: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value, user in last_user.items():
        frees.setdefault(user, []).append(value)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    steps: list[_Step] = []
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        free = list(frees.get(node, []))
        if node not in last_user:  # no users: dropped at once
            free.append(node)
        steps.append(_Step(node, free))
    return placeholders, steps, output


class _NodeRunner:
    """Runs the graph one node at a time; `hook(i, fn)` wraps the call of op node i."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.placeholders, self.steps, self.output = _schedule(gm)
        self.op_index = {}
        i = 0
        for s in self.steps:
            if s.node.op == "call_function":
                self.op_index[s.node] = i
                i += 1
        self.num_ops = i

    def run(self, inputs: list[torch.Tensor], hook: Callable[[int, Callable[[], Any]], Any], check_layout: bool = False) -> None:
        """One step, node by node. `check_layout`: refuse the graph at the first CPU op whose
        real output strides differ from the trace's (see `_check_layout`)."""
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, inputs))
        lookup = env.__getitem__
        for s in self.steps:
            node = s.node
            if node.op == "call_function":
                args = map_arg(node.args, lookup)
                kwargs = map_arg(node.kwargs, lookup)
                target = node.target
                env[node] = hook(self.op_index[node], lambda: target(*args, **kwargs))
                del args, kwargs
                if check_layout:
                    _check_layout(node, env[node])
            elif node.op == "get_attr":
                obj: Any = self.gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                env[node] = obj
            else:
                raise RematError(f"cannot profile graph node {node.name} of kind {node.op!r}")
            for dead in s.free_after:
                env.pop(dead, None)
        env.clear()


def _check_layout(node: torch.fx.Node, value: Any) -> None:
    """Refuse a CPU op whose real output has other strides than its fake one in the trace.

    The trace decides views, copies and reshapes from the fake strides; where a fake
    kernel predicts other strides than the real one (cpu_strides.CpuLikeEager corrects
    the ones known), the step would fail on real tensors or not match eager bitwise.
    Dimensions of size 1 have no meaningful stride and are ignored.
    """
    source = node.args[0] if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) else node
    if source.target in CORRECTED_STRIDES:  # its fake output is followed by the real strides' view
        return
    fake = node.meta.get("val")
    reals = value if isinstance(value, (list, tuple)) else [value]
    fakes = fake if isinstance(fake, (list, tuple)) else [fake]
    for real, f in zip(reals, fakes):
        if not isinstance(real, torch.Tensor) or not isinstance(f, torch.Tensor) or real.device.type != "cpu":
            continue
        if tuple(real.shape) != tuple(f.shape):
            continue
        if any(d > 1 and a != b for d, a, b in zip(real.shape, real.stride(), f.stride())):
            raise CaptureError(
                f"the captured step does not match the real kernels: {node.target} ({node.name}) makes a tensor of "
                f"shape {tuple(real.shape)} with strides {real.stride()} on the CPU, where PyTorch's fake kernel "
                f"predicted {f.stride()}, so the trace may hold views that fail or that do not match eager. Make the "
                "op's inputs contiguous (.contiguous()) in the model, and please report the op."
            )


def _time_run_cpu(runner: _NodeRunner, inputs: list[torch.Tensor], check_layout: bool = False) -> np.ndarray:
    times = np.zeros(runner.num_ops, dtype=np.float64)
    clock = time.perf_counter

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        t0 = clock()
        out = fn()
        times[i] = clock() - t0
        return out

    runner.run(inputs, hook, check_layout)
    return times


def _time_run_cuda(runner: _NodeRunner, inputs: list[torch.Tensor], device: torch.device) -> np.ndarray:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runner.num_ops)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runner.num_ops)]

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        starts[i].record()
        out = fn()
        ends[i].record()
        return out

    torch.cuda.synchronize(device)
    runner.run(inputs, hook)
    torch.cuda.synchronize(device)
    return np.array([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)], dtype=np.float64)


@dataclass
class _NodeMemory:
    allocated: np.ndarray
    live_after: np.ndarray
    peak: np.ndarray


def _memory_run_cpu(runner: _NodeRunner, inputs: list[torch.Tensor]) -> _NodeMemory:
    """One run under the profiler; each allocator event goes to the node last started.

    Frees of values past their last use happen between one node's range and the next
    one's start, so they count for the node that let them go.
    """
    from torch.profiler import record_function

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        with record_function(f"{_LABEL}{i}"):
            return fn()

    with cpu_memory_profile() as prof:
        runner.run(inputs, hook)
    n = runner.num_ops
    begin = np.full(n, -1, dtype=np.int64)
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name.startswith(_LABEL):
            begin[int(name[len(_LABEL):])] = e.start_ns()
    if (begin < 0).any():
        raise RematError("the profiler lost some node ranges; cannot attribute memory to nodes")
    order = np.argsort(begin, kind="stable")
    starts = begin[order].tolist()
    allocated = np.zeros(n, dtype=np.int64)
    live_after = np.zeros(n, dtype=np.int64)
    peak = np.zeros(n, dtype=np.int64)
    running = 0
    current = -1  # position in `order` of the node whose events we are reading
    for t, nbytes, live in cpu_memory_events(prof):
        pos = bisect.bisect_right(starts, t) - 1
        while current < pos:  # entering later nodes: they start from what is live now
            current += 1
            if current > 0:
                live_after[order[current - 1]] = running
            peak[order[current]] = running
        running = live
        if current >= 0:
            node = order[current]
            if nbytes > 0:
                allocated[node] += nbytes
            peak[node] = max(peak[node], running)
    while current < n - 1:
        current += 1
        if current > 0:
            live_after[order[current - 1]] = running
        peak[order[current]] = running
    if n:
        live_after[order[n - 1]] = running
    return _NodeMemory(allocated, live_after, peak)


def _memory_run_cuda(runner: _NodeRunner, inputs: list[torch.Tensor], device: torch.device) -> _NodeMemory:
    n = runner.num_ops
    allocated = np.zeros(n, dtype=np.int64)
    live_after = np.zeros(n, dtype=np.int64)
    peak = np.zeros(n, dtype=np.int64)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    pending: list[int] = []  # the node whose frees are still to be counted

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        if pending:
            live_after[pending.pop()] = torch.cuda.memory_allocated(device) - base
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        top = torch.cuda.max_memory_allocated(device)
        peak[i] = top - base
        # The allocator keeps no event log here: the most the node added at once
        # (outputs and scratch) stands for what it allocated.
        allocated[i] = max(top - before, 0)
        pending.append(i)
        return out

    runner.run(inputs, hook)
    torch.cuda.synchronize(device)
    if pending:
        live_after[pending.pop()] = torch.cuda.memory_allocated(device) - base
    return _NodeMemory(allocated, live_after, peak)


def _profiling_inputs(tg: TrainGraph, model: torch.nn.Module, optimizer: Any, batch: Any) -> list[torch.Tensor]:
    """Clones of everything the step may mutate (parameters, buffers, optimizer state, tensors
    outside the model such as an EMA copy); the batch as is."""
    real = flat_inputs(tg, model, optimizer, batch)
    out: list[torch.Tensor] = []
    for inp, t in zip(tg.inputs, real):
        if inp.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.OPTIMIZER_STATE, InputKind.OUTSIDE):
            out.append(t.detach().clone())
        else:
            out.append(t)
    return out


def _device_of(tg: TrainGraph, device: str | torch.device | None) -> torch.device:
    dev = torch.device(device if device is not None else tg.device)
    captured = torch.device(tg.device)
    if dev.type != captured.type or (dev.index is not None and captured.index is not None and dev.index != captured.index):
        raise RematError(
            f"the graph was captured on {tg.device} but profiling was asked on {dev}; "
            "move the model and batch there and capture again"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise RematError(f"cannot profile on {dev}: only cpu and cuda are supported")
    return dev


def profile(
    tg: TrainGraph,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    *,
    warmup: int = 1,
    runs: int = 3,
    device: str | torch.device | None = None,
    progress: bool = True,
    analysis: GraphAnalysis | None = None,
    pool_repeats: bool = False,
) -> Profile:
    """Profile the captured iteration on clones of the model's state.

    The repeated blocks (profile.repeats) are listed in `meta["repeats"]`. With
    `pool_repeats`, a node's time is the median of its samples and those of its
    counterparts in the other repeats of its block, not of its own samples alone: the
    repeats are priced alike, each estimate resting on runs x repeats samples. Not the
    default: the plans made from pooled times cost more, measured against held-out
    per-node times and against held-out pooled ones alike (benchmarks/repeat_pooling.py).

    Leaves `model`, `optimizer` and the global RNG (CPU and CUDA) exactly as it found them.
    """
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    dev = _device_of(tg, device)
    is_cuda = dev.type == "cuda"
    analysis = analysis if analysis is not None else analyze(tg)
    runner = _NodeRunner(tg.gm)
    if runner.num_ops != analysis.num_nodes:
        raise RematError(f"graph has {runner.num_ops} op nodes but its analysis {analysis.num_nodes}; analyse this graph")

    fork_devices = [dev.index] if is_cuda else []
    with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
        inputs = _profiling_inputs(tg, model, optimizer, batch)
        total = warmup + runs + 2
        times: list[np.ndarray] = []
        with progress_bar(progress, total, "warm-up" if warmup else "timing") as advance:
            for i in range(warmup + runs):
                t = _time_run_cuda(runner, inputs, dev) if is_cuda else _time_run_cpu(runner, inputs, check_layout=i == 0)
                if i >= warmup:
                    times.append(t)
                advance("timing" if i + 1 < warmup + runs else "memory per node")
            mem = _memory_run_cuda(runner, inputs, dev) if is_cuda else _memory_run_cpu(runner, inputs)
            advance("measured peak")
            measured = measure_peak(lambda: tg.gm(*inputs), dev)
            del measured.result
            advance("done")
        del inputs

    repeats = find_repeats(tg)
    seconds = pooled_medians(np.stack(times), repeats) if pool_repeats else np.median(np.stack(times), axis=0)
    timeline = simulate(analysis, granularity=_CUDA_GRANULARITY if is_cuda else 1)
    prof = _assemble(tg, analysis, timeline, seconds, mem, measured.peak_bytes, dev, warmup, runs)
    prof.meta["repeats"] = repeats.summary()
    prof.meta["pooled_repeats"] = pool_repeats
    return prof


def node_peaks(gm: torch.fx.GraphModule, tg: TrainGraph, model: torch.nn.Module, optimizer: Any, batch: Any) -> dict[str, int]:
    """One run of `gm` (a graph that runs `tg`'s step: a rewrite, compiled regions) on clones of
    the state, node by node: each op node's measured peak of step memory (bytes above the
    level before the step). Leaves the model, optimizer and RNG as it found them."""
    dev = torch.device(tg.device)
    runner = _NodeRunner(gm)
    with torch.random.fork_rng(devices=[dev.index] if dev.type == "cuda" else []), torch.no_grad():
        inputs = _profiling_inputs(tg, model, optimizer, batch)
        mem = _memory_run_cuda(runner, inputs, dev) if dev.type == "cuda" else _memory_run_cpu(runner, inputs)
        del inputs
    return {s.node.name: int(mem.peak[runner.op_index[s.node]]) for s in runner.steps if s.node.op == "call_function"}


def _assemble(
    tg: TrainGraph,
    analysis: GraphAnalysis,
    timeline: Timeline,
    seconds: np.ndarray,
    mem: _NodeMemory,
    measured_step_peak: int,
    dev: torch.device,
    warmup: int,
    runs: int,
) -> Profile:
    op_nodes = tg.op_nodes()
    nodes = [
        NodeProfile(
            name=n.name,
            target=target_name(n.target),
            phase=tg.phase[n.name].value,
            seconds=float(seconds[i]),
            allocated_bytes=int(mem.allocated[i]),
            live_bytes_after=int(mem.live_after[i]),
            peak_bytes=int(mem.peak[i]),
        )
        for i, n in enumerate(op_nodes)
    ]
    cum = np.concatenate([[0.0], np.cumsum(seconds)])
    tensors: list[TensorProfile] = []
    for t in analysis.tensors:
        inactive = None
        if t.role is Role.ACTIVATION and t.last_forward_use is not None and t.first_backward_use is not None:
            lo, hi = t.last_forward_use + 1, t.first_backward_use  # strictly between
            inactive = float(cum[hi] - cum[lo]) if hi > lo else 0.0
        tensors.append(
            TensorProfile(
                id=t.id,
                node=t.node,
                role=t.role.value,
                nbytes=int(t.nbytes),
                created=int(t.created),
                last_forward_use=t.last_forward_use,
                first_backward_use=t.first_backward_use,
                last_use=int(t.last_use),
                persistent=bool(t.persistent),
                inactive_seconds=inactive,
            )
        )
    phase_seconds = {p: 0.0 for p in PHASES}
    for node in nodes:
        phase_seconds[node.phase] += node.seconds
    persistent_by_role = {r.value: int(timeline.persistent_by_role.get(r.value, 0)) for r in ROLES}
    return Profile(
        device=str(dev),
        fingerprint=graph_fingerprint(tg),
        nodes=nodes,
        tensors=tensors,
        phase_bounds={k: (int(v[0]), int(v[1])) for k, v in analysis.phase_bounds.items()},
        phase_seconds=phase_seconds,
        iteration_seconds=float(seconds.sum()),
        persistent_by_role=persistent_by_role,
        persistent_bytes=int(timeline.persistent_bytes),
        simulated_peak_bytes=int(timeline.peak_bytes),
        simulated_step_peak_bytes=int(timeline.step_peak_bytes),
        peak_rank=int(timeline.peak_rank),
        peak_breakdown={k: int(v) for k, v in timeline.breakdown_at_peak().items()},
        measured_step_peak_bytes=int(measured_step_peak),
        measured_peak_bytes=int(timeline.persistent_bytes + measured_step_peak),
        timeline={k: [int(x) for x in v] for k, v in timeline.by_role.items()},
        warmup=warmup,
        runs=runs,
        meta={
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "has_optimizer": tg.has_optimizer,
        },
    )


def load_profile_for(path: str | Path, tg: Any, model: str, batch_size: int, optimizer: str) -> Any:
    """A saved profile, refused with a clear message if it is of another model, batch or graph."""
    prof = Profile.from_json(path)
    wanted = (model, batch_size, optimizer)
    found = (prof.model, prof.batch_size, prof.optimizer)
    for what, w, f in zip(("model", "batch size", "optimizer"), wanted, found):
        if f is not None and f != w:
            raise PlanError(
                f"{path} is a profile of {prof.model} with batch size {prof.batch_size} ({prof.optimizer}), "
                f"not of {model} with batch size {batch_size} ({optimizer}): its {what} differs. "
                "Profile this configuration (drop --profile) or pass its own profile.json."
            )
    try:
        prof.check_graph(tg)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    return prof
