"""Refuse a step that changes Python state while it runs.

The step's Python code runs once, while it is traced; the graph holds the numbers it saw
then as constants. A step that counts its calls in a Python number (`self.steps += 1`, a
global counter) and computes from it (a KL weight warming up, a teacher-forcing ratio)
would repeat its first value at every step, with no error. What is watched: the plain
numbers, strings and None held as attributes of the model's modules, and those train_step
reads as globals or from its closure. State kept inside containers (`counts[0] += 1`) is
not seen.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from remat.errors import CaptureError

_PLAIN = (bool, int, float, str, type(None))


def module_attributes(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """(qualified name, module, key, value) of every value a module holds as an attribute
    (its __dict__), but for a DDP wrapper's own settings (checked by pipeline.data_parallel)."""
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            continue
        for key, value in vars(module).items():
            yield ".".join(filter(None, ("model", prefix, key))), module, key, value


def _plain_attributes(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """The plain values among them (`training` aside: train/eval mode is checked on its own)."""
    for name, module, key, value in module_attributes(model):
        if key != "training" and not key.startswith("__") and isinstance(value, _PLAIN):
            yield name, module, key, value


def module_values(model: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    """The model's plain attribute values, as the graph traced with them saw them: a step is
    compiled again when one changes between steps (a temperature or a drop rate set by the
    loop), since the graph holds them as constants."""
    return tuple((name, value) for name, _, _, value in _plain_attributes(model))


def changed_values(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> list[str]:
    """'name (old -> new)' for each value that differs (added or removed ones included)."""
    old, new, gone = dict(before), dict(now), object()
    return [f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in {**old, **new} if old.get(k, gone) != new.get(k, gone)]


def _watched(model: torch.nn.Module, train_step: Callable[..., Any]) -> dict[str, tuple[Any, str, Any]]:
    """name -> (owner, key, value): module attributes (owner a module), train_step's globals
    (owner its globals dict) and closure cells (owner the cell, key None)."""
    out: dict[str, tuple[Any, str, Any]] = {name: (module, key, value) for name, module, key, value in _plain_attributes(model)}
    fn = getattr(train_step, "__func__", train_step)
    code, globs = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        for key in code.co_names:
            if key in globs and isinstance(globs[key], _PLAIN):
                out[f"global {key}"] = (globs, key, globs[key])
        for key, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, _PLAIN):
                out[f"{key} (from the closure)"] = (cell, key, value)
    return out


def _value(owner: Any, key: str) -> Any:
    if isinstance(owner, dict):
        return owner.get(key)
    if hasattr(owner, "cell_contents"):
        return owner.cell_contents
    return vars(owner).get(key)


def _restore(owner: Any, key: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[key] = value
    elif hasattr(owner, "cell_contents"):
        owner.cell_contents = value
    else:
        setattr(owner, key, value)


@contextlib.contextmanager
def no_python_state_changed(model: torch.nn.Module, train_step: Callable[..., Any]) -> Iterator[None]:
    """Around the whole capture: refuse, naming them, the watched values the traces changed
    (put back as they were, so that a refused capture leaves nothing changed)."""
    before = _watched(model, train_step)
    yield
    changed = []
    for name, (owner, key, value) in before.items():
        now = _value(owner, key)
        if now is not value and now != value:
            changed.append(f"{name} ({value!r} -> {now!r})")
            _restore(owner, key, value)
    if changed:
        raise CaptureError(
            f"train_step changed Python state while it was traced: {', '.join(changed[:5])}"
            + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            + ". Its Python code runs once, at capture, so the graph would repeat the first value at every step. "
            "Keep such state outside train_step and pass what the step computes from it as a tensor (in the batch, "
            "or a buffer of the model updated between steps)."
        )
