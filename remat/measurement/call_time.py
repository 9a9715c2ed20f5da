"""The host time a compiled step spends at each call before its graph runs: finding the
graph for the batch (checking the watched Python state: guards) and gathering its inputs
(with the checks of the loop's changes). Medians over repeated calls of those two parts
alone, which change nothing: the graph itself is not run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from remat.pipeline.step_inputs import ModelView, flat_inputs


@dataclass(frozen=True)
class CallTime:
    guards_seconds: float  # RematStep.compiled_for: the watched state checked, the graph found
    inputs_seconds: float  # the model read, the loop's changes checked, the inputs gathered

    @property
    def host_seconds(self) -> float:
        return self.guards_seconds + self.inputs_seconds

    def fields(self, call_seconds: float) -> dict[str, float]:
        """For `remat run --json`: of a call's time, the host's before the graph runs, and the rest."""
        return {
            "call_guards_seconds": self.guards_seconds,
            "call_inputs_seconds": self.inputs_seconds,
            "call_host_seconds": self.host_seconds,
            "graph_seconds": call_seconds - self.host_seconds,
        }


def median_seconds(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_call_time(step: Any, batch: Any, calls: int = 30) -> CallTime:
    """`step` (a RematStep) already compiled for `batch`'s shape."""
    compiled = step.compiled_for(batch)
    guards = median_seconds(lambda: step.compiled_for(batch), calls)
    inputs = median_seconds(lambda: flat_inputs(compiled.tg, step.model, step.optimizer, batch, ModelView.of(step.model)), calls)
    return CallTime(guards, inputs)
