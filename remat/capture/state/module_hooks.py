"""The model's hook tables as capture found them, and a library's first-call set-up.

Some libraries set a model up the first time it runs: `transformers` installs forward
hooks on every layer the first time a model is asked for `output_hidden_states` or a
mixture-of-experts router's logits, and marks the model (a module attribute) so that it
does not install them again. Capture traces the step more than once; had each trace
started from the user's model, each would install the hooks again, and had capture kept
them, the user's model would be left altered (a later eager forward returning its
hidden states twice over).

So capture takes a `HookTables` snapshot first. Where the first trace changed a hook table
(the library's set-up), the step is traced again with that set-up in place, as eager's
second and later steps run, and the module attributes that trace added beside the hooks
(the library's mark) are that set-up's too, not numbers the step keeps. After the capture
every table is put back and those attributes removed: the user's model is as it was,
and a later eager step sets itself up as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.modules.module as module_globals

from remat.errors import CaptureError

# Every per-module table of hooks (forward, backward, state-dict, load-state-dict).
_TABLES = tuple(k for k in vars(torch.nn.Module()) if "hook" in k)
# The process-wide ones (torch.nn.modules.module.register_module_forward_hook and the like).
_GLOBAL_TABLES = tuple(k for k, v in vars(module_globals).items() if k.startswith("_global") and "hook" in k and isinstance(v, dict))


def _tables(model: torch.nn.Module) -> list[tuple[str, dict[Any, Any]]]:
    out = [(f"torch.nn.modules.module.{k}", getattr(module_globals, k)) for k in _GLOBAL_TABLES]
    for prefix, module in model.named_modules(remove_duplicate=True):
        out += [(f"{prefix or 'model'}.{k}", table) for k in _TABLES if isinstance(table := vars(module).get(k), dict)]
    return out


def functions(model: torch.nn.Module) -> list[Callable[..., Any]]:
    """Every hook held in the model's tables and the process-wide ones (a forward hook that
    logs a layer's statistics): their globals and closures are the user's state the step
    reads, as its own are."""
    return [fn for _, table in _tables(model) for fn in table.values()]


@dataclass
class HookTables:
    """Each hook table of a model's modules (and the process-wide ones), with what it held."""

    model: torch.nn.Module
    held: list[tuple[str, dict[Any, Any], list[tuple[Any, Any]]]]
    keys: dict[int, frozenset[str]]  # each module's attribute names, by id

    @classmethod
    def of(cls, model: torch.nn.Module) -> HookTables:
        return cls(
            model,
            [(name, table, list(table.items())) for name, table in _tables(model)],
            {id(m): frozenset(vars(m)) for m in model.modules()},
        )

    def changed(self) -> list[str]:
        """The tables whose hooks differ from the snapshot's, by name."""
        return [name for name, table, items in self.held if list(table.items()) != items]

    def added_attributes(self) -> list[tuple[torch.nn.Module, str]]:
        """The attributes the modules hold now that they did not at the snapshot."""
        return [(m, k) for m in self.model.modules() if id(m) in self.keys for k in vars(m) if k not in self.keys[id(m)]]

    def put_back(self, attributes: list[tuple[torch.nn.Module, str]] = ()) -> None:
        """Every table as it was, and `attributes` removed."""
        for _, table, items in self.held:
            if list(table.items()) != items:
                table.clear()
                table.update(items)
        for module, key in attributes:
            vars(module).pop(key, None)


@dataclass
class Submodules:
    """Each module's table of submodules, with what it held: a trace that replaces a layer
    (a library setting the model up at its first call) is refused, and the tables put back."""

    held: list[tuple[str, dict[str, Any], list[tuple[str, Any]]]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Submodules:
        tables = [(prefix or "model", m._modules) for prefix, m in model.named_modules(remove_duplicate=True)]
        return cls([(name, t, list(t.items())) for name, t in tables if isinstance(t, dict)])

    def refuse_replaced(self) -> None:
        changed = [f"{name}.{k}" for name, table, items in self.held for k in {**table, **dict(items)} if table.get(k) is not dict(items).get(k)]
        if changed:
            raise CaptureError(
                f"train_step changed the model's submodules while it was traced ({', '.join(changed[:3])}): a library "
                "setting the model up at its first call (BigBird switching its attention type for short sequences). "
                "The graph would run the new modules while the first eager step also builds them (drawing random "
                "numbers). Run one step eagerly before compiling, so that the model is as later steps find it."
            )

    def put_back(self) -> None:
        for _, table, items in self.held:
            if list(table.items()) != items:
                table.clear()
                table.update(items)


def traced_as_set_up(trace: Callable[[], torch.fx.GraphModule], model: torch.nn.Module) -> torch.fx.GraphModule:
    """The step traced again with the hooks the first trace installed in place; refused if it
    installs more (eager would then add hooks at every step, which one graph cannot repeat)."""
    tables = HookTables.of(model)
    gm = trace()
    if tables.changed():
        raise CaptureError(
            f"the step adds hooks to the model at every call ({', '.join(tables.changed()[:3])}): eager would run one more "
            "hook at each step, which one graph cannot repeat. Register hooks once, outside the step."
        )
    return gm
