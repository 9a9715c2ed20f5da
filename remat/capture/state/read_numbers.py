"""Floats and ints the loop changes between steps, read at every call as graph inputs.

A plain float the step reads (a loss weight in a config object, a model's temperature, a
global) is a constant of the traced graph, so a loop that anneals it would get a compile
for every value. Once such a float has changed between steps, the runtime captures the
step again with it read as the optimizer's hyperparameters are (capture.optim.hyperparams): a
0-dim float64 graph input, turned back into a Python scalar inside the trace (`.item()`, a
symbolic float), so the step's arithmetic on it is eager's, on the same double, bitwise.
From then on its value is read from where it is held at every call, and a new value costs
nothing.

A float the traced code compares with zero (`if self.aux_weight > 0:`, `if alpha:`) keeps
its sign from the capture, as a hyperparameter the update branches on does: the trace is
told the sign, and the step is compiled again only when the sign changes. A zero is held
as the constant it is (0.0 or -0.0), since what a symbol known to equal zero decides is
not always known to the tracer. A float it
branches on otherwise (`if alpha > 0.5`, `F.dropout`'s check that its rate is in [0, 1])
cannot be a symbol: it stays a constant of the graph, compiled again for each value as
before. What one trace learns of a field holds for that field of every object of its
class (every dropout's `p`), so a model of many layers costs a trace or two, not two per layer.

An int the loop changes (an iteration count the step reads: a warm-up `min(1.0, it /
warmup)`, `if it % 4 == 0`) is read the same way, as a 0-dim int64 input whose `.item()`
is a symbolic int. Each comparison the trace trips on is a `Condition`: the trace is told
which side the int is on now (`torch._check`), and the key holds that side, so a count
compiles once per side of each condition (two graphs for `it % 4 == 0`), not once per
value, and the arithmetic is Python's, on the same int, bitwise. An int used where only a
fixed number can go (a list's index, a tensor's size, a format) stays a constant of the
graph, compiled again for each value as before. An int the step counts up itself and
computes with (`self.step += 1; if self.step % 10 == 0`) is read the same way
(kept_numbers.CountUsed), and what the trace added to it is added again after each run. A
float the step computes with and sets anew (a smoothed loss, `self.ema = 0.9 * self.ema +
0.1 * loss.item()`) is read the same way, and set after each run to what the graph computes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import sympy
import torch
from torch.fx.experimental.sym_node import SymNode
from torch.utils._sympy.printers import PythonPrinter

from remat.errors import CaptureError
from remat.capture.optim.hyperparams import added_to, sign, traced_number
from remat.capture.state.kept_numbers import KeptNumber, Term
from remat.capture.state.kept_tensors import KeptTensor
from remat.capture.state.slots import TRACED_NUMBERS, Slot
from remat.capture.train_graph import InputKind, TrainGraph
from remat.capture.trace_checks import wrapped_methods


_N = sympy.Symbol("n", integer=True)  # the int a Condition is of
_INT64 = range(-(2**63), 2**63)


@dataclass(frozen=True)
class Condition:
    """A comparison of an int read at every call that a trace decided (`it % 4 == 0`,
    `(it + 1) / warmup < 1.0`): torch's sympy form over the symbol `n`. The graph holds the
    side the int was on, so the key holds which side it is on now."""

    expr: Any

    def holds(self, value: int) -> bool:
        return bool(_as_python(self.expr)(value))

    def told(self, symbol: Any, value: int) -> None:
        """While tracing: the trace told the side `value` is on, for its symbolic int `symbol`."""
        expr = self.expr.xreplace({_N: symbol.node.expr})
        torch._check(torch.SymBool(SymNode(expr if self.holds(value) else sympy.Not(expr), symbol.node.shape_env, bool, hint=None)))

    @classmethod
    def learned(cls, cond: Any, symbol: Any, value: int) -> Condition | None:
        """The condition a trace tripped on, of `symbol` only (torch's sympy), where Python's
        arithmetic decides it for `value` as sympy does; None where not (a format, an index)."""
        if not isinstance(cond, sympy.logic.boolalg.Boolean) or cond.free_symbols != {symbol}:
            return None
        made = cls(cond.xreplace({symbol: _N}))
        return made if made.agrees(value) else None

    def agrees(self, value: int) -> bool:
        """Python's arithmetic decides the side of `value` as sympy does."""
        try:
            return self.holds(value) == bool(self.expr.xreplace({_N: sympy.Integer(value)}))
        except Exception:  # noqa: BLE001 - a form Python's arithmetic cannot evaluate: the int stays a constant
            return False


@functools.lru_cache(maxsize=1024)
def _as_python(expr: Any) -> Callable[[int], Any]:
    """A condition as Python code on the int: torch's printer writes its floor division,
    modulo and true division as Python's operators, and its square root as torch._sym_sqrt (math's on a
    number), so the side is Python's, as eager's."""
    return eval(f"lambda n: {PythonPrinter().doprint(expr)}", {"math": math, "torch": torch, "__builtins__": {"abs": abs, "min": min, "max": max, "float": float, "int": int}})  # noqa: S307


def sizing(gm: torch.fx.GraphModule, symbols: dict[str, str]) -> set[str]:
    """The names (in `symbols`) of the symbolic numbers a tensor's size, stride or offset in the graph comes from."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in (*val.shape, *val.stride(), val.storage_offset()):
                if isinstance(size, torch.SymInt):
                    names |= {symbols[str(s)] for s in size.node.expr.free_symbols if str(s) in symbols}
    return names


@dataclass
class Reading:
    """The numbers one capture reads at every call: where each is held, those still traced
    as symbols (a trace that trips on one leaves it a constant), the signs the traces
    assume (floats compared with zero) and the conditions (ints compared)."""

    slots: dict[str, Slot]
    symbolic: dict[str, Slot] = field(default_factory=dict)
    signs: dict[str, int] = field(default_factory=dict)
    conditions: dict[str, list[Condition]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # ints the step counts up (`self.step += 1`), by how much
    # Numbers only the step changes (an optimizer's state: `state["step"] += 1`), and what
    # the last trace left in those it set otherwise: a number or tensor it computed, set after each run.
    set_by_step: frozenset[str] = frozenset()
    set_to: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, slots: list[tuple[Slot, Any]], names: frozenset[str], set_by_step: list[tuple[Slot, Any]] = ()) -> Reading:
        """The slots of `names`, and the slots `set_by_step` (which the step may set to any
        number or tensor it computes: an optimizer's numbers, read from the first capture on),
        that hold a float or an int (within int64) now."""
        names = names | {slot.name for slot, _ in set_by_step}
        held = {slot.name: slot for slot, value in [*slots, *set_by_step] if slot.name in names and (type(value) is float or type(value) is int and value in _INT64)}
        return cls(held, dict(held), set_by_step=frozenset(slot.name for slot, _ in set_by_step))

    def tripped(self, branched: list[str], other_failure: bool, cond: Any = None, symbols: dict[str, str] | None = None) -> bool:
        """After a trace failed: an int it branched on learns the condition `cond` (torch's,
        over the trace's `symbols`), or where it cannot (another number in it, a use that
        needs the value, a condition told already) is left a constant; each float keeps its
        sign from now on, or, where it had one already, is left a constant; on any other
        failure (`other_failure`: a use a symbol cannot take, `torch.tensor(alpha)`) every
        number is, as without them. True if the trace is worth running again."""
        counts = [name for name in branched if name in self.symbolic and type(self.symbolic[name].get()) is int]
        # A trip on one field is taken as a trip on the same field of every object of its
        # class (each dropout's `p`, each parameter's `state["step"]`): the same code reads
        # them, and one trace per object would cost a trace per layer. A sibling that would
        # not have tripped is given the condition, a sign or left a constant early,
        # compiled per side or value as before: slower, never wrong.
        if counts:
            symbol = [s for s in getattr(cond, "free_symbols", ()) if (symbols or {}).get(str(s)) == counts[0]]
            learned = Condition.learned(cond, symbol[0], self.symbolic[counts[0]].get()) if len(counts) == 1 and symbol else None
            if learned is None or learned in self.conditions.get(counts[0], []):
                self.constant(self._with_siblings(counts))
                return True
            for name in self._with_siblings(counts):
                if type(self.symbolic[name].get()) is not int or not learned.agrees(self.symbolic[name].get()):
                    self.constant([name])
                elif learned not in self.conditions.get(name, []):
                    self.conditions.setdefault(name, []).append(learned)
            return True
        hit = self._with_siblings([name for name in branched if name in self.symbolic])
        for name in hit:
            if name in self.signs:
                del self.symbolic[name], self.signs[name]
            else:
                self.signs[name] = sign(self.symbolic[name].get())
        if hit or not (other_failure and self.symbolic):
            return bool(hit)
        self.constant(list(self.symbolic))
        return True

    def _with_siblings(self, names: list[str]) -> list[str]:
        """`names`, and every other number still a symbol of the same kind as one of them (`_kind`)."""
        kinds = {_kind(self.symbolic[name]) for name in names}
        return names + [name for name, slot in self.symbolic.items() if name not in names and _kind(slot) in kinds]

    def constant(self, names: list[str]) -> None:
        """These numbers are constants of the graph from now on (compiled per value)."""
        for name in names:
            self.symbolic.pop(name, None)
            self.signs.pop(name, None)
            self.conditions.pop(name, None)

    def sized(self, gm: torch.fx.GraphModule, symbols: dict[str, str]) -> bool:
        """After a trace: the ints a tensor's size, stride or offset came from (`x[:it]`,
        `torch.zeros(it)`) are constants from now on, since the plan is made for fixed sizes.
        True if there were any (trace again)."""
        names = sizing(gm, symbols) & set(self.symbolic)
        self.constant(sorted(names))
        return bool(names)

    def attach(self, tg: TrainGraph) -> None:
        """Where the graph's NUMBER inputs are read from, and the signs it assumes (a zero's
        input is not read: the graph holds the zero)."""
        tg.call.numbers = {i.name: self.slots[i.name] for i in tg.inputs if i.kind is InputKind.NUMBER}
        tg.call.number_signs = {name: s for name, s in self.signs.items() if name in self.symbolic}
        # Every number still a symbol, with the conditions its graph assumes (an int's): read
        # at every call even where the graph no longer takes it (its branches all decided).
        tg.call.number_conditions = {name: tuple(self.conditions.get(name, ())) for name, slot in self.symbolic.items()}

    def kept(self) -> list[tuple[Any, list[Any]]]:
        """What the last trace left in the numbers it read, to do again after each run, each
        with the traced values it takes from the graph: the ints it counted up (`self.step
        += 1`) counted up again; a number of `set_by_step` it set otherwise, set to what the
        graph computes (a tensor where it set a tensor, KeptTensor)."""
        out: list[tuple[Any, list[Any]]] = [
            (KeptNumber(self.slots[name], (Term.SLOT, count), keyed=False), []) for name, count in self.counts.items() if name in self.symbolic
        ]
        for name, now in self.set_to.items():
            keyed = name not in self.symbolic  # a constant of the graph: the graph is picked by its value
            if isinstance(now, torch.Tensor):
                out.append((KeptTensor(self.slots[name], keyed=keyed), [now]))
            elif isinstance(now, TRACED_NUMBERS):
                out.append((KeptNumber(self.slots[name], (Term.GRAPH,), keyed=keyed), [now]))
            else:
                out.append((KeptNumber(self.slots[name], (now,), keyed=keyed), []))
        return out

    @contextlib.contextmanager
    def traced(self, tensors: dict[str, torch.Tensor], symbols: dict[str, str], others: set[str] = frozenset()) -> Iterator[None]:
        """While tracing: each number still a symbol is the `.item()` of its graph input
        (`tensors`, by name) in its slot, with its sign known where one is assumed, and a
        zero is itself; `symbols` is filled with each symbol's name, to name a branch the
        trace trips on. Text made of one, or of the `others` (the batch's numbers: symbols),
        (`f"step {it}"`) trips the trace as a use that needs the value, rather than hold the
        symbol's name. The numbers are put back after."""
        saved = {name: slot.get() for name, slot in self.symbolic.items()}
        # A number only the step changes that is a constant of the graph (a use that needs
        # its value): what the step leaves in it is set again after each run of this graph,
        # which its value picks.
        constant = {name: self.slots[name].get() for name in self.set_by_step if name in self.slots and name not in self.symbolic}
        placed: dict[str, Any] = {}
        try:
            for name, slot in self.symbolic.items():
                if self.signs.get(name) == 0:
                    placed[name] = saved[name]  # the zero itself, with its sign bit
                    continue
                if type(saved[name]) is int:
                    placed[name] = value = tensors[name].item()
                    symbols[str(value.node.expr)] = name
                    for condition in self.conditions.get(name, ()):
                        condition.told(value, saved[name])
                else:
                    placed[name] = value = traced_number(tensors[name], name, self.signs.get(name), symbols)
                slot.set(value)
            with _text_trips({str(v.node.expr) for v in placed.values() if isinstance(v, (torch.SymInt, torch.SymFloat))} | set(others)), _math_on_symbols():
                yield
            self.set_to = {name: self.slots[name].get() for name, was in constant.items() if self.slots[name].get() is not was}
            for name, slot in self.symbolic.items():
                if slot.get() is placed[name]:
                    continue
                count = added_to(slot.get(), placed[name]) if isinstance(slot.get(), torch.SymInt) and isinstance(placed[name], torch.SymInt) else None
                if count is not None:
                    self.counts[name] = count  # added again after each run (kept), to the number held then
                else:  # set anew (a smoothed loss computed from itself, a library's cache length): set after each run
                    self.set_to[name] = slot.get()
            for name, now in self.set_to.items():
                if not (isinstance(now, (torch.Tensor, *TRACED_NUMBERS)) or type(now) in (int, float)):
                    raise CaptureError(
                        f"train_step sets {name} to a {type(now).__name__}; remat can set it after each run to a number or "
                        "tensor the step computes, not to another value. Keep that value elsewhere, or train without remat."
                    )
        finally:
            for name, slot in self.symbolic.items():
                slot.set(saved[name])
            for name, was in constant.items():
                self.slots[name].set(was)


class TextOfNumber(RuntimeError):
    """Text made of a number read at every call while tracing: it needs the number's value
    (`cond`, its symbol, as a data-dependent guard's), so the number becomes a constant."""

    def __init__(self, cond: Any) -> None:
        super().__init__(f"text made of the number read at every call {cond}")
        self.cond = cond


_OWN_CODE = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["remat"]))


@contextlib.contextmanager
def _text_trips(ours: set[str]) -> Iterator[None]:
    """While tracing: `format` and `repr` (`str`, f-strings) of a symbol among `ours`, from
    code other than torch's and remat's, raise TextOfNumber."""
    if not ours:
        yield
        return

    def tripping(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any) -> Any:
            if not sys._getframe(1).f_code.co_filename.startswith(_OWN_CODE) and any(str(s) in ours for s in self.node.expr.free_symbols):
                raise TextOfNumber(self.node.expr)
            return original(self, *args)

        return method

    with wrapped_methods((torch.SymInt, torch.SymFloat), ("__format__", "__repr__"), tripping):
        yield


# math's functions torch traces on a symbolic number (torch._sym_cos, ...): a cosine
# schedule computed in the step from its count, `math.cos(math.pi * it / total)`.
_SYMBOLIC_MATH = ("acos", "asin", "atan", "cos", "cosh", "log2", "sin", "sinh", "sqrt", "tan", "tanh")


@contextlib.contextmanager
def _math_on_symbols() -> Iterator[None]:
    """While tracing: these functions of the math module take a symbolic number, traced as
    torch's `_sym_` twin, which calls math's own on the value when the graph runs (eager's
    result); any other number goes to math's own as before. `math.pow` of a symbol is
    traced as `**` on floats, which computes C's pow as math.pow does (a bias correction
    `1 - math.pow(step, -0.8)`). Code that imported the function itself (`from math
    import cos`) needs the value: the number is a constant."""
    originals = {name: getattr(math, name) for name in (*_SYMBOLIC_MATH, "pow")}
    symbolic = (torch.SymInt, torch.SymFloat)

    def on_symbols(name: str) -> Callable[[Any], Any]:
        traced, original = getattr(torch, f"_sym_{name}"), originals[name]
        return lambda x: traced(x) if isinstance(x, symbolic) else original(x)

    def power(x: Any, y: Any) -> Any:
        if isinstance(x, symbolic) or isinstance(y, symbolic):
            return torch.sym_float(x) ** torch.sym_float(y)
        return originals["pow"](x, y)

    for name in _SYMBOLIC_MATH:
        setattr(math, name, on_symbols(name))
    math.pow = power
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(math, name, original)


def _kind(slot: Slot) -> tuple[Any, ...]:
    """Which fields one piece of code reads alike: a field of an object, by its class and
    key; one key of each item of one table (each parameter's `state["step"]`, each param
    group's), by the table and key; any other place (a global, a dict's key, a cell) is its own kind."""
    if isinstance(slot.owner, Slot) and isinstance(slot.owner.owner, Slot):
        return ("item", slot.owner.owner.place(), slot.key)
    if isinstance(slot.owner, (Slot, dict, types.CellType, functools.partial, types.ModuleType)):
        return (slot.name,)
    return (type(slot.owner), slot.key)


def value(slot: Slot, dtype: str | None = None) -> torch.Tensor:
    """The graph input for a number read at every call, from its slot as it is now (`dtype`:
    the graph input's, where it was made)."""
    now = number(slot, dtype)
    return torch.scalar_tensor(now, dtype=torch.int64 if type(now) is int else torch.float64)


def number(slot: Slot, dtype: str | None = None) -> float | int:
    """A number read at every call, as it is now in its slot (`dtype`: the graph input's, "float64" or "int64")."""
    now = slot.get()
    kind = {"float64": float, "int64": int}.get(dtype or "", type(now))
    if type(now) is not kind or kind not in (float, int) or kind is int and now not in _INT64:  # the step's cache key sees a change of type first: a safeguard
        raise CaptureError(f"{slot.name} was {'an int64' if kind is int else 'a float'} when the step was compiled and is now {now!r}; compile a new step")
    return now


@dataclass
class KeyRules:
    """What the cache key holds of the numbers read at every call, as the graphs so far
    assume: the floats whose sign they assume, and the ints' conditions."""

    signed: set[str] = field(default_factory=set)
    conditions: dict[str, tuple[Condition, ...]] = field(default_factory=dict)

    def learn(self, number_signs: dict[str, int], number_conditions: dict[str, tuple[Condition, ...]]) -> None:
        """What one more graph assumes (TrainGraph.call): the keys made before it no longer
        match, so the graphs made before are found no more once an int learns a condition."""
        self.signed |= set(number_signs)
        for name, conditions in number_conditions.items():
            self.conditions[name] = tuple(dict.fromkeys((*self.conditions.get(name, ()), *conditions)))

    def key(self, name: str, value: Any) -> tuple[str, int | None, str, tuple[bool, ...]]:
        """What the key holds of `value`, read at every call from the slot `name`: its type,
        a float's sign where a graph assumes it, a zero itself (which the graph then holds),
        and which side of each condition an int is on."""
        is_float = type(value) is float
        known = sign(value) if name in self.signed and is_float else None
        sides = tuple(c.holds(value) for c in self.conditions.get(name, ())) if type(value) is int and value in _INT64 else ()
        return (type(value).__name__, known, repr(value) if known == 0 else "", sides)
