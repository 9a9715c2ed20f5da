"""Accelerate's `accumulate()` inside a compiled step: what remat knows of its count.

`with accelerator.accumulate(model):` counts its calls in `accelerator.step` and sets
`sync_gradients`, which the prepared optimizer, scheduler and the user's own code branch
on: the optimizer steps at every `gradient_accumulation_steps`-th call, and at the last
batch of a prepared loader, where the count starts again. The step's graph depends on that
branch, so the branch is in the step's key (one graph for the calls that accumulate, one
for those that step), and the count is moved after each run as `Accelerator._do_sync`
moves it. Imported by the capture once Accelerate is (library_objects.INTEGRATIONS); the
capture checks, at each capture, that the trace left the count and the branch as
`next_sync` says, so a version of Accelerate that counts otherwise is refused, not followed
wrongly.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from remat.capture.state import library_objects


def next_sync(accelerator: Any) -> tuple[int, bool]:
    """The count `accumulate()` leaves and whether that call syncs (steps the optimizer), as
    `Accelerator._do_sync` decides it from the accelerator as the call finds it."""
    state = accelerator.gradient_state
    if state.sync_with_dataloader and state.end_of_dataloader:
        return 0, True
    count = accelerator.step + 1
    return count, count % state.num_steps == 0


library_objects.counted_branch(Accelerator, "step", next_sync, Accelerator._do_sync)
