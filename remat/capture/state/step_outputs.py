"""What train_step returns, as graph outputs and back.

A lone tensor is the loss; a tuple, list or dict may add other tensors (logits for
metrics) and Python numbers traced from the step's inputs (`loss.item()`, a learning rate
read from param_groups). Such a number is computed in the graph as a 0-dim tensor of a
dtype that holds it exactly, and given back as a Python number of the type eager returns.
A plain number (no input gives it) would be the traced value at every step: refused. A
scheduler's rate (`scheduler.get_last_lr()[0]`, a scheduler_calls.SchedulerRead) is read from the
scheduler once the call's scheduler steps are made (`after_graph`). None (a step that
returns nothing, logging through its own meters) is given back as None.
`float(t)` of a value the step computes cannot be traced (Python wants a plain float from
it): refused while the step is traced, saying to use `.item()`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from remat.capture.state import user_code
from remat.capture.state.scheduler_calls import SchedulerRead
from remat.capture.trace_checks import where_in_users_code_now, wrapped_methods
from remat.errors import CaptureError
from remat.capture.train_graph import TrainGraph

def as_graph_outputs(result: Any, logged: list[list[Any]] | None = None) -> tuple[list[torch.Tensor], Any, dict[int, str]]:
    """train_step's return value as graph outputs: its tensors (detached), its structure, and
    which outputs stand for Python numbers (position -> 'bool', 'int', 'float' or 'none', or the
    SchedulerRead it is read from: its output a placeholder zero). The
    numbers of each of the step's updates of Python state (TrainGraph.call.state_updates), if
    any, follow it: the structure is then `(result, logged)`."""
    if logged:
        as_graph_outputs(result)  # the same checks of what it returns
        result = (result, logged)
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise CaptureError(f"train_step must return the loss as a one-element tensor, got shape {tuple(result.shape)}")
        return [result.detach()], None, {}
    leaves, out_spec = pytree.tree_flatten(result)
    outputs: list[torch.Tensor] = []
    numbers: dict[int, str] = {}
    for i, leaf in enumerate(leaves):
        kind = _traced_number_kind(leaf)
        if isinstance(leaf, torch.Tensor):
            outputs.append(leaf.detach())
        elif isinstance(leaf, SchedulerRead):
            outputs.append(torch.zeros((), dtype=torch.float64))
            numbers[i] = leaf
        elif leaf is None:  # a step that logs through its own objects returns nothing, or a None beside its loss
            outputs.append(torch.zeros((), dtype=torch.bool))
            numbers[i] = "none"
        elif kind is not None:
            outputs.append(torch.scalar_tensor(leaf, dtype=_NUMBER_DTYPES[kind]))
            numbers[i] = kind
        elif isinstance(leaf, (bool, int, float)):
            raise CaptureError(
                f"train_step returned the Python number {leaf!r} (output {i}), which no tensor or optimizer setting gives: "
                "it is read once, when the step is traced, so every step would return that value (a count "
                "kept outside the step, a clock). Return numbers computed from tensors (loss.item()) or read from "
                "optimizer.param_groups, and read others outside train_step."
            )
        else:
            raise CaptureError(
                f"train_step must return the loss, or a tuple, list or dict of tensors and numbers; it returned "
                f"{type(result).__name__} holding {type(leaf).__name__}. Return tensors and numbers only."
            )
    return outputs, out_spec, numbers


_NUMBER_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float64}


def _traced_number_kind(value: Any) -> str | None:
    """'bool', 'int' or 'float' for the traced stand-in of a Python number, else None."""
    for kind, traced in (("bool", torch.SymBool), ("int", torch.SymInt), ("float", torch.SymFloat)):
        if isinstance(value, traced):
            return kind
    return None


def as_returned(tg: TrainGraph, outputs: list[torch.Tensor], after_graph: Callable[[], None] | None = None) -> Any:
    """The graph's outputs as train_step returned them, once `after_graph()` is done (the
    scheduler steps made after the graph: the rates returned and printed are read after
    them) and the step's updates of Python state are done again with their numbers."""
    if after_graph is not None:
        after_graph()
    if tg.call.output_spec is None:
        return outputs[0]
    numbers = tg.call.output_numbers
    returned = [t if i not in numbers else _number(numbers[i], t) for i, t in enumerate(outputs)]
    result = pytree.tree_unflatten(returned, tg.call.output_spec)
    if tg.call.state_updates:
        result, logged = result
        for update, values in zip(tg.call.state_updates, logged):
            update.replay(values)
    return result


def _number(kind: str | SchedulerRead, output: torch.Tensor) -> Any:
    if isinstance(kind, SchedulerRead):
        return kind.read()
    return None if kind == "none" else output.item()


@contextlib.contextmanager
def float_of_a_traced_value_named() -> Iterator[None]:
    """While the step is traced, `float(t)` in the user's code of a value only the graph's run
    knows (a loss: `float(loss)`) is refused saying to use `t.item()`, which the trace holds
    as a number: Python wants a plain float from `__float__`, and the trace has none to give."""
    original = torch.Tensor.__float__
    depth = [0]  # torch function modes call it again, inside: the outermost call sees the caller

    def checked(self: torch.Tensor) -> float:
        outermost, depth[0] = depth[0] == 0, depth[0] + 1
        caller = sys._getframe(1).f_code.co_filename
        try:
            return original(self)
        except GuardOnDataDependentSymNode as e:
            if not outermost or not user_code.is_user_file(caller):
                raise  # a library's float() (BatchNorm's of its count) is named by what it is, later
            raise CaptureError(
                f"train_step converts a tensor it computes to a Python float with float(){where_in_users_code_now()}: "
                "Python needs a plain number there, and the value is known only when the graph runs. Use .item() "
                "instead (float(loss) -> loss.item()): remat traces that number, so returned, logged or added up it "
                "is each step's own."
            ) from e
        finally:
            depth[0] -= 1

    torch.Tensor.__float__ = checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__float__ = original  # type: ignore[method-assign]


_OWN_CODE = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["remat"]))


@contextlib.contextmanager
def text_of_a_traced_value_named(deciding: Callable[[], bool]) -> Iterator[None]:
    """While the step is traced, `str()` or `repr()` of a number only the graph's run knows
    (`str(loss.item())`, `round(loss.item(), 4)`, a csv writer's row of it), from code other
    than torch's and remat's, is refused saying to pass the number to print or logging: the
    text would hold the trace's stand-in for it (`zuf0`), written once. While a side of a
    value check is tried (`deciding()`), the text may be the message of the step's own
    raise, which value_checks shows with a placeholder: it is refused only where that trace
    runs to its end. (An f-string of such a number is refused by torch's own format check:
    trace_failures.)"""
    made: list[str] = []  # what the text was made of, and where

    def refused(what: str) -> CaptureError:
        return CaptureError(
            f"train_step makes text of a number it computes ({what}: its Python code runs once, at capture, where "
            "the number is not known, so the text would be the trace's stand-in, written once. Pass the number to "
            "print or logging as an argument (print('loss', loss.item()), log.info('loss %.4f', loss.item())), which "
            "remat makes again after each step with its value, append it to a list, or return it from train_step and "
            "write it there."
        )

    def noting(original: Any) -> Any:
        def method(self: Any) -> str:
            if free_unbacked_symbols(self.node.expr) and not sys._getframe(1).f_code.co_filename.startswith(_OWN_CODE):
                what = f"str() or repr() of {self.node.expr}){where_in_users_code_now()}"
                if not deciding():
                    raise refused(what)
                made.append(what)
            return original(self)

        return method

    with wrapped_methods((torch.SymInt, torch.SymFloat, torch.SymBool), ("__str__", "__repr__"), noting):
        yield
    if made:
        raise refused(made[0])
