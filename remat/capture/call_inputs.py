"""A graph's inputs at each call, gathered quickly while nothing the full gather checked
has changed.

`step_inputs.flat_inputs` reads every input where it lives and checks the loop's changes
(a parameter replaced or thawed, a hook added, a train/eval mode or an optimizer setting
changed): about a microsecond an input, a millisecond on BERT-base at every call. What
those checks read is a few tables and flags: the model's tables of submodules (which
the guards check before each gather, and where they fail no last call is kept), of
parameters and of buffers, each module's train flag, each parameter's requires_grad and
hook tables, the optimizers' param groups and state tables. `LastCall` records them after
a full gather, beside its inputs, as identities and flags. A call compares them with
C-level maps (tens of nanoseconds an item); where all hold, the full gather would read
the same tensors and pass the same checks, so the call reuses them and reads again only
what may change at every call: hyperparameters, numbers read at every call, tensors held
outside the model, the batch. Where any differs, the full gather runs again (and refuses
the change, or records anew): nothing is taken on trust.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat.errors import CaptureError
from remat.capture.distributed import data_parallel
from remat.capture.optim import hyperparams
from remat.capture.state import read_numbers
from remat.capture.state.guards import SameContents, SameEntries, same_objects
from remat.capture.optimizers import as_one, each
from remat.capture.batch_leaves import flatten_batch, graph_leaves, graph_values, is_plain_value
from remat.capture.step_inputs import ModelView, flat_inputs, outside_value, state_owners
from remat.capture.train_graph import InputKind, TrainGraph

_training = attrgetter("training")
_requires_grad = attrgetter("requires_grad")
_gradient_hooks = attrgetter("_backward_hooks")
_accumulation_hooks = attrgetter("_post_accumulate_grad_hooks")
_grad = attrgetter("grad")


@dataclass
class _Reread:
    """An input read again at every call. A float's tensor is made anew, as the full
    gather makes it: the memory model counts it among the step's own allocations."""

    position: int
    read: Callable[[], Any]  # the float, or (for a tensor outside the model, a gradient) the tensor

    def now(self) -> torch.Tensor:
        value = self.read()
        return value if isinstance(value, torch.Tensor) else torch.scalar_tensor(value, dtype=torch.float64)


@dataclass
class LastCall:
    """One graph's last full gather: its inputs (the batch's leaves apart) and what its
    checks read, to compare at the next call."""

    view: ModelView
    params: list[torch.Tensor]  # the view's
    inputs: list[torch.Tensor]
    reread: list[_Reread]
    batch_spec: Any
    # The model's tables of parameters. Its tables of submodules are the guards' to check
    # (RematStep.compiled_for, before each gather): where they fail, no last call is kept.
    tables: SameContents
    buffers: SameEntries  # the buffers the graph reads, in their modules' tables
    training: list[bool] | None  # None: the step sets the model's mode itself first
    requires_grad: list[bool]
    hook_tables: list[Any]  # each parameter's two tables of hooks (or None), one list after the other
    hooks: SameContents  # their items
    optimizer: Any  # as optimizers.as_one made it
    optimizers: list[torch.optim.Optimizer]
    groups: list[dict[str, Any]]
    group_sizes: list[int]
    group_params: SameContents
    settings: SameEntries  # each group's entries but the floats read at every call
    # (group, key, sign) of each float the update branches on the sign of, and (group, key,
    # value) of each it fixed (where read at every call, settings leaves them out)
    signs: list[tuple[int, str, int]]
    fixed: list[tuple[int, str, float]]
    held: list[Any]  # each optimizer's list of param groups and its state table
    state_tables: SameContents  # each optimizer's state by parameter
    states: SameEntries  # the state tensors of each parameter the graph reads state for (its numbers are read at every call)

    @classmethod
    def record(cls, tg: TrainGraph, view: ModelView, optimizer: Any, inputs: list[torch.Tensor], batch: Any) -> LastCall:
        params = list(view.params.values())
        optimizers = each(optimizer)
        groups = [g for opt in optimizers for g in opt.param_groups]
        tables = {id(p): opt.state for opt in optimizers for g in opt.param_groups for p in g["params"]}
        owners = [view.params[name] for name in state_owners(tg)]
        leaves, spec = flatten_batch(batch)
        reread = _rereads(tg, optimizer, groups, view)
        hook_tables = _hook_tables(params)
        return cls(
            view=view,
            params=params,
            inputs=inputs[: len(inputs) - len(graph_leaves(leaves))],
            reread=reread,
            batch_spec=spec,
            tables=SameContents.of(m._parameters for m in view.modules),
            buffers=_buffers(tg, view),
            training=None if tg.call.sets_mode_first else list(map(_training, view.modules)),
            requires_grad=list(map(_requires_grad, params)),
            hook_tables=hook_tables,
            hooks=SameContents.of(t for t in hook_tables if t is not None),
            optimizer=optimizer,
            optimizers=optimizers,
            groups=groups,
            group_sizes=list(map(len, groups)),
            group_params=SameContents.of(g["params"] for g in groups),
            settings=_settings(tg, groups),
            signs=[(gi, key, was) for gi, spec in enumerate(tg.call.groups) for key, was in spec.signs] if tg.has_optimizer else [],
            fixed=[(gi, key, was) for gi, spec in enumerate(tg.call.groups) for key, was in spec.fixed] if tg.has_optimizer else [],
            held=_held(optimizers),
            state_tables=SameContents.of(opt.state for opt in optimizers),
            states=SameEntries.of((st, key, value) for st in (tables[id(p)][p] for p in owners) for key, value in st.items() if isinstance(value, torch.Tensor)),
        )

    def holds(self, optimizer: Any) -> bool:
        """Whether the full gather would read the same tensors and pass the same checks."""
        params = self.params
        return (
            self.tables.hold()
            and self.buffers.hold()
            and (self.training is None or list(map(_training, self.view.modules)) == self.training)
            and list(map(_requires_grad, params)) == self.requires_grad
            and _hook_tables(params) == self.hook_tables
            and self.hooks.hold()
            and same_objects(each(optimizer), self.optimizers)
            and same_objects(_held(self.optimizers), self.held)
            and same_objects([g for opt in self.optimizers for g in opt.param_groups], self.groups)
            and list(map(len, self.groups)) == self.group_sizes
            and self.group_params.hold()
            and self.settings.hold()
            and self._same_numbers()
            and self.state_tables.hold()
            and self.states.hold()
        )

    def _same_numbers(self) -> bool:
        try:
            return all(hyperparams.sign(self._number(gi, key)) == was for gi, key, was in self.signs) and all(
                self._number(gi, key) == was for gi, key, was in self.fixed
            )
        except CaptureError:
            return False

    def _number(self, gi: int, key: str) -> float:
        return hyperparams.read(self.optimizer, self.groups, gi, key)


class CallInputs:
    """One graph's inputs at each call (its placeholders, in order, as flat_inputs gives them)."""

    def __init__(self, tg: TrainGraph) -> None:
        self.tg = tg
        self.last: LastCall | None = None

    def gather(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> tuple[list[torch.Tensor], ModelView]:
        """The inputs, and the model's view they were read from."""
        optimizer = as_one(optimizer)
        last, tg = self.last, self.tg
        if last is not None and last.holds(optimizer):
            leaves, spec = flatten_batch(batch)
            if spec == last.batch_spec and all(isinstance(leaf, (torch.Tensor, float)) or is_plain_value(leaf) for leaf in leaves):
                if tg.call.data_parallel is not None:
                    data_parallel.check_unchanged(model, tg.call.data_parallel)
                for r in last.reread:  # the last call's value let go as this one's is made: the step holds one
                    last.inputs[r.position] = r.now()
                inputs = list(last.inputs)
                inputs.extend(graph_values(leaves))
                return inputs, last.view
        self.last = last = None  # its inputs let go before this call's are made
        view = ModelView.of(model)
        inputs = flat_inputs(tg, model, optimizer, batch, view)
        self.last = LastCall.record(tg, view, optimizer, inputs, batch)
        return inputs, view


def gradients_set(params: list[torch.Tensor]) -> tuple[bool, ...]:
    """Which of `params` have a gradient set (C-level maps: a few microseconds for hundreds)."""
    return tuple(map(is_not, map(_grad, params), repeat(None)))


def _buffers(tg: TrainGraph, view: ModelView) -> SameEntries:
    """Where each buffer the graph reads is held (a buffer added elsewhere changes nothing it reads)."""
    tables = {name: m._buffers for name, m in zip(view.module_names, view.modules)}
    entries = []
    for inp in tg.inputs:
        if inp.kind is InputKind.BUFFER:
            owner, _, key = inp.name.rpartition(".")
            entries.append((tables[owner], key, view.buffers[inp.name]))
    return SameEntries.of(entries)


def _settings(tg: TrainGraph, groups: list[dict[str, Any]]) -> SameEntries:
    read = {hyperparams.parse_input_name(i.name) for i in tg.inputs if i.kind is InputKind.HYPERPARAMETER}
    read_bases = {(gi, key.split("[")[0]) for gi, key in read}
    # "params" too: the list itself (its items: group_params), which the user may replace
    return SameEntries.of((g, k, v) for gi, g in enumerate(groups) for k, v in g.items() if (gi, k) not in read_bases)


def _held(optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    return [table for opt in optimizers for table in (opt.param_groups, opt.state)]


def _hook_tables(params: list[torch.Tensor]) -> list[Any]:
    return [*map(_gradient_hooks, params), *map(_accumulation_hooks, params)]


def _rereads(tg: TrainGraph, optimizer: Any, groups: list[dict[str, Any]], view: ModelView) -> list[_Reread]:
    out = []
    for position, inp in enumerate(tg.inputs):
        if inp.kind is InputKind.GRADIENT:  # a gradient the step adds to: the one set now (the key says one is)
            out.append(_Reread(position, lambda p=view.params[inp.name]: p.grad))
        elif inp.kind is InputKind.HYPERPARAMETER:
            gi, key = hyperparams.parse_input_name(inp.name)
            out.append(_Reread(position, lambda gi=gi, key=key: hyperparams.read(optimizer, groups, gi, key)))
        elif inp.kind is InputKind.NUMBER:
            out.append(_Reread(position, lambda slot=tg.call.numbers[inp.name], dtype=inp.dtype: read_numbers.number(slot, dtype)))
        elif inp.kind is InputKind.OUTSIDE:
            out.append(_Reread(position, lambda inp=inp: outside_value(tg, inp)))
    return out
