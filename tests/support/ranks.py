"""What the multi-process tests share: two gloo ranks with deadlines, and a digest of tensors to compare ranks by."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from remat.launch import run_ranks

DEADLINE = 300  # seconds for a whole two-rank run
PG_TIMEOUT = 60  # seconds a collective may wait


def two_ranks(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(*args)` on two spawned ranks (a process-group timeout and an overall deadline,
    so that a hang fails the test instead of CI); each rank's result, in rank order."""
    return run_ranks(fn, 2, args, timeout_s=DEADLINE, pg_timeout_s=PG_TIMEOUT)


def digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
