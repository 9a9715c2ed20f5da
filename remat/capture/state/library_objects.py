"""Tensors and numbers a library's objects hold where the step can reach them: a diffusers
noise scheduler's `alphas_cumprod` that its `add_noise` indexes inside the step, an EMA
helper's list of shadow weights and its step count. The library's code is not followed
(what it reads is not known), so every field of such an object that holds tensors or a
number is a slot; the graph reads the tensors its trace read (outside_tensors) and drops
the others, and a number the step changes is a kept number (kept_numbers: traced as the
next step finds it too, and refused where the graph depends on it). They are not part of
the watched values: the graph's inputs check their shapes when gathered."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

import torch

from remat.capture.state import user_code
from remat.capture.state.slots import Slot, fields_of

_PLAIN = (bool, int, float, str, type(None))
_NUMBERS = (bool, int, float)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MOST_ITEMS = 1024  # a larger list or dict is not taken for a table of tensors

_LIBRARY_DEPTH = 1  # a library object, and the library objects in its fields


# Per model class: where a library keeps objects the step uses deeper than the walk goes
# (Lightning's precision plugin's GradScaler, under the module's trainer): an integration registers them.
_REACHED_THROUGH: dict[type, Callable[[Any], list[tuple[str, Any]]]] = {}


def reach_through(model_class: type, roots: Callable[[Any], list[tuple[str, Any]]]) -> None:
    """Walk, for a model of `model_class`, the library objects `roots(model)` names, (name, object) each."""
    _REACHED_THROUGH[model_class] = roots


# remat's integrations that register with the capture what a framework's objects hold, by
# the framework's module: each is imported, by name, once its framework is (the user's code
# imports the framework; an integration imports the capture, never the other way).
INTEGRATIONS = {"lightning.pytorch": "remat.integrations.lightning"}


def _load_integrations() -> None:
    for framework, integration in INTEGRATIONS.items():
        if framework in sys.modules and integration not in sys.modules:
            importlib.import_module(integration)


def reached_through(model: Any) -> list[tuple[str, Any]]:
    """The library objects registered for `model`'s class (`reach_through`), its frameworks'
    integrations loaded first."""
    _load_integrations()
    return [root for cls, roots in _REACHED_THROUGH.items() if isinstance(model, cls) for root in roots(model)]


def fields(roots: list[tuple[str, Any]]) -> list[tuple[Slot, Any]]:
    """The fields of library objects the user's state holds (a noise scheduler's
    `alphas_cumprod`, an EMA helper's list of shadow weights) that hold a tensor, or a list,
    tuple or dict of tensors, or a number, as library slots; and those of the library
    objects in their fields. The library's code is not followed, so every such field is a slot: the graph
    reads those its trace read (outside_tensors), and drops the others."""
    out: list[tuple[Slot, Any]] = []
    seen: set[int] = set()

    def walk(name: str, obj: Any, depth: int) -> None:
        if depth > _LIBRARY_DEPTH or id(obj) in seen or not _is_library_object(obj):
            return
        seen.add(id(obj))
        _make_first_use_state(obj)
        fields = fields_of(obj)
        for key, value in list((fields or {}).items()):
            if not isinstance(key, str) or key.startswith("__"):
                continue
            if _holds_tensors(value) or type(value) in _NUMBERS:
                out.append((Slot(f"{name}.{key}", obj, key, library=True), value))
            else:
                walk(f"{name}.{key}", value, depth + 1)

    for name, value in roots:
        walk(name, value, 0)
    return out


def _make_first_use_state(obj: Any) -> None:
    """Make the tensors a library object creates at its first use, as that use would, so
    that the graph reads them from its first step instead of the step creating them:
    torch.amp.GradScaler's scale and growth tracker (made at the first `scale()`)."""
    if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() and getattr(obj, "_scale", None) is None:
        device = torch.device(obj._device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        obj._lazy_init_scale_growth_tracker(device)


def _is_library_object(obj: Any) -> bool:
    """An instance of a library's class that may hold the step's tensors: not a module,
    tensor, class, function or Python module, not the user's own (their fields are followed
    by name), and not an optimizer or a scheduler (their tensors are the graph's own inputs)."""
    if isinstance(obj, (_PLAIN, _CONTAINERS, type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor,
                        torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    if isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        return False
    return not user_code.user_class(type(obj)) and hasattr(obj, "__dict__")


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)) and 0 < len(value) <= _MOST_ITEMS:
        return all(isinstance(v, torch.Tensor) for v in value)
    if isinstance(value, dict) and 0 < len(value) <= _MOST_ITEMS:
        return all(isinstance(k, (str, int)) and isinstance(v, torch.Tensor) for k, v in value.items())
    return False
