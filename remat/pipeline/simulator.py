"""Memory simulator: the live-bytes timeline of a graph from its storages' lifetimes.

A storage occupies its bytes from the step that creates it through the step of its last
use, inclusive: "during step r" counts what r allocates and what it still reads, which is
when the allocator's peak happens. Persistent storages (inputs, constants) are counted
once, outside the timeline, as the executor's caller holds them before and after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.pipeline.analysis import ROLES, GraphAnalysis, Role, persistent_by_role, round_up
from remat.pipeline.graph_index import GraphIndex
from remat.pipeline.schedule import ORIGINAL, Schedule


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


@dataclass
class ScheduleIntervals:
    """Each storage instance a schedule makes, one row each: its bytes, the steps [start,
    end] it is live over, and its role."""

    nbytes: np.ndarray
    start: np.ndarray
    end: np.ndarray
    roles: list[str]
    # Where asked for (`touches`): the rows each copy step makes or reads, and the last step
    # that is not a copy to make or read each row (-1 for none).
    touched_by_copy: dict[int, list[int]] | None = None
    last_plain_touch: np.ndarray | None = None


def schedule_intervals(index: GraphIndex, schedule: Schedule, granularity: int = 1, touches: bool = False) -> ScheduleIntervals:
    """The storage instances of running `schedule` and when each is live (the simulator's
    conventions, module docstring). Generator states held for replay are not among them.
    `touches`: also record which instances each copy makes or reads."""
    tensors = index.analysis.tensors
    storages, persistent = index.storages, index.persistent
    n_tensors = len(tensors)
    n_steps = len(schedule.steps)
    start: dict[int, int] = {}
    end: dict[int, int] = {}  # steps run in order: a key's last step so far is its end so far
    source: dict[int, int] = {}  # key -> the storage whose bytes and role it has
    # An original storage is keyed by its id; each rebuilt instance's fresh storage gets a
    # new key. A view or in-place result shares the key of the input it aliases *as read
    # in this step*, so a backward view of a rebuilt value lives in the rebuilt storage.
    value_keys: dict[tuple[str, int], list[int]] = {}
    next_key = n_tensors
    touched: dict[int, list[int]] = {}
    plain: dict[int, int] = {}
    no_storages: list[int] = []
    for i, (step, reads) in enumerate(zip(schedule.steps, schedule.reads)):
        inherited: dict[int, int] = {}
        for a, instance in reads:
            sids = storages.get(a, no_storages)
            if sids:
                for s, k in zip(sids, value_keys.get((a, instance), sids)):
                    inherited[s] = k
                    if k in start:
                        end[k] = i
        own: list[int] = []
        copy = step.instance != ORIGINAL
        for s in storages.get(step.node, no_storages):
            k = inherited.get(s)
            if k is None:
                if copy:
                    k, next_key = next_key, next_key + 1
                else:
                    k = s
            own.append(k)
            if k in start:
                end[k] = i
            elif k >= n_tensors or k not in persistent:
                start[k] = end[k] = i
                source[k] = s
        value_keys[(step.node, step.instance)] = own
        if touches and copy:
            touched[i] = own + list(inherited.values())
        elif touches:
            for k in own + list(inherited.values()):
                plain[k] = i
    for a, instance in schedule.output_reads:
        sids = storages.get(a, no_storages)
        for k in value_keys.get((a, instance), sids):
            if k in start:
                end[k] = n_steps
    ks = sorted(start)
    row = {k: j for j, k in enumerate(ks)} if touches else {}
    return ScheduleIntervals(
        nbytes=np.array([round_up(tensors[source[k]].nbytes, granularity) for k in ks], dtype=np.int64),
        start=np.array([start[k] for k in ks], dtype=np.int64),
        end=np.array([end[k] for k in ks], dtype=np.int64),
        roles=[tensors[source[k]].role.value for k in ks],
        touched_by_copy={i: sorted({row[k] for k in keys if k in row}) for i, keys in touched.items()} if touches else None,
        last_plain_touch=np.array([plain.get(k, -1) for k in ks], dtype=np.int64) if touches else None,
    )


def simulate_schedule(index: GraphIndex, schedule: Schedule, granularity: int = 1, made: ScheduleIntervals | None = None) -> Timeline:
    """The memory timeline of running `schedule` (see simulator.py for the conventions);
    `made`: its `schedule_intervals` at this granularity, where already worked out."""
    made = made if made is not None else schedule_intervals(index, schedule, granularity)
    extra = replay_state_intervals(index, schedule)
    return simulate_intervals(
        len(schedule.steps),
        np.concatenate([made.nbytes, np.array([b for b, _, _, _ in extra], dtype=np.int64)]),
        np.concatenate([made.start, np.array([lo for _, lo, _, _ in extra], dtype=np.int64)]),
        np.concatenate([made.end, np.array([hi for _, _, hi, _ in extra], dtype=np.int64)]),
        made.roles + [Role.OTHER.value] * len(extra),
        persistent_by_role(index.analysis.tensors, granularity),
        np.array([index.scratch.get(s.node, 0) for s in schedule.steps], dtype=np.int64) if index.scratch else None,
    )


def replay_state_intervals(index: GraphIndex, schedule: Schedule) -> list[tuple[int, int, int, str]]:
    """(bytes, first step, last step, random op) of each generator state a schedule holds
    for replay: saved just before a random op runs, held through its last copy."""
    bytes_of = {n: index.replay_state_bytes(n) for n in {s.node for s in schedule.steps if s.copy}}
    original: dict[str, int] = {}
    last_copy: dict[str, int] = {}
    for i, step in enumerate(schedule.steps):
        if not step.copy:
            original[step.node] = i
        elif bytes_of.get(step.node):
            last_copy[step.node] = i
    return [(bytes_of[n], original[n], hi, n) for n, hi in last_copy.items()]
