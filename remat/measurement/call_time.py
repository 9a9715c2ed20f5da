"""The host time remat spends at each call of a compiled step, apart from its graph's:
finding the graph for the batch (checking the watched Python state: guards), gathering its
inputs (with the checks of the loop's changes), and the whole call but the graph (those,
the gradients set on the parameters, the effects replayed).

Medians over repeated calls: the first two alone, which change nothing; the whole call
twice. Over real steps, with the graph timed apart: on a CPU the graph has just evicted
the host's caches, so the host's work runs cold. And warm, as it runs beside a GPU (whose
kernels leave the host's caches alone): with the graph replaced by one that returns what
the last real run returned (the gradients set again, the step's effects replayed again).
Before each real step the previous gradients are dropped, outside the timer: freeing them
is the step's own work (eager's zero_grad frees them too), milliseconds on BERT-base.
The real steps' whole times are kept too: the step as a loop runs it, one after another
(timed in pairs beside eager's step, a step of compiled kernels on a small model runs
cold: bert-tiny's with Inductor regions 14–20% slower after an eager step than after itself).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from remat.profile.time_model import median_seconds


@dataclass(frozen=True)
class CallTime:
    guards_seconds: float  # RematStep.compiled_for: the watched state checked, the graph found
    inputs_seconds: float  # the loop's changes checked, the inputs gathered
    host_seconds: float  # a whole real call but its graph: the above, and what runs after the graph
    warm_host_seconds: float  # the same, with the graph replaced by one that returns at once
    step_seconds: float  # a whole real call, graph included, steps run one after another as a loop runs them

    def fields(self, call_seconds: float) -> dict[str, float]:
        """For `remat run --json`: of a call's time, the host's, and the rest."""
        return {
            "call_guards_seconds": self.guards_seconds,
            "call_inputs_seconds": self.inputs_seconds,
            "call_host_seconds": self.host_seconds,
            "call_host_warm_seconds": self.warm_host_seconds,
            "graph_seconds": call_seconds - self.host_seconds,
            "back_to_back_seconds": self.step_seconds,
        }


class _TimedGraph:
    """A graph that notes how long each run of it took."""

    def __init__(self, gm: Any) -> None:
        self.gm, self.seconds, self.returned = gm, 0.0, None

    def __call__(self, *inputs: Any) -> Any:
        start = time.perf_counter()
        self.returned = self.gm(*inputs)
        self.seconds = time.perf_counter() - start
        return self.returned


def measure_call_time(step: Any, batch: Any, calls: int = 30, steps: int = 5) -> CallTime:
    """`step` (a RematStep) already compiled for `batch`'s shape; `steps` real training steps
    are run to time the whole call. Every call finds no gradients set (a step that adds to
    set ones runs another graph for those: gradient accumulation across calls)."""
    params = list(step.model.parameters())
    _clear(params)
    compiled = step.compiled_for(batch)
    guards = median_seconds(lambda: step.compiled_for(batch), calls)
    inputs = median_seconds(lambda: compiled.inputs(step.model, step.optimizer, batch), calls)
    runs = "cuda_graph" if compiled.cuda_graph is not None else "gm"  # what the step calls to run its graph
    timed = _TimedGraph(getattr(compiled, runs))
    setattr(compiled, runs, timed)
    host, whole = [], []
    try:
        for _ in range(steps):
            _clear(params)
            start = time.perf_counter()
            step(batch)
            whole.append(time.perf_counter() - start)
            host.append(whole[-1] - timed.seconds)
        setattr(compiled, runs, lambda *inputs: timed.returned)
        warm = statistics.median(_timed_call(step, batch, params) for _ in range(calls))
    finally:
        setattr(compiled, runs, timed.gm)
    return CallTime(guards, inputs, statistics.median(host), warm, statistics.median(whole))


def _clear(params: list[torch.Tensor]) -> None:
    for p in params:
        if p.requires_grad:  # a frozen one's is the step's input (held_gradients): kept, as the step keeps it
            p.grad = None


def _timed_call(step: Any, batch: Any, params: list[torch.Tensor]) -> float:
    _clear(params)  # what the stand-in graph left set, cleared outside the time
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start
