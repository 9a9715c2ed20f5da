"""Refuse a step that sets the global random-number generator's state while it runs.

Random ops are recorded in the graph and draw from the generator when the graph runs;
`torch.manual_seed`, `torch.set_rng_state` or `torch.random.fork_rng` inside the step run
once, while it is traced, and are not in the graph. The graph's dropout masks, and the
generator's state after each step, would then differ from eager's, with no error.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from remat.errors import CaptureError

_SETTERS = ("manual_seed", "set_rng_state", "seed")


def _refusal(what: str) -> CaptureError:
    return CaptureError(
        f"train_step {what} while it runs, which one captured graph cannot repeat: the graph's random ops draw from "
        "the generator as it is when each step runs. Seed or fork the generator outside train_step (before the "
        "loop, or between steps), not inside it."
    )


@contextlib.contextmanager
def no_rng_state_set() -> Iterator[None]:
    """Around the user's step while it is traced: refuse a call that sets the CPU or a
    CUDA generator's state, and any other change to the CPU generator's state."""
    before = torch.get_rng_state()
    saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def refusing(name: str) -> Callable[..., Any]:
        also = " (torch.random.fork_rng does when it ends)" if name.startswith("set_rng_state") else ""

        def call(*args: Any, **kwargs: Any) -> Any:
            raise _refusal(f"calls torch.{name}(){also}")

        return call

    modules = [torch, torch.random] + ([torch.cuda] if torch.cuda.is_available() else [])
    for module in modules:
        for name in _SETTERS + (("manual_seed_all", "set_rng_state_all") if module is torch.cuda else ()):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refusing(name))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    if not torch.equal(before, torch.get_rng_state()):
        torch.set_rng_state(before)
        raise _refusal("changes the random-number generator's state")
