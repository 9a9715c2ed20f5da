"""What a step says about a graph it compiles again or cannot compile: a batch that comes
in many shapes (or with many values of a plain value the step reads), a budget given as a fraction that no plan meets, and a budget that a
call's graph cannot meet because it holds the gradients it finds set."""

from __future__ import annotations

import math
import warnings
from typing import Any

from remat.budget import Budget, format_bytes
from remat.capture.state.python_state import changed_values, numpy_floats_changed
from remat.capture.train_graph import InputKind, TrainGraph
from remat.passes.update_buckets import nbytes

# Batch shapes after which a step says that each new one is compiled again (dynamic padding).
MANY_SHAPES = 4

Values = tuple[tuple[str, Any], ...]  # (name, frozen value) of what a graph's key holds


def warn_constants_changed(before: Values, now: Values, needed: bool, reading_needs: int | None = None) -> None:
    """Name the values the graph about to be compiled holds as constants that changed since
    the last graph of its shape (`before`: its key's values, empty for the first graph;
    `now`: this one's); `needed`: among them a number the loop changes that the step needs
    the value of; `reading_needs`: among them a number held constant because the graph
    reading it at every call has no plan under the budget, the smallest peak that graph
    reaches."""
    changed = changed_values(before, now) if before else []
    if not changed:
        return
    rounded = numpy_floats_changed(before, now)  # numpy floats whose arithmetic rounds to their precision
    why = ""
    if reading_needs is not None:
        why = (
            f" A number the loop changes is read at every call, but reading it adds an input to the graph, whose "
            f"plans then reach no lower than {format_bytes(reading_needs)} ({reading_needs} bytes), over the memory "
            f"budget. Raise the budget to at least {reading_needs} bytes to have it read at every call."
        )
    elif rounded:
        why = (
            f" {', '.join(rounded[:3])} {'is a numpy float' if len(rounded) == 1 else 'are numpy floats'} (not float64), whose "
            "arithmetic in Python rounds to its precision, which the graph does not reproduce; so each value is a graph. "
            "Set a Python float there (float(...)): the step then reads it at every call."
        )
    elif needed:
        why = (
            " A number the loop changes is read at every call, unless the step needs its value: as a list's index, "
            "a tensor's size, text, torch.tensor(n), or a branch beyond what it can keep as a condition. Compute "
            "that use between steps (a float the step reads is read at every call), or pass it in the batch as a tensor."
        )
    warnings.warn(
        f"remat: {', '.join(changed[:3])}{' and more' if len(changed) > 3 else ''} changed since the step was "
        "compiled: the graph holds such values as constants, so the step is compiled again for them." + why,
        stacklevel=5,
    )


def warn_many_shapes(shapes: int, compile_seconds: float) -> None:
    """Say, at the shape that makes them many, that every new batch shape is a capture."""
    if shapes == MANY_SHAPES:
        warnings.warn(
            f"remat: the batch has come in {MANY_SHAPES} shapes so far, and each new shape is captured, profiled "
            f"and planned again ({compile_seconds:.1f} s for this one) and keeps a graph of its own. "
            "Batches padded to their longest row (a data collator's dynamic padding) take as many shapes as there "
            "are lengths: pad to a few lengths instead (DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64), "
            "or padding='max_length'), and drop or pad a smaller last batch (drop_last=True).",
            stacklevel=5,
        )


def warn_many_graphs(shapes_and_values: tuple[int, int], names_read: list[str], compile_seconds: float) -> None:
    """Say, at the shape or value that makes them many, that each new batch shape is a
    capture, and each new value of the batch's plain values the graphs read (`names_read`).
    `shapes_and_values`: batch_signature.shapes_and_values of the graphs compiled."""
    warn_many_shapes(shapes_and_values[0], compile_seconds)
    warn_many_values(names_read, shapes_and_values[1], compile_seconds)


def warn_many_values(names: list[str], graphs: int, compile_seconds: float) -> None:
    """Say, at the value that makes them many, that every new value of the batch's plain
    values the step reads is a capture."""
    if graphs == MANY_SHAPES and names:
        warnings.warn(
            f"remat: train_step reads {', '.join(names[:3])} (plain values of the batch: a str, bytes or int), so the "
            f"graph holds each value as a constant, and each new one is captured, profiled and planned again "
            f"({compile_seconds:.1f} s for this one); {MANY_SHAPES} graphs of this shape so far. Leave such values "
            "out of what train_step uses (log or store them in the loop); an int it computes with, compares or "
            "returns is read at every call, but one formatted into text, used as a size, an index or a dict key is "
            "held as its value: do that outside train_step, or pass the number as a tensor.",
            stacklevel=5,
        )


def note_gradients_held(error: Exception, tg: TrainGraph) -> None:
    """Where a budget error's graph takes the gradients a call finds set, say so: they are
    held from its start, which a call finding none does not."""
    held = [i for i in tg.inputs if i.kind is InputKind.GRADIENT and i.name in tg.call.trainable]  # not a frozen one's, held in eager too
    if held:
        error.add_note(
            f"remat: this call finds {len(held)} gradients set (gradient accumulation across calls), and its graph "
            f"holds them from its start: {format_bytes(sum(nbytes(i.shape, i.dtype) for i in held))} that a call "
            "finding none allocates only in its backward pass, so the floor of this call's graph is higher than "
            "the first one's."
        )


def note_fraction_reached(error: Exception, budget: Budget, persistent_bytes: int, activation_peak_bytes: int) -> None:
    """Where the budget was a fraction, the smallest fraction that reaches the plans'
    smallest peak: the error's advice in the form the user gave."""
    reach = getattr(error, "reach", None)
    if budget.fraction is None or reach is None or activation_peak_bytes <= 0:
        return
    needed = math.ceil(100 * (reach.best - persistent_bytes) / activation_peak_bytes) / 100
    if needed <= 1:
        error.add_note(
            f"remat: as a fraction of the activation peak ({format_bytes(activation_peak_bytes)} above "
            f"the {format_bytes(persistent_bytes)} held across steps), that is "
            f"memory_budget={needed:g} (--budget {needed:g}); {budget.fraction:g} was asked."
        )
