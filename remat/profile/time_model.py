"""The time of a step as two timelines: the host issuing ops, the device running them.

Each op has a host cost (the generated code's line and the op's dispatch or launch: the
time until the host can issue the next op) and a device cost (running its kernel). On a
GPU the host runs ahead of the device: it issues op i at H_i = H_{i-1} + h_i, and the
device starts it when it is issued and the previous op is done, ending at
D_i = max(H_i, D_{i-1}) + d_i; the step ends when both are done. A step of many tiny
kernels is bound by the host (the device waits for each issue), one of large kernels by
the device, and recomputing fifty tiny ops costs their issuing, not their kernels. On a
CPU the op runs on the host as it is issued: the host waits for each, and the step is
the sum of both costs.

What node-by-node timing does not see is the cost of the generated code's own line per
op (binding the result, dropping dead values). `line_seconds` calibrates it on this
machine: a graph of tiny ops run whole against the same ops timed one by one.

On a CPU an allocation above glibc's largest mmap threshold (32 MiB on 64-bit) maps fresh
pages, and the op that first writes them pays a page fault per page: measured here,
0.24 ms per MiB, 2.5 times the multiplication that filled them. An op whose plan writes
its result into a dying input (lean_ops) saves that cost; `first_touch_seconds_per_byte`
calibrates it, `fresh_pages_seconds` applies it.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
import torch.fx

from remat.profile.node_runner import NodeRunner, time_run_cpu, time_run_cuda

CALIBRATION_OPS = 400  # tiny ops in the calibration graph
CALIBRATION_RUNS = 15
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest dynamic mmap threshold (64-bit): larger blocks are always fresh pages
FIRST_TOUCH_BYTES = 48 * 2**20  # the block the first-touch calibration allocates


@dataclass(frozen=True)
class OpCosts:
    """Per op node of a graph (by name): its host and device cost, in seconds."""

    host: dict[str, float]
    device: dict[str, float]
    synchronous: bool  # the host waits for each op (a CPU)
    first_touch_seconds_per_byte: float = 0.0  # writing freshly mapped pages (first_touch_seconds_per_byte())

    def replayed(self) -> "OpCosts":
        """The costs of the ops replayed as one CUDA graph: the host issues the graph, not each op."""
        return replace(self, host=dict.fromkeys(self.host, 0.0))

    def seconds_by_node(self) -> dict[str, float]:
        """What one run of each op costs the step alone (`op_seconds`): what the planners add up."""
        names = list(self.device)
        cost = op_seconds(np.array([self.host[n] for n in names]), np.array([self.device[n] for n in names]), self.synchronous)
        return dict(zip(names, np.maximum(cost, 0.0).tolist()))


@dataclass(frozen=True)
class StepTime:
    """A step's ops on the two timelines."""

    seconds: float  # when the last op is done (the step's time)
    host_seconds: float  # the host's issuing alone (on a CPU: the sum of the host costs)
    device_seconds: float  # the device's running alone
    device_wait_seconds: float  # of `seconds`, the time the device had nothing issued to run
    ops: int

    @property
    def host_bound(self) -> bool:
        """The device waited for the host for more than half the step."""
        return self.device_wait_seconds > 0.5 * self.seconds

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "seconds": self.seconds,
            "host_seconds": self.host_seconds,
            "device_seconds": self.device_seconds,
            "device_wait_seconds": self.device_wait_seconds,
            "ops": self.ops,
            "host_bound": self.host_bound,
        }


def scaled_to_runs(samples: np.ndarray, medians: np.ndarray | None = None) -> np.ndarray:
    """Each node's time from `samples` (runs x nodes): its median (or the given `medians`),
    scaled so that the nodes add up to the median run. A node's median keeps one slow
    sample from pricing it (the planners rank nodes by it); but the slow samples fall on
    different nodes in different runs, so medians alone add up to less than a run takes
    (15% less for bert-tiny, batch 1, on a CPU). The scale puts that back in proportion."""
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    medians = np.median(samples, axis=0) if medians is None else np.asarray(medians, dtype=np.float64)
    total = float(medians.sum())
    return medians * (float(np.median(samples.sum(axis=1))) / total) if total > 0 else medians


def simulate_time(host: np.ndarray, device: np.ndarray, synchronous: bool) -> StepTime:
    """The two timelines of ops issued in order with these host and device costs (seconds).

    `synchronous`: the host waits for each op (a CPU), so the step is the sum of both."""
    host = np.asarray(host, dtype=np.float64)
    device = np.asarray(device, dtype=np.float64)
    if host.shape != device.shape:
        raise ValueError(f"host costs {host.shape} and device costs {device.shape} differ in length")
    busy = float(device.sum())
    if synchronous or not len(host):
        issued = float(host.sum())
        # A negative host cost (a calibrated line below the timer's own cost) takes an op's
        # cost to zero and no lower, as `op_seconds` is clipped where the planners add it up.
        busy = float(np.maximum(device, -host).sum())
        return StepTime(issued + busy, issued, busy, issued, len(host))
    issue = np.cumsum(host)  # H_i
    ran = np.cumsum(device)  # the device's busy time up to and including op i
    # D_i = max over k <= i of (H_k + the device costs of ops k..i): a running maximum.
    before = np.concatenate(([0.0], ran[:-1]))
    end = float(ran[-1] + np.maximum.accumulate(issue - before)[-1])
    return StepTime(end, float(issue[-1]), busy, end - busy, len(host))


def op_seconds(host: np.ndarray, device: np.ndarray, synchronous: bool) -> np.ndarray:
    """What one more op costs the step, alone: both costs where the host waits for it, the
    larger where the host issues while the device runs (what the planners add up)."""
    host = np.asarray(host, dtype=np.float64)
    device = np.asarray(device, dtype=np.float64)
    return host + device if synchronous else np.maximum(host, device)


def synchronous(device: torch.device | str) -> bool:
    """Whether the host waits for each op on this device."""
    return torch.device(device).type == "cpu"


def _tiny_graph(ops: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = x
    for _ in range(ops):
        y = graph.call_function(torch.ops.aten.add.Tensor, (y, x))
    graph.output(y)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def median_seconds(fn: Callable[[], Any], calls: int) -> float:
    """The median wall time of `calls` calls of `fn`."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fresh_pages_seconds(nbytes: int, per_byte: float) -> float:
    """What an op's output of `nbytes` costs in page faults where it is freshly mapped."""
    return nbytes * per_byte if nbytes > MMAP_THRESHOLD_BYTES else 0.0


@functools.lru_cache(maxsize=None)
def first_touch_seconds_per_byte(device: str = "cpu", runs: int = 5) -> float:
    """Seconds per byte an op spends writing a freshly mapped output, over writing into a
    block it was given: `x * 2` against `torch.mul(x, 2, out=block)`, medians of `runs`,
    on a block above the mmap threshold. 0 on CUDA (its caching allocator keeps blocks).
    Once per process and device: a property of the machine."""
    if torch.device(device).type != "cpu":
        return 0.0
    x = torch.ones(FIRST_TOUCH_BYTES // 4)
    block = torch.empty_like(x)
    fresh = median_seconds(lambda: x * 2, runs)
    given = median_seconds(lambda: torch.mul(x, 2, out=block), runs)
    return max(0.0, fresh - given) / FIRST_TOUCH_BYTES


@functools.lru_cache(maxsize=None)
def line_seconds(device: str = "cpu", ops: int = CALIBRATION_OPS, runs: int = CALIBRATION_RUNS) -> float:
    """Seconds per op that a graph's generated code spends beyond what node-by-node timing
    (node_runner.NodeRunner, timed as the profiler times: on CUDA, each op's issuing) sees: a chain of `ops` one-element
    adds, the median whole run against the median sum of its nodes' times. May be
    negative where the timing's own cost is the larger. Once per process and device."""
    device = torch.device(device)
    gm = _tiny_graph(ops)
    x = torch.ones(1, device=device)
    runner = NodeRunner(gm)

    def whole() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        gm(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def by_node() -> float:
        if device.type == "cuda":
            return float(time_run_cuda(runner, [x], device)[1].sum())
        return float(time_run_cpu(runner, [x]).sum())

    for _ in range(2):  # warm both paths
        whole(), by_node()
    wholes = statistics.median(whole() for _ in range(runs))
    nodes = statistics.median(by_node() for _ in range(runs))
    return (wholes - nodes) / ops
