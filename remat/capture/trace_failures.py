"""Why a trace of train_step failed, as an error that names the cause and what to do: a
branch on a value (and where: the user's line, a library's, the optimizer's), a shape
made from values, an op its fake kernel refuses, a tensor held where remat does not look,
host work on a tensor's values."""

from __future__ import annotations

import linecache
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from remat.errors import CaptureError
from remat.capture.trace_checks import STATIC_SHAPES, VALUE_SHAPED, users_frame, where_in_frames

def _drawn_just_before(frames: list) -> bool:
    """Whether the user's line that branched follows a `torch.rand` draw within a few lines
    (LayerDrop: `skip = torch.rand([]) < self.layerdrop`, then `if not skip:`)."""
    frame = users_frame(frames)
    before = [] if frame is None else [linecache.getline(frame.filename, n) for n in range(max(1, frame.lineno - 5), frame.lineno + 1)]
    return any("torch.rand(" in line for line in before)


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
    where = where_in_frames(frames)
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
        return CaptureError(f"{VALUE_SHAPED} ({first}){where}{STATIC_SHAPES}")
    if "Sym" in first and ("__format__" in first or "is not JSON serializable" in first):
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
    if ".numpy() is not supported" in first:
        return CaptureError(
            f"train_step makes a numpy array of a tensor (.numpy()){where}: its Python code runs once, at capture, where "
            "tensors hold no values, so host work on them (a scipy matching, a numpy or scikit-learn metric) cannot be "
            "replayed at each step. Do that work with torch ops inside train_step, or outside it, on tensors it returns "
            "(t.detach()); a number it needs from the host can come in the batch, as a tensor."
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
            "reads it), or pass it in the batch. Data the step fetches itself (next(iterator), a dataset indexed in the "
            "step) is such a tensor too, fetched once, at capture: fetch it in the loop and pass it as the batch."
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
