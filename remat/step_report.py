"""What `remat.compile` decided for one batch shape, and what it measured: `step.report`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.budget import format_bytes, not_held
from remat.planners.plan import Plan
from remat.profile.profiles import Profile
from remat.profile.time_model import StepTime


@dataclass
class StepReport:
    """What remat decided for one batch shape, and what it measured."""

    profile: Profile
    plan: Plan | None  # None: no recomputation (memory_budget=None)
    budget_bytes: int | None
    baseline_peak_bytes: int  # simulated, captured graph without recomputation
    predicted_peak_bytes: int  # simulated, rewritten graph
    persistent_bytes: int
    measured_peak_bytes: int | None = None  # persistent + the allocator's peak of a real step
    measured_reserved_peak_bytes: int | None = None  # CUDA: persistent + the segments that step reserved
    num_recomputed: int = 0
    compile_seconds: float = 0.0
    copies: int = 0
    backend: str = "eager"
    regions: int = 0  # Inductor-compiled regions (backend "inductor")
    region_splits: int = 0  # of them, split because the step's measured peak was over the bound in one
    regions_slower: int = 0  # regions left to run op by op: they took longer compiled (timed at compile time)
    predicted_time: StepTime | None = None  # the graph's ops on the host and device timelines (time_model)
    cuda_graph: bool = False  # replayed as a CUDA graph (passes.cuda_graph)
    cuda_graph_captures: int = 0  # captures so far: the first, then one per changed key
    cuda_graph_pool_bytes: int | None = None  # what the last capture reserved for the graph's memory

    def take_measured(self, measured: Any, device: str, data_parallel: bool) -> str | None:
        """The first run's measured peaks (`allocator.Measured`, above the persistent bytes), and
        what to warn of where the peak went over the budget, else None. Not under DDP or FSDP2:
        gloo's worker threads free a collective's buffers after the step has moved on, which the
        peak counts (up to two gradients' bytes: tests/test_data_parallel.py). On a GPU the
        allocator's blocks put the measured peak a megabyte or so off the prediction."""
        self.measured_peak_bytes = self.persistent_bytes + measured.peak_bytes
        if measured.reserved_peak_bytes is not None:
            self.measured_reserved_peak_bytes = self.persistent_bytes + measured.reserved_peak_bytes
        slack = 0 if device.startswith("cpu") else (self.budget_bytes or 0) // 100
        return None if data_parallel else not_held(self.measured_peak_bytes, self.predicted_peak_bytes, self.budget_bytes, slack)

    def __repr__(self) -> str:
        # The profile and plan hold every node: a repr of them all would bury what was decided.
        measured = format_bytes(self.measured_peak_bytes) if self.measured_peak_bytes is not None else "not measured"
        return (
            f"StepReport(predicted_peak={format_bytes(self.predicted_peak_bytes)}, measured_peak={measured}, "
            f"num_recomputed={self.num_recomputed}, backend={self.backend!r}; print() it for a summary)"
        )

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """What was decided and measured, in a few lines (the fields and `to_dict()` hold the rest)."""
        budget = f"budget {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None else "no budget (memory_budget=None)"
        measured = format_bytes(self.measured_peak_bytes) if self.measured_peak_bytes is not None else "not measured"
        lines = [
            f"remat step ({self.backend} backend): {budget}; peak {format_bytes(self.predicted_peak_bytes)} predicted, {measured} measured",
            f"  without recomputation: {format_bytes(self.baseline_peak_bytes)}; of either, {format_bytes(self.persistent_bytes)} held between steps (parameters, optimizer state)",
        ]
        plan = self.plan
        if plan is not None:
            share = plan.predicted_overhead_seconds / plan.baseline_iteration_seconds if plan.baseline_iteration_seconds > 0 else 0.0
            lines.append(
                f"  recomputes {self.num_recomputed} activations ({self.copies} ops copied, planner {plan.planner}): "
                f"predicted {plan.predicted_overhead_seconds * 1e3:.1f} ms more than a {plan.baseline_iteration_seconds * 1e3:.1f} ms step (+{share:.0%})"
            )
            if plan.updates_note:
                lines.append(f"  updates: {plan.updates_note}")
            if plan.meta.get("lean_ops_note"):
                lines.append(f"  lean ops: {plan.meta['lean_ops_note']}")
        if self.predicted_time is not None:
            t = self.predicted_time
            # A negative host cost is the calibration taking the op timer's own cost back
            # off the measured ops (time_model.line_seconds), not time the host spends.
            split = (
                f"host {t.host_seconds * 1e3:.1f} ms, device {t.device_seconds * 1e3:.1f} ms" if t.host_seconds >= 0
                else f"{t.device_seconds * 1e3:.1f} ms as timed op by op, less {-t.host_seconds * 1e3:.1f} ms of the timer's own cost"
            )
            lines.append(f"  predicted graph time {t.seconds * 1e3:.1f} ms ({t.ops:,} ops; {split})")
        if self.regions:
            lines.append(f"  {self.regions} regions compiled by Inductor ({self.region_splits} split, {self.regions_slower} left op by op)")
        if self.cuda_graph:
            lines.append(f"  replayed as a CUDA graph ({self.cuda_graph_captures} captures)")
        where = "; step.report.plan.recomputed lists what is rebuilt and from what" if plan is not None and plan.recomputed else ""
        lines.append(f"  compiled in {self.compile_seconds:.1f} s{where}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_reserved_peak_bytes": self.measured_reserved_peak_bytes,
            "persistent_bytes": self.persistent_bytes,
            "num_recomputed": self.num_recomputed,
            "recompute_ops": self.copies,
            "compile_seconds": self.compile_seconds,
            "planner": self.plan.planner if self.plan else None,
            "predicted_overhead_seconds": self.plan.predicted_overhead_seconds if self.plan else 0.0,
            "updates_in_backward": bool(self.plan and self.plan.updates_in_backward),
            "updates_note": self.plan.updates_note if self.plan else "",
            "lean_ops": list(self.plan.lean_ops) if self.plan else [],
            "backend": self.backend,
            "regions": self.regions,
            "region_splits": self.region_splits,
            "regions_slower": self.regions_slower,
            "predicted_graph_seconds": self.predicted_time.seconds if self.predicted_time else None,
            "time_model": self.predicted_time.to_dict() if self.predicted_time else None,
            "cuda_graph": self.cuda_graph,
            "cuda_graph_captures": self.cuda_graph_captures,
            "cuda_graph_pool_bytes": self.cuda_graph_pool_bytes,
        }
