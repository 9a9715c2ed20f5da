"""Memory simulator: the live-bytes timeline of a graph from its storages' lifetimes.

A storage occupies its bytes from the step that creates it through the step of its last
use, inclusive: "during step r" counts what r allocates and what it still reads, which is
when the allocator's peak happens. Persistent storages (inputs, constants) are counted
once, outside the timeline, as the executor's caller holds them before and after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.analysis import ROLES, GraphAnalysis, Role


@dataclass
class Timeline:
    """Bytes live during each step of an execution order (the step itself included)."""

    during: np.ndarray  # int64 [n_steps]: non-persistent bytes live while step r runs
    by_role: dict[str, np.ndarray]  # role -> int64 [n_steps], sums to `during`
    persistent_by_role: dict[str, int]
    persistent_bytes: int

    @property
    def peak_rank(self) -> int:
        return int(np.argmax(self.during)) if len(self.during) else 0

    @property
    def step_peak_bytes(self) -> int:
        """The most bytes the step itself holds at once: what recomputation shrinks."""
        return int(self.during.max()) if len(self.during) else 0

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + self.step_peak_bytes

    def breakdown_at(self, rank: int) -> dict[str, int]:
        """Bytes per role live during step `rank`, persistent ones included."""
        out = {r.value: self.persistent_by_role.get(r.value, 0) for r in ROLES}
        for role, arr in self.by_role.items():
            out[role] += int(arr[rank]) if len(arr) else 0
        return out

    def breakdown_at_peak(self) -> dict[str, int]:
        return self.breakdown_at(self.peak_rank)


def round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity if granularity > 1 else nbytes


def persistent_by_role(tensors: list, granularity: int = 1) -> dict[str, int]:
    """Bytes held before and after the step (parameters, buffers, optimizer state, inputs),
    by role: the one definition the simulator, the schedule's simulation and the bound use."""
    out: dict[str, int] = {}
    for t in tensors:
        if t.persistent:
            out[t.role.value] = out.get(t.role.value, 0) + round_up(t.nbytes, granularity)
    return out


def simulate_intervals(
    n_steps: int,
    nbytes: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    roles: list[str],
    persistent_by_role: dict[str, int],
    scratch: np.ndarray | None = None,
) -> Timeline:
    """Timeline of storages each live over steps [start, end] (inclusive, clipped to the order).

    `scratch[r]`: bytes step r's kernel holds only while it runs (counted as "other").
    """
    during = np.zeros(n_steps, dtype=np.int64)
    by_role: dict[str, np.ndarray] = {}
    roles_arr = np.asarray(roles)
    start = np.clip(start, 0, max(n_steps - 1, 0))
    end = np.clip(end, 0, max(n_steps - 1, 0))
    for role in ROLES:
        mask = roles_arr == role.value
        diff = np.zeros(n_steps + 1, dtype=np.int64)
        if mask.any():
            np.add.at(diff, start[mask], nbytes[mask])
            np.add.at(diff, end[mask] + 1, -nbytes[mask])
        arr = np.cumsum(diff[:-1])
        if role is Role.OTHER and scratch is not None:
            arr = arr + scratch.astype(np.int64)
        by_role[role.value] = arr
        during += arr
    return Timeline(
        during=during,
        by_role=by_role,
        persistent_by_role=persistent_by_role,
        persistent_bytes=sum(persistent_by_role.values()),
    )


def simulate(analysis: GraphAnalysis, granularity: int = 1, scratch: dict[str, int] | None = None) -> Timeline:
    """The timeline of the graph as analysed, in its own order (no recomputation).

    `granularity` rounds each storage up as the allocator does (512 bytes on CUDA);
    `scratch` adds each node's measured kernel scratch (Profile.scratch_by_node()).
    """
    transient = [t for t in analysis.tensors if not t.persistent]
    return simulate_intervals(
        analysis.num_nodes,
        np.array([round_up(t.nbytes, granularity) for t in transient], dtype=np.int64),
        np.array([t.created for t in transient], dtype=np.int64),
        np.array([t.last_use for t in transient], dtype=np.int64),
        [t.role.value for t in transient],
        persistent_by_role(analysis.tensors, granularity),
        np.array([scratch.get(n, 0) for n in analysis.node_names], dtype=np.int64) if scratch else None,
    )


def activation_role_bytes(timeline: Timeline, rank: int) -> int:
    return int(timeline.by_role[Role.ACTIVATION.value][rank])
