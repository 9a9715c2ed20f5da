"""Errors remat raises on purpose: each names the problem and what to do about it."""


class RematError(Exception):
    """Base class: a user-facing problem (bad input, unsupported model, impossible budget)."""


class CaptureError(RematError):
    """The training step could not be captured as one graph."""


class BudgetError(RematError):
    """A memory budget could not be parsed, or no plan fits it."""


class PlanError(RematError):
    """A plan or profile does not belong to this graph, or is malformed."""
