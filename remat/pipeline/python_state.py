"""Refuse a step that changes Python state while it runs.

The step's Python code runs once, while it is traced; the graph holds the numbers it saw
then as constants. A step that counts its calls in a Python number (`self.steps += 1`, a
global counter) and computes from it (a KL weight warming up, a teacher-forcing ratio)
would repeat its first value at every step, with no error; a list the step appends
`loss.item()` to would hold traced placeholders. What is watched: the plain numbers,
strings and None, and lists, tuples, dicts and sets of them (nested), held as attributes
of the model's modules, or read by train_step as globals or from its closure. State in
other objects (a config object's field, a counter in a class of one's own) is not seen.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from remat.errors import CaptureError

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MOST_ITEMS = 10_000  # larger containers are not watched (each capture and step compares them)
_NOT_PLAIN = object()


def frozen(value: Any) -> Any:
    """A hashable copy of a plain value, or of a container (list, tuple, dict, set) of plain
    values and such containers; _NOT_PLAIN for anything else (tensors, modules, objects)."""
    budget = [_MOST_ITEMS]

    def freeze(v: Any, depth: int) -> Any:
        if isinstance(v, _PLAIN):
            return v
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


def module_attributes(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """(qualified name, module, key, value) of every value a module holds as an attribute
    (its __dict__), but for a DDP wrapper's own settings (checked by pipeline.data_parallel)."""
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            continue
        for key, value in vars(module).items():
            yield ".".join(filter(None, ("model", prefix, key))), module, key, value


_MODULE_TABLES = frozenset(vars(torch.nn.Module()))  # nn.Module's own: parameters, buffers, submodules, hooks


def _plain_attributes(model: torch.nn.Module) -> Iterator[tuple[str, "_Watched"]]:
    """The plain values and containers among them (`training` aside: train/eval mode is
    checked on its own)."""
    for name, module, key, value in module_attributes(model):
        if key in _MODULE_TABLES or key.startswith("__"):
            continue
        watched = _watch(module, key, value)
        if watched is not None:
            yield name, watched


def module_values(model: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    """The model's plain attribute values, as the graph traced with them saw them: a step is
    compiled again when one changes between steps (a temperature or a drop rate set by the
    loop), since the graph holds them as constants."""
    return tuple((name, w.frozen) for name, w in _plain_attributes(model))


def changed_values(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> list[str]:
    """'name (old -> new)' for each value that differs (added or removed ones included)."""
    old, new, gone = dict(before), dict(now), object()
    return [f"{k} ({shown(old.get(k))} -> {shown(new.get(k))})" for k in {**old, **new} if old.get(k, gone) != new.get(k, gone)]


@dataclass
class _Watched:
    owner: Any  # a module, train_step's globals, or a closure cell
    key: str
    value: Any  # the object itself
    frozen: Any  # and what it held

    def now(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.key)
        if hasattr(self.owner, "cell_contents"):
            return self.owner.cell_contents
        return vars(self.owner).get(self.key)

    def put_back(self) -> None:
        if self.now() is not self.value:
            if isinstance(self.owner, dict):
                self.owner[self.key] = self.value
            elif hasattr(self.owner, "cell_contents"):
                self.owner.cell_contents = self.value
            else:
                setattr(self.owner, self.key, self.value)
        if isinstance(self.value, (list, dict, set)) and frozen(self.value) != self.frozen:
            self.value.clear()
            content = _thawed(self.frozen)
            if isinstance(self.value, list):
                self.value.extend(content)
            else:
                self.value.update(content)


def _watched(model: torch.nn.Module, train_step: Callable[..., Any]) -> dict[str, _Watched]:
    """Module attributes, train_step's globals and its closure cells that hold plain values
    or containers of them."""
    out = dict(_plain_attributes(model))
    fn = getattr(train_step, "__func__", train_step)
    code, globs = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        for key in code.co_names:
            if key in globs:
                out[f"global {key}"] = _watch(globs, key, globs[key])
        for key, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            out[f"{key} (from the closure)"] = _watch(cell, key, value)
    return {name: w for name, w in out.items() if w is not None}


def _watch(owner: Any, key: str, value: Any) -> _Watched | None:
    """What to watch of `value`, or None when it is not plain."""
    fz = frozen(value)
    return None if fz is _NOT_PLAIN else _Watched(owner, key, value, fz)


@contextlib.contextmanager
def no_python_state_changed(model: torch.nn.Module, train_step: Callable[..., Any]) -> Iterator[None]:
    """Around the whole capture: refuse, naming them, the watched values the traces changed
    (put back as they were, so that a refused capture leaves nothing changed)."""
    before = _watched(model, train_step)
    yield
    changed = []
    for name, w in before.items():
        now = frozen(w.now())
        if now is not w.frozen and now != w.frozen:
            text = shown(now) if now is not _NOT_PLAIN else _short(repr(w.now()))
            changed.append(f"{name} ({shown(w.frozen)} -> {text})")
            w.put_back()
    if changed:
        raise CaptureError(
            f"train_step changed Python state while it was traced: {', '.join(changed[:5])}"
            + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            + ". Its Python code runs once, at capture, so the graph would repeat the first value at every step "
            "(and a value kept from inside the step would be a traced placeholder, not a number). Keep such state "
            "outside train_step and pass what the step computes from it as a tensor (in the batch, or a buffer of the "
            "model updated between steps); to log a value, return it from train_step."
        )


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
