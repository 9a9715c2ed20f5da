"""What the captured graph takes and leaves at each call: the real tensors for its
placeholders, read from the model, the optimizer, the user's state and the batch as they
are now (where the loop's changes are checked), and one step run with `.grad` and the
train/eval flags left as eager leaves them. Also what a capture takes: its arguments
checked (the batch's leaves: `batch_leaves`), and how the step is called: with the model,
optimizer and batch, or the batch alone, for a step that reaches its model and optimizer
itself (globals, a closure, a trainer's fields), as many training scripts write it
(`call_step`)."""

from __future__ import annotations

import inspect
import operator
import sys
import warnings
import weakref
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Iterator

import torch
import torch.fx

from remat.errors import CaptureError, ChangedSinceCompiled
from remat.capture.state.guards import same_objects
from remat.capture import param_hooks
from remat.capture.distributed import data_parallel
from remat.capture.optim import hyperparams
from remat.capture.state import read_numbers, step_outputs, train_modes
from remat.capture.optim.optimizer_state import optimizer_states
from remat.capture.optimizers import as_one
from remat.capture.train_graph import GraphInput, InputKind, TrainGraph
from remat.ops import value_checks
from remat.capture.trace_checks import check_settings
from remat.capture.batch_leaves import batch_leaf_names, batch_value, check_batch, graph_values, is_graph_leaf
from remat.capture.markers import MARKER


def unique_named(items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


@dataclass
class ModelView:
    """The model's modules, and its parameters and buffers by name (as named_parameters and
    named_buffers name them, the first name of a tensor held twice), read in one walk of
    its modules: a call reads them once for its checks, its inputs and its gradients."""

    modules: list[torch.nn.Module]
    module_names: list[str]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    _graded: tuple[Any, list[torch.Tensor]] | None = None  # grad_names, and their parameters

    def graded(self, grad_names: list[str]) -> list[torch.Tensor]:
        """The parameters named in `grad_names`, in order (worked out once for each list)."""
        if self._graded is None or self._graded[0] is not grad_names:
            self._graded = (grad_names, [self.params[name] for name in grad_names])
        return self._graded[1]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelView:
        modules, names, params, buffers, seen = [], [], {}, {}, set()
        for prefix, module in model.named_modules():
            modules.append(module)
            names.append(prefix)
            for table, out in ((module._parameters, params), (module._buffers, buffers)):
                for key, t in table.items():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        out[f"{prefix}.{key}" if prefix else key] = t
        return cls(modules, names, params, buffers)


def _takes_batch_only(train_step: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(train_step).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: called as documented
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    if len(positional) >= 3 and required <= 3:
        return False
    if positional and required <= 1:  # train_step(batch), or train_step(batch, scale=1.0)
        return True
    what = f"it needs {required} arguments" if required > 3 else f"it takes {len(positional)} arguments"
    raise CaptureError(_said(train_step, positional, what))


def _said(train_step: Callable[..., Any], positional: list[inspect.Parameter], what: str) -> str:
    name = getattr(train_step, "__name__", None) or type(train_step).__name__
    return (
        f"remat calls the training step as train_step(model, optimizer, batch), or as train_step(batch) when the step "
        f"reaches its model and optimizer itself; {name}({', '.join(p.name for p in positional)}) does not fit, as {what}. "
        "Give it those three parameters, or only the batch (other values as defaults, globals or fields of an object)."
    )


def call_step(train_step: Callable[..., Any], model: Any, optimizer: Any, batch: Any) -> Any:
    """Run the step as its signature asks: with the model, optimizer and batch, or the batch alone."""
    return train_step(batch) if _takes_batch_only(train_step) else train_step(model, optimizer, batch)


def check_arguments(
    model: torch.nn.Module, example_batch: Any, optimizer: Any = None
) -> tuple[list[Any], Any, dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[str, ...], str]:
    """(batch leaves, batch spec, parameters, buffers, trainable names, device), or a CaptureError
    naming what is wrong; `optimizer` (one, as_one's) for a warning on stale gradients."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    compiled = next((n for n, m in model.named_modules() if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")), None)
    if compiled is not None:
        where, do = ("the model is", "pass the module before torch.compile (its _orig_mod), in the step too") if compiled == "" else (
            f"the model's submodule {compiled!r} is", f"put the module before torch.compile back in its place (model.get_submodule({compiled!r})._orig_mod)"
        )  # fmt: skip
        raise CaptureError(f"{where} torch.compile'd, and remat traces the step itself, which it cannot do through a compiled module: {do}")
    scripted = next((n for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:
        warnings.warn(
            f"remat: the model's {scripted or 'root'} is a TorchScript module (torch.jit.script or torch.jit.trace). "
            "remat traces its ops and runs them with autograd's derivatives, where TorchScript differentiates and "
            "fuses them its own way: the step agrees with eager's within rounding, not bitwise (script nothing to "
            "compare bitwise).",
            stacklevel=4,
        )
    check_settings()
    leaves, spec = check_batch(example_batch)
    params = unique_named(model.named_parameters())
    buffers = unique_named(model.named_buffers())
    if not params:
        raise CaptureError("the model has no parameters: there is nothing to train")
    lazy = [n for n, t in [*params.items(), *buffers.items()] if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise CaptureError(
            f"the model's {lazy[0]} is not initialized yet (a lazy module's, such as nn.LazyLinear's, whose shape its first "
            "forward sets): run the model once on an example batch before compiling, as the lazy modules ask"
        )
    trainable = tuple(n for n, p in params.items() if p.requires_grad)
    if not trainable:
        raise CaptureError("no parameter of the model requires a gradient: there is nothing to train")
    devices = {str(t.device) for t in [*params.values(), *buffers.values(), *leaves] if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        raise CaptureError(f"model and batch must be on one device, found {sorted(devices)}; move them with .to(device)")
    device = devices.pop()
    return leaves, spec, params, buffers, trainable, device


def _warn_frozen_gradients(frozen: list[str]) -> None:
    """A data-parallel step does not take a frozen parameter's gradient (GRADIENT inputs
    are refused across ranks): eager's would count it in `clip_grad_norm_` over all
    parameters and leave it set; remat's step sets it to None."""
    if frozen:
        warnings.warn(
            f"remat: {len(frozen)} parameters that require no gradient hold one (first: {frozen[0]}.grad), which remat's "
            "step across ranks (DDP, FSDP2) does not read and sets to None, where eager's would count it in "
            "clip_grad_norm_ over all parameters and keep it. Set their .grad to None before compiling "
            "(model.zero_grad() before freezing).",
            stacklevel=3,
        )


def describe(t: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    return tuple(t.shape), str(t.dtype).replace("torch.", ""), str(t.device)


def graph_inputs(
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    grads: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    numbers: dict[str, Any],
    outside: list[tuple[Any, torch.Tensor]],
    example_batch: Any,
    leaves: list[Any],
) -> tuple[list[GraphInput], list[torch.Tensor], dict[str, float]]:
    """The graph's placeholders in order (parameters, buffers, optimizer state, gradients, one 0-dim
    float64 per number of param_groups and per number read at every call, tensors outside
    the model, batch leaves), their tensors, and the param groups' numbers."""
    inputs: list[GraphInput] = []
    flat: list[torch.Tensor] = []
    for n, p in params.items():
        inputs.append(GraphInput(n, InputKind.PARAMETER, *describe(p)))
        flat.append(p)
    for n, b in buffers.items():
        inputs.append(GraphInput(n, InputKind.BUFFER, *describe(b)))
        flat.append(b)
    for n, st in states.items():
        for key, value in st.items():
            inputs.append(GraphInput(f"{n}.{key}", InputKind.OPTIMIZER_STATE, *describe(value)))
            flat.append(value)
    for n, g in grads.items():
        inputs.append(GraphInput(n, InputKind.GRADIENT, *describe(g)))
        flat.append(g)
    hyper_values: dict[str, float] = {}
    if optimizer is not None:
        hyperparams.check_readable(optimizer)
        for gi, group in enumerate(optimizer.param_groups):
            for key, value in hyperparams.float_entries(group).items():
                hyper_values[name := hyperparams.input_name(gi, key)] = value
                inputs.append(GraphInput(name, InputKind.HYPERPARAMETER, (), "float64", "cpu"))
                flat.append(torch.tensor(value, dtype=torch.float64))
    for name, slot in numbers.items():
        flat.append(read_numbers.value(slot))
        inputs.append(GraphInput(name, InputKind.NUMBER, (), str(flat[-1].dtype).removeprefix("torch."), "cpu"))
    for held, t in outside:
        inputs.append(GraphInput(held.name, InputKind.OUTSIDE, *describe(t)))
        flat.append(t)
    for n, leaf in [(n, batch_value(leaf)) for n, leaf in zip(batch_leaf_names(example_batch), leaves) if is_graph_leaf(leaf)]:
        inputs.append(GraphInput(n, InputKind.BATCH, *describe(leaf)))
        flat.append(leaf)
    return inputs, flat, hyper_values


def flat_inputs(tg: TrainGraph, model: torch.nn.Module, optimizer: Any, batch: Any, view: ModelView | None = None) -> list[torch.Tensor]:
    """The real tensors for the graph's placeholders, in order (`optimizer`: the step's
    argument: one optimizer, a list of them, or None; `view`: the model's, where read).

    Also where the loop around the step is checked: a change the graph cannot follow
    (a frozen parameter thawed, an optimizer flag or group changed) is refused here,
    and the hyperparameters are read from the param groups as they are now.
    """
    optimizer = as_one(optimizer)
    view = ModelView.of(model) if view is None else view
    train_modes.check_mode(view.modules, tg)
    if tg.call.data_parallel is not None:
        data_parallel.check_unchanged(model, tg.call.data_parallel)
    params, buffers = view.params, view.buffers
    trainable = tuple(n for n, p in params.items() if p.requires_grad)
    if trainable != tg.call.trainable:
        changed = sorted(set(trainable) ^ set(tg.call.trainable))
        raise ChangedSinceCompiled(f"requires_grad of {len(changed)} parameters changed since the step was compiled (first: {changed[0]})")
    param_hooks.check_unchanged(params, tg.call.param_hooks)
    if tg.has_optimizer:
        names = {id(p): n for n, p in params.items()}
        hyperparams.check_unchanged(optimizer, tg.call.groups, names)
    # Only the state the graph reads: eager creates none for a parameter without a gradient.
    wanted = {id(params[name]) for name in state_owners(tg)}
    states = optimizer_states(optimizer, params, wanted) if tg.has_optimizer else {}
    hyper_names = [i.name for i in tg.inputs if i.kind is InputKind.HYPERPARAMETER]
    hyper = dict(zip(hyper_names, hyperparams.values(optimizer, hyper_names))) if hyper_names else {}
    leaves, spec = check_batch(batch)
    if str(spec) != tg.call.batch_spec:
        raise CaptureError(
            f"the batch has a different structure from the one captured ({spec} vs {tg.call.batch_spec}); "
            "a new structure needs a new capture"
        )
    out: list[torch.Tensor] = []
    for inp in tg.inputs:
        if inp.kind is InputKind.PARAMETER:
            out.append(params[inp.name])
        elif inp.kind is InputKind.BUFFER:
            out.append(buffers[inp.name])
        elif inp.kind is InputKind.OPTIMIZER_STATE:
            pname, key = inp.name.rsplit(".", 1)
            out.append(states[pname][key])
        elif inp.kind is InputKind.GRADIENT:
            out.append(accumulated_gradient(inp.name, params[inp.name]))
        elif inp.kind is InputKind.HYPERPARAMETER:
            out.append(hyper[inp.name])
        elif inp.kind is InputKind.OUTSIDE:
            out.append(outside_value(tg, inp))
        elif inp.kind is InputKind.NUMBER:
            out.append(read_numbers.value(tg.call.numbers[inp.name], inp.dtype))
    out.extend(graph_values(leaves))
    return out


def held_gradients(params: dict[str, torch.Tensor], trainable: tuple[str, ...], across_ranks: Any, grads_in: bool) -> dict[str, torch.Tensor]:
    """The gradients set now that the graph takes (GRADIENT inputs): where `grads_in`, the
    trainable parameters' (accumulated_gradients); and always those a frozen parameter
    holds (frozen after a backward that set it): eager's step counts it in
    `clip_grad_norm_` over all parameters, an optimizer holding the parameter applies it,
    and what clears nothing leaves it set. The key holds which of these are set."""
    held = accumulated_gradients(params, trainable, across_ranks) if grads_in else {}
    frozen = [n for n, p in params.items() if not p.requires_grad and p.grad is not None]
    if across_ranks is not None:
        _warn_frozen_gradients(frozen)
        return held
    return held | {n: accumulated_gradient(n, params[n]) for n in frozen}


def accumulated_gradients(params: dict[str, torch.Tensor], trainable: tuple[str, ...], across_ranks: Any = None) -> dict[str, torch.Tensor]:
    """The gradients set now on the parameters `trainable` names, which a step that
    accumulates across calls adds to; refused for a step `across_ranks` (DDP, FSDP2)."""
    found = {n: accumulated_gradient(n, params[n]) for n in trainable if params[n].grad is not None}
    if found and across_ranks is not None:
        first = next(iter(found))
        raise accumulation_refused(f"the step finds {len(found)} gradients set (first: {first}.grad) and adds to them", "across ranks (DDP, FSDP2)")
    return found


def accumulated_gradient(name: str, param: torch.Tensor) -> torch.Tensor:
    g = param.grad
    if g is None:  # the key holds which are set: a graph that reads one is not chosen without it
        raise CaptureError(f"{name} has no gradient, but the step was compiled to add to the one it had")
    (shape, dtype, device), (p_shape, p_dtype, p_device) = describe(g), describe(param)
    if (shape, dtype, device) != (p_shape, p_dtype, p_device) or g.layout is not torch.strided:
        raise CaptureError(
            f"{name}.grad is a {g.layout} {dtype} tensor of shape {shape} on {device}, unlike its parameter "
            f"({p_dtype} of shape {p_shape} on {p_device}); the step adds its gradient to it. Set it to None "
            "(optimizer.zero_grad()) or to a tensor like the parameter."
        )
    return g


def frozen_gradients_taken(tg: TrainGraph, model: torch.nn.Module) -> list[torch.Tensor]:
    """The frozen parameters whose gradient the graph takes (held_gradients): the call
    finding one of them set or not picks another graph."""
    taken = {i.name for i in tg.inputs if i.kind is InputKind.GRADIENT} - set(tg.call.trainable)
    return [p for n, p in model.named_parameters() if n in taken]


def state_owners(tg: TrainGraph) -> tuple[str, ...]:
    """The parameters whose optimizer state the graph reads (worked out once per graph)."""
    known = tg.meta.get("state_owners")
    if known is None or known[0] is not tg.inputs:
        known = tg.meta["state_owners"] = (tg.inputs, tuple({i.name.rsplit(".", 1)[0]: None for i in tg.inputs if i.kind is InputKind.OPTIMIZER_STATE}))
    return known[1]


def outside_value(tg: TrainGraph, inp: GraphInput) -> torch.Tensor:
    t = tg.call.outside[inp.name].get()
    if describe(t) != (inp.shape, inp.dtype, inp.device):
        shape, dtype, device = describe(t)
        raise CaptureError(
            f"{inp.name}, a tensor outside the model that the step reads, is now {dtype} of shape {shape} on {device}, "
            f"but the step was compiled for {inp.dtype} of shape {inp.shape} on {inp.device}; compile a new step."
        )
    return t


_grad = attrgetter("grad")
# The gradients a step that ends with zero_grad(set_to_none=False) left on each model's
# parameters, by weak reference (a gradient the user drops is freed): while each parameter
# still holds its own, they are known zeros.
_ZERO_GRADS_LEFT: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def _no_gradient() -> None:
    return None


def _check_grads_are_zero(model: torch.nn.Module, view: ModelView) -> None:
    """A step that adds its gradients to the zeros the previous one left must not find other
    gradients there (an eager backward since): eager would add to them."""
    left = _ZERO_GRADS_LEFT.get(model, [])
    if same_objects(list(map(_grad, view.params.values())), list(map(operator.call, left))):
        return
    for name, p in view.params.items():
        g = p.grad
        if g is not None and bool(g.any()):
            raise CaptureError(
                f"{name} holds a nonzero gradient from outside the step; the step adds its gradients to what it finds "
                "(it ends with zero_grad(set_to_none=False)), which the captured graph does not. Call "
                "optimizer.zero_grad() before the step."
            )


def run_captured(
    tg: TrainGraph,
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    view: ModelView | None = None,
    after_graph: Callable[[], None] | None = None,
) -> Any:
    """Run one step of `gm` (the captured graph or a rewrite of it) in place; returns what
    train_step returns (the loss, or its tuple/dict of tensors). `after_graph()` runs once
    the graph has, before what the step returns is read (step_outputs.as_returned).

    Leaves each parameter's `.grad` as the eager step would: the graph's final gradient
    where train_step left one set, None where it cleared them; and the modules' train/eval
    flags as train_step's own train() and eval() calls leave them.
    """
    view = ModelView.of(model) if view is None else view
    params = view.params
    if tg.call.leaves_zero_grads:
        _check_grads_are_zero(model, view)
    # The step clears the previous gradients before its backward (checked at capture), or
    # adds to the zeros the last step left; drop them now rather than hold them through the step.
    for p in params.values():
        p.grad = None
    try:
        with torch.no_grad():
            outputs, grads = gm(*inputs)
    except Exception as e:  # a value check that failed (inside a compiled region too) raises what eager raises
        value_checks.raise_as_eager(e, tg.call.value_checks)
        raise
    train_modes.make_mode_calls(model, tg)
    train_modes.set_requires_grad(view.params, tg)
    for p, g in zip(view.graded(tg.grad_names), grads):
        p.grad = g
    if tg.call.leaves_zero_grads:
        _ZERO_GRADS_LEFT[model] = [_no_gradient if p.grad is None else weakref.ref(p.grad) for p in params.values()]
    return step_outputs.as_returned(tg, outputs, after_graph)


def accumulates(probe_gm: torch.fx.GraphModule, trainable: dict[str, torch.Tensor], optimizer: Any, data_parallel: Any) -> bool:
    """Whether the step adds its gradients to those of the step before (gradient
    accumulation across calls): then each call's graph takes the gradients set when it is
    called as inputs and adds to them in place, as eager's backward does, and which are
    set is in the key. Refused under DDP or FSDP2 (`data_parallel`), whose syncing differs
    between accumulating calls and the last.

    `probe_gm` was traced with the `.grad` of every parameter in `trainable` (by name, in
    the marker's order) already set: if train_step calls zero_grad() before backward(),
    nothing reads those gradients (or they are zeroed in place first).
    """
    marker = next(n for n in probe_gm.graph.nodes if n.target is MARKER and n.args[1] == "preset_grads")
    kept = [name for name, preset in zip(trainable, marker.args[0]) if _read_before_cleared(preset, marker)]
    if not kept:
        return False
    named = f"{', '.join(kept[:3])}{f' and {len(kept) - 3} more' if len(kept) > 3 else ''}"
    if data_parallel is not None:
        raise accumulation_refused(
            f"train_step leaves gradients set ({named}) and does not clear them before backward(), so each step adds "
            "its gradients to the previous step's", "across ranks (DDP, FSDP2)",
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]} if optimizer is not None else set()
    unheld = [name for name in kept if id(trainable[name]) not in held]
    if held and len(unheld) == len(kept):  # the optimizer's are cleared, not these: likely an oversight
        warnings.warn(
            f"remat: train_step clears the gradients of its optimizer's parameters, but {len(unheld)} parameter"
            f"{'s' if len(unheld) > 1 else ''} that no optimizer holds (first: {unheld[0]}) also get gradients, and "
            "each call adds to them, as eager's would; the step holds them from call to call. Freeze them "
            "(requires_grad_(False)), add them to the optimizer, or call model.zero_grad() in train_step.",
            stacklevel=5,
        )
    return True


def finds_gradients(
    probe_gm: torch.fx.GraphModule | None, cleared_first: bool, leaves_zero_grads: bool, trainable: dict[str, torch.Tensor],
    optimizer: Any, data_parallel: Any,
) -> bool:  # fmt: skip
    """Whether the graph depends on which gradients a call finds set (TrainGraph.call.accumulates).
    Not where the step clears them all before its first backward, nor where it ends with
    them zeroed in place (ends_with_zero_grads: checked at each call). Where it leaves some
    set, as the trace with them preset (`probe_gm`) tells: accumulates. Where it leaves
    none set (zero_grad() at its end), yes: only gradients set outside it (another step's,
    an eager backward's) can be found, and it adds to them, as eager does."""
    if cleared_first or leaves_zero_grads:
        return False
    return probe_gm is None or accumulates(probe_gm, trainable, optimizer, data_parallel)


def accumulation_refused(what: str, where: str) -> CaptureError:
    error = CaptureError(
        f"{what} (gradient accumulation across calls), which remat does not follow {where}. To accumulate gradients "
        "over micro-batches, give train_step all of them and loop over them inside it (one backward() each, then one "
        "optimizer.step())."
    )
    if _accelerate_accumulates():
        error.add_note(
            "remat: Accelerate's accumulate() steps the optimizer only at every gradient_accumulation_steps-th call. "
            "Drop the `with accelerator.accumulate(model):` and loop over that many micro-batches inside train_step "
            "instead: accelerator.backward() still divides each loss by gradient_accumulation_steps, and the optimizer "
            "steps once, as at eager's last micro-batch."
        )
    return error


def _accelerate_accumulates() -> bool:
    """Whether an Accelerate accelerator accumulates gradients over calls (its shared gradient state)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None) or {}
    return bool(shared) and (shared.get("plugin_kwargs") or {}).get("num_steps", 1) > 1


def _read_before_cleared(preset: torch.fx.Node, marker: torch.fx.Node) -> bool:
    # A marker or the output is no read: a gradient the step never touches (a parameter no
    # loss of this step reaches) is among the final gradients only because it was preset.
    users = [u for u in preset.users if u.op == "call_function" and u.target is not MARKER]
    return bool(users) and users[0].target not in (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)
