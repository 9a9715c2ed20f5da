"""What is done to a traced graph before it becomes a TrainGraph: checks that refuse, by
name, what remat cannot run as eager does, and passes that drop inputs nothing reads."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import sys
import time
import types
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from remat.errors import CaptureError
from remat.capture.state import user_code
from remat.ops import ctc_loss

from remat.capture.train_graph import GraphInput, InputKind


def branched_hyperparameters(e: BaseException, symbols: dict[str, str]) -> list[str]:
    """The hyperparameters and numbers read at every call a failed trace branched on, from a data-dependent guard's condition."""
    cond = data_dependent_condition(e)
    return [symbols[str(s)] for s in cond.free_symbols if str(s) in symbols] if cond is not None else []


def data_dependent_condition(e: BaseException | None) -> Any:
    """The condition (torch's sympy) of the data-dependent guard a failed trace stopped at, or None."""
    while e is not None:
        cond = getattr(e, "cond", None)
        if cond is not None and hasattr(cond, "free_symbols"):
            return cond
        e = e.__cause__ or e.__context__
    return None


def drop_unread_inputs(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> list[GraphInput]:
    """Remove the hyperparameters the update never reads (a scheduler's initial_lr, a float
    fixed at zero), the tensors outside the model the step does not use, and the numbers
    read at every call that the trace left constant, so that only what changes the step is
    an input."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    keep: list[GraphInput] = []
    for node, inp in zip(placeholders, inputs):
        if inp.kind in (InputKind.HYPERPARAMETER, InputKind.OUTSIDE, InputKind.NUMBER):
            for user in list(node.users):
                if user.target is torch.ops.aten._local_scalar_dense.default and not user.users:
                    gm.graph.erase_node(user)
            if not node.users:
                gm.graph.erase_node(node)
                continue
        keep.append(inp)
    return keep


def drop_unread_new_state(
    gm: torch.fx.GraphModule,
    inputs: list[GraphInput],
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.Tensor],
    had_state: set[int],
) -> list[GraphInput]:
    """Undo the first-step state of parameters the step gave no gradient.

    The optimizer skips a parameter whose `.grad` is None and eager never creates its
    state; the state made before tracing (`init_optimizer_state`) is then read by no
    node. It is removed from the optimizer and from the graph's inputs, so that the
    optimizer's state is what eager's would be (and costs no memory).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read: dict[str, bool] = {}  # parameter -> whether any of its new state is read
    for node, inp in zip(placeholders, inputs):
        if inp.kind is InputKind.OPTIMIZER_STATE:
            pname = inp.name.rsplit(".", 1)[0]
            read[pname] = read.get(pname, False) or bool(node.users) or id(params[pname]) in had_state
    keep: list[GraphInput] = []
    for node, inp in zip(placeholders, inputs):
        pname = inp.name.rsplit(".", 1)[0]
        if inp.kind is InputKind.OPTIMIZER_STATE and not read[pname]:
            optimizer.state.pop(params[pname], None)
            gm.graph.erase_node(node)
            continue
        keep.append(inp)
    return keep


def ends_with_zero_grads(gm: torch.fx.GraphModule) -> bool:
    """Whether the step leaves every gradient it sets zeroed in place (zero_grad(set_to_none=False)
    at its end). The next step's backward then adds to zeros, which is the fresh gradient
    the graph computes: such a step is no accumulation across calls."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = output.args[0][1]
    return bool(grads) and all(g.target is torch.ops.aten.zero_.default for g in grads)


@contextlib.contextmanager
def cleared_before_backward(calls: dict[str, int], cleared: set[int]) -> Iterator[None]:
    """While the block runs, the parameters (by id) that `zero_grad()` (optimizer's or
    module's, setting gradients to None) clears before the first backward go into `cleared`.
    A step that clears every trainable parameter so starts from no gradients whatever the
    step before left: capture then needs no trace with gradients preset to tell
    (accumulates)."""
    optimizer_zero, module_zero = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad

    def on_optimizer(self, set_to_none: bool = True):  # type: ignore[no-untyped-def]
        if set_to_none and calls["backward"] == 0:
            cleared.update(id(p) for group in self.param_groups for p in group["params"])
        return optimizer_zero(self, set_to_none)

    def on_module(self, set_to_none: bool = True):  # type: ignore[no-untyped-def]
        if set_to_none and calls["backward"] == 0:
            cleared.update(map(id, self.parameters()))
        return module_zero(self, set_to_none)

    torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad = on_optimizer, on_module  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad = optimizer_zero, module_zero  # type: ignore[method-assign]


_ANOMALY_NAN = (
    "checks every backward op's output for NaN on the host, a branch on tensor values one captured graph cannot hold. "
    "Turn it off to compile the step (set_detect_anomaly(False), or detect_anomaly(check_nan=False), which keeps its "
    "forward tracebacks), and debug NaNs on an eager step."
)


def check_settings() -> None:
    """Refuse a global setting the graph cannot honour."""
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        raise CaptureError(f"autograd's anomaly detection is on (torch.autograd.set_detect_anomaly(True)): it {_ANOMALY_NAN}")


@contextlib.contextmanager
def host_effects_named() -> Iterator[None]:
    """What the step's Python does on the host that a trace cannot, refused by name as it
    starts: a backward pass with anomaly detection turned on inside train_step (its NaN check
    meets a traced value), torch.save (before it writes: nothing saved would be a step's),
    and the user's code reading the clock (`time.perf_counter()`, `from time import
    perf_counter` bound before, `datetime.now()`: a time taken inside would be the trace's at
    every step; a library's reads are its own business)."""
    engine, save = torch.autograd._engine_run_backward, torch.save
    clocks = {name: getattr(time, name) for name in _CLOCKS}

    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return engine(*args, **kwargs)
        except GuardOnDataDependentSymNode as e:
            if not (torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()):
                raise
            raise CaptureError(f"train_step runs a backward pass with autograd's anomaly detection on{where_in_users_code_now()}: it {_ANOMALY_NAN}") from e

    def refused_save(*args: Any, **kwargs: Any) -> None:
        raise CaptureError(
            f"train_step saves with torch.save{where_in_users_code_now()}: its Python code runs once, at capture, where "
            "tensors hold no values, so nothing it saves would be a step's. Save outside train_step: in the loop, between "
            "steps (every N steps, at the end of an epoch)."
        )

    def refused_clock(name: str) -> Any:
        def read() -> Any:
            if not user_code.is_user_file(sys._getframe(1).f_code.co_filename):
                return clocks[name]()
            raise _clock_read(f"time.{name}()")

        return read

    torch.autograd._engine_run_backward, torch.save = checked, refused_save
    for name in _CLOCKS:
        setattr(time, name, refused_clock(name))
    try:
        with _clocks_bound_by_users_code({id(clock): refused_clock(name) for name, clock in clocks.items()}):
            yield
    finally:
        torch.autograd._engine_run_backward, torch.save = engine, save
        for name, clock in clocks.items():
            setattr(time, name, clock)


def _clock_read(what: str) -> CaptureError:
    return CaptureError(
        f"train_step reads the clock with {what}{where_in_users_code_now()}: its Python code runs once, "
        "at capture, so a time taken inside it would be the trace's at every step. Time the call of the step "
        "in the loop instead (t0 = time.perf_counter(); loss = step(batch); took = time.perf_counter() - t0)."
    )


def _refusing_now(cls: type) -> type:
    """`cls` (datetime.datetime or datetime.date) with its clock reads (`now()`, `today()`) refused."""

    def refused(name: str) -> Any:
        def read(kind: type, *args: Any, **kwargs: Any) -> Any:
            raise _clock_read(f"{cls.__name__}.{name}()")

        return classmethod(read)

    return type(cls.__name__, (cls,), {name: refused(name) for name in ("now", "utcnow", "today") if hasattr(cls, name)})


def _clocks_bound_by_users_code(refused: dict[int, Any]) -> contextlib.AbstractContextManager[None]:
    """The clocks the user's modules bound to their own names while the block runs (`from time
    import perf_counter`, `from datetime import datetime`, `import datetime`), swapped for ones
    that refuse: patching the time module does not reach a name bound before."""
    instead = {**refused, id(datetime.datetime): _refusing_now(datetime.datetime), id(datetime.date): _refusing_now(datetime.date)}
    module = types.ModuleType("datetime")
    module.__dict__.update({**vars(datetime), "datetime": instead[id(datetime.datetime)], "date": instead[id(datetime.date)]})
    instead[id(datetime)] = module
    return user_code.globals_swapped(lambda v: instead.get(id(v)))


_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "process_time_ns")


@contextlib.contextmanager
def wrapped_methods(classes: tuple[type, ...], names: tuple[str, ...], wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While the block runs, each of `names` of each of `classes` is `wrap(the method)`; put back after."""
    saved = [(cls, name, cls.__dict__.get(name)) for cls in classes for name in names]
    for cls, name, _ in saved:
        setattr(cls, name, wrap(getattr(cls, name)))
    try:
        yield
    finally:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def check_backward_ran(backward_passes: int) -> None:
    if backward_passes == 0:
        raise CaptureError(
            "train_step never called loss.backward() (nor torch.autograd.grad on the parameters): remat captures a "
            "whole training step and plans its backward pass. Gradients taken with torch.func (grad, vjp, jacrev, "
            "per-sample gradients under vmap) are not such a pass: take them with loss.backward() or "
            "torch.autograd.grad, or train this step without remat."
        )


def no_dynamic_output_shapes(args: tuple[Any, ...]) -> None:
    """An op whose output shape depends on tensor values (nonzero, boolean-mask indexing)
    raises where it runs, so that the refusal names the line (`check_static_shapes`, after
    the trace, is the check where this setting is not found)."""
    mode = torch._guards.detect_fake_mode(args)
    env = mode.shape_env if mode is not None else None
    if env is not None and dataclasses.is_dataclass(getattr(env, "settings", None)):
        env.settings = dataclasses.replace(env.settings, allow_dynamic_output_shape_ops=False)


def check_static_shapes(gm: torch.fx.GraphModule) -> None:
    """Refuse a trace in which an op's output shape depends on tensor values (a symbolic
    size): the analysis, the simulator and the planners need every size. A masked_select
    held by its static stand-in for CTC's targets is refused where anything else reads it."""
    for where in ctc_loss.flat_selections(gm):
        raise CaptureError(f"{VALUE_SHAPED} (aten.masked_select.default){where}{STATIC_SHAPES}")
    for node in gm.graph.nodes:
        for v in _vals(node):
            if any(not isinstance(d, int) for d in v.shape):
                raise CaptureError(f"{VALUE_SHAPED} ({node.target} makes a tensor of shape {tuple(v.shape)}){STATIC_SHAPES}")


VALUE_SHAPED = "an op in train_step returns a shape that depends on tensor values"
STATIC_SHAPES = (
    "; remat needs static shapes: replace it (e.g. masked ops instead of nonzero/boolean indexing). Where a "
    "library's code makes it: a model's own loss, given labels (call the model without them and compute the "
    "loss in train_step from its logits), or a metric's update() (call it outside train_step, on tensors the "
    "step returns)."
)


def check_graph_runnable(gm: torch.fx.GraphModule) -> None:
    """Refuse ops that make tensors the analysis cannot measure (sparse ones), naming the
    way around."""
    for node in gm.graph.nodes:
        sparse = [v for v in _vals(node) if v.layout is not torch.strided] if node.op == "call_function" else []
        if sparse:
            raise CaptureError(
                f"an op in train_step makes a {str(sparse[0].layout).replace('torch.', '')} tensor ({node.target}), such "
                "as the gradient of nn.Embedding(sparse=True): remat plans dense tensors only. Use sparse=False (a "
                "dense gradient; SparseAdam then becomes Adam), or train this model without remat."
            )


def _vals(node: torch.fx.Node) -> list[torch.Tensor]:
    v = node.meta.get("val")
    return [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]


_LIBRARY_DIRS = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[1])  # torch's and remat's own code (resolved, as the frames are)


_AROUND_CALLS = (contextlib.__file__, functools.__file__)  # the decorators around remat's functions


def users_stacklevel() -> int:
    """The stacklevel, for a warning its caller gives, of the innermost frame outside torch's
    and remat's code and the decorators around it: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename in _AROUND_CALLS or any(Path(frame.f_code.co_filename).resolve().is_relative_to(d) for d in _LIBRARY_DIRS)):
        frame, level = frame.f_back, level + 1
    return level


def users_frame(frames: list) -> Any:
    """The innermost frame outside torch and remat (the model's or the step's line), or None."""
    users = [f for f in frames if not f.filename.startswith("<") and not any(Path(f.filename).resolve().is_relative_to(d) for d in _LIBRARY_DIRS)]
    return users[-1] if users else None


def where_in_frames(frames: list) -> str:
    """', at file.py, line N: code' for `users_frame`, or ''."""
    frame = users_frame(frames)
    return "" if frame is None else f", at {Path(frame.filename).resolve().name}, line {frame.lineno}: {(frame.line or '').strip()}"


def where_in_users_code_now() -> str:
    """where_in_frames of the frames running now."""
    return where_in_frames(traceback.extract_stack())


def calls_compiled_function(e: BaseException) -> bool:
    """Whether the trace failed at a function torch.compile wrapped; if so, say it is traced as its plain code."""
    if "FX to symbolically trace a dynamo-optimized function" not in str(e):
        return False
    warnings.warn(
        f"remat: train_step calls a function compiled by torch.compile{where_in_users_code(e)}. remat captures the "
        "step whole, that function's Python code included, and runs it as the captured ops, which compute what it "
        "computes without torch.compile (to fuse the step's ops too, use remat.compile(..., backend='inductor')).",
        stacklevel=2,
    )
    return True


def where_in_users_code(e: BaseException) -> str:
    """where_in_frames of the frames `e` was raised through."""
    return where_in_frames(traceback.extract_tb(e.__traceback__))
