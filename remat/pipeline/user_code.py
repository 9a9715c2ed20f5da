"""Which code is the user's: functions and classes outside the installed packages and the
standard library, and the names their code mentions (python_state follows these)."""

from __future__ import annotations

import argparse
import functools
import site
import sys
import sysconfig
import types
from typing import Any

import torch

_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {site.getusersitepackages()}
)


def is_user_file(path: str) -> bool:
    return not path.startswith("<") and not path.startswith(_LIBRARY_DIRS)


def user_function(value: Any) -> types.FunctionType | None:
    """The Python function behind `value` (itself, a bound method's, a partial's), if the
    user wrote it."""
    while isinstance(value, (types.MethodType, functools.partial, staticmethod, classmethod, property)):
        value = value.fget if isinstance(value, property) else getattr(value, "__func__", None) or value.func
    if isinstance(value, types.FunctionType) and is_user_file(value.__code__.co_filename):
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
def names_in_class(cls: type) -> frozenset[str]:
    return frozenset(n for f in class_functions(cls) if (fn := user_function(f)) is not None for n in names(fn.__code__))


def methods(module: torch.nn.Module) -> list[Any]:
    """The functions of the user's classes among a module's and its submodules' classes."""
    return [f for cls in {type(m) for m in module.modules()} for f in class_functions(cls)]


def names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the functions nested in it mention."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= names(const)
    return out
