"""Memory simulator: the live-bytes timeline of a graph from its storages' lifetimes.

A storage occupies its bytes from the step that creates it through the step of its last
use, inclusive: "during step r" counts what r allocates and what it still reads, which is
when the allocator's peak happens. Persistent storages (inputs, constants) are counted
once, outside the timeline, as the executor's caller holds them before and after the step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from remat.memory.analysis import ROLES, GraphAnalysis, Role, persistent_by_role, round_up
from remat.memory.graph_index import GraphIndex
from remat.memory.schedule import ORIGINAL, Schedule


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
    `scratch` adds each node's measured kernel scratch (Profile.scratch_by_node()), beside
    what the graph tells a node holds while it runs (`analysis.held_while_running`).
    """
    transient = [t for t in analysis.tensors if not t.persistent]
    held = {**(scratch or {})}
    for n, b in analysis.held_while_running.items():
        held[n] = held.get(n, 0) + b
    return simulate_intervals(
        analysis.num_nodes,
        np.array([round_up(t.nbytes, granularity) for t in transient], dtype=np.int64),
        np.array([t.created for t in transient], dtype=np.int64),
        np.array([t.last_use for t in transient], dtype=np.int64),
        [t.role.value for t in transient],
        persistent_by_role(analysis.tensors, granularity),
        np.array([held.get(n, 0) for n in analysis.node_names], dtype=np.int64) if held else None,
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
    # Where asked for (`touches`): each (copy step, row) touch of a copy making or reading a
    # row, as two arrays (a pair may repeat), and the last step that is not a copy to make
    # or read each row (-1 for none).
    copy_touches: tuple[np.ndarray, np.ndarray] | None = None
    last_plain_touch: np.ndarray | None = None


@dataclass
class _CapturedTouches:
    """Every (step, storage) touch of the captured order, one entry each: the node's rank,
    the storage, and whether the node makes it (own) or reads it. A schedule runs most
    nodes as captured, so their touches are taken from here in bulk."""

    rank: np.ndarray
    key: np.ndarray
    own: np.ndarray  # bool: the node makes a value on this storage
    nbytes: np.ndarray  # per storage id
    roles: np.ndarray  # per storage id: its role's value
    persistent: np.ndarray  # per storage id: bool, held by the caller


def _captured_touches(index: GraphIndex) -> _CapturedTouches:
    cache = index.__dict__.get("_captured_touches")
    if cache is None:
        storages = index.storages
        touches = [
            (r, s, made)
            for r, u in enumerate(index.order)
            for a, made in [*((a, 0) for a in index.inputs[u]), (u, 1)]
            for s in storages.get(a, ())
        ]
        table = np.array(touches, dtype=np.int64).reshape(-1, 3)
        tensors = index.analysis.tensors
        cache = index.__dict__["_captured_touches"] = _CapturedTouches(
            rank=table[:, 0],
            key=table[:, 1],
            own=table[:, 2].astype(bool),
            nbytes=np.array([t.nbytes for t in tensors], dtype=np.int64),
            roles=np.array([t.role.value for t in tensors], dtype=object),
            persistent=np.array([t.persistent for t in tensors], dtype=bool),
        )
    return cache


def _positions(index: GraphIndex, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Where each captured node runs in `schedule` (by rank; -1: removed), and which steps
    are copies: the nodes that are not copies run in their captured order. Kept with the
    schedule, which both its intervals and its scratch read."""
    cached = schedule.__dict__.get("_positions")
    if cached is not None:
        return cached
    position = np.full(len(index.order), -1, dtype=np.int64)
    is_copy = np.zeros(len(schedule.steps), dtype=bool)
    is_copy[schedule.copy_positions] = True
    kept = np.ones(len(index.order), dtype=bool)
    kept[[index.rank[n] for n in schedule.removed]] = False
    position[kept] = np.flatnonzero(~is_copy)
    schedule.__dict__["_positions"] = (position, is_copy)
    return position, is_copy


def _persistent_by_role(index: GraphIndex, granularity: int) -> dict[str, int]:
    """The same for every schedule of the index: worked out once per granularity."""
    cache = index.__dict__.setdefault("_persistent_by_role", {})
    if granularity not in cache:
        cache[granularity] = persistent_by_role(index.analysis.tensors, granularity)
    return dict(cache[granularity])


def _scratch(index: GraphIndex, schedule: Schedule) -> np.ndarray | None:
    """Each step's kernel scratch bytes, with the generator state a replayed copy sets aside
    while it runs (None where there is neither)."""
    replays = [i for i in schedule.copy_positions if schedule.steps[i].node in index.replayable]
    if not index.scratch and not replays:
        return None
    out = _measured_scratch(index, schedule) if index.scratch else np.zeros(len(schedule.steps), dtype=np.int64)
    for i in replays:
        out[i] += index.replay_state_bytes(schedule.steps[i].node)
    return out


def _measured_scratch(index: GraphIndex, schedule: Schedule) -> np.ndarray:
    """Each step's kernel scratch as the profile measured it (a copy's is its original's)."""
    by_rank = index.__dict__.get("_scratch_by_rank")
    if by_rank is None or by_rank[0] is not index.scratch:
        by_rank = index.__dict__["_scratch_by_rank"] = (index.scratch, np.array([index.scratch.get(n, 0) for n in index.order], dtype=np.int64))
    position, is_copy = _positions(index, schedule)
    out = np.zeros(len(schedule.steps), dtype=np.int64)
    ran = position >= 0
    out[position[ran]] = by_rank[1][ran]
    for i in schedule.copy_positions:
        out[i] = index.scratch.get(schedule.steps[i].node, 0)
    return out


def schedule_intervals(index: GraphIndex, schedule: Schedule, granularity: int = 1, touches: bool = False) -> ScheduleIntervals:
    """The storage instances of running `schedule` and when each is live (the simulator's
    conventions, module docstring). Generator states held for replay are not among them.
    `touches`: also record which instances each copy makes or reads.

    An original storage is keyed by its id; each rebuilt instance's fresh storage gets a
    new key. A view or in-place result shares the key of the input it aliases *as read in
    this step*, so a backward view of a rebuilt value lives in the rebuilt storage. A key
    lives from the first step that makes it (never for a persistent storage, which the
    caller holds) through the last step that makes or reads it, or the end where the
    graph's output reads it. Steps that run as captured and read values as captured touch
    the storages they touched in the captured order: taken in bulk. The rest (copies, the
    nodes their blocks precede, and readers of a value they left on a rebuilt key) follow
    the rules step by step."""
    storages = index.storages
    n_tensors, n_steps = len(index.analysis.tensors), len(schedule.steps)
    captured = _captured_touches(index)

    position, is_copy = _positions(index, schedule)

    step_by_step = set(schedule.copy_positions) | {int(position[index.rank[u]]) for u in schedule.resolved}
    pending = sorted(step_by_step)
    pos: list[int] = []
    key: list[int] = []
    own_flag: list[bool] = []
    source: dict[int, int] = {}  # new key -> the storage whose bytes and role it has
    value_keys: dict[tuple[str, int], list[int]] = {}  # values whose keys are not their storages'
    next_key = n_tensors
    touched_at: list[int] = []  # the copy steps' touches (`touches`): step, key
    touched_key: list[int] = []
    no_storages: list[int] = []
    while pending:
        i = heapq.heappop(pending)
        step, reads = schedule.steps[i], schedule.reads[i]
        inherited: dict[int, int] = {}
        for a, instance in reads:
            sids = storages.get(a, no_storages)
            for s, k in zip(sids, value_keys.get((a, instance), sids)):
                inherited[s] = k
                pos.append(i), key.append(k), own_flag.append(False)
        own: list[int] = []
        copy = step.instance != ORIGINAL
        sids = storages.get(step.node, no_storages)
        for s in sids:
            k = inherited.get(s)
            if k is None:
                if copy:
                    k, next_key = next_key, next_key + 1
                    source[k] = s
                else:
                    k = s
            own.append(k)
            pos.append(i), key.append(k), own_flag.append(True)
        if copy:
            value_keys[(step.node, step.instance)] = own
            if touches:
                touched_key.extend(own)
                touched_key.extend(inherited.values())
                touched_at.extend([i] * (len(own) + len(inherited)))
        elif own != sids:
            # Its readers read it on a rebuilt key: they follow the rules too.
            value_keys[(step.node, ORIGINAL)] = own
            for u in index.users[step.node]:
                j = int(position[index.rank[u]])
                if j > i and j not in step_by_step:
                    step_by_step.add(j)
                    heapq.heappush(pending, j)

    # The captured touches of every other step, at its position in the schedule.
    at = position[captured.rank]
    bulk = at >= 0
    if step_by_step:
        by_rules = np.zeros(n_steps, dtype=bool)
        by_rules[list(step_by_step)] = True
        bulk &= ~by_rules[np.maximum(at, 0)]
    all_pos = np.concatenate([at[bulk], np.array(pos, dtype=np.int64)])
    all_key = np.concatenate([captured.key[bulk], np.array(key, dtype=np.int64)])
    all_own = np.concatenate([captured.own[bulk], np.array(own_flag, dtype=bool)])

    n_keys = next_key
    persistent = np.concatenate([captured.persistent, np.zeros(n_keys - n_tensors, dtype=bool)])  # new keys never are
    start = np.full(n_keys, n_steps, dtype=np.int64)
    makes = all_own & ~persistent[all_key]
    np.minimum.at(start, all_key[makes], all_pos[makes])
    end = np.full(n_keys, -1, dtype=np.int64)
    np.maximum.at(end, all_key, all_pos)
    for a, instance in schedule.output_reads:
        sids = storages.get(a, no_storages)
        for k in value_keys.get((a, instance), sids):
            end[k] = n_steps
    ks = np.flatnonzero(start < n_steps)
    src = ks.copy()
    new = ks >= n_tensors
    src[new] = [source[int(k)] for k in ks[new]]
    nbytes = round_up(captured.nbytes[src], granularity)
    copy_touches = last_plain_touch = None
    if touches:
        row = np.full(n_keys, -1, dtype=np.int64)
        row[ks] = np.arange(len(ks))
        rows = row[np.array(touched_key, dtype=np.int64)]
        made_rows = rows >= 0  # a key no step makes has no row
        copy_touches = (np.array(touched_at, dtype=np.int64)[made_rows], rows[made_rows])
        plain = ~is_copy[all_pos]
        last = np.full(n_keys, -1, dtype=np.int64)
        np.maximum.at(last, all_key[plain], all_pos[plain])
        last_plain_touch = last[ks]
    return ScheduleIntervals(
        nbytes=nbytes,
        start=start[ks],
        end=end[ks],
        roles=captured.roles[src].tolist(),
        copy_touches=copy_touches,
        last_plain_touch=last_plain_touch,
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
        _persistent_by_role(index, granularity),
        _scratch(index, schedule),
    )


def replay_state_intervals(index: GraphIndex, schedule: Schedule) -> list[tuple[int, int, int, str]]:
    """(bytes, first step, last step, random op) of each generator state a schedule holds
    for replay: saved just before a random op runs, held through its last copy."""
    if not index.replayable:
        return []
    copied = {schedule.steps[i].node for i in schedule.copy_positions}
    bytes_of = {n: b for n in index.replayable & copied if (b := index.replay_state_bytes(n))}
    if not bytes_of:
        return []
    last_copy: dict[str, int] = {}
    for i in schedule.copy_positions:
        if schedule.steps[i].node in bytes_of:
            last_copy[schedule.steps[i].node] = i
    positions, ranks = schedule.plain_steps(index)  # a random op is never removed: its original is among them
    original = positions[np.searchsorted(ranks, [index.rank[n] for n in last_copy])].tolist()
    return [(bytes_of[n], lo, hi, n) for (n, hi), lo in zip(last_copy.items(), original)]
