"""Running a graph one op node at a time, the way fx's generated code runs it (each value
dropped right after its last use), with a hook around each op's call: what the profiler
times and measures each node by."""

from __future__ import annotations

import functools
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


HOLD_CHUNK_OPS = 16  # ops issued behind one hold of the device
HOLD_HOST_FACTOR = 3.0  # a hold lasts this many times its ops' host time (the events add to it)
HOLD_MARGIN_SECONDS = 1e-3
MAX_HOLD_SECONDS = 0.05
SLEEP_CALIBRATION_CYCLES = 10_000_000


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_second(index: int | None) -> float:
    """How many cycles of `torch.cuda._sleep` the device spins per second (its clock)."""
    torch.cuda._sleep(1000)  # loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return SLEEP_CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)


class CudaOpTimer:
    """Times each op of a run on the device and on the host, on CUDA.

    The events around an op measure from the moment the device reaches the first to the
    moment it reaches the second. Where the device is idle when the host issues the op (a
    step of small kernels, the host behind), the first event fires at once and the pair
    then measures the host's issuing and the launch latency as well: BERT-base at batch 8
    on an H100 summed to 68 ms of such device time for a 26 ms step. So the host times
    come from one run (`host_run`: each call's own time, which returns once the kernel is
    queued) and the device times from another (`device_run`), in which the device is held
    by a spinning kernel (`torch.cuda._sleep`) before each `HOLD_CHUNK_OPS` ops, long
    enough for the host to queue them all: each pair then brackets its op's kernels alone.
    A hold lasts three times the host time of its ops in the host run and 1 ms (at most
    `MAX_HOLD_SECONDS`), and its time falls between two ops' pairs, on none."""

    def __init__(self, num_ops: int, device: torch.device):
        self.device = device
        self.host = np.zeros(num_ops, dtype=np.float64)
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(num_ops)]
        self.holding: np.ndarray | None = None  # the host times the holds are sized by; None: a host run

    def host_run(self, run: Callable[[], Any]) -> np.ndarray:
        self.holding = None
        self._whole(run)
        return self.host.copy()

    def device_run(self, run: Callable[[], Any], host: np.ndarray) -> np.ndarray:
        self.holding = host
        self._whole(run)
        self.holding = None
        return np.array([s.elapsed_time(e) / 1e3 for s, e in self.events], dtype=np.float64)

    def _whole(self, run: Callable[[], Any]) -> None:
        torch.cuda.synchronize(self.device)
        run()
        torch.cuda.synchronize(self.device)

    def call(self, i: int, fn: Callable[[], Any]) -> Any:
        if self.holding is None:
            start = time.perf_counter()
            out = fn()
            self.host[i] = time.perf_counter() - start
            return out
        if i % HOLD_CHUNK_OPS == 0:
            seconds = min(MAX_HOLD_SECONDS, HOLD_HOST_FACTOR * float(self.holding[i : i + HOLD_CHUNK_OPS].sum()) + HOLD_MARGIN_SECONDS)
            torch.cuda._sleep(max(1, int(seconds * _sleep_cycles_per_second(self.device.index))))
        self.events[i][0].record()
        out = fn()
        self.events[i][1].record()
        return out


def time_run_cuda(runner: NodeRunner, inputs: list[torch.Tensor], device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Each op's time on the device and on the host issuing it (`CudaOpTimer`: two runs)."""
    timer = CudaOpTimer(runner.num_ops, device)
    host = timer.host_run(lambda: runner.run(inputs, timer.call))
    return timer.device_run(lambda: runner.run(inputs, timer.call), host), host


class _TimedCall:
    """An op's target that times each call through `time` (op `i`)."""

    def __init__(self, target: Any, i: int, time: Callable[[int, Callable[[], Any]], Any]) -> None:
        self.target, self.i, self.time = target, i, time
        self.__name__ = getattr(target, "__name__", type(target).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.time(self.i, lambda: self.target(*args, **kwargs))


def time_whole_runs(gm: torch.fx.GraphModule, inputs: list[Any], runs: int, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Each op node's time over `runs` runs of `gm`'s own generated code (runs x ops: on the
    device, and on the host issuing it), each target wrapped to time its call. Unlike
    `NodeRunner`, values are dropped and boxed inputs handed over exactly as the graph
    does: what a graph of compiled regions, which free their inputs inside, needs. On CUDA
    each run is two (`CudaOpTimer`)."""
    graph = torch.fx.Graph()
    graph.graph_copy(gm.graph, {})
    ops = [n for n in graph.nodes if n.op == "call_function"]
    cuda = device.type == "cuda"
    timer = CudaOpTimer(len(ops), device) if cuda else None
    host = np.zeros(len(ops), dtype=np.float64)

    def time_on_cpu(i: int, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        host[i] = time.perf_counter() - start
        return out

    for i, node in enumerate(ops):
        node.target = _TimedCall(node.target, i, timer.call if timer is not None else time_on_cpu)
    timed = torch.fx.GraphModule(gm, graph)
    device_runs, host_runs = [], []
    for _ in range(runs):
        if timer is not None:
            host_runs.append(timer.host_run(lambda: timed(*inputs)))
            device_runs.append(timer.device_run(lambda: timed(*inputs), host_runs[-1]))
        else:
            timed(*inputs)
            host_runs.append(host.copy())
            device_runs.append(host.copy())
    return np.stack(device_runs), np.stack(host_runs)
