"""Checks on tensor values that a step's code raises on, held in the graph.

Libraries validate what they are given (`if labels.max() >= vocab_size: raise ValueError`,
a distribution's `validate_args`) and scripts assert on the loss (`assert
torch.isfinite(loss)`). Each is a Python branch on a tensor's value, which one captured
graph cannot hold in general. But where one side of the branch raises, the graph need
not hold both: it takes the side that goes on and checks, at every call, that the value
says so, raising what eager raises where it does not.

While tracing, `Tensor.__bool__` of a tensor whose value is not known (the trace runs on
fake tensors) is a *value check*: the trace is run with each side assumed in turn (in the
order the checks come, `assumed`). A side on which the step's code raises (an exception
from the user's or a library's code, not a tracing failure) is the failing side; the graph
takes the other, with `remat::value_check(t, holds, index)` where the branch was, which
raises `ValueCheckFailed` when `bool(t)` is not `holds`. Where neither side raises, the
branch is real control flow and the trace fails as it would have (trace_checks explains
it).

Where neither side raises but the batch's values decide the branch (ops/known_values.py:
Longformer's `if is_global_attn:` from its attention mask), the graph takes the side the
example batch gives, and a failed check raises `BatchValueChanged` instead. A later check
at a line where one was decided for the side the batch gives (the same branch in each
layer) is held as that one was, without tracing both its sides again: a trace or two per
line, not per layer.

At run time (`raise_as_eager`), a failed check raises the exception the failing side
raised while tracing, with its message: the step stops there, as eager stops. A check
runs early (`check_placement.hoisted`) but after every change to the user's state and every random draw
that came before it, and no update runs before a check that came before it
(update_placement), so the parameters, buffers, optimizer state and generator are as
eager's were when it raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from remat.errors import BatchValueChanged, RematError, StateValueChanged

VALUE_CHECK = "remat::value_check"
_FAILED = re.compile(r"remat value check (\d+) failed")


_CHECKING = [True]  # off while the profiler runs a graph again and again on the same copies (`unchecked`)


@torch.library.custom_op(VALUE_CHECK, mutates_args=())
def value_check(t: torch.Tensor, holds: bool, index: int) -> None:
    """Raise where `bool(t)` is not `holds` (check `index` of its step)."""
    if _CHECKING[0] and bool(t) != holds:
        raise ValueCheckFailed(f"remat value check {index} failed")


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """No value check raises while the block runs: a profile runs a graph several times on one
    copy of the state, which its first run changes (an initialisation flag the step sets),
    where the user's step runs once on each state."""
    was, _CHECKING[0] = _CHECKING[0], False
    try:
        yield
    finally:
        _CHECKING[0] = was


@value_check.register_fake
def _(t: torch.Tensor, holds: bool, index: int) -> None:
    return None


VALUE_CHECK_OP = torch.ops.remat.value_check.default
torch.fx.node.has_side_effect(VALUE_CHECK_OP)


class ValueCheckFailed(RuntimeError):
    """Raised by a graph's value check; `raise_as_eager` turns it into what eager raises."""


class KernelCheck(RuntimeError):
    """Raised, while tracing, by remat's static stand-in for an op where the values make
    eager's kernel raise, or where the stand-in's static form cannot hold them
    (ops/ctc_loss.py): a side of a branch that raises, as a library's own check is."""


@dataclass
class ValueCheck:
    """One check: where the step branches, the side the graph takes, and what the other raises."""

    where: str  # ", at file.py, line N: code" (trace_checks.where_in_frames)
    holds: bool
    error_type: type[BaseException]
    message: str
    args: tuple[Any, ...] | None = None  # the exception's own arguments, where plain values (sys.exit's code)
    as_eager: bool = True  # False: a branch on the batch's values fixed at the compiled batch's side (eager goes on)
    state: tuple[str, ...] = ()  # a branch on small state tensors alone (buffers, optimizer state): their names
    first: bool = False  # run before anything else in the step (state_checks_first): a failure changed nothing


@dataclass
class _Trial:
    """The check being decided: the sides tried so far and what each raised (None: it went on)."""

    index: int
    first: BaseException  # the trace's failure at the branch, reported where neither side raises
    where: str
    raised: dict[bool, BaseException | None] = field(default_factory=dict)


class ValueChecks:
    """The checks of one capture, decided over its traces (see the module docstring)."""

    def __init__(self) -> None:
        self.assumed: list[bool] = []
        self.checks: list[ValueCheck] = []
        self._trial: _Trial | None = None
        self._reached = 0  # checks reached by the running trace
        self._refused: BaseException | None = None  # the failure to report where a check cannot be decided
        # The truth the batch's values give a tested value, where they decide it (known_values.KnownValues.truth).
        self.known: Any = lambda value: None
        self._known_at: dict[int, bool | None] = {}
        # The small state tensors a tested value comes from, where it comes from them alone (known_values.KnownValues.state_of).
        self.state_of: Any = lambda value: None
        self.where_now: Any = lambda: ""  # the user's line branching now (trace_checks.where_in_users_code_now)

    @contextlib.contextmanager
    def tracing(self, inputs: dict[str, str]) -> Iterator[None]:
        """Tensor.__bool__ on a tensor of unknown value takes the side assumed for it, and so
        does a test of a number the step computed. `inputs`: the symbols of the numbers read
        as graph inputs (hyperparameters, the batch's floats), by name, filled while tracing;
        a test of one of those is theirs to handle (a sign fact, a fixed value, a refusal)."""
        plain = torch.Tensor.__bool__
        self._reached = 0
        checks = self

        def checked_bool(t: torch.Tensor, tested: Any = None) -> bool:
            try:
                return plain(t)
            except GuardOnDataDependentSymNode as e:
                index = checks._reached
                if index >= len(checks.assumed):
                    value = t if tested is None else tested
                    known = checks.known(value)
                    if not checks._state_decided(value, known) and not checks._decided_as_before(known):
                        e.remat_value_check = index  # type: ignore[attr-defined]
                        checks._known_at[index] = known
                        raise
                checks._reached += 1
                holds = checks.assumed[index]
                torch.ops.remat.value_check(t, holds, index)
                return holds

        plain_sym = torch.SymBool.__bool__

        def checked_sym_bool(b: torch.SymBool) -> bool:
            # `if loss.item() > 100: raise ...`: a comparison of a number the step computed, in
            # the user's or a library's code (torch's own kernels handle theirs), is checked
            # as the same comparison of a tensor; so is one in torch's own code that small state
            # tensors alone decide (RAdam's `if rho_t > 5.0:` on its step count).
            ours = not Path(sys._getframe(1).f_code.co_filename).is_relative_to(_TORCH)
            if (_computed(b, inputs) and ours) or checks.state_of(b) is not None:
                return checked_bool(torch.scalar_tensor(b, dtype=torch.bool), b)
            return plain_sym(b)

        torch.Tensor.__bool__ = checked_bool  # type: ignore[method-assign]
        torch.SymBool.__bool__ = checked_sym_bool  # type: ignore[method-assign]
        tests = {name: getattr(math, name) for name in _MATH_TESTS}
        for name, test in tests.items():
            setattr(math, name, _on_tensors(test, _MATH_TESTS[name], inputs))
        try:
            yield
        finally:
            torch.Tensor.__bool__ = plain  # type: ignore[method-assign]
            torch.SymBool.__bool__ = plain_sym  # type: ignore[method-assign]
            for name, test in tests.items():
                setattr(math, name, test)

    def _state_decided(self, value: Any, known: bool | None) -> bool:
        """Whether small state tensors decide a new check's `value` (a flag, a step count), whose
        truth the batch and state give as `known`: its side is taken, and the trace goes on
        without being run again."""
        state = self.state_of(value)
        if not state or known is None:
            return False
        self.assumed.append(known)
        self.checks.append(_state_branch(self.where_now(), known, state))
        return True

    def _decided_as_before(self, known: bool | None) -> bool:
        """Whether a new check, whose side the batch's values decide (`known`), is tested at a line
        where an earlier one was decided for the same side (Longformer's `if is_global_attn:`
        in every layer): the same code, held the same way and raising what it raised, without
        a trace of each side again. Not while a side of an earlier check is being tried: its
        other side may not come here."""
        return self._trial is None and known is not None and self._as_before(self.where_now(), known)

    def _as_before(self, where: str, known: bool | None) -> bool:
        if known is None:
            return False
        earlier = [c for c in self.checks if c.where == where and c.holds == known and not c.state]
        if not earlier:
            return False
        self.assumed.append(known)
        self.checks.append(dataclasses.replace(earlier[0]))
        return True

    def retry(self, e: BaseException, where: str) -> bool:
        """After a trace failed with `e`: whether to trace again, with a side to try or the
        side decided. False: `refusal(e)` is the trace's failure."""
        trial = self._trial
        if trial is not None:
            # The side tried raised, or went on past the branch (to a later check, or to a
            # failure of the trace itself, which the other side may not reach).
            tried = self.assumed[trial.index]
            trial.raised[tried] = e if _raised_by_code(e) and self._reached <= trial.index + 1 else None
            outcome = self._settle(trial)
            if outcome == "refused":
                return False
            if outcome != tried:
                return True
            # Decided for the side just traced, which went on: to the next check, or to a failure of its own.
        new = _check_index(e)
        if new is not None and new == len(self.assumed) and self._as_before(where, self._known_at.get(new)):
            return True
        if new is not None and new == len(self.assumed):
            self._trial = _Trial(new, e, where)
            self.assumed.append(True)
            return True
        return False

    def at_check(self, e: BaseException) -> bool:
        """Whether the trace failed at a check of a value the graph makes (a `bool()` of a
        tensor), or at the step's own raise on the side of one being tried: what `retry`
        decides, not anything the numbers the trace reads could cause."""
        trying = self._trial is not None and _raised_by_code(e)
        return trying or _check_index(e) is not None

    def deciding(self) -> bool:
        """Whether a side of a check is being tried (the trace may end in the step's own raise)."""
        return self._trial is not None

    def finished(self) -> bool:
        """After a trace succeeded: whether it must run again (a check not yet decided, or
        decided for the other side)."""
        trial = self._trial
        if trial is None:
            return False
        tried = self.assumed[trial.index]
        trial.raised[tried] = None
        outcome = self._settle(trial)
        if outcome == "refused":
            assert self._refused is not None
            raise self._refused
        return outcome != tried

    def _settle(self, trial: _Trial) -> bool | str:
        """The other side to try ("again"), the side decided (the check recorded), or "refused"
        where it cannot be decided."""
        if len(trial.raised) < 2:
            self.assumed[trial.index] = not self.assumed[trial.index]
            return "again"
        failing = [side for side, raised in trial.raised.items() if raised is not None]
        self._trial = None
        known = self._known_at.get(trial.index)
        if not failing and known is not None:  # control flow on a value the batch decides: its side, checked
            self.assumed[trial.index] = known
            self.checks.append(_fixed_branch(trial.where, known))
            return known
        if len(failing) != 1:  # both went on (real control flow), or both raised (the failure is elsewhere)
            self._refused = trial.first if not failing else trial.raised[False]
            return "refused"
        error = trial.raised[failing[0]]
        assert error is not None
        holds = not failing[0]
        self.assumed[trial.index] = holds
        self.checks.append(_as_raised(trial.where, holds, error))
        return holds

    def refusal(self, e: BaseException) -> BaseException:
        """The failure to explain when a trace is not retried."""
        return self._refused or e


# `loss_value = loss.item()` then `if not math.isfinite(loss_value): sys.exit(1)` (the
# loops of MAE, DeiT, DINO): a test of a number the step computed becomes the same test of
# a tensor, whose truth is a value check like `torch.isfinite(loss)`'s.
_MATH_TESTS = {"isfinite": torch.isfinite, "isnan": torch.isnan, "isinf": torch.isinf}


def _computed(value: Any, inputs: dict[str, str]) -> bool:
    """Whether symbolic `value` holds a number the step computed (an unbacked symbol from
    `.item()`), and none read as a graph input."""
    found = free_unbacked_symbols(value)
    return bool(found) and not any(str(s) in inputs for s in found)


def _on_tensors(test: Any, on_tensor: Any, inputs: dict[str, str]) -> Any:
    def tested(x: Any) -> bool:
        if isinstance(x, (torch.SymFloat, torch.SymInt)) and _computed(x, inputs):
            return bool(on_tensor(torch.scalar_tensor(x, dtype=torch.float64)))
        return test(x)

    return tested


# What the trace wrote for a value it did not know: an unbacked symbol (`u0`, `zuf3`: a
# number from `.item()`) or a fake tensor's repr.
_TRACED_VALUE = re.compile(r"\b(?:u|zuf|zub)\d+\b|FakeTensor\(\.\.\.[^)]*\)")
_SHOWN_INSTEAD = "<a value the step computed>"


def _as_raised(where: str, holds: bool, error: BaseException) -> ValueCheck:
    """The check of a failing side that raised `error` while traced. A message that showed a
    value the step computed shows a placeholder instead: the trace did not know the value.
    A message formatted with a format spec (`f"{loss_value:.3f}"`) failed to format on the
    trace, so eager's exception is unknown: a RuntimeError that says so."""
    message = str(error)
    if isinstance(error, TypeError) and re.search(r"unsupported format string passed to Sym(Float|Int|Bool)", message):
        return ValueCheck(where, holds, RuntimeError, (
            "train_step raises here in eager with a message that formats a number the step computed with a format "
            "spec, which remat cannot write; the check failed"))
    shown = _TRACED_VALUE.sub(_SHOWN_INSTEAD, message)
    plain = shown == message and all(a is None or type(a) in (str, int, float, bool) for a in error.args)
    return ValueCheck(where, holds, type(error), shown, error.args if plain else None)


def _fixed_branch(where: str, holds: bool) -> ValueCheck:
    return ValueCheck(where, holds, BatchValueChanged, (
        f"train_step branches on a value of the batch{where}; it was {holds} for the batch the step was compiled with "
        f"and is {not holds} for this one. A branch on the batch's values that goes on either way is held at the "
        "compiled batch's side and checked at every call. Give every batch the same value there (Longformer's and "
        "LED's global attention: the same in every batch, or none), or compile a step for each kind of batch "
        "(remat.compile once for each)."), as_eager=False)


def _state_branch(where: str, holds: bool, state: tuple[str, ...]) -> ValueCheck:
    names = ", ".join(state)
    return ValueCheck(where, holds, StateValueChanged, (
        f"train_step branches on the value of {names}{where}, which went {holds} when the step was compiled and goes "
        f"{not holds} now. A branch on small state tensors that goes on either way (an initialisation flag, a warm-up "
        "counter, an optimizer's step count) is held at the side they gave then and checked at every call: before the "
        "step changes anything, the step is compiled again for the new side; checked after it changed something that "
        "the check cannot be run ahead of, the step stops there. Run such a branch before the step changes what it "
        "reads, or keep the flag outside the graph (a Python attribute the loop sets)."), as_eager=False, state=state)


def _check_index(e: BaseException) -> int | None:
    """The index of the value check whose `bool()` the trace failed at, if it failed at one."""
    return getattr(_guard_of(e), "remat_value_check", None)


def _guard_of(e: BaseException | None) -> BaseException | None:
    while e is not None:
        if isinstance(e, GuardOnDataDependentSymNode):
            return e
        e = e.__cause__ or e.__context__
    return None


_TORCH = Path(torch.__file__).parent
_REMAT = Path(__file__).resolve().parents[1]


def _raised_by_code(e: BaseException) -> bool:
    """Whether `e` was raised by the step's or a library's own check (a `raise` or an
    `assert` in Python code, torch.nn's and torch.distributions' included), not by the
    trace itself (fake tensors, fx, remat)."""
    if isinstance(e, RematError) or _guard_of(e) is not None:
        return False
    if isinstance(e, KernelCheck):
        return True
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    path = Path(frames[-1].filename).resolve()
    if path.is_relative_to(_REMAT):
        return False
    if path.is_relative_to(_TORCH):
        top = path.relative_to(_TORCH).parts[0]
        return top in ("nn", "distributions", "optim", "functional.py", "autograd")
    return not frames[-1].filename.startswith("<")


def raise_as_eager(e: BaseException, checks: list[ValueCheck]) -> None:
    """Where `e` is a failed value check of a graph with `checks`, raise what eager raises there."""
    found = _FAILED.search(str(e))
    if found is None or int(found.group(1)) >= len(checks):
        return
    check = checks[int(found.group(1))]
    try:
        error = check.error_type(*check.args) if check.args is not None else check.error_type(check.message)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        error = RuntimeError(f"{check.error_type.__name__}: {check.message}")
    if isinstance(error, StateValueChanged) and check.first:  # nothing changed: the step compiles again for it
        error.before_any_change = True
        raise error from None
    where = f" ({check.where.removeprefix(', at ')})" if check.where else ""
    note = (
        f"remat: the step's graph checks this tensor value at every call{where} and raised what eager raises there; "
        "the step stopped there, with no update run that eager's had not run."
        if check.as_eager
        else "remat: the step stopped at that check, with no update run; what it changed before it in this call (a "
        "BatchNorm's running statistics, the random generator's state) stays changed."
    )
    if isinstance(error, SystemExit):  # the interpreter shows no note of a SystemExit, nor what the step printed first
        print(f"{note[:-1]} (sys.exit; what the step printed on its way there is not printed again).", file=sys.stderr)
    error.add_note(note)
    raise error from None
