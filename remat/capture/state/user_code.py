"""Which code is the user's: functions and classes outside the installed packages, the
standard library and remat itself, and the names their code reads (python_state follows
these), and the user's code a step runs, followed through globals, closures and what a
`functools.partial` binds (`followed`). A global is followed only where the code loads it
by that name, an object's field only where the code reads or writes that attribute: a
name the code only uses as an attribute (`optimizer.step()`) is no read of a global `step`."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dis
import functools
import os
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat.capture.state import module_hooks
from remat.capture.state.slots import CONTAINERS, MISSING, PLAIN, Defaults, Slot

_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {site.getusersitepackages()}
)


# remat's own code (an editable install lives outside the installed packages): never the
# user's, so the compiled step and remat's modules are never followed.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


# Code with no file that the user typed or ran: a script piped to `python -`, `python -c`,
# exec() of a string, the interactive console, older IPython's cells. Other code with no
# file (`<frozen ...>` modules of the standard library, torch.fx's generated forwards) is not.
_USER_PSEUDO_FILES = ("<stdin>", "<string>", "<console>", "<ipython-input-")


def is_user_file(path: str) -> bool:
    if path.startswith("<"):
        return path.startswith(_USER_PSEUDO_FILES)
    return not path.startswith(_LIBRARY_DIRS) and not path.startswith(_OWN_DIR)


def user_function(value: Any) -> types.FunctionType | None:
    """The Python function behind `value` (itself, a bound method's, a partial's, the one
    torch.compile wrapped: the capture traces its code), if the user wrote it."""
    while True:
        if isinstance(value, (types.MethodType, functools.partial, staticmethod, classmethod, property)):
            value = value.fget if isinstance(value, property) else getattr(value, "__func__", None) or value.func
        elif isinstance(value, types.FunctionType) and "_torchdynamo_orig_callable" in vars(value):
            value = vars(value)["_torchdynamo_orig_callable"]
        else:
            break
    # A dataclass's generated methods (`__init__`, `__eq__`: their file is `<string>`) are
    # not the user's code: they name every field, which would watch all of them.
    if isinstance(value, types.FunctionType) and is_user_file(value.__code__.co_filename) and "__create_fn__" not in getattr(value.__code__, "co_qualname", ""):
        return value
    return None


@functools.lru_cache(maxsize=4096)
def user_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return cls in (argparse.Namespace, types.SimpleNamespace) or (path is not None and is_user_file(path))


@functools.lru_cache(maxsize=4096)
def class_functions(cls: type) -> tuple[Any, ...]:
    """The functions of a user's class and its user base classes (a trainer's or EMA helper's methods)."""
    return tuple(f for c in cls.__mro__ if user_class(c) and c is not object for f in vars(c).values())


@functools.lru_cache(maxsize=4096)
def names_in_class(cls: type, ran: frozenset[types.CodeType] | None = None) -> frozenset[str]:
    """The attribute names its methods read or write (an EMA helper's `self.decay`); only
    those of the methods that ran, where `ran` is given."""
    return frozenset(n for f in class_functions(cls) if (fn := user_function(f)) is not None for n in attribute_names(fn.__code__, ran))


def methods(module: torch.nn.Module) -> list[Any]:
    """The functions of the user's classes among a module's and its submodules' classes."""
    return [f for cls in {type(m) for m in module.modules()} for f in class_functions(cls)]


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


def global_names(code: types.CodeType, ran: frozenset[types.CodeType] | None = None) -> frozenset[str]:
    """The globals a code object (and the functions, lambdas and comprehensions nested in
    it) reads or writes by name; where `ran` is given (the code a trace ran: `recording_run`),
    only those of the code that ran."""
    return _read(code, ran, 0)


def attribute_names(code: types.CodeType, ran: frozenset[types.CodeType] | None = None) -> frozenset[str]:
    """The attribute names it reads, writes or calls (`self.decay`, `optimizer.step`), as global_names."""
    return _read(code, ran, 1)


def _read(code: types.CodeType, ran: frozenset[types.CodeType] | None, which: int) -> frozenset[str]:
    if ran is not None and code not in ran:
        return frozenset()
    out = set(_own_names(code)[which])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _read(const, ran, which)
    return frozenset(out)


@functools.lru_cache(maxsize=8192)
def _own_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    globals_, attributes = set(), set()
    by_name = False  # after `getattr` (hasattr, setattr) is loaded, until its call: `getattr(cfg, "aux", 0.0)`
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            globals_.add(ins.argval)
            by_name = by_name or ins.argval in _BY_NAME
        elif ins.opname in _ATTRIBUTE_OPS:
            attributes.add(ins.argval)
        elif by_name and ins.opname == "LOAD_CONST" and isinstance(ins.argval, str):
            attributes.add(ins.argval)
        elif ins.opname.startswith("CALL"):
            by_name = False
    return frozenset(globals_), frozenset(attributes)


_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr"})


_RECORDING: list[cProfile.Profile] = []  # the profiler of the run being recorded, while one is

# Operator namespaces whose kernels (real, fake and decompositions) are torch's own code.
_TORCH_OP_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "_dtensor", "rngprims", "quantized", "mkldnn"})


def _only_torch_below(op: Any, types_: Any) -> bool:
    return (
        getattr(op, "namespace", None) in _TORCH_OP_NAMESPACES
        and all(t.__module__.startswith("torch.") for t in types_)
        and all(type(mode).__module__.startswith("torch.") for mode in _get_current_dispatch_mode_stack())
    )


@contextlib.contextmanager
def torch_dispatch_unrecorded(op: Any, types_: Any) -> Iterator[None]:
    """Around the dispatch of one op while a run is recorded: the profiler paused where
    only torch's code can run below (an op of torch's namespaces, on torch's tensor types,
    under torch's dispatch modes), which is most of a trace's Python calls (make_fx's proxy
    and fake tensor modes), so that recording costs a fraction of the trace instead of
    doubling it. A custom op's kernels, a tensor subclass's dispatch or a dispatch mode of
    the user's may be the user's code: recorded."""
    profiler = _RECORDING[-1] if _RECORDING else None
    if profiler is None or not _only_torch_below(op, types_):
        yield
        return
    profiler.disable()
    try:
        yield
    finally:
        profiler.enable()


@contextlib.contextmanager
def recording_run(ran: set[types.CodeType], device: str) -> Iterator[bool]:
    """While the block runs (a trace), every code object of the user's that starts running
    is added to `ran`: what the trace read is what that code names, and nothing the user's
    other code names (a training loop's counter, the compiled step held in a global).
    Yields whether it records: not where a profiler of the process's own is set (it would
    be displaced), nor for a model off the CPU, whose backward pass (and the user's hooks
    in it) runs in autograd's device threads, which this thread's hook does not see."""
    previous = sys.getprofile()
    if previous is not None or device != "cpu":
        yield False
        return
    # cProfile's C profiler records every function that runs at a fraction of the cost of
    # a Python profile function (make_fx's own Python calls are millions).
    profiler = cProfile.Profile(builtins=False, subcalls=False)
    _RECORDING.append(profiler)
    profiler.enable()
    try:
        yield True
    finally:
        profiler.disable()
        _RECORDING.remove(profiler)
        user_files: dict[str, bool] = {}
        for entry in profiler.getstats():
            code = entry.code
            if isinstance(code, types.CodeType):
                mine = user_files.get(code.co_filename)
                if mine is None:
                    mine = user_files[code.co_filename] = is_user_file(code.co_filename)
                if mine:
                    ran.add(code)


_MOST_FUNCTIONS = 500


def _held_across_calls(value: Any) -> bool:
    """A default argument the step could change for the next call: a container or an object (not a function, a class, a module)."""
    return isinstance(value, CONTAINERS) or not (isinstance(value, (*PLAIN, type, types.ModuleType)) or callable(value))


@dataclass
class UserCode:
    names: set[str]  # every attribute name the code reads or writes (fields of the user's objects are watched by these)
    bindings: list[tuple[Slot, Any]]  # the globals and closure cells it reads, with their values


def followed(pending: list[Any], step_globals: dict[str, Any] | None, ran: frozenset[types.CodeType] | None) -> UserCode:
    """The user's functions the step runs, followed from `pending` (train_step and the model's
    classes' methods, or functions held in the user's objects) through globals and closures.
    A global is named with its module unless it is train_step's (`step_globals`)."""
    names: set[str] = set()
    bindings: list[tuple[Slot, Any]] = []
    seen: set[int] = set()
    partials: set[int] = set()
    while pending and len(seen) < _MOST_FUNCTIONS:
        held = pending.pop()
        fn = user_function(held)
        if fn is None or id(fn) in seen and not isinstance(held, functools.partial):
            continue
        if isinstance(held, functools.partial) and id(held) not in partials:  # what it binds (a hook's dict of features)
            partials.add(id(held))
            where = f"of partial {len(partials)} of {fn.__name__}"
            bound = [Slot(f"argument {i} {where}", held, str(i)) for i in range(len(held.args))]
            bindings += [(slot, slot.get()) for slot in [*bound, *(Slot(f"{k} {where}", held.keywords, k) for k in held.keywords)]]
            pending += [v for v in (*held.args, *held.keywords.values()) if user_function(v) is not None]  # a loss_fn it binds
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if ran is not None and fn.__code__ not in ran:
            continue  # it never ran: nothing it names was read
        names |= attribute_names(fn.__code__, ran)
        globs = fn.__globals__
        where = "" if globs is step_globals else f"{globs.get('__name__', '?')}."
        slots = [Slot(f"global {where}{key}", globs, key) for key in sorted(global_names(fn.__code__, ran) & globs.keys())]
        slots += [Slot(f"{key} (from the closure of {fn.__name__})", cell, key) for key, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())]
        # A function given as a default argument (`loss_fn=focal_loss`) runs as the step's; a container or an
        # object given so (`history=[]`) is held there from call to call, as a closure's is.
        defaults = Defaults(fn)
        pending += [d for d in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()) if user_function(d) is not None]
        slots += [Slot(f"default {k} of {fn.__name__}", defaults, k) for k in defaults.names() if _held_across_calls(defaults.get(k))]
        for slot in slots:
            value = slot.get()
            if value is not MISSING:  # an empty closure cell
                bindings.append((slot, value))
                pending += [*methods(value), *module_hooks.functions(value)] if isinstance(value, torch.nn.Module) else [value, *class_functions(type(value))]
    return UserCode(names, bindings)


def _user_modules_globals() -> list[dict[str, Any]]:
    """The globals of each imported module of the user's."""
    modules = list(sys.modules.values())
    return [vars(m) for m in modules if isinstance(path := getattr(m, "__file__", None), str) and is_user_file(path)]


@contextlib.contextmanager
def globals_swapped(instead: Callable[[Any], Any], in_classes: bool = False) -> Iterator[None]:
    """While the block runs, each global of the user's imported modules (and, `in_classes`,
    each attribute of the classes they define) for which `instead(value)` gives an object
    (not None) holds that object; each put back after."""
    swapped = []
    for names in _user_modules_globals():
        swapped += [(names, k, v, new) for k, v in list(names.items()) if (new := instead(v)) is not None and new is not v]
        for cls in [v for v in list(names.values()) if in_classes and isinstance(v, type) and v.__module__ == names.get("__name__")]:
            swapped += [(cls, k, v, new) for k, v in list(vars(cls).items()) if (new := instead(v)) is not None and new is not v]

    def put(held: Any, key: str, value: Any) -> None:
        if isinstance(held, dict):
            held[key] = value
        else:
            setattr(held, key, value)

    try:
        for held, k, _, new in swapped:
            put(held, k, new)
        yield
    finally:
        for held, k, v, _ in swapped:
            put(held, k, v)


def caches_passed_over() -> contextlib.AbstractContextManager[None]:
    """While a step is traced, the user's functions and methods cached with
    `functools.lru_cache` or `functools.cache` (a causal mask by length, positional
    encodings) called as they are: the trace's placeholder kept in the cache would be what
    eager's next call and the next trace get, and a value eager cached is computed in the
    graph as eager's first call did."""
    return globals_swapped(lambda v: v.__wrapped__ if isinstance(v, functools._lru_cache_wrapper) and user_function(v.__wrapped__) else None, in_classes=True)
