"""Errors remat raises on purpose: each names the problem and what to do about it."""


class RematError(Exception):
    """Base class: a user-facing problem (bad input, unsupported model, impossible budget)."""


class CaptureError(RematError):
    """The training step could not be captured as one graph."""


class UsageError(RematError):
    """Bad arguments (a command-line option, a model name, a size): the message says which."""


class BudgetError(RematError):
    """A memory budget could not be parsed, or no plan fits it.

    `reach`, where a planner knows it: the smallest peak its plans reach (`plan.Reach`),
    for callers that retry at it rather than read the message."""

    def __init__(self, message: str, reach: object | None = None):
        super().__init__(message)
        self.reach = reach


class PlanError(RematError):
    """A plan or profile does not belong to this graph, or is malformed."""
