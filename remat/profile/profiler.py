"""Run-time profile of a captured training iteration: time and memory of every node.

The captured graph is run node by node, the way fx's generated code runs it (each value
dropped right after its last use), on *clones* of the parameters, buffers and optimizer
state, with the global RNG saved and restored: profiling must not train the user's
model, nor move the RNG stream that the user's next step will draw dropout masks from.

Per node: the median time over several runs after a warm-up (or, on request, pooled with
the same node's in the other repeats of a repeated block: profile.repeats), scaled so that
the nodes add up to the median run (time_model.scaled_to_runs); the bytes it allocated,
the bytes the step held after it and the most it held while it ran. The step's peak is
also measured on the compiled GraphModule itself (not the interpreter loop), and set
beside the simulator's prediction from the static analysis (DESIGN.md, "Memory:
simulate, then measure")."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.fx

from remat.memory.analysis import ROLES, GraphAnalysis, Role, analyze
from remat.capture.step_inputs import flat_inputs
from remat.capture.train_graph import InputKind, TrainGraph
from remat.errors import PlanError, RematError
from remat.ops import value_checks
from remat.ops.rng_replay import generators_kept
from remat.profile.node_runner import NodeRunner, time_run_cpu, time_run_cuda, time_whole_runs
from remat.profile.time_model import OpCosts, first_touch_seconds_per_byte, line_seconds, scaled_to_runs, synchronous
from remat.profile.allocator import cpu_memory_events, cpu_memory_profile, measure_peak
from remat.progress import progress_bar
from remat.profile.repeats import find_repeats, pooled_medians
from remat.memory.simulator import Timeline, simulate

from remat.profile.profiles import PHASES, NodeProfile, Profile, TensorProfile, graph_fingerprint, target_name




_LABEL = "remat.node:"  # record_function label prefix of the memory run; index follows


_CUDA_GRANULARITY = 512  # the CUDA caching allocator rounds every block up to this




@dataclass
class _NodeMemory:
    allocated: np.ndarray
    live_after: np.ndarray
    peak: np.ndarray


def _memory_run_cpu(runner: NodeRunner, inputs: list[torch.Tensor]) -> _NodeMemory:
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


def _memory_run_cuda(runner: NodeRunner, inputs: list[torch.Tensor], device: torch.device) -> _NodeMemory:
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
    """Clones of everything the step may mutate (parameters, buffers, optimizer state, the
    gradients it adds to, tensors outside the model such as an EMA copy); the batch as is."""
    real = flat_inputs(tg, model, optimizer, batch)
    out: list[torch.Tensor] = []
    for inp, t in zip(tg.inputs, real):
        if inp.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.OPTIMIZER_STATE, InputKind.GRADIENT, InputKind.OUTSIDE):
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
    runner = NodeRunner(tg.gm)
    if runner.num_ops != analysis.num_nodes:
        raise RematError(f"graph has {runner.num_ops} op nodes but its analysis {analysis.num_nodes}; analyse this graph")

    with generators_kept(tg.gm, dev), torch.no_grad(), value_checks.unchecked():
        inputs = _profiling_inputs(tg, model, optimizer, batch)
        total = warmup + runs + 2
        times: list[np.ndarray] = []
        host_times: list[np.ndarray] = []  # CUDA: each op's issuing on the host
        with progress_bar(progress, total, "warm-up" if warmup else "timing") as bar:
            for i in range(warmup + runs):
                t, host = time_run_cuda(runner, inputs, dev) if is_cuda else (time_run_cpu(runner, inputs, check_layout=i == 0), None)
                if i >= warmup:
                    times.append(t)
                    if host is not None:
                        host_times.append(host)
                bar.advance("timing" if i + 1 < warmup + runs else "memory per node")
            mem = _memory_run_cuda(runner, inputs, dev) if is_cuda else _memory_run_cpu(runner, inputs)
            bar.advance("measured peak")
            measured = measure_peak(lambda: tg.gm(*inputs), dev)
            del measured.result
            bar.advance("done")
        del inputs

    repeats = find_repeats(tg)
    samples = np.stack(times)
    seconds = scaled_to_runs(samples, pooled_medians(samples, repeats) if pool_repeats else None)
    timeline = simulate(analysis, granularity=_CUDA_GRANULARITY if is_cuda else 1)
    prof = _assemble(tg, analysis, timeline, seconds, mem, measured.peak_bytes, dev, warmup, runs)
    _with_largest_scratch(prof, tg, timeline, dev)
    if host_times:
        for node, host in zip(prof.nodes, np.median(np.stack(host_times), axis=0)):
            node.host_seconds = float(host)
    prof.line_seconds = line_seconds(str(dev))
    prof.first_touch_seconds_per_byte = first_touch_seconds_per_byte(str(dev))
    prof.meta["repeats"] = repeats.summary()
    prof.meta["pooled_repeats"] = pool_repeats
    return prof


# Kernels whose scratch depends on their input's values, not only on its shape, each with
# an input of a given shape, dtype and device that takes its largest: matrix_exp holds more
# matrix powers the higher the Taylor degree its input's norm calls for (on a CPU, 64 x 64:
# 80 KiB at a norm near 0, 192 KiB from a norm of 3 on).
_SCRATCH_BY_VALUE: dict[Any, Callable[[Any], torch.Tensor]] = {
    torch.ops.aten.linalg_matrix_exp.default: lambda val: torch.full(val.shape, 4.0, dtype=val.dtype, device=val.device),
}


def _with_largest_scratch(prof: Profile, tg: TrainGraph, timeline: Timeline, dev: torch.device) -> None:
    """Each node of such a kernel given at least its largest scratch (the scratch of its op
    run alone on the input that takes it), so that a prediction made while the values are
    small holds when they grow; the step measured before they do may peak below it."""
    for i, node in enumerate(tg.op_nodes()):
        make_input = _SCRATCH_BY_VALUE.get(node.target)
        if make_input is None:
            continue
        val = node.args[0].meta["val"]
        x = make_input(torch.empty(val.shape, dtype=val.dtype, device=dev))
        alone = measure_peak(lambda: node.target(x), dev)
        out_bytes = alone.result.numel() * alone.result.element_size()
        del alone.result
        largest = int(timeline.during[i]) + max(0, alone.peak_bytes - out_bytes)
        prof.nodes[i].peak_bytes = max(prof.nodes[i].peak_bytes, largest)


def node_peaks(gm: torch.fx.GraphModule, tg: TrainGraph, model: torch.nn.Module, optimizer: Any, batch: Any) -> dict[str, int]:
    """One run of `gm` (a graph that runs `tg`'s step: a rewrite, compiled regions) on clones of
    the state, node by node: each op node's measured peak of step memory (bytes above the
    level before the step). Leaves the model, optimizer and RNG as it found them."""
    dev = torch.device(tg.device)
    runner = NodeRunner(gm)
    with generators_kept(gm, dev), torch.no_grad(), value_checks.unchecked():
        inputs = _profiling_inputs(tg, model, optimizer, batch)
        mem = _memory_run_cuda(runner, inputs, dev) if dev.type == "cuda" else _memory_run_cpu(runner, inputs)
        del inputs
    return {s.node.name: int(mem.peak[runner.op_index[s.node]]) for s in runner.steps if s.node.op == "call_function"}


def node_costs(gm: torch.fx.GraphModule, tg: TrainGraph, model: torch.nn.Module, optimizer: Any, batch: Any, runs: int = 3) -> OpCosts:
    """Each op node's host and device cost in `gm` (a graph that runs `tg`'s step: compiled
    regions), timed in `gm`'s own code (node_runner.time_whole_runs) over `runs` runs on
    clones of the state after one warm-up. Leaves the model, optimizer and RNG as it found them."""
    dev = torch.device(tg.device)
    with generators_kept(gm, dev), torch.no_grad(), value_checks.unchecked():
        inputs = _profiling_inputs(tg, model, optimizer, batch)
        device_runs, host_runs = time_whole_runs(gm, inputs, runs + 1, dev)
        del inputs
    line = line_seconds(str(dev))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    device, host = scaled_to_runs(device_runs[1:]), np.median(host_runs[1:], axis=0)
    on_host = dev.type == "cuda"  # a CPU's op time is its issuing: host cost is the line alone
    return OpCosts(
        host={n: line + (float(host[i]) if on_host else 0.0) for i, n in enumerate(names)},
        device={n: float(device[i]) for i, n in enumerate(names)},
        synchronous=synchronous(dev),
    )


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
