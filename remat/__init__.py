"""remat: automatic activation checkpointing for PyTorch training.

Captures a whole training iteration as one graph, decides which activations to
recompute in the backward pass so the iteration fits a memory budget at the
least extra time, and runs the rewritten graph as the training step.
"""

__version__ = "0.1.0"

from remat.memory.analysis import Role, analyze
from remat.capture.capture import capture
from remat.capture.train_graph import Phase, TrainGraph
from remat.errors import BudgetError, CaptureError, PlanError, RematError
from remat.runtime import RematStep, StepReport, compile

__all__ = [
    "BudgetError",
    "CaptureError",
    "Phase",
    "PlanError",
    "RematError",
    "RematStep",
    "Role",
    "StepReport",
    "TrainGraph",
    "analyze",
    "capture",
    "compile",
]
