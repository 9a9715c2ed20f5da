"""What is done to a traced graph before it becomes a TrainGraph: checks that refuse, by
name, what remat cannot run as eager does, and passes that drop inputs nothing reads."""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import CaptureError
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


def check_settings() -> None:
    """Refuse a global setting the graph cannot honour."""
    if torch.is_anomaly_enabled():
        raise CaptureError(
            "autograd's anomaly detection is on (torch.autograd.set_detect_anomaly(True)): it checks every backward "
            "op's output for NaN on the host, a branch on tensor values one captured graph cannot hold. Turn it off "
            "to compile the step (torch.autograd.set_detect_anomaly(False)), and debug NaNs on an eager step."
        )


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
        raise CaptureError(f"{_VALUE_SHAPED} (aten.masked_select.default){where}{_STATIC_SHAPES}")
    for node in gm.graph.nodes:
        for v in _vals(node):
            if any(not isinstance(d, int) for d in v.shape):
                raise CaptureError(f"{_VALUE_SHAPED} ({node.target} makes a tensor of shape {tuple(v.shape)}){_STATIC_SHAPES}")


_VALUE_SHAPED = "an op in train_step returns a shape that depends on tensor values"
_STATIC_SHAPES = (
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


def _users_frame(frames: list) -> Any:
    """The innermost frame outside torch and remat (the model's or the step's line), or None."""
    users = [f for f in frames if not f.filename.startswith("<") and not any(Path(f.filename).resolve().is_relative_to(d) for d in _LIBRARY_DIRS)]
    return users[-1] if users else None


def _where_in_users_code(frames: list) -> str:
    """', at file.py, line N: code' for `_users_frame`, or ''."""
    frame = _users_frame(frames)
    return "" if frame is None else f", at {Path(frame.filename).resolve().name}, line {frame.lineno}: {(frame.line or '').strip()}"


def where_in_users_code_now() -> str:
    """_where_in_users_code of the frames running now."""
    return _where_in_users_code(traceback.extract_stack())


def _drawn_just_before(frames: list) -> bool:
    """Whether the user's line that branched follows a `torch.rand` draw within a few lines
    (LayerDrop: `skip = torch.rand([]) < self.layerdrop`, then `if not skip:`)."""
    frame = _users_frame(frames)
    before = [] if frame is None else [linecache.getline(frame.filename, n) for n in range(max(1, frame.lineno - 5), frame.lineno + 1)]
    return any("torch.rand(" in line for line in before)


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
    """_where_in_users_code of the frames `e` was raised through."""
    return _where_in_users_code(traceback.extract_tb(e.__traceback__))


def _fake_dispatch_of(e: BaseException) -> tuple[str, list[Any]] | None:
    """(the op, its flat arguments) being run on fake tensors when `e` was raised inside
    FakeTensorMode's dispatch (which holds them as `func`, `args` and `kwargs`), or None."""
    tb = e.__traceback__
    found = None
    while tb is not None:
        code, local = tb.tb_frame.f_code, tb.tb_frame.f_locals
        if code.co_name == "_dispatch_impl" and code.co_filename.endswith("fake_tensor.py") and "func" in local:
            found = (str(local["func"]), pytree.tree_leaves((local.get("args", ()), local.get("kwargs", {}))))
        tb = tb.tb_next
    return found


def _packed_sequence_live(e: BaseException) -> bool:
    """Whether a frame `e` was raised through holds a PackedSequence."""
    tb = e.__traceback__
    while tb is not None:
        if any(isinstance(v, torch.nn.utils.rnn.PackedSequence) for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def _one_hot_without_classes(e: BaseException) -> bool:
    """Whether `e` was raised in a call of one_hot given no number of classes (seen by a
    torch-function mode's frame, which holds the call as `func`, `args` and `kwargs`)."""
    tb = e.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name == "__torch_function__" and getattr(local.get("func"), "__name__", None) == "one_hot":
            args, kwargs = local.get("args") or (), local.get("kwargs") or {}
            if kwargs.get("num_classes", args[1] if len(args) > 1 else -1) == -1:
                return True
        tb = tb.tb_next
    return False


def _sized_by_values(e: BaseException, data_dependent: bool, where: str) -> CaptureError | None:
    """The refusal of a size or an index the step takes from tensor values, where it says
    what to do instead: a recurrent layer on a PackedSequence, a tensor read as an int."""
    name = type(e).__name__
    first = str(e).strip().splitlines()[0] if str(e).strip() else name
    if _packed_sequence_live(e) or "_pack_padded_sequence" in first:
        return CaptureError(
            f"train_step runs a recurrent layer on a PackedSequence (nn.utils.rnn.pack_padded_sequence){where}: how "
            "many sequences each time step holds is computed from the lengths' values, a shape one captured graph "
            f"cannot hold ({name}: {first}). Run the layer on the padded batch instead (with batches of sequences of "
            "one length, as a length-bucketing sampler makes them, that is the same computation), or train this "
            "model without remat."
        )
    if data_dependent and _one_hot_without_classes(e):
        return CaptureError(
            f"train_step calls one_hot without num_classes{where}, which then takes the number of classes from the "
            "largest label in the batch: a shape from tensor values, which one captured graph cannot hold (and a "
            "batch without the last class would give eager another shape). Pass it: "
            "F.one_hot(labels, num_classes=...), the model's number of outputs."
        )
    if data_dependent and "extract specialized integer" in first:
        return CaptureError(
            f"train_step uses a tensor's value as a Python int{where} (int(t) or t.item() as an index, a slice "
            "bound, a size or a count, such as a queue's pointer kept in a buffer): a number that depends on tensor "
            "values, which one captured graph cannot hold. Index with the tensor itself instead: "
            "buffer.index_copy_(dim, (torch.arange(n) + ptr) % size, values) for a slice written at a pointer, "
            "ptr.add_(n).remainder_(size) to move it, index_select or gather to read; or compute the number outside "
            "train_step."
        )
    return None


def _library_branch(frames: list[traceback.FrameSummary], where: str) -> CaptureError | None:
    """The refusal of a branch on tensor values in a library's code that a setting of that
    library, or a call outside the step, avoids: what to do, by library."""
    if any(Path(f.filename).name == "swa_utils.py" for f in frames):
        return CaptureError(
            "train_step calls torch.optim.swa_utils.AveragedModel.update_parameters, which branches on how many "
            f"steps it has averaged (n_averaged == 0){where}: one captured graph cannot hold that branch. Call it "
            "between steps, outside train_step, or keep the average yourself inside the step "
            "(with torch.no_grad(): for e, p in zip(ema.parameters(), model.parameters()): e.lerp_(p, 1 - decay))."
        )
    if any(Path(f.filename).parent.parts[-2:] == ("torch", "distributions") for f in frames):
        return CaptureError(
            f"a torch.distributions object in train_step checks its arguments or samples with a Python branch on "
            f"tensor values (validate_args){where}, which one captured graph cannot hold. Pass validate_args=False to "
            "the distribution, or call torch.distributions.Distribution.set_default_validate_args(False) before the "
            "step: its samples are then drawn in the graph at every step, as eager draws them."
        )
    if any(Path(f.filename).name == "batchnorm.py" and "num_batches_tracked" in (f.line or "") for f in frames):
        return CaptureError(
            f"a BatchNorm layer has momentum=None (a cumulative average), whose factor 1 / num_batches_tracked is read "
            f"from a tensor at every step{where}: a number one captured graph cannot hold. Give the layer a float "
            "momentum (the default is 0.1), or train without remat."
        )
    if any(f.name == "_detect_is_causal_mask" for f in frames):
        return CaptureError(
            f"nn.Transformer (or nn.TransformerEncoder / nn.TransformerDecoder) was given an attention mask without "
            f"being told whether it is causal, and compares the mask with a causal one to find out, a Python branch "
            f"on tensor values{where}. Tell it: tgt_is_causal=True with a causal tgt_mask (nn.Transformer, "
            "nn.TransformerDecoder), src_is_causal=True with a causal src_mask (nn.Transformer), is_causal=True with "
            "a causal mask (nn.TransformerEncoder); False where the mask is not causal."
        )
    if any("(labels >= 0).nonzero()" in (f.line or "") for f in frames):
        return CaptureError(
            f"the model's own classification loss keeps the examples whose label is not negative, a shape that "
            f"depends on tensor values{where} (DeBERTa's, where config.problem_type is None). Set "
            "model.config.problem_type = 'single_label_classification' (its loss is then plain cross-entropy, which "
            "ignores labels of -100 only), or call the model without labels and compute the loss in train_step from "
            "its logits."
        )
    if any("torchmetrics" in Path(f.filename).parts for f in frames):
        return CaptureError(
            f"a torchmetrics metric updated in train_step checks its input with a Python branch on tensor values"
            f"{where}, which one captured graph cannot hold. Turn its checks off: nan_strategy='disable' for the "
            "aggregation metrics (MeanMetric, SumMetric, ...), validate_args=False for the classification and "
            "regression metrics (Accuracy, F1Score, ...); the update then runs in the graph at every step. Or update "
            "the metric outside train_step, from tensors the step returns (return the logits with the loss)."
        )
    return None


_TORCH_AND_REMAT = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


def explain_trace_failure(e: Exception, model: torch.nn.Module | None = None) -> CaptureError:
    name = type(e).__name__
    first = str(e).strip().splitlines()[0] if str(e).strip() else name

    frames = traceback.extract_tb(e.__traceback__)
    where = _where_in_users_code(frames)
    data_dependent = "DataDependent" in name or "GuardOnDataDependent" in name or "data-dependent" in str(e).lower()
    if (data_dependent or "DynamicOutputShape" in name) and (known := _library_branch(frames, where)) is not None:
        return known
    in_optimizer = [f for f in frames if Path(f.filename).parent.parts[-2:] == ("torch", "optim")]
    if data_dependent and any("fused" in f.name for f in in_optimizer):
        return CaptureError(
            f"the optimizer runs its fused kernel (fused=True, in torch/optim/{Path(in_optimizer[-1].filename).name}), "
            "which took a setting as a fixed number where remat reads it from param_groups at every call (remat "
            "gives it the learning rate as a tensor and fixes the other floats). Construct the optimizer with fused=False "
            "(foreach=True is its multi-tensor path), or train without remat."
        )
    if data_dependent and in_optimizer:
        # The optimizer's own code: a library's, called from torch's step wrapper, or torch's.
        inner = [f for f in frames[frames.index(in_optimizer[-1]) + 1 :] if not f.filename.startswith(_TORCH_AND_REMAT)]
        line = (inner or in_optimizer)[-1]
        adafactor = " (transformers' Adafactor: give it lr with scale_parameter=False and relative_step=False, as Hugging Face's Trainer does)"
        return CaptureError(
            "the optimizer's update branches on a value that can change from step to step "
            f"({'/'.join(Path(line.filename).parts[-3 if line in in_optimizer else -2 :])}, line {line.lineno}: {line.line}), which one "
            "captured graph cannot hold: one computed from its parameters or gradients, from a state tensor of more than "
            "16 elements, or from a count kept as a Python number together with its settings (a branch on small state "
            "tensors, such as torch's RAdam's step count, is followed, and compiles again where it turns). Use an "
            "optimizer whose update does not branch on such values (SGD, Adam, AdamW, "
            f"RAdam, RMSprop, Adagrad, Adamax, NAdam, Adadelta, Rprop){adafactor if 'RMS' in (line.line or '') else ''}, "
            "or train this one without remat."
        )
    if data_dependent and _drawn_just_before(frames):
        return CaptureError(
            f"train_step branches on a random draw{where}, as LayerDrop skips a layer when torch.rand() falls below "
            "its rate: one captured graph would skip the same layers at every step. Set the rate to 0 (in Hugging "
            "Face configs: layerdrop, encoder_layerdrop, decoder_layerdrop), or train without remat."
        )
    if (sized := _sized_by_values(e, data_dependent, where)) is not None:
        return sized
    if data_dependent:
        return CaptureError(
            f"train_step has data-dependent Python control flow or an op whose output shape depends "
            f"on tensor values ({name}: {first}){where}. Make the branch independent of tensor values "
            "(e.g. use torch.where), or move it out of train_step. (A branch one side of which raises, as an input "
            "check or an assert does, is held in the graph as a check; this one goes on either way.) A number read "
            "from a tensor (.item(), float(t)) can be returned, printed or logged as it is, but not compared, used as "
            "a size or made a tensor again (torch.tensor(acc)): keep it a tensor (t.detach()) for those."
        )
    if "DynamicOutputShape" in name and "_ctc_loss" in first:
        return CaptureError(
            f"train_step computes a CTC loss on targets given as one concatenated 1-D tensor (as Hugging Face's CTC "
            f"heads pass them){where}, whose forward variables have a shape that depends on the target lengths' "
            "values. Pass the targets padded to (batch, longest) with the lengths as a tensor (nn.CTCLoss, "
            "nn.functional.ctc_loss), which remat traces: for a Hugging Face CTC model, call it without labels and "
            "compute the loss in train_step from its logits (log_softmax, transposed to (time, batch, classes))."
        )
    if "DynamicOutputShape" in name:
        return CaptureError(f"{_VALUE_SHAPED} ({first}){where}{_STATIC_SHAPES}")
    if "Sym" in first and "__format__" in first:
        return CaptureError(
            f"train_step formats a number it computes into text ({first}){where}: its Python code runs once, at "
            "capture, where the number is not known. Pass the number to print or logging as an argument "
            "(print('loss', loss.item()), log.info('loss %.4f', loss.item())), which remat makes again after each "
            "step with its value, or return it from train_step and format it there."
        )
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], FakeTensor):
        return CaptureError(
            f"train_step or a hook looks a tensor up in a dict keyed by the model's tensors ({name}){where}. While "
            "tracing, remat swaps the parameters and buffers for stand-ins, which such a dict does not hold. Key it by "
            "name (model.named_parameters()). An optimizer per parameter, stepped in a "
            "register_post_accumulate_grad_hook, is not needed: pass one optimizer (or a list) to remat.compile and "
            "step it in train_step; remat runs each parameter's update as soon as its gradient is final."
        )
    if isinstance(e, NameError):  # a global the loop sets later (`for it, batch in enumerate(loader)` after compiling)
        return CaptureError(
            f"could not capture train_step: {name}: {first}{where}. remat.compile runs train_step once, on the example "
            "batch, to trace it: give each global it reads a value before compiling (it = 0), as the first step will find it."
        )
    if "Unsupported" in name or "NotImplemented" in name:
        return CaptureError(f"train_step uses an op that cannot be traced on fake tensors ({name}: {first}){where}; replace or remove it.")
    dispatch = _fake_dispatch_of(e)
    real = [a for a in dispatch[1] if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)] if dispatch else []
    if real:
        t = real[0]
        return CaptureError(
            f"train_step uses a {'parameter' if isinstance(t, torch.nn.Parameter) else 'tensor'} of shape "
            f"{tuple(t.shape)} that is not the model's, its optimizer's or the batch's, and not held where remat "
            f"looks for tensors outside the model ({dispatch[0]}){where}. remat finds such a tensor in a global or "
            "closure variable of the user's code, a field of the user's object (one in a list or dict too), a module "
            "held there, a list or dict in one of those, or a field of a library's object held in one of those (two "
            "objects deep): hold the tensor, or the library object that holds it, in one of those places (a global the "
            "step reads, a field of your trainer), register it with the model (register_buffer, where the model's code "
            "reads it), or pass it in the batch."
        )
    if dispatch is not None:
        op = dispatch[0]
        hint = (
            " For a Hugging Face mixture-of-experts layer, load the model with experts_implementation=\"batched_mm\"."
            if "grouped_mm" in op else ""
        )
        return CaptureError(
            f"{op}'s shape function, which remat traces with, refuses these inputs ({name}: {first}){where}, "
            f"though eager PyTorch may run them: replace the op or change its inputs' dtype or layout.{hint}"
        )
    return CaptureError(f"could not capture train_step: {name}: {first}{where}")
