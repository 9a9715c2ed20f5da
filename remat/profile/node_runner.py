"""Running a graph one op node at a time, the way fx's generated code runs it (each value
dropped right after its last use), with a hook around each op's call: what the profiler
times and measures each node by."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.fx
from torch.fx.node import map_arg

from remat.capture.cpu_strides import CORRECTED_STRIDES
from remat.errors import CaptureError, RematError


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


class NodeRunner:
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


def time_run_cpu(runner: NodeRunner, inputs: list[torch.Tensor], check_layout: bool = False) -> np.ndarray:
    times = np.zeros(runner.num_ops, dtype=np.float64)
    clock = time.perf_counter

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        t0 = clock()
        out = fn()
        times[i] = clock() - t0
        return out

    runner.run(inputs, hook, check_layout)
    return times


def time_run_cuda(runner: NodeRunner, inputs: list[torch.Tensor], device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Each op's time on the device (CUDA events) and on the host issuing it (the call's
    own time, which returns once the kernel is queued)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runner.num_ops)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runner.num_ops)]
    host = np.zeros(runner.num_ops, dtype=np.float64)
    clock = time.perf_counter

    def hook(i: int, fn: Callable[[], Any]) -> Any:
        starts[i].record()
        t0 = clock()
        out = fn()
        host[i] = clock() - t0
        ends[i].record()
        return out

    torch.cuda.synchronize(device)
    runner.run(inputs, hook)
    torch.cuda.synchronize(device)
    return np.array([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)], dtype=np.float64), host


class _TimedCall:
    """An op's target that notes, each call, its host time and (CUDA) its events."""

    def __init__(self, target: Any, i: int, host: np.ndarray, events: list | None) -> None:
        self.target, self.i, self.host, self.events = target, i, host, events
        self.__name__ = getattr(target, "__name__", type(target).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.events is not None:
            self.events[self.i][0].record()
        start = time.perf_counter()
        out = self.target(*args, **kwargs)
        self.host[self.i] = time.perf_counter() - start
        if self.events is not None:
            self.events[self.i][1].record()
        return out


def time_whole_runs(gm: torch.fx.GraphModule, inputs: list[Any], runs: int, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Each op node's time over `runs` runs of `gm`'s own generated code (runs x ops: on the
    device, and on the host issuing it), each target wrapped to time its call. Unlike
    `NodeRunner`, values are dropped and boxed inputs handed over exactly as the graph
    does: what a graph of compiled regions, which free their inputs inside, needs."""
    graph = torch.fx.Graph()
    graph.graph_copy(gm.graph, {})
    ops = [n for n in graph.nodes if n.op == "call_function"]
    host = np.zeros(len(ops), dtype=np.float64)
    cuda = device.type == "cuda"
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in ops] if cuda else None
    for i, node in enumerate(ops):
        node.target = _TimedCall(node.target, i, host, events)
    timed = torch.fx.GraphModule(gm, graph)
    device_runs, host_runs = [], []
    for _ in range(runs):
        timed(*inputs)
        if cuda:
            torch.cuda.synchronize(device)
            device_runs.append(np.array([s.elapsed_time(e) / 1e3 for s, e in events], dtype=np.float64))
        else:
            device_runs.append(host.copy())
        host_runs.append(host.copy())
    return np.stack(device_runs), np.stack(host_runs)
