"""The pipeline's first stages, built one way everywhere: capture → analyze → profile → index.

`build` is what `remat.compile`, `remat plan`, `remat frontier`, `remat bench` and the
planner benchmarks start from. A profile is the costly part (several iterations, node
by node): pass a `profile_cache` (a dict, keyed by the graph's fingerprint) to reuse the
profile of a graph already profiled, or a saved `profile` to use it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remat.gc_pause import gc_paused
from remat.memory.analysis import GraphAnalysis, analyze
from remat.capture.capture import capture
from remat.capture.train_graph import TrainGraph, TrainStep
from remat.profile.profiler import profile
from remat.profile.profiles import Profile, graph_fingerprint
from remat.memory.schedule import GraphIndex


@dataclass
class Pipeline:
    tg: TrainGraph
    analysis: GraphAnalysis
    profile: Profile
    index: GraphIndex  # with the profile's measured kernel scratch per node

    def node_seconds(self) -> dict[str, float]:
        return self.profile.seconds_by_node()


def build(
    train_step: TrainStep,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    **options: Any,
) -> Pipeline:
    """Capture `train_step` and build the rest on the graph (`build_on`, which takes the options)."""
    return build_on(capture(train_step, model, optimizer, batch), model, optimizer, batch, **options)


@gc_paused()
def build_on(
    tg: TrainGraph,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    *,
    runs: int = 3,
    device: str | torch.device | None = None,
    progress: bool = False,
    profile_cache: dict[str, Profile] | None = None,
    saved_profile: Profile | None = None,
) -> Pipeline:
    """Analysis, profile (saved, cached, or measured now) and index of a captured graph."""
    analysis = analyze(tg)
    prof = saved_profile
    if prof is None:
        key = graph_fingerprint(tg)
        prof = profile_cache.get(key) if profile_cache is not None else None
        if prof is None:
            prof = profile(tg, model, optimizer, batch, runs=runs, device=device, progress=progress, analysis=analysis)
            if profile_cache is not None:
                profile_cache[key] = prof
    index = GraphIndex.build(tg, analysis)
    index.scratch = prof.scratch_by_node()
    return Pipeline(tg, analysis, prof, index)
