"""A plan: which activations to recompute, why, and what that is predicted to cost.

Every planner returns one; the rewriter and the reports read one. It names storages by
their stable keys (analysis.TensorInfo.key), never by ids, so that a plan saved as JSON
can be checked against, and applied to, a fresh capture of the same graph.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.fx

from remat.errors import PlanError
from remat.profile.profiles import graph_fingerprint
from remat.passes.rewriter import runnable
from remat.memory.schedule import GraphIndex, RebuildPolicy, Schedule, build_schedule
from remat.memory.simulator import Timeline, simulate_schedule
from remat.serialize import check_fields, describe_value, dump_document, load_document
from remat.passes.lean_ops import lean_index
from remat.passes.update_placement import moved_index

PLAN_FORMAT = "remat.plan"
PLAN_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class AppliedPlan:
    """A plan applied to a graph: the index it runs (with the plan's lean operator variants
    and moved updates), its schedule, and their simulated memory over the step."""

    index: GraphIndex
    schedule: Schedule
    timeline: Timeline

    @property
    def peak_bytes(self) -> int:
        return self.timeline.peak_bytes

    def runnable(self) -> torch.fx.GraphModule:
        """The rewritten graph, which runs the step (the rewrite is the costly part: made on demand)."""
        return runnable(self.index, self.schedule)


@dataclass
class Recomputed:
    """One dropped activation and how it is rebuilt from what the final plan keeps.

    `ops` are the forward ops copied to rebuild it (in execution order, its closure under
    the final plan) and `sources` the kept values they read (parameters, inputs, kept
    activations). Entries may share ops, and the schedule may rebuild a value more than
    once, so their seconds do not add up to the plan's overhead (schedule.py decides).
    """

    key: str
    nbytes: int
    sources: list[str]  # node names of the kept values the rebuild reads
    ops: list[str]  # node names of the forward ops copied to rebuild it
    recompute_seconds: float  # summed median seconds of `ops`
    ratio: float | None  # nbytes / recompute_seconds (None when the ops take no time)


@dataclass
class Plan:
    planner: str
    fingerprint: str
    budget_bytes: int
    recomputed: list[Recomputed]  # in the order the planner picked them
    predicted_peak_bytes: int
    predicted_step_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead_seconds: float  # recompute_seconds() of the final schedule
    baseline_iteration_seconds: float
    planning_seconds: float
    num_recomputed: int
    persistent_bytes: int = 0
    baseline_step_peak_bytes: int = 0
    model: str | None = None
    batch_size: int | None = None
    optimizer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    share_rebuilt: bool = False  # the rebuild policy it was made for: shared (True) or per block; a bool in the file format
    updates_in_backward: bool = False  # each private optimizer update runs as soon as its gradient is final
    updates_note: str = ""  # which updates moved, or why they stay at the end of the step
    lean_ops: list[str] = field(default_factory=list)  # nodes that write their result into a dying input (lean_ops)

    def __repr__(self) -> str:  # the lists hold every recomputed value and its ops: fields and to_dict() have them
        return (
            f"Plan(planner={self.planner!r}, num_recomputed={self.num_recomputed}, budget_bytes={self.budget_bytes:,}, "
            f"predicted_peak_bytes={self.predicted_peak_bytes:,}, predicted_overhead_seconds={self.predicted_overhead_seconds:.4g})"
        )

    @property
    def policy(self) -> RebuildPolicy:
        return RebuildPolicy.SHARED if self.share_rebuilt else RebuildPolicy.PER_BLOCK

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.recomputed]

    @property
    def predicted_overhead_fraction(self) -> float:
        return self.predicted_overhead_seconds / self.baseline_iteration_seconds if self.baseline_iteration_seconds else 0.0

    def dropped(self, index: GraphIndex, check_fingerprint: bool = True) -> set[int]:
        """The storage ids of this graph that the plan recomputes.

        Refuses a plan made for another graph: by the tensors it names, then by the graph
        fingerprint (the same model at another batch size has the same tensor names).
        """
        by_key = index.analysis.storage_by_key()
        missing = [k for k in self.keys if k not in by_key]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise PlanError(
                f"the plan names {len(missing)} tensor(s) this graph does not have ({shown}): it was made for "
                f"another graph{self._made_for()}. Plan this model and batch size again."
            )
        if check_fingerprint:
            self.check_graph(graph_fingerprint_of(index))
        return {by_key[k] for k in self.keys}

    def check_graph(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for another graph{self._made_for()} (fingerprint {self.fingerprint[:12]}…, "
                f"this graph {fingerprint[:12]}…): the model, optimizer or batch shape differ. Plan this graph again."
            )

    def index_for(self, index: GraphIndex) -> GraphIndex:
        """The index of the graph this plan runs: `index` as captured, with the plan's lean
        operator variants and its updates moved into the backward pass, as the plan says."""
        base = index.captured or index
        if self.lean_ops:
            lean, found = lean_index(base)
            if lean is None or lean.lean_ops != self.lean_ops:
                raise PlanError(
                    f"the plan writes {len(self.lean_ops)} backward results into dying inputs, but this graph allows "
                    f"{len(found.applied)} other ones: it was made for another graph. Plan this graph again."
                )
            base = lean
        if not self.updates_in_backward:
            return base
        moved, placement = moved_index(base, in_buckets=self.meta.get("update_buckets", True))
        if moved is None:
            raise PlanError(f"the plan runs optimizer updates in the backward pass, but none can move in this graph: {placement.summary()}")
        return moved

    def schedule(self, index: GraphIndex) -> Schedule:
        """The schedule of this plan, over `index_for(index)` (the index to rewrite and simulate with)."""
        index = self.index_for(index)
        return build_schedule(index, self.dropped(index), self.policy)

    def apply(self, index: GraphIndex) -> AppliedPlan:
        """This plan on `index`'s graph: the one way every caller applies a plan (the step,
        `remat plan`, the frontier, the batch-size search)."""
        ordered = self.index_for(index)
        schedule = self.schedule(ordered)
        return AppliedPlan(ordered, schedule, simulate_schedule(ordered, schedule))

    def _made_for(self) -> str:
        if self.model is None:
            return ""
        return f" ({self.model}, batch {self.batch_size})" if self.batch_size is not None else f" ({self.model})"

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "plan") -> "Plan":
        """A plan from its JSON object, refused (PlanError, naming the field) unless every
        field is there, of its type, and the entries agree with each other."""
        check_fields(d, cls, where, _PLAN_SIGNS)
        d = {k: v for k, v in d.items() if k not in ("format", "version")}
        if not _SHA256.fullmatch(d["fingerprint"]):
            raise PlanError(
                f"{where}: fingerprint must be a sha256 digest (64 hexadecimal digits), not {describe_value(d['fingerprint'])}"
            )
        seen: dict[str, int] = {}
        for i, r in enumerate(d["recomputed"]):
            if r["key"] in seen:
                raise PlanError(f"{where}: recomputed[{i}] repeats the tensor {r['key']} of recomputed[{seen[r['key']]}]")
            seen[r["key"]] = i
        entries = [Recomputed(**r) for r in d["recomputed"]]
        d["recomputed"] = entries
        plan = cls(**d)
        if plan.num_recomputed != len(entries):
            raise PlanError(f"{where}: num_recomputed is {plan.num_recomputed} but {len(entries)} entries are listed")
        return plan

    def to_json(self, path: str | Path) -> Path:
        return dump_document(path, PLAN_FORMAT, PLAN_VERSION, self.to_dict())

    @classmethod
    def from_json(cls, path: str | Path) -> "Plan":
        return cls.from_dict(load_document(path, PLAN_FORMAT, PLAN_VERSION), where=str(path))


# Fields that are counts, bytes or seconds: a negative one is an edited or broken file.
_PLAN_SIGNS: dict[type, dict[str, str]] = {
    Plan: {
        **{k: "non-negative" for k in (
            "budget_bytes", "predicted_peak_bytes", "predicted_step_peak_bytes", "baseline_peak_bytes",
            "predicted_overhead_seconds", "baseline_iteration_seconds", "planning_seconds", "num_recomputed",
            "persistent_bytes", "baseline_step_peak_bytes",
        )},
        "batch_size": "positive",
    },
    Recomputed: {"nbytes": "non-negative", "recompute_seconds": "non-negative", "ratio": "non-negative"},
}  # fmt: skip


def graph_fingerprint_of(index: GraphIndex) -> str:
    """The captured graph's fingerprint, as the profiler computes it (profiles and plans agree);
    worked out once per captured graph, which every plan of it carries."""
    captured = index.captured or index
    found = captured.__dict__.get("_fingerprint")
    if found is None:
        found = captured.__dict__["_fingerprint"] = graph_fingerprint(captured.tg)
    return found


def check_node_seconds(index: GraphIndex, node_seconds: dict[str, float]) -> None:
    missing = [n for n in index.order if n not in node_seconds]
    if missing:
        raise PlanError(
            f"the node times do not cover this graph: {len(missing)} of its {len(index.order)} nodes have no time "
            f"(e.g. {', '.join(missing[:3])}); the profile was measured on another graph. Profile this graph again."
        )
