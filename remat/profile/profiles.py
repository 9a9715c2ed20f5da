"""A Profile: what one profiled iteration measured (time and memory of every node, every
tensor's role and lifetime, the peak and its breakdown), and its versioned JSON file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx

from remat.memory.analysis import ROLES, Role
from remat.capture.train_graph import TrainGraph
from remat.errors import PlanError
from remat.serialize import check_fields, dump_document, load_document
from remat.memory.simulator import Timeline
from remat.profile.time_model import OpCosts, synchronous

from remat.capture.train_graph import Phase

PHASES: tuple[str, ...] = tuple(p.value for p in Phase)


PROFILE_FORMAT = "remat.profile"


PROFILE_VERSION = 1


@dataclass
class NodeProfile:
    """One node of the iteration. Bytes are counted above what was live before the step."""

    name: str
    target: str  # the op, e.g. "aten.addmm.default"
    phase: str
    seconds: float  # median over the timed runs, scaled so the nodes add up to the median run (time_model.scaled_to_runs)
    allocated_bytes: int  # bytes allocated while it ran, outputs and scratch (CUDA: the most added at once)
    live_bytes_after: int  # bytes the step holds once it ran and dead values were dropped
    peak_bytes: int  # the most bytes the step held while it ran
    host_seconds: float | None = None  # CUDA: median time to issue it (a CPU runs it as it issues it: `seconds`)


@dataclass
class TensorProfile:
    """One storage of the graph (see analysis.TensorInfo) with its inactive time."""

    id: int
    node: str
    role: str
    nbytes: int
    created: int
    last_forward_use: int | None
    first_backward_use: int | None
    last_use: int
    persistent: bool
    inactive_seconds: float | None  # activations: run time strictly between last forward and first backward use


@dataclass
class Profile:
    """Everything measured and predicted about one captured iteration, saved as JSON."""

    device: str
    fingerprint: str  # graph_fingerprint() of the graph profiled
    nodes: list[NodeProfile]
    tensors: list[TensorProfile]
    phase_bounds: dict[str, tuple[int, int]]  # phase -> [first rank, last rank + 1)
    phase_seconds: dict[str, float]
    iteration_seconds: float  # sum of the nodes' times: the median run
    persistent_by_role: dict[str, int]
    persistent_bytes: int
    simulated_peak_bytes: int
    simulated_step_peak_bytes: int
    peak_rank: int
    peak_breakdown: dict[str, int]  # role -> bytes live at the simulated peak, persistent included
    measured_step_peak_bytes: int
    measured_peak_bytes: int  # persistent + measured step peak
    timeline: dict[str, list[int]]  # role -> non-persistent bytes live during each rank (simulated)
    warmup: int = 1
    runs: int = 3
    line_seconds: float = 0.0  # per op, the generated code's cost that node timing misses (time_model.line_seconds)
    first_touch_seconds_per_byte: float = 0.0  # writing freshly mapped pages (time_model.first_touch_seconds_per_byte)
    model: str | None = None
    batch_size: int | None = None
    optimizer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # every node's and tensor's profile: the fields and to_dict() have them
        return (
            f"Profile(device={self.device!r}, nodes={len(self.nodes)}, iteration_seconds={self.iteration_seconds:.4g}, "
            f"simulated_peak_bytes={self.simulated_peak_bytes:,}, measured_peak_bytes={self.measured_peak_bytes:,})"
        )

    # ------------------------------------------------------------------ views

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def nodes_per_phase(self) -> dict[str, int]:
        counts = {}
        for phase in PHASES:
            lo, hi = self.phase_bounds.get(phase, (0, 0))
            counts[phase] = hi - lo
        return counts

    def activations(self) -> list[TensorProfile]:
        return [t for t in self.tensors if t.role == Role.ACTIVATION.value]

    @property
    def num_activations(self) -> int:
        return len(self.activations())

    @property
    def node_seconds(self) -> np.ndarray:
        return np.array([n.seconds for n in self.nodes], dtype=np.float64)

    def op_costs(self) -> OpCosts:
        """Each node's host and device cost (time_model): on a CPU the node's time is both
        its issuing and its running, and only the generated code's line is added as host
        cost; on CUDA the host cost is the measured issuing plus that line."""
        line = self.line_seconds
        return OpCosts(
            host={n.name: line + (n.host_seconds or 0.0) for n in self.nodes},
            device={n.name: n.seconds for n in self.nodes},
            synchronous=synchronous(self.device),
            first_touch_seconds_per_byte=self.first_touch_seconds_per_byte,
        )

    def seconds_by_node(self) -> dict[str, float]:
        """Node name -> what one run of it costs the step (time_model.op_seconds): what the planners take."""
        return self.op_costs().seconds_by_node()

    def scratch_by_node(self) -> dict[str, int]:
        """Bytes each node held beyond what the simulator sees: its kernel's scratch.

        The measured peak while a node ran, less the simulated bytes live during it; the
        simulator adds these back so that predictions include oneDNN/cuDNN workspaces.
        """
        during = self.to_timeline().during
        return {n.name: max(0, int(n.peak_bytes) - int(during[i])) for i, n in enumerate(self.nodes) if n.peak_bytes > during[i]}

    def to_timeline(self) -> Timeline:
        """The simulated timeline back from its stored per-role arrays."""
        by_role = {r.value: np.asarray(self.timeline.get(r.value, [0] * self.num_nodes), dtype=np.int64) for r in ROLES}
        during = np.sum(list(by_role.values()), axis=0) if by_role else np.zeros(0, dtype=np.int64)
        return Timeline(
            during=np.asarray(during, dtype=np.int64),
            by_role=by_role,
            persistent_by_role=dict(self.persistent_by_role),
            persistent_bytes=self.persistent_bytes,
        )

    def check_graph(self, tg: TrainGraph) -> None:
        """Refuse to use this profile for a graph other than the one it measured.

        The graph fingerprint (ops and input shapes) first; then every node's name, op
        and phase, which the fingerprint does not cover: an edited profile would time
        nodes this graph does not have.
        """
        fp = graph_fingerprint(tg)
        if fp != self.fingerprint:
            what = f" ({self.model}, batch {self.batch_size})" if self.model else ""
            raise PlanError(
                f"this profile{what} was measured on another graph (fingerprint {self.fingerprint[:12]}…, "
                f"this graph {fp[:12]}…): the model, optimizer or batch shape differ. Profile this graph again."
            )
        ops = tg.op_nodes()
        if len(ops) != len(self.nodes):
            raise PlanError(
                f"this profile has {len(self.nodes)} nodes, but this graph {len(ops)}: the profile was edited, or measured "
                "on another graph. Profile this graph again."
            )
        for i, (mine, node) in enumerate(zip(self.nodes, ops)):
            theirs = (node.name, target_name(node.target), tg.phase[node.name].value)
            if (mine.name, mine.target, mine.phase) != theirs:
                raise PlanError(
                    f"this profile's node {i} is {mine.name} ({mine.target}, {mine.phase}), but this graph's node {i} is "
                    f"{theirs[0]} ({theirs[1]}, {theirs[2]}): the profile was edited, or measured on another graph. "
                    "Profile this graph again."
                )

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> "Profile":
        """A profile from its JSON object, refused (PlanError, naming the field) unless every
        field is there, of its type, and the fields agree with each other."""
        where = f"malformed remat profile {where}"
        check_fields(d, cls, where, PROFILE_SIGNS)
        d = {k: v for k, v in d.items() if k not in ("format", "version")}
        _check_consistent(d, where)
        d["nodes"] = [NodeProfile(**n) for n in d["nodes"]]
        d["tensors"] = [TensorProfile(**t) for t in d["tensors"]]
        d["phase_bounds"] = {k: (v[0], v[1]) for k, v in d["phase_bounds"].items()}
        return cls(**d)

    def to_json(self, path: str | Path) -> Path:
        return dump_document(path, PROFILE_FORMAT, PROFILE_VERSION, self.to_dict())

    @classmethod
    def from_json(cls, path: str | Path) -> "Profile":
        return cls.from_dict(load_document(path, PROFILE_FORMAT, PROFILE_VERSION), where=str(path))


def _check_consistent(d: dict[str, Any], where: str) -> None:
    """Refuse a profile (already of the right types) whose fields disagree with each other."""
    n = len(d["nodes"])
    roles = [r.value for r in ROLES]

    def refuse(detail: str) -> PlanError:
        return PlanError(f"{where}: {detail}")

    names: dict[str, int] = {}
    for i, node in enumerate(d["nodes"]):
        if node["name"] in names:
            raise refuse(f"nodes[{i}] repeats the name {node['name']} of nodes[{names[node['name']]}]")
        names[node["name"]] = i
        if node["phase"] not in PHASES:
            raise refuse(f"nodes[{i}].phase is {node['phase']!r}, not one of {', '.join(PHASES)}")
    for field_name in ("timeline", "persistent_by_role", "peak_breakdown"):
        odd = [k for k in d[field_name] if k not in roles]
        if odd:
            raise refuse(f"{field_name} has the role(s) {', '.join(odd)}, not one of {', '.join(roles)}")
    for role, values in d["timeline"].items():
        if len(values) != n:
            raise refuse(f"timeline[{json.dumps(role)}] has {len(values)} entries, but the profile has {n} nodes")
    odd = [k for k in d["phase_bounds"] if k not in PHASES]
    if odd:
        raise refuse(f"phase_bounds has the phase(s) {', '.join(odd)}, not one of {', '.join(PHASES)}")
    for phase, (lo, hi) in d["phase_bounds"].items():
        if not 0 <= lo <= hi <= n:
            raise refuse(f"phase_bounds[{json.dumps(phase)}] is [{lo}, {hi}], not within the {n} nodes")
    if not -1 <= d["peak_rank"] < max(n, 1):
        raise refuse(f"peak_rank is {d['peak_rank']}, outside the {n} nodes")
    ids: dict[int, int] = {}
    for i, t in enumerate(d["tensors"]):
        if t["id"] in ids:
            raise refuse(f"tensors[{i}] repeats the id {t['id']} of tensors[{ids[t['id']]}]")
        ids[t["id"]] = i
        if t["role"] not in roles:
            raise refuse(f"tensors[{i}].role is {t['role']!r}, not one of {', '.join(roles)}")
        # Ranks: -1 is "before the step" (inputs), n "after it" (what outlives the step).
        for key, lo, hi in (("created", -1, n - 1), ("last_use", -1, n), ("last_forward_use", 0, n - 1), ("first_backward_use", 0, n - 1)):
            v = t[key]
            if v is not None and not lo <= v <= hi:
                raise refuse(f"tensors[{i}].{key} is {v}, outside the {n} nodes")


def target_name(target: Any) -> str:
    """The op as text: "aten.addmm.default" for aten ops, "operator.getitem" for Python ones."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001 - any callable still gets a name
        return getattr(target, "__name__", repr(target))


def graph_fingerprint(tg: TrainGraph) -> str:
    """sha256 of the op sequence and the inputs' kinds, shapes and dtypes.

    A saved profile or plan carries it, so that it is never applied to another graph.
    """
    h = hashlib.sha256()
    for inp in tg.inputs:
        h.update(f"input {inp.kind.value} {tuple(inp.shape)} {inp.dtype}\n".encode())
    for node in tg.op_nodes():
        h.update(f"op {target_name(node.target)}\n".encode())
    return h.hexdigest()


# Fields that are counts, bytes or seconds: a negative one is an edited or broken file. The
# nodes' live and peak bytes are counted above what was live before the step, and a step
# may free some of that (gradients set to None): those may be negative.
PROFILE_SIGNS: dict[type, dict[str, str]] = {
    Profile: {
        **{k: "non-negative" for k in (
            "phase_seconds", "iteration_seconds", "persistent_by_role", "persistent_bytes", "simulated_peak_bytes",
            "simulated_step_peak_bytes", "peak_breakdown", "timeline", "warmup", "phase_bounds",
        )},
        "runs": "positive",
        "batch_size": "positive",
    },
    NodeProfile: {"seconds": "non-negative", "allocated_bytes": "non-negative"},
    TensorProfile: {"nbytes": "non-negative", "inactive_seconds": "non-negative"},
}  # fmt: skip
