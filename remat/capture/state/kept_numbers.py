"""Numbers the step keeps in the user's Python state: a count it adds to
(`self.global_step += 1`, `tokens += batch.numel()`, `self.loss_sum += loss.item()`) or a
value it sets (`self.last_loss = loss.item()`).

The step's Python code runs once, at capture. Once a first trace has shown which slots of
the user's state (python_state's) the step leaves holding another number, it is traced
again with each such number swapped for a `_Counted`: a stand-in that can only be added
to. Anything else the step does with it (compare it, scale it, print it, pass it to torch)
is refused, naming the slot: the graph would hold what it computed from the count at
capture; but an int or float of the user's is captured again read at every call (`CountUsed`,
read_numbers), where what it computes with the number holds for any value. What the slot
ends as is done again after each run, on the number it holds then: the same additions
in the same order (so that floats round as eager's do), the numbers the graph computes
(`loss.item()`) taken from its outputs. A value set outright is set again, and so is a
text (a str or bytes: a mode, a name) the user's code sets where it held one or a number.

A library object's number (library_objects: its code is not followed, so any use may
matter) is not swapped: the step is traced with it as this step found it and as the next
step will, and a graph that differs is refused. Otherwise it is set again, or the same
amount added again (a count), after each run; a change that is neither (a progress bar's
timing) is left as it was, with a warning.

A slot that held None or nothing before (`self.last_loss = None` in `__init__`) is traced
as it is (`x is None` and `hasattr` cannot be intercepted), then once more as if it held a
number already, as it will from the second step on. If both traces give the same graph
and the same updates, the step does not depend on which, and the slot is left out of the
step's cache key; if not, it stays in it, and the step is compiled again once the slot
holds a number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx

from remat.errors import CaptureError
from remat.capture.state import library_objects
from remat.capture.state.slots import shown
from remat.capture.trace_checks import users_stacklevel
from remat.capture.state.python_state import TEXT, NumberChange, same_number
from remat.capture.state.slots import MISSING, NUMBERS, TRACED_NUMBERS, Slot, is_number



class Term(enum.Enum):
    """A term of a kept number that is not a constant."""

    SLOT = "the number the slot holds when the step runs"
    GRAPH = "the graph's next number output"


@dataclass(frozen=True)
class KeptNumber:
    """What the step leaves in one slot, done again after each run: the first of `terms`,
    plus each of the others in order (a constant, or Term.GRAPH: a number the graph computes)."""

    slot: Slot
    terms: tuple[Any, ...]
    keyed: bool  # the slot's value stays in the step's cache key: the trace may have read it

    @property
    def count(self) -> int:
        """How many of the graph's number outputs it takes."""
        return sum(t is Term.GRAPH for t in self.terms)

    def where(self) -> str:
        return f"kept in {self.slot.name}"

    def replay(self, values: list[Any]) -> None:
        numbers = iter(values)

        def value(term: Any) -> Any:
            return self.slot.get() if term is Term.SLOT else next(numbers) if term is Term.GRAPH else term

        kept = value(self.terms[0])
        for term in self.terms[1:]:
            kept = kept + value(term)
        self.slot.set(kept)


@dataclass(frozen=True)
class CountedBranch:
    """A count a library's code moves inside the step and branches on, registered by an
    integration (library_objects.counted_branch: Accelerate's accumulate()): which branch a
    call takes is in the step's key (`branch`, read before the call), and after each run the
    count is set to what the library's code would have left in it."""

    slot: Slot
    next_of: Callable[[Any], tuple[Any, Any]]
    keyed: bool = False
    count: int = 0  # of the graph's number outputs

    def where(self) -> str:
        return f"counted in {self.slot.name}"

    def branch(self) -> tuple[str, Any]:
        return self.slot.name, self.next_of(self.slot.owner)[1]

    def replay(self, values: list[Any]) -> None:
        self.slot.set(self.next_of(self.slot.owner)[0])


def _counted_branch(change: NumberChange, value: Any) -> CountedBranch | None:
    """The CountedBranch for a registered count, checked against what the traces left in it
    (`change.after`, the first; `value`, the trace as the next step finds the state); None
    for another number."""
    next_of = library_objects.counted_branch_of(change.slot)
    if next_of is None:
        return None
    predicted = next_of(change.slot.owner)[0]  # the slot holds the count as the step found it again
    if not (same_number(change.after, predicted) and same_number(value, predicted)):
        raise CaptureError(
            f"train_step moves {change.slot.name}, a count {type(change.slot.owner).__name__} keeps, from "
            f"{_shown(change.before)} to {_shown(change.after)}, where remat expected {predicted!r} from that library's "
            f"code: this version of {type(change.slot.owner).__module__.split('.')[0]} counts otherwise, and remat cannot "
            "follow which branch each call takes. Move that call (e.g. Accelerate's accumulate()) out of train_step."
        )
    return CountedBranch(change.slot, next_of)


class _Counted:
    """A number of the user's state while the step is traced again: it can be added to,
    nothing else. `terms` as KeptNumber's, with the traced numbers themselves."""

    __slots__ = ("change", "terms")

    def __init__(self, change: NumberChange, terms: tuple[Any, ...]) -> None:
        self.change = change
        self.terms = terms

    def _plus(self, other: Any, sign: int, op: str) -> _Counted:
        if is_number(other):
            return _Counted(self.change, self.terms + (other if sign > 0 else -other,))
        _refuse(self.change, f"{op} {type(other).__name__}")

    def __add__(self, other: Any) -> _Counted:
        return self._plus(other, 1, "+")

    def __radd__(self, other: Any) -> _Counted:  # other + self: the same sum, IEEE addition commutes
        return self._plus(other, 1, "+")

    def __sub__(self, other: Any) -> _Counted:  # x - y rounds as x + (-y)
        return self._plus(other, -1, "-")

    __iadd__ = __add__
    __isub__ = __sub__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # a protocol probed by introspection (copy, torch): absent
            raise AttributeError(name)
        _refuse(self.change, f".{name}")

    def __repr__(self) -> str:  # for error messages and debuggers: not a use of the number
        return f"<{self.change.slot.name}, counted while traced>"


class CountUsed(CaptureError):
    """A use of an int or float of the user's that the step changes (`self.step += 1`, then `if
    self.step % 10 == 0`): the capture tries again with it read at every call as a symbol
    (read_numbers), the count made again after each run; where it cannot be, this error."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def with_counts_read(again: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps a capture function: where it is refused with CountUsed, `again(*its arguments)`
    undoes what the refused capture set up, and it captures again with that int among the
    numbers it reads at every call (its argument `read_numbers_named`, the fifth); where
    the int is among them already (a use that needs its value), the refusal stands."""

    def wrap(capture: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(capture)
        def capturing(train_step: Any, model: Any, optimizer: Any, batch: Any, read_numbers_named: frozenset[str] = frozenset(), *rest: Any, **kwargs: Any) -> Any:
            try:
                return capture(train_step, model, optimizer, batch, read_numbers_named, *rest, **kwargs)
            except CountUsed as refused:
                if refused.name in read_numbers_named:
                    raise CountUsed(f"{refused} {_NEEDS_VALUE.format(refused.name)}", refused.name) from None
                again(train_step, model, optimizer, batch, read_numbers_named, *rest, **kwargs)
                return capturing(train_step, model, optimizer, batch, read_numbers_named | {refused.name}, *rest, **kwargs)

        return capturing

    return wrap


_NEEDS_VALUE = (
    "Read at every call instead, {} was still needed as a fixed value: by a use only a constant can take (a list "
    "index, a tensor's size, text), or by a math function torch cannot trace on a number read at every call "
    "(math.exp, math.log; math.cos, sin, tan, sqrt and pow it can). Compute that value in the loop, outside "
    "train_step, and set it where the step reads it: a float the loop sets is read at every call."
)


def _refuse(change: NumberChange, op: str) -> Any:
    read_again = type(change.before) in (int, float) and not change.slot.library  # a user's number: read at every call instead
    raise (functools.partial(CountUsed, name=change.slot.name) if read_again else CaptureError)(
        f"train_step changed Python state while it was traced: {change.slot.name} ({_shown(change.before)} -> "
        f"{_shown(change.after)}), which it also uses ({op}). Its Python code runs once, at capture, so what it computes "
        "from that number would be the same at every step. A step may add to a number it keeps (a step count, a sum of "
        "losses) or set it, and nothing else: keep other uses outside train_step, or pass what the step computes from "
        "it as a tensor (in the batch, or a buffer of the model updated between steps)."
    )


def counted(value: Any) -> tuple[Slot, tuple[Any, ...]] | None:
    """For a number the step counts up, as traced so far: its slot, and the additions made
    to the slot's number by then (traced numbers as they are); None for any other value."""
    return (value.change.slot, value.terms[1:]) if isinstance(value, _Counted) and value.terms[0] is Term.SLOT else None


def _shown(value: Any) -> str:
    return "nothing" if value is MISSING else "a number computed in the step" if isinstance(value, TRACED_NUMBERS) else shown(value)


def _using(op: str) -> Any:
    def method(self: _Counted, *args: Any) -> Any:
        _refuse(self.change, op)

    return method


for _op in (
    "__bool__", "__int__", "__float__", "__index__", "__complex__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__neg__", "__pos__", "__abs__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
    "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
    "__divmod__", "__rdivmod__", "__pow__", "__rpow__", "__rsub__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
    "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__str__", "__format__", "__len__", "__iter__",
    "__getitem__", "__contains__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
):  # fmt: skip
    setattr(_Counted, _op, _using(_op.strip("_")))


@contextlib.contextmanager
def counting(changes: list[NumberChange], as_numbers: bool = False, library_ahead: bool = True) -> Iterator[list[tuple[NumberChange, Any]]]:
    """While the block runs, each changed number swapped for a `_Counted` (a slot that held
    None or nothing too if `as_numbers`, else left as it is); a library's number, whose
    uses its code does not show, set to what the first trace left in it, as the next step
    finds it (if `library_ahead`, else left as it is: see `traced_counting`); after, what
    each slot ended as, and the slot put back."""
    ended: list[tuple[NumberChange, Any]] = []
    for change in changes:
        if change.slot.library:
            # A registered count stays as found: the branch it picks is in the key, not traced ahead.
            if library_ahead and library_objects.counted_branch_of(change.slot) is None:
                change.slot.set(change.after)
        elif type(change.before) in NUMBERS or as_numbers:
            change.slot.set(_Counted(change, (Term.SLOT,)))
    try:
        yield ended
    finally:
        ended += [(change, change.slot.get()) for change in changes]  # all read first: two slots may be one place
        for change in changes:
            change.slot.set(change.before)


def kept(ended: list[tuple[NumberChange, Any]], unread: frozenset[str] = frozenset()) -> tuple[list[KeptNumber], list[list[Any]], list[str]]:
    """What `counting` saw the step leave in each slot as KeptNumbers, with the traced numbers
    each takes from the graph, and a warning per library object whose numbers are left as
    they were; or a CaptureError for what the graph cannot do again.
    `unread`: slots that held None or nothing, and that the step is known not to read."""
    numbers: list[Any] = []  # KeptNumber, or CountedBranch
    values: list[list[Any]] = []
    left: dict[int, list[Any]] = {}  # per library object: its numbers left as they were
    for change, value in ended:
        branch = _counted_branch(change, value) if change.slot.library else None
        if branch is not None:
            numbers.append(branch)
            values.append([])
            continue
        if change.slot.library:
            terms = _library_terms(change, value)
            if terms is None:
                left.setdefault(id(change.slot.owner), [change.slot.owner]).append(change.slot.name)
                continue
        elif isinstance(value, _Counted) and value.change is change:
            terms = value.terms
        elif isinstance(value, _Counted):  # `self.a = self.b + 1`: a use of the other slot's number
            _refuse(value.change, f"assigned to {change.slot.name}")
        elif type(value) in (*NUMBERS, *TEXT) and type(change.after) in (*NUMBERS, *TEXT) and not same_number(value, change.after):
            raise CaptureError(
                f"train_step sets {change.slot.name} to a number that differs from one trace to the next ({change.after!r}, "
                f"then {value!r}): it comes from outside the step's inputs (a clock, a counter of a library's object), "
                "so the graph would set the first one at every step. Compute it outside train_step."
            )
        elif is_number(value) or type(value) in TEXT:
            terms = (value,)
        else:
            raise CaptureError(
                f"train_step changed Python state while it was traced: {change.slot.name} ({_shown(change.before)} -> "
                f"{_shown(change.after)}) the first time, and to {type(value).__name__} when traced again; remat "
                "cannot repeat it. Keep such state outside train_step."
            )
        traced = [t for t in terms if isinstance(t, TRACED_NUMBERS)]
        terms = tuple(Term.GRAPH if isinstance(t, TRACED_NUMBERS) else t for t in terms)
        # A text's reads are not seen (a number's are: `_Counted`): it stays in the key.
        keyed = ((change.before is None or change.before is MISSING) and change.slot.name not in unread) or type(value) in TEXT
        numbers.append(KeptNumber(change.slot, terms, keyed))
        values.append(traced)
    warned = [
        f"remat: train_step changes {', '.join(names)}, numbers a library's {type(owner).__name__} keeps, in a way "
        "remat cannot repeat at every step (neither a count nor a value set again); the step's graph does not depend "
        "on them, so they are left as they were: call the method that changes them between steps, outside train_step, "
        "to keep them current."
        for owner, *names in left.values()
    ]
    return numbers, values, warned


def warn_left_alone(messages: list[str]) -> None:
    """The warnings `kept` worded, given once a capture's traces are done."""
    for message in messages:
        warnings.warn(message, stacklevel=users_stacklevel())


def _library_terms(change: NumberChange, value: Any) -> tuple[Any, ...] | None:
    """What a library's number the step changes becomes at each run, from what the first
    trace made of it (`change`) and what the next step's trace made of that (`value`): the
    same number set again, or the same amount added again (a step count). None for another
    change (a progress bar's timing), which the graph then must not depend on
    (`traced_counting`): it is left as capture found it, with a warning (`kept` words it)."""
    before, after = change.before, change.after
    if type(value) in NUMBERS and type(after) in NUMBERS:
        if same_number(value, after):
            return (value,)
        if type(before) in (int, float) and type(after) is type(before):
            step = after - before
            if before + step == after and after + step == value:
                return (Term.SLOT, step)
    return None


def traced_counting(trace: Callable[[], torch.fx.GraphModule], probe: dict[str, Any], seen: dict[str, Any]) -> torch.fx.GraphModule:
    """The step traced with the numbers `probe["numbers"]` counted (see `counting`). Where
    a slot held None or nothing, traced once more with it counted too: the same graph and
    updates leave it out of the cache key. `seen["state_updates"]`: what the last trace saw.

    A library's number the step changes (an EMA helper's step count) may be read by the
    library's code in any way, so the step is traced with it as this step found it and as
    the next will: a graph that differs depends on it, and is refused."""
    library = [change for change in probe["numbers"] if change.slot.library]
    if library:
        probe["library_ahead"] = False
        try:
            as_found = trace()
        finally:
            probe["library_ahead"] = True
    gm = trace()
    if library and as_found.code != gm.code:
        _refuse_library(library)
    updates = seen["state_updates"]
    if not any(isinstance(u, KeptNumber) and u.keyed for u in updates):
        return gm
    probe["as_numbers"] = True
    try:
        again: torch.fx.GraphModule | None = trace()
    except CaptureError:  # it uses the number once it holds one (`if self.best is None or loss < self.best`)
        again = None
    finally:
        probe["as_numbers"] = False
    if again is not None and again.code == gm.code and _described(seen["state_updates"]) == _described(updates):
        probe["numbers_unread"] = frozenset(u.slot.name for u in updates if isinstance(u, KeptNumber))  # for later traces
        seen["state_updates"] = [dataclasses.replace(u, keyed=False) if isinstance(u, KeptNumber) else u for u in updates]
        return gm
    return trace()  # what the step does as it is, again


def _refuse_library(changes: list[NumberChange]) -> None:
    named = ", ".join(f"{c.slot.name} ({_shown(c.before)} -> {_shown(c.after)})" for c in changes[:3])
    owners = sorted({type(c.slot.owner).__name__ for c in changes})
    raise CaptureError(
        f"train_step changes numbers a library's {', '.join(owners)} keeps: {named}, and the step's graph depends on "
        "them (traced again as the next step would find them, it computes something else: an EMA helper's decay from its "
        "step count). Its Python code runs once, at capture, so the graph would repeat the first step's at every step. "
        "Call the method that changes them (an EMA helper's step()) between steps, outside train_step."
    )


def _described(updates: list[Any]) -> list[tuple[Any, ...]]:
    return [(type(u).__name__, u.where(), u.count, getattr(u, "terms", None)) for u in updates]
