"""Tensors and numbers a library's objects hold where the step can reach them: a diffusers
noise scheduler's `alphas_cumprod` that its `add_noise` indexes inside the step, an EMA
helper's list of shadow weights and its step count. The library's code is not followed
(which tensors it reads is not known), so every field of such an object that holds tensors or a
number is a slot; the graph reads the tensors its trace read (outside_tensors) and drops
the others, and a number the step changes is a kept number (kept_numbers: traced as the
next step finds it too, and refused where the graph depends on it). Their tensors are not
part of the watched values: the graph's inputs check their shapes when gathered; their
bool and int fields a trace read are (`recording_reads`)."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any, Callable, Iterable, Iterator

import torch

from remat.capture.state import user_code
from remat.capture.state.slots import CONTAINERS, PLAIN, Slot, fields_of

_NUMBERS = (bool, int, float)
_MOST_ITEMS = 1024  # a larger list or dict is not taken for a table of tensors

_LIBRARY_DEPTH = 1  # a library object, and the library objects in its fields


# Per model class: where a library keeps objects the step uses deeper than the walk goes
# (Lightning's precision plugin's GradScaler, under the module's trainer): an integration registers them.
_REACHED_THROUGH: dict[type, Callable[[Any], list[tuple[str, Any]]]] = {}


def reach_through(model_class: type, roots: Callable[[Any], list[tuple[str, Any]]]) -> None:
    """Walk, for a model of `model_class`, the library objects `roots(model)` names, (name, object) each."""
    _REACHED_THROUGH[model_class] = roots


# Per library class and field: a count the library's own code moves inside the step and
# branches on (Accelerate's accumulate(): its call count, and whether this call steps the
# optimizer). An integration registers, from the library's code, what a call will leave in
# the count and which branch it takes, both from the object as the call finds it: the
# branch is in the step's key, and the count is moved after each run (kept_numbers.CountedBranch).
_COUNTED_BRANCHES: dict[tuple[type, str], Callable[[Any], tuple[Any, Any]]] = {}
_BRANCH_READS: set[types.CodeType] = set()  # the library functions whose reads a branch accounts for


def counted_branch(owner_class: type, key: str, next_of: Callable[[Any], tuple[Any, Any]], moved_by: Callable[..., Any]) -> None:
    """Register `next_of(owner) -> (count the call leaves, branch)` for the count an object of
    `owner_class` keeps in its field `key`, as the library's function `moved_by` moves it:
    what that function reads is in the branch, not in the key (recording_reads)."""
    _COUNTED_BRANCHES[(owner_class, key)] = next_of
    _BRANCH_READS.add(moved_by.__code__)


def counted_branch_of(slot: Slot) -> Callable[[Any], tuple[Any, Any]] | None:
    """The registered `next_of` for the count `slot` holds, if any."""
    _load_integrations()
    return next((f for (cls, key), f in _COUNTED_BRANCHES.items() if slot.key == key and isinstance(slot.owner, cls)), None)


# remat's integrations that register with the capture what a framework's objects hold, by
# the framework's module: each is imported, by name, once its framework is (the user's code
# imports the framework; an integration imports the capture, never the other way).
INTEGRATIONS = {"lightning.pytorch": "remat.integrations.lightning", "accelerate": "remat.integrations.accelerate"}


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


@contextlib.contextmanager
def recording_reads(objects: Iterable[Any]) -> Iterator[set[tuple[int, str]]]:
    """While the block runs, which bool and int fields of the library objects `objects`
    hold are read before the block sets them, as (id of the object's dict of fields, field),
    which the objects of the user's state keep alive: a flag the library's code
    branches on (Accelerate's `sync_gradients`, which `accumulate()` around a compiled step
    sets), but for those a registered count's branch accounts for (counted_branch). A
    library's code is not followed, so its reads are recorded where they happen:
    each class's attribute lookup is wrapped for the block, and a read is the read of the
    object's dict (Accelerate's GradientState instances share one: a read through the
    optimizer's is a read of the accelerator's). What a trace read is in the step's
    key (python_state.step_values), as dynamo guards what its trace read."""
    read: set[tuple[int, str]] = set()
    written: set[tuple[int, str]] = set()  # (the fields dict, field): set in the block, then read
    patched: list[tuple[type, dict[str, Any]]] = []

    def fields_id(obj: Any) -> int | None:
        try:
            return id(object.__getattribute__(obj, "__dict__"))
        except AttributeError:
            return None

    objects = list(objects)
    for cls in dict.fromkeys(type(obj) for obj in objects):
        get, put = cls.__getattribute__, cls.__setattr__

        def getattribute(obj: Any, name: str, get: Any = get, cls: type = cls) -> Any:
            value = get(obj, name)
            if type(value) in (bool, int) and not name.startswith("__") and sys._getframe(1).f_code not in _BRANCH_READS:
                held = fields_id(obj)
                if held is not None and name in object.__getattribute__(obj, "__dict__") and (held, name) not in written:
                    read.add((held, name))
            return value

        def setattr_(obj: Any, name: str, value: Any, put: Any = put) -> None:
            written.add((fields_id(obj), name))
            put(obj, name, value)

        own = {k: cls.__dict__[k] for k in ("__getattribute__", "__setattr__") if k in cls.__dict__}
        try:
            cls.__getattribute__ = getattribute
        except TypeError:  # a built-in or extension type (SimpleNamespace): all its flags taken as read
            read.update((id(vars(obj)), k) for obj in objects if type(obj) is cls for k, v in vars(obj).items() if type(v) in (bool, int))
            continue
        patched.append((cls, own))
        cls.__setattr__ = setattr_
    try:
        yield read
    finally:
        for cls, own in reversed(patched):
            for k in ("__getattribute__", "__setattr__"):
                if k in own:
                    setattr(cls, k, own[k])
                else:
                    delattr(cls, k)


def read_by_trace(slot: Slot, read: frozenset[tuple[int, str]]) -> bool:
    """Whether a library slot holds a field a trace read (`recording_reads`)."""
    return bool(read) and (id(vars(slot.owner)), slot.key) in read


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
    if isinstance(obj, (PLAIN, CONTAINERS, type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor,
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
