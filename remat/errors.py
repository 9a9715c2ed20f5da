"""Errors remat raises on purpose: each names the problem and what to do about it."""

from __future__ import annotations

from typing import Any, Callable


class RematError(Exception):
    """Base class: a user-facing problem (bad input, unsupported model, impossible budget)."""


class CaptureError(RematError):
    """The training step could not be captured as one graph."""


class ChangedSinceCompiled(CaptureError):
    """The parameters trained or the optimizer's parameters changed since a graph was
    compiled (a layer frozen or unfrozen, `add_param_group`): that graph cannot run the
    step, and the step compiles a new one. `change` says what changed."""

    def __init__(self, change: str):
        super().__init__(f"{change}; compile the step again (remat.compile) for it")
        self.change = change


class BatchValueChanged(RematError):
    """A batch's values give another size, or send a branch another way, than the batch the
    step was compiled with: the graph holds the compiled batch's (ops/known_values.py)."""


class StateValueChanged(RematError):
    """A value of the model's own state (a buffer: an initialisation flag, a step counter)
    sends a branch of the step another way than when its graph was compiled, which holds the
    side the value gave then (ops/value_checks.py). Raised before the step changed anything
    (`before_any_change`), the step compiles a graph for the value as it is now and runs
    that; raised later, the step stops there."""

    before_any_change = False
    UNDER_DATA_PARALLEL = (
        "remat: under DDP or FSDP2 the step is not compiled again (every rank would have to, together): run the steps "
        "before this branch turns eagerly (an optimizer's warm-up branch: RAdam's first 6 steps), then compile the step"
    )

    @property
    def change(self) -> str:  # as ChangedSinceCompiled's, for the warning that the step compiles again
        return str(self).split(". ")[0]


class UsageError(RematError):
    """Bad arguments (a command-line option, a model name, a size): the message says which."""


class BudgetError(RematError):
    """A memory budget could not be parsed, or no plan fits it.

    `reach`, where a planner knows it: the smallest peak its plans reach (`plan.Reach`),
    for callers that retry at it rather than read the message. Pinning it down can take
    seconds, and a planner that fails on one graph often succeeds on another, so it may be
    given as a function, called on first use, with the message as a function of it."""

    def __init__(self, message: str | Callable[[Any], str], reach: Any = None, headline: str = "no plan fits the budget"):
        super().__init__(message if isinstance(message, str) else "")
        self._message, self._reach, self._headline = message, reach, headline

    @property
    def reach(self) -> Any:
        if callable(self._reach):
            self._reach = self._reach()
        return self._reach

    def brief(self) -> str:
        """The message's first line where it is known; where it waits on the reach, that no
        plan fits, without pinning the reach down (for a record of a plan not chosen)."""
        if isinstance(self._message, str):
            return self._message.splitlines()[0] if self._message else ""
        return f"{self._headline} (its smallest reachable peak was not worked out, as another plan was kept)"

    def __str__(self) -> str:
        if not isinstance(self._message, str):
            self._message = self._message(self.reach)
            self.args = (self._message,)
        return self._message


class PlanError(RematError):
    """A plan or profile does not belong to this graph, or is malformed."""
