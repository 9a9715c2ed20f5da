"""Python state the graph holds as constants: refused when the step changes it, and a new
compile when the loop does.

The step's Python code runs once, while it is traced; the graph holds the numbers it saw
then as constants. A step that counts its calls in a Python number (`self.steps += 1`, a
global counter) and computes from it (a KL weight warming up, a teacher-forcing ratio)
would repeat its first value at every step, with no error; a list the step appends
`loss.item()` to would hold traced placeholders. And a number the loop sets between steps
(a loss weight in a global, a config field) would keep its first value in the graph.

What is watched: plain numbers, strings and None, tensors (by shape, dtype and device:
the graph reads them at each call, see outside_tensors), and lists, tuples, dicts and
sets of them (nested), held
- as attributes of the model's modules (all of them);
- as globals or closure cells of the user's code the step runs: train_step, the functions
  it reaches through its globals and closure, and the methods of the model's classes and
  of the user's objects held there (code outside the installed packages and the standard
  library; a library's code is not followed);
- as fields of the user's objects found there (a trainer whose method is train_step, a
  config object or namespace, an EMA helper), where that code or the object's own
  methods name the field;
- as attributes of another module held in those places (a teacher), and its modules'
  train/eval flags;
- and which function a global or closure name holds (a loss function swapped between
  steps).
A tensor the trace leaves in one of these places (`self.last_output = y.detach()`) is
refused too: it is a traced placeholder, and the graph stores no step's value there.
State reached otherwise (a library object's field, an object in a list) is not seen.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import CaptureError

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MOST_ITEMS = 10_000  # larger containers are not watched (each capture and step compares them)
_NOT_PLAIN = object()


@dataclass(frozen=True)
class TensorSignature:
    """A tensor as the watch compares it: the graph reads a tensor held in Python state
    (pipeline.outside_tensors) at every call, but was traced for its shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSignature:
        return cls(tuple(t.shape), str(t.dtype).replace("torch.", ""), str(t.device))

    def __repr__(self) -> str:
        return f"tensor{list(self.shape)} {self.dtype}"


def frozen(value: Any) -> Any:
    """A hashable copy of a plain value, or of a container (list, tuple, dict, set) of plain
    values, tensors (their signatures) and such containers; a tensor's signature; _NOT_PLAIN
    for anything else (modules, objects)."""
    if isinstance(value, _PLAIN):
        return value
    budget = [_MOST_ITEMS]

    def freeze(v: Any, depth: int) -> Any:
        if isinstance(v, _PLAIN):
            return v
        if isinstance(v, torch.Tensor):
            return TensorSignature.of(v)
        if not isinstance(v, _CONTAINERS) or depth > 8 or len(v) > budget[0]:
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
        return _NOT_PLAIN


class _Skip(Exception):
    pass


def _thawed(value: Any) -> Any:
    """The container `frozen` stands for, made anew."""
    if not isinstance(value, tuple) or not value or value[0] not in _CONTAINERS:
        return value
    kind, items = value
    if kind is dict:
        return {_thawed(k): _thawed(x) for k, x in items}
    return kind(_thawed(x) for x in items)


def shown(value: Any) -> str:
    """A frozen value as the user wrote it, shortened."""
    return _short(repr(_thawed(value)))


def module_attributes(model: torch.nn.Module, name: str = "model", skip: frozenset[int] = frozenset()) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """(qualified name, module, key, value) of every value a module holds as an attribute
    (its __dict__, but for nn.Module's own tables and dunder names), but for a DDP wrapper's
    own settings (checked by pipeline.data_parallel) and the modules in `skip` (by id)."""
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) or id(module) in skip:
            continue
        for key, value in vars(module).items():
            if key not in _MODULE_TABLES and not key.startswith("__"):
                yield f"{name}.{prefix}.{key}" if prefix else f"{name}.{key}", module, key, value


_MODULE_TABLES = frozenset(vars(torch.nn.Module()))  # nn.Module's own: parameters, buffers, submodules, hooks


def changed_values(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> list[str]:
    """'name (old -> new)' for each value that differs (added or removed ones included)."""
    old, new, gone = dict(before), dict(now), object()
    return [f"{k} ({shown(old.get(k))} -> {shown(new.get(k))})" for k in {**old, **new} if old.get(k, gone) != new.get(k, gone)]


MISSING = object()


@dataclass
class Slot:
    """Where a value is held: an attribute of a module or of a user's object, a key of a
    function's globals, or a closure cell."""

    name: str  # as an error shows it
    owner: Any
    key: str

    def get(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.key, MISSING)
        if isinstance(self.owner, types.CellType):
            try:
                return self.owner.cell_contents
            except ValueError:  # an empty cell
                return MISSING
        return vars(self.owner).get(self.key, MISSING)

    def set(self, value: Any) -> None:
        if value is MISSING:  # it was not there
            if isinstance(self.owner, dict):
                self.owner.pop(self.key, None)
            elif not isinstance(self.owner, types.CellType):
                vars(self.owner).pop(self.key, None)
        elif isinstance(self.owner, dict):
            self.owner[self.key] = value
        elif isinstance(self.owner, types.CellType):
            self.owner.cell_contents = value
        else:
            setattr(self.owner, self.key, value)


@dataclass
class _Watched:
    slot: Slot
    value: Any  # the object itself
    frozen: Any  # and what it held
    content: Any = None  # a copy of a container's items (the tensors in it themselves), to put back

    def put_back(self) -> None:
        if self.slot.get() is not self.value:
            self.slot.set(self.value)
        if isinstance(self.value, (list, dict, set)) and _snapshot(self.value) != self.frozen:
            self.value.clear()
            if isinstance(self.value, list):
                self.value.extend(self.content)
            else:
                self.value.update(self.content)


def state_slots(model: torch.nn.Module, train_step: Callable[..., Any]) -> list[tuple[Slot, Any]]:
    """Every slot the watch reads (see the module's docstring), with the value it holds."""
    out = [(Slot(name, module, key), value) for name, module, key, value in module_attributes(model)]
    code = _user_code(model, train_step)
    out += code.bindings
    roots = [(slot.name, value) for slot, value in out if not isinstance(value, _PLAIN + _CONTAINERS)]
    # The object a method belongs to (a trainer), or the callable object that is the step.
    owner = train_step if _user_class(type(train_step)) else getattr(train_step, "__self__", None)
    if owner is not None:
        roots.append((type(owner).__name__, owner))
    seen: set[int] = set()
    for name, value in roots:
        out += _object_fields(name, value, code.names, seen, depth=0)
    # Another module the step runs (a teacher, an EMA copy of the model): its attributes and
    # train/eval flags, which its forward is traced with as the model's are.
    model_modules = frozenset(id(m) for m in model.modules())
    for slot, value in list(out):
        if isinstance(value, torch.nn.Module) and id(value) not in model_modules and id(value) not in seen:
            seen.add(id(value))
            out += [(Slot(n, m, k), v) for n, m, k, v in module_attributes(value, slot.name, model_modules)]
            out += [
                (Slot(f"{slot.name}.{prefix}.training" if prefix else f"{slot.name}.training", m, "training"), m.training)
                for prefix, m in value.named_modules() if id(m) not in model_modules
            ]
    return out


def _watched(slots: list[tuple[Slot, Any]]) -> dict[str, _Watched]:
    """The slots holding plain values (or the user's functions), by name."""
    out = {}
    for slot, value in slots:
        fz = _snapshot(value)
        if fz is not _NOT_PLAIN:
            out[slot.name] = _Watched(slot, value, fz)
    return out


def _copied(value: Any) -> Any:
    """A container copied through its nested containers (for `frozen` values: bounded)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, _CONTAINERS):
        return type(value)(_copied(v) for v in value)
    return value


def step_values(model: torch.nn.Module, train_step: Callable[..., Any], skip: set[str] | frozenset[str] = frozenset()) -> tuple[tuple[str, Any], ...]:
    """The watched values as the graph traced with them saw them: a step is compiled again
    when one changes between steps (a temperature, a drop rate or a loss weight set by the
    loop), since the graph holds them as constants. `skip`: slots left out (a list the step
    logs numbers to, which the graph never reads)."""
    return tuple((name, w.frozen) for name, w in _watched(state_slots(model, train_step)).items() if name not in skip)


@dataclass
class _UserCode:
    names: set[str]  # every global and attribute name the code mentions
    bindings: list[tuple[Slot, Any]]  # the globals and closure cells it reads, with their values


_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {site.getusersitepackages()}
)
_MOST_FUNCTIONS = 500


def _is_user_file(path: str) -> bool:
    return not path.startswith("<") and not path.startswith(_LIBRARY_DIRS)


def _user_function(value: Any) -> types.FunctionType | None:
    """The Python function behind `value` (itself, a bound method's, a partial's), if the
    user wrote it."""
    while isinstance(value, (types.MethodType, functools.partial, staticmethod, classmethod, property)):
        value = value.fget if isinstance(value, property) else getattr(value, "__func__", None) or value.func
    if isinstance(value, types.FunctionType) and _is_user_file(value.__code__.co_filename):
        return value
    return None


@functools.lru_cache(maxsize=4096)
def _user_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return cls in (argparse.Namespace, types.SimpleNamespace) or (path is not None and _is_user_file(path))


def _user_code(model: torch.nn.Module, train_step: Callable[..., Any]) -> _UserCode:
    """The user's functions the step runs, followed from train_step and the model's classes
    through globals and closures."""
    pending: list[Any] = [train_step, getattr(type(train_step), "__call__", None), *_methods(model)]
    step_globals = getattr(_user_function(train_step), "__globals__", None)
    names: set[str] = set()
    bindings: list[tuple[Slot, Any]] = []
    seen: set[int] = set()
    while pending and len(seen) < _MOST_FUNCTIONS:
        fn = _user_function(pending.pop())
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        mentioned = _names(fn.__code__)
        names |= mentioned
        globs = fn.__globals__
        where = "" if globs is step_globals else f"{globs.get('__name__', '?')}."
        slots = [Slot(f"global {where}{key}", globs, key) for key in sorted(mentioned & globs.keys())]
        slots += [Slot(f"{key} (from the closure of {fn.__name__})", cell, key) for key, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())]
        for slot in slots:
            value = slot.get()
            if value is not MISSING:  # an empty closure cell
                bindings.append((slot, value))
                pending += _methods(value) if isinstance(value, torch.nn.Module) else [value, *_class_functions(type(value))]
    return _UserCode(names, bindings)


@functools.lru_cache(maxsize=4096)
def _class_functions(cls: type) -> tuple[Any, ...]:
    """The functions of a user's class and its user base classes (a trainer's or EMA helper's methods)."""
    return tuple(f for c in cls.__mro__ if _user_class(c) and c is not object for f in vars(c).values())


@functools.lru_cache(maxsize=4096)
def _names_in_class(cls: type) -> frozenset[str]:
    return frozenset(n for f in _class_functions(cls) if (fn := _user_function(f)) is not None for n in _names(fn.__code__))


def _methods(module: torch.nn.Module) -> list[Any]:
    """The functions of the user's classes among a module's and its submodules' classes."""
    return [f for cls in {type(m) for m in module.modules()} for f in _class_functions(cls)]


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the functions nested in it mention."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _object_fields(name: str, obj: Any, names: set[str], seen: set[int], depth: int) -> Iterator[tuple[Slot, Any]]:
    """The fields of a user's object (and of the user's objects in them) that the user's code names."""
    if depth > 3 or id(obj) in seen or isinstance(obj, (type, torch.nn.Module, torch.Tensor)) or not _user_class(type(obj)):
        return
    seen.add(id(obj))
    try:
        fields = vars(obj)
    except TypeError:  # __slots__
        return
    names = names | _names_in_class(type(obj))  # what its own methods name (an EMA helper's update())
    for key in sorted(k for k in fields if k in names):
        yield Slot(f"{name}.{key}", obj, key), fields[key]
        yield from _object_fields(f"{name}.{key}", fields[key], names, seen, depth + 1)


def _snapshot(value: Any) -> Any:
    """What a watched value is compared by: its frozen copy, or which function it is."""
    fn = _user_function(value) if isinstance(value, types.FunctionType) else None
    return _FunctionRef(fn) if fn is not None else frozen(value)


class _FunctionRef:
    """Which function a name holds: equal only to the same function."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FunctionRef) and other.fn is self.fn

    def __hash__(self) -> int:
        return id(self.fn)

    def __repr__(self) -> str:
        return self.fn.__qualname__


@contextlib.contextmanager
def no_python_state_changed(model: torch.nn.Module, train_step: Callable[..., Any], slots: list[tuple[Slot, Any]]) -> Iterator[None]:
    """Around the whole capture: refuse, naming them, the watched values the traces changed
    and the tensors they left in Python state, putting everything back as it was (so that a
    refused capture leaves nothing changed). `slots`: state_slots before the capture."""
    held = {slot.name: value for slot, value in slots}
    before = _watched(slots)
    for w in before.values():
        w.content = _copied(w.value)
    yield
    kept = [slot for slot, value in state_slots(model, train_step) if _holds_traced_tensor(value)]
    for slot in kept:
        if slot.name not in before:
            slot.set(held.get(slot.name, MISSING))
    kept_names = {slot.name for slot in kept}
    changed = []
    for name, w in before.items():
        value = w.slot.get()
        now = _snapshot(value)
        if now is not w.frozen and now != w.frozen:
            text = shown(now) if now is not _NOT_PLAIN else "deleted" if value is MISSING else _short(repr(value))
            if name not in kept_names:
                changed.append(f"{name} ({shown(w.frozen)} -> {text})")
            w.put_back()
    if changed:
        raise CaptureError(
            f"train_step changed Python state while it was traced: {_listed(changed)}. Its Python code runs once, at "
            "capture, so the graph would repeat the first value at every step (and a value kept from inside the step "
            "would be a traced placeholder, not a number). Keep such state outside train_step and pass what the step "
            "computes from it as a tensor (in the batch, or a buffer of the model updated between steps); to log a "
            "value, return it from train_step or append it to a list of your own code (a global, not a module's)."
        )
    if kept:
        raise CaptureError(
            f"train_step kept a tensor it computed in Python state: {_listed([s.name for s in kept])}. Its Python code "
            "runs once, at capture: there the tensor is a traced placeholder, and at run time the graph computes it "
            "but stores it nowhere, so it would never hold a step's value. Return it from train_step instead (a tuple "
            "or dict of the loss and the tensors to keep), or, if nothing reads it after the step (features a forward "
            "hook stored for the loss), drop it before train_step returns (.clear() the dict, del the attribute)."
        )


def _holds_traced_tensor(value: Any, depth: int = 0) -> bool:
    """Whether `value` is, or a list, tuple or dict holds, a tensor made while tracing."""
    if isinstance(value, FakeTensor):
        return True
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= _MOST_ITEMS:
        return any(_holds_traced_tensor(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict) and len(value) <= _MOST_ITEMS:
        return any(_holds_traced_tensor(v, depth + 1) for v in value.values())
    return False


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
