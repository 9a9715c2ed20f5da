"""Agreement between the ranks of a data-parallel step: one graph, one plan, one outcome.

Every rank must run the same rewritten graph, or their collectives pair up wrongly and
hang. So each stage that could go differently on one rank (reading the batch, capturing,
rewriting) ends in `together`: the ranks exchange whether it worked, and if it failed
anywhere, every rank raises, naming the rank and its error. The plan is made once, on
rank 0, from its profile, and sent to the others (`share_plan`); a rank's own profile
would differ by timing noise and could plan otherwise. Rank 0's measured kernel scratch
goes to every rank too (`from_root`), so that budgets and predicted peaks, which count
it, are the same numbers everywhere.

What fails inside a collective (a rank that died mid-step) surfaces as the process
group's timeout error; `note_collective_failure` says what it probably means.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from remat.errors import BudgetError, RematError
from remat.capture.distributed.data_parallel import DataParallel
from remat.planners.plan import Plan

T = TypeVar("T")

ROOT = 0  # the rank that plans


class RankFailed(RematError):
    """Another rank failed at a stage every rank must pass together."""


def together(dp: DataParallel, what: str, fn: Callable[[], T], summary: Callable[[T], Any] = lambda _: None) -> tuple[T, list[Any]]:
    """Run `fn()` here, then agree with every rank that it worked everywhere.

    Returns its result and every rank's `summary(result)` (small, picklable), so that
    callers can check that the ranks agree on it. If it raised on any rank, every rank
    raises: the failing ranks their own error, the others a RankFailed naming them.
    """
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
        mine: Any = ("ok", summary(result))
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
        mine = ("failed", f"{type(e).__name__}: {e}".splitlines()[0])
    gathered: list[Any] = [None] * dp.world_size
    dist.all_gather_object(gathered, mine, group=dp.group)
    failed = [(rank, text) for rank, (status, text) in enumerate(gathered) if status == "failed"]
    if error is not None:
        error.add_note(f"remat: rank {dp.rank} failed {what}; every rank of the process group stops with it")
        raise error
    if failed:
        rank, text = failed[0]
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise RankFailed(f"rank {rank}{others} failed {what}: {text}. Every rank stops: they must run the same graph")
    return result, [s for _, s in gathered]


def same_everywhere(values: list[Any], what: str) -> None:
    """Refuse values that differ between ranks (each rank's, in rank order)."""
    if any(v != values[0] for v in values[1:]):
        differing = next(r for r, v in enumerate(values) if v != values[0])
        raise RankFailed(
            f"the ranks differ in {what}: rank 0 has {values[0]}, rank {differing} has {values[differing]}. Every rank must "
            "capture the same graph (same model, batch shapes and settings)"
        )


def from_root(dp: DataParallel, value: Any) -> Any:
    """Rank 0's `value` on every rank (small and picklable)."""
    box = [value if dp.rank == ROOT else None]
    dist.broadcast_object_list(box, src=ROOT, group=dp.group)
    return box[0]


def share_plan(dp: DataParallel, make: Callable[[], Plan]) -> Plan:
    """`make()` on rank 0, and its plan on every rank; where it failed, its error on rank
    0 and, on the others, a BudgetError with its message (no plan fits) or a RankFailed."""
    message: list[Any] = [None]
    failure: Exception | None = None
    if dp.rank == ROOT:
        try:
            message[0] = ("plan", json.dumps(make().to_dict()))
        except Exception as e:  # noqa: BLE001 - the other ranks wait for this message
            failure = e
            message[0] = ("budget" if isinstance(e, BudgetError) else "error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(message, src=ROOT, group=dp.group)
    if failure is not None:
        raise failure
    kind, payload = message[0]
    if kind == "plan":
        return Plan.from_dict(json.loads(payload), where=f"the plan rank {ROOT} sent")
    if kind == "budget":
        raise BudgetError(f"rank {ROOT}, which plans for every rank: {payload}")
    raise RankFailed(f"rank {ROOT} failed to plan: {payload}. Every rank stops: they must run the same plan")


def note_collective_failure(error: BaseException, dp: DataParallel) -> None:
    """A step that failed on this rank while the others may be waiting in a collective."""
    error.add_note(
        f"remat: rank {dp.rank} of {dp.world_size} failed inside the data-parallel step; the other ranks stop when their "
        "next collective times out (the process group's timeout). If this is a timeout, look for the first error on another rank."
    )
