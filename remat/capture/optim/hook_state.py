"""Python state that an optimizer's hooks change while the step is traced.

An optimizer may call functions of its own or of another library's around its update:
torch's step hooks (`register_step_pre_hook`, `register_step_post_hook`, and the global
ones), or a function a library keeps in one of its fields (opacus' `DPOptimizer.step_hook`,
which moves its privacy accountant on by one step). Their Python code runs once, when
the step is traced: a count or a history they keep would move once, at capture, and never
again, with no error (an accountant that counts one step of many reports a privacy budget
too small). So the values their closures and bound objects hold (plain values, and
containers of them) are noted before the traces and compared after: one left changed is
put back as it was, and the step refused, naming it. So are the fields the user set on
one of torch's optimizers (`optimizer.my_count += 1` in the step): torch's code does not
follow them, and remat counts a number in the user's own objects, globals and modules.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
import torch.optim.optimizer as torch_optimizer

from remat.capture.optimizers import innermost
from remat.capture.state.python_state import watched_now
from remat.capture.state.slots import Slot
from remat.errors import CaptureError


def _hooks(optimizer: Any) -> list[tuple[str, Any]]:
    """(how a message names it, the function) for each hook `optimizer` calls around its step."""
    name = type(optimizer).__name__
    tables = [
        (f"a step hook on {name}", getattr(optimizer, "_optimizer_step_pre_hooks", None)),
        (f"a step hook on {name}", getattr(optimizer, "_optimizer_step_post_hooks", None)),
        ("a global optimizer step hook", torch_optimizer._global_optimizer_pre_hooks),
        ("a global optimizer step hook", torch_optimizer._global_optimizer_post_hooks),
    ]
    found = [(where, fn) for where, table in tables if isinstance(table, dict) for fn in table.values()]
    fields = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
    found += [
        (f"{name}.{key}", fn) for key, fn in fields.items()
        if isinstance(fn, (types.FunctionType, types.MethodType)) and getattr(fn, "__self__", None) is not optimizer
    ]  # fmt: skip
    return found


def _reached(fn: Any) -> list[tuple[str, Slot]]:
    """The places a hook reaches, by name: its closure's cells, and the fields of the objects
    they hold and of its `self`."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    cells = getattr(getattr(fn, "__func__", fn), "__closure__", None) or ()
    out = [(name, Slot(name, cell, "")) for name, cell in zip(code.co_freevars if code is not None else (), cells)]
    objects = [*([fn.__self__] if isinstance(fn, types.MethodType) else []), *(slot.get() for _, slot in out)]
    for obj in objects:
        if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, types.FunctionType, type)) and hasattr(obj, "__dict__"):
            out += [(f"{type(obj).__name__}.{key}", Slot(key, obj, key)) for key in vars(obj) if not key.startswith("__")]
    return out


def _places(optimizer: Any) -> list[tuple[Slot, Any]]:
    """Each place the hooks reach, named as a message names it, with the value it holds."""
    return [
        (Slot(f"{name} (reached through {where}, {getattr(fn, '__qualname__', fn)})", slot.owner, slot.key), slot.get())
        for where, fn in _hooks(optimizer) for name, slot in _reached(fn)
    ]  # fmt: skip


_TORCH_FIELDS = frozenset({"defaults", "state", "param_groups"})  # a torch optimizer's own public fields


def _user_fields(optimizer: Any) -> list[tuple[Slot, Any]]:
    """The public fields the user set on one of torch's optimizers, with their values."""
    if not type(optimizer).__module__.startswith("torch.") or not hasattr(optimizer, "__dict__"):
        return []
    return [(Slot(f"optimizer.{k}", optimizer, k), v) for k, v in vars(optimizer).items() if not k.startswith("_") and k not in _TORCH_FIELDS]


def _passed(passed: Any) -> list[Any]:
    """The optimizers passed, and the one each wraps (a library's wrapper calls hooks too)."""
    items = list(passed) if isinstance(passed, (list, tuple)) else [] if passed is None else [passed]
    return list({id(o): o for item in items for o in (item, innermost(item))}.values())


@contextlib.contextmanager
def unchanged_by_traces(passed: Any) -> Iterator[None]:
    """Around the step's traces: refuse a change they leave in what the hooks reach, put
    back as it was (after a failed trace too)."""
    before = watched_now([place for opt in _passed(passed) for place in _places(opt)])
    fields = watched_now([field for opt in _passed(passed) for field in _user_fields(opt)])
    try:
        yield
    finally:
        changed, set_there = [w for w in before.values() if w.changed()], [w for w in fields.values() if w.changed()]
        for w in [*changed, *set_there]:
            w.put_back()
    if set_there:
        raise CaptureError(
            f"train_step changes {', '.join(w.slot.name for w in set_there)}, a field set on the optimizer "
            f"({type(set_there[0].slot.owner).__name__}), which remat does not follow: its code runs once, when the step "
            "is traced, so the graph would not change it again at later steps. It is put back as it was; keep such a "
            "count in your own object, a global or an attribute of the model, which remat counts as eager does."
        )
    if changed:
        libraries = {type(w.slot.owner).__module__.split(".")[0] for w in changed}
        raise CaptureError(
            f"the optimizer's step changes Python state while train_step is traced: {', '.join(w.slot.name for w in changed)}. "
            "The code that changes it runs once, when the step is traced, and the graph would not change it again at "
            "later steps (a step count or a history kept there would stop). It is put back as it was; do that "
            f"bookkeeping outside train_step, after each step{_OPACUS if 'opacus' in libraries else ''}."
        )


_OPACUS = (
    " (opacus' PrivacyEngine: set optimizer.step_hook = None after make_private, and call "
    "privacy_engine.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=1 / len(data_loader)) "
    "after each step)"
)
