"""Where a value of the user's Python state lives (dynamo's `Source`): a global, a closure
cell, an attribute of a module or object, a key of a dict or an item of a list another slot
holds (`split`: a container watched item by item), an argument
a `functools.partial` binds, a function's default argument; and a value held there as the watch compares it (`frozen`)
and as a message shows it (`shown`): plain values as they are, containers of them copied,
a tensor by its shape, dtype and device, a small numpy array or numpy scalar by its bytes
(one changed in place is the same object), an iterator of Python's own by where it stands
(`itertools.count()`: one the step advances is a change), anything else NOT_PLAIN."""

from __future__ import annotations

import collections
import functools
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.utils._pytree as pytree

MISSING = object()


@dataclass(frozen=True)
class Defaults:
    """A function's default arguments, as the owner of a slot keyed by the parameter's name
    (`def train_step(model, opt, batch, history=[])`: the list every call appends to)."""

    fn: types.FunctionType

    def get(self, name: str) -> Any:
        if name in (self.fn.__kwdefaults__ or {}):
            return self.fn.__kwdefaults__[name]  # type: ignore[index]
        code = self.fn.__code__
        positional = code.co_varnames[: code.co_argcount]
        defaults = self.fn.__defaults__ or ()
        i = positional.index(name) - (len(positional) - len(defaults))
        return defaults[i]

    def set(self, name: str, value: Any) -> None:
        if name in (self.fn.__kwdefaults__ or {}):
            self.fn.__kwdefaults__[name] = value  # type: ignore[index]
            return
        code = self.fn.__code__
        positional = code.co_varnames[: code.co_argcount]
        defaults = list(self.fn.__defaults__ or ())
        defaults[positional.index(name) - (len(positional) - len(defaults))] = value
        self.fn.__defaults__ = tuple(defaults)

    def names(self) -> list[str]:
        code = self.fn.__code__
        positional = code.co_varnames[: code.co_argcount]
        return [*positional[len(positional) - len(self.fn.__defaults__ or ()) :], *(self.fn.__kwdefaults__ or {})]


@dataclass
class Slot:
    """Where a value is held: an attribute of a module or of a user's object, a key of a
    function's globals, a closure cell, a key of the dict another slot holds then, or a
    positional argument of a partial (a keyword one is a key of its keywords dict)."""

    name: str  # as an error shows it
    owner: Any
    key: str
    # A library object's field holding tensors (library_objects): read by the graph where
    # it reads them, never part of the watched values (the graph's inputs check their shapes).
    library: bool = False

    def place(self) -> tuple[int, str]:
        """Which place it is, whatever the path it was found by."""
        return (id(self.owner.get()) if isinstance(self.owner, Slot) else id(self.owner), self.key)

    def get(self) -> Any:
        if isinstance(self.owner, Defaults):
            return self.owner.get(self.key)
        if isinstance(self.owner, functools.partial):  # a positional argument it binds (key: its index)
            return self.owner.args[int(self.key)]
        if isinstance(self.owner, Slot):
            held = self.owner.get()
            if isinstance(held, (list, tuple)) and type(self.key) is int:  # an item of a list split by index
                return held[self.key] if self.key < len(held) else MISSING
            return held.get(self.key, MISSING) if isinstance(held, dict) else MISSING
        if isinstance(self.owner, dict):
            return self.owner.get(self.key, MISSING)
        if isinstance(self.owner, types.CellType):
            try:
                return self.owner.cell_contents
            except ValueError:  # an empty cell
                return MISSING
        held = fields_of(self.owner)
        return held.get(self.key, MISSING) if held is not None else getattr(self.owner, self.key, MISSING)  # __slots__

    def set(self, value: Any) -> None:
        if isinstance(self.owner, Defaults):
            self.owner.set(self.key, value)
        elif isinstance(self.owner, functools.partial):
            p, i = self.owner, int(self.key)
            p.__setstate__((p.func, (*p.args[:i], value, *p.args[i + 1 :]), p.keywords, p.__dict__ or None))
        elif isinstance(self.owner, Slot):
            Slot(self.name, self.owner.get(), self.key).set(value)
        elif isinstance(self.owner, list) and type(self.key) is int:
            if value is not MISSING and self.key < len(self.owner):
                self.owner[self.key] = value
        elif value is MISSING:  # it was not there
            if isinstance(self.owner, dict):
                self.owner.pop(self.key, None)
            elif not isinstance(self.owner, types.CellType):
                held = fields_of(self.owner)
                if isinstance(held, dict):
                    held.pop(self.key, None)
                elif hasattr(self.owner, self.key):  # a class's (a read-only mapping), or a __slots__ attribute
                    delattr(self.owner, self.key)
        elif isinstance(self.owner, dict):
            self.owner[self.key] = value
        elif isinstance(self.owner, types.CellType):
            self.owner.cell_contents = value
        else:
            setattr(self.owner, self.key, value)


def item_name(slot: Slot, index: str) -> str:
    """`index` after the name of what the slot holds: `state['seen'] (from the closure of step)`."""
    base, closure, fn = slot.name.partition(" (from the closure of ")
    return f"{base}{index}{closure}{fn}"


def fields_of(obj: Any) -> dict[str, Any] | None:
    """An object's attributes (None for one with __slots__ only)."""
    try:
        return vars(obj)
    except TypeError:
        return None


def slotted_fields(obj: Any) -> dict[str, Any]:
    """The attributes set of those an object keeps in `__slots__` (a `dataclass(slots=True)`), by name."""
    names = []
    for cls in type(obj).__mro__:
        declared = vars(cls).get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return {n: getattr(obj, n) for n in names if n not in ("__dict__", "__weakref__") and hasattr(obj, n)}


PLAIN = (bool, int, float, str, type(None))
CONTAINERS = (list, tuple, dict, set, frozenset)
MOST_ITEMS = 10_000  # larger containers are not watched (each capture and step compares them)
NOT_PLAIN = object()


@dataclass(frozen=True)
class TensorSignature:
    """A tensor as the watch compares it: the graph reads a tensor held in Python state
    (capture.state.outside_tensors) at every call, but was traced for its shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSignature:
        return cls(tuple(t.shape), str(t.dtype).replace("torch.", ""), str(t.device))

    def __repr__(self) -> str:
        return f"tensor{list(self.shape)} {self.dtype}"


def frozen(value: Any, opaque: frozenset[int] = frozenset()) -> Any:
    """A hashable copy of a plain value, or of a container (list, tuple, dict, set) of plain
    values, tensors (their signatures) and such containers; a tensor's signature; NOT_PLAIN
    for anything else (modules, objects). A nested container in `opaque` (by id) stands
    for itself, whatever it holds."""
    if isinstance(value, PLAIN):
        return value
    budget = [MOST_ITEMS]

    def freeze(v: Any, depth: int) -> Any:
        if isinstance(v, PLAIN):
            return v
        if isinstance(v, torch.Tensor):
            return TensorSignature.of(v)
        if isinstance(v, np.generic) and not isinstance(v, np.object_):  # np.float32(0.5): by value
            return (np.generic, v.dtype.str, (), v.tobytes())
        if isinstance(v, np.ndarray) and v.dtype != object and v.size <= budget[0]:  # a small array of weights: by value
            budget[0] -= v.size
            return (np.ndarray, v.dtype.str, v.shape, v.tobytes())
        if depth and id(v) in opaque:
            return _NotCompared(type(v))
        if type(v).__module__ in ("itertools", "builtins") and hasattr(type(v), "__next__"):
            return _iterator_state(v)  # `next(self.counter)` in the step: a change the watch sees
        if not isinstance(v, CONTAINERS) or depth > 8 or len(v) > budget[0]:
            raise _Skip
        budget[0] -= len(v)
        if isinstance(v, dict):
            return (dict, tuple((freeze(k, depth + 1), freeze(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, (set, frozenset)):
            return (type(v), frozenset(freeze(x, depth + 1) for x in v))
        return (type(v), tuple(freeze(x, depth + 1) for x in v))

    try:
        return freeze(value, 0)
    except _Skip:
        return NOT_PLAIN


class _Skip(Exception):
    pass


@dataclass(frozen=True)
class _IteratorState:
    """An iterator of Python's own (`itertools.count()`, `iter(a_list)`) by where it stands:
    the state its pickling gives, with the objects it walks by identity."""

    kind: str
    state: Any

    def __repr__(self) -> str:
        return f"<{self.kind} at {self.state!r}>"


def _iterator_state(it: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # itertools' pickling is deprecated (3.12): where it is gone, not compared
            reduced = it.__reduce__()
    except Exception:
        raise _Skip from None
    plain = [x if isinstance(x, PLAIN) else id(x) for x in pytree.tree_leaves(reduced[1:])]
    return _IteratorState(type(it).__name__, tuple(plain))


@dataclass(frozen=True)
class _NotCompared:
    """A container `frozen` compares by its type alone: the step never reads its contents."""

    kind: type

    def __repr__(self) -> str:
        return f"<a {self.kind.__name__}>"


def thawed(value: Any) -> Any:
    """The container `frozen` stands for, made anew."""
    if isinstance(value, tuple) and value and value[0] in (np.generic, np.ndarray):
        array = np.frombuffer(value[3], dtype=np.dtype(value[1])).reshape(value[2])
        return array[()] if value[0] is np.generic else array
    if not isinstance(value, tuple) or not value or not (isinstance(value[0], type) and issubclass(value[0], CONTAINERS)):
        return value
    kind, items = value
    if kind is dict:
        return {thawed(k): thawed(x) for k, x in items}
    return remade(kind, [thawed(x) for x in items])


def remade(kind: type, items: list[Any]) -> Any:
    """A container of type `kind` (a list, tuple, set, or a subclass) holding `items`; a
    namedtuple (loguru's `Level`, held by a library a step calls) takes them one by one."""
    return kind._make(items) if issubclass(kind, tuple) and hasattr(kind, "_make") else kind(items)


def rounds_in_python(value: Any) -> bool:
    """A numpy float other than float64 (a schedule kept as np.float32): Python's arithmetic on
    it rounds to its precision, which a graph reading it as a float at every call would not,
    so a step holds it by value (numpy's float64 is a float, and read as one)."""
    return isinstance(value, np.floating) and type(value) is not np.float64


def shown(value: Any) -> str:
    """A frozen value as the user wrote it, shortened."""
    return short(repr(thawed(value)))


def short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


NUMBERS = (bool, int, float)
TRACED_NUMBERS = (torch.SymBool, torch.SymInt, torch.SymFloat)  # a number computed from tensors while tracing (`loss.item()`)
MOST_KEYS = 64  # a larger dict is not split by key, nor looked into for the objects it holds
_SPLIT_DICTS = (dict, collections.defaultdict, collections.OrderedDict, collections.Counter)
_SPLIT_DEPTH = 3


def is_number(value: Any) -> bool:
    """A plain number or a traced one."""
    return type(value) in NUMBERS or isinstance(value, TRACED_NUMBERS)


def split(slot: Slot, value: Any, depth: int = 0) -> list[tuple[Slot, Any]]:
    """The slots a slot's value is watched as: itself, or one per key or item. A dict (a
    defaultdict, OrderedDict or Counter too) of numbers (traced ones too), strings, None and lists of numbers
    or tensors under str keys (metrics, a history of losses, a loop's state) held outside a
    module, as one slot per key: the step may count or log into one key
    (capture.state.kept_numbers, logged_numbers) while the others are watched as values, and
    a number the loop changes is read at every call on its own (read_numbers). Its keys are
    watched through the items' names. Any other value: its own slot. (A list the step logs
    tensors into splits its dict as it did when empty: the step found again after the loop
    touched the state.)

    A dict under str keys that cannot be watched whole (it holds a deque, a model or an
    object beside its numbers: a loop's state `{"recent": deque(maxlen=100), "n": 0}`) is
    split by key too, down to `_SPLIT_DEPTH`, each value then watched, counted or logged
    into on its own; left whole, nothing the step changed in it would be seen. So is a list
    by index (`[head, 0]`), and a tuple where it holds lists or dicts (its other items cannot change).
    A module's attribute is split only so (a dict of numbers there stays one value)."""
    if type(value) not in (list, tuple, *_SPLIT_DICTS) or not value or len(value) > MOST_KEYS:
        return [(slot, value)]
    if isinstance(slot.owner, torch.nn.Module) and not _holds_objects(value):
        return [(slot, value)]
    if type(value) in (list, tuple):
        if depth >= _SPLIT_DEPTH or not _holds_objects(value):
            return [(slot, value)]
        indexed = [(Slot(item_name(slot, f"[{i}]"), slot, i), v) for i, v in enumerate(value)]
        return [item for index, v in indexed if type(value) is list or type(v) in (list, dict) for item in split(index, v, depth + 1)]
    if any(type(k) is not str for k in value):
        return [(slot, value)]
    keys = [(Slot(item_name(slot, f"[{k!r}]"), slot, k), v) for k, v in value.items()]
    if all(is_number(v) or type(v) in (str, type(None)) or (type(v) is list and all(is_number(x) or isinstance(x, torch.Tensor) for x in v)) for v in value.values()):
        return keys
    if depth < _SPLIT_DEPTH and _holds_objects(value):
        return [item for key, v in keys for item in split(key, v, depth + 1)]
    return [(slot, value)]


def _holds_objects(value: Any) -> bool:
    """Whether a container holds something the watch cannot compare (a deque, a module, an
    object), looked into through the base classes' methods: the step's recording lists are
    not read."""
    return holds(value, lambda v: not isinstance(v, (*PLAIN, *CONTAINERS, torch.Tensor, np.generic, np.ndarray)))


def holds(value: Any, test: Callable[[Any], bool], depth: int = 0) -> bool:
    """Whether `value` is, or a list, tuple or dict of at most MOST_ITEMS holds (three
    deep), a value `test` picks."""
    if test(value):
        return True
    # Through the base classes' own methods: a list the step logs into is a recording one
    # while it is traced (logged_numbers), and remat's look is no read of the step's.
    base = next((kind for kind in (list, tuple, dict) if isinstance(value, kind)), None)
    if depth < 3 and base is not None and base.__len__(value) <= MOST_ITEMS:
        return any(holds(v, test, depth + 1) for v in (dict.values(value) if base is dict else base.__iter__(value)))
    return False
