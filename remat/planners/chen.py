"""Chen et al. (2016), "Training deep nets with sublinear memory cost": √n segments.

The forward pass is cut into k segments; the activation at the end of each segment is
kept and the others in it are recomputed in the backward pass. Segments are cut by
bytes, as Chen's budgeted variant does (walk the forward order, close a segment when the
activations since the last checkpoint exceed total/k), so that a segment of many tiny
tensors and one of a few large ones weigh the same. k is then chosen for the budget:
over a grid of counts (every k for small graphs; about 80 values, spread on a log scale
and dense around √n, otherwise), from the most segments down, each is simulated until a
few fit, and the fitting one with the least predicted overhead wins. A baseline: it knows nothing of recompute costs or of where the peak is.
"""

from __future__ import annotations

import math
import time

import numpy as np

from remat.memory.schedule import GraphIndex, RebuildPolicy
from remat.planners.evaluate import Evaluation, Evaluator, assemble_plan, no_plan_error
from remat.planners.plan import Plan

FULL_GRID_UP_TO = 48  # candidates; above that, a grid of segment counts
# Fewer segments drop more and rebuild longer chains: memory falls and time grows as k
# falls. Counts are tried from the most segments down; once this many fit, the cheapest
# of them is kept (the next counts down only drop more and rebuild more).
FITS_TO_COMPARE = 2


def segment_drops(candidates: list[int], sizes: list[int], k: int) -> set[int]:
    """The candidates dropped when cut into `k` segments of about equal bytes.

    The last candidate of each segment is kept (its checkpoint); k >= len(candidates)
    keeps everything.
    """
    n = len(candidates)
    if k >= n:
        return set()
    cum = np.cumsum(np.asarray(sizes, dtype=np.float64))
    total = cum[-1]
    kept: set[int] = set()
    for j in range(1, k + 1):
        # the last candidate whose running total is within j/k of the whole
        i = int(np.searchsorted(cum, total * j / k, side="right")) - 1
        kept.add(candidates[max(i, 0)])
    kept.add(candidates[-1])
    return set(candidates) - kept


def segment_counts(n: int) -> list[int]:
    if n <= FULL_GRID_UP_TO:
        return list(range(1, n + 1))
    root = math.isqrt(n)
    grid = {int(round(x)) for x in np.geomspace(1, n, 64)}
    grid.update(range(max(1, root - 8), min(n, root + 8) + 1))
    return sorted(k for k in grid if 1 <= k <= n)


def plan(index: GraphIndex, node_seconds: dict[str, float], budget_bytes: int, **meta) -> Plan:
    """The planner interface (remat.planners.make_plan)."""
    t0 = time.perf_counter()
    # Chen's segments are recomputed once and held through their backward pass.
    ev = Evaluator(index, node_seconds, budget_bytes, policy=RebuildPolicy.SHARED)
    baseline = ev.baseline
    extra = dict(meta.pop("meta", None) or {})
    if baseline.peak_bytes <= budget_bytes:
        return assemble_plan("chen", index, node_seconds, budget_bytes, [], baseline, baseline.timeline, time.perf_counter() - t0, meta=extra, **meta)
    candidates = index.candidates()  # in forward (creation) order
    tensors = index.analysis.tensors
    sizes = [tensors[s].nbytes for s in candidates]
    best: tuple[float, int, set[int], Evaluation] | None = None
    seen: set[frozenset] = set()
    counts = segment_counts(len(candidates))
    fitting = 0
    for k in reversed(counts):  # most segments (least dropped, shortest rebuilds) first
        dropped = segment_drops(candidates, sizes, k)
        if frozenset(dropped) in seen:
            continue
        seen.add(frozenset(dropped))
        ok, _, evaluation = ev.check(dropped)
        if ok and evaluation is not None:
            fitting += 1
            if best is None or evaluation.overhead_seconds < best[0]:
                best = (evaluation.overhead_seconds, k, dropped, evaluation)
            if fitting >= FITS_TO_COMPARE:
                break
    if best is None:
        raise no_plan_error("chen", budget_bytes, ev.smallest_peak, baseline.peak_bytes, len(candidates))
    _, k, dropped, evaluation = best
    picks = [s for s in candidates if s in dropped]  # forward order
    extra.update(ev.stats())
    extra.update({"segments": k, "candidates": len(candidates), "segment_counts_tried": len(seen)})
    return assemble_plan("chen", index, node_seconds, budget_bytes, picks, evaluation, baseline.timeline, time.perf_counter() - t0, meta=extra, policy=RebuildPolicy.SHARED, **meta)
