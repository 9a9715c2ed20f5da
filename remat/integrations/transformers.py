"""Hugging Face `Trainer` with remat: `RematTrainer`, and `RematTrainerMixin` for a
trainer class of your own (TRL's, or a `Trainer` subclass).

The trainer's loop stays Trainer's own (callbacks, logging, evaluation, checkpoints,
schedulers). What changes is one optimizer step: the forward and backward passes of its
micro-batches, the gradient clipping and `optimizer.step()` run as one remat graph, so
that each parameter's update runs as soon as its gradient is final and the recomputation
plan covers the whole step. Trainer asks for that step one micro-batch at a time
(`training_step`, then `_clip_grad_norm`, then `optimizer.step()`); the mixin runs the
graph at the first micro-batch of an optimizer step (Trainer has fetched all of them by
then, `get_batch_samples`) and hands Trainer each result where it asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator

import torch
from transformers import Trainer

from remat.errors import RematError

logger = logging.getLogger(__name__)


class RematTrainerMixin:
    """Put before `transformers.Trainer` (or a subclass of it) in a class's bases:
    `class MyTrainer(RematTrainerMixin, SFTTrainer)`. Takes `memory_budget=` (as
    `remat.compile`'s: a fraction of the activation peak, a cap such as "6GiB", or None)
    and `remat_options=` (other `remat.compile` keywords: planner, updates_in_backward, ...).

    After the first optimizer step, `trainer.remat_report` holds remat's report (predicted
    and measured peak, the plan) for the last batch shape compiled; its peaks are logged
    once, through Trainer's `log` (`remat_predicted_peak_mib`, ...).
    Between `optimizer.step()` and the next step the gradients are already freed (remat
    frees each after its update), so a callback's `on_optimizer_step` sees no `.grad`.
    """

    def __init__(self, *args: Any, memory_budget: str | int | float | None = 0.5, remat_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not hasattr(super(), "_run_epoch"):
            raise RematError(
                "RematTrainer needs a transformers version whose Trainer runs an epoch in _run_epoch and fetches each "
                "optimizer step's micro-batches with get_batch_samples (5.0 or newer): pip install -U transformers"
            )
        refused = [
            (self.args.torch_compile, "torch_compile=True: remat compiles the step itself; drop torch_compile"),
            (getattr(self, "is_deepspeed_enabled", False), "DeepSpeed runs the optimizer step in its own engine; train without it"),
            (getattr(self, "is_fsdp_enabled", False), "FSDP is not built in remat yet; use DDP (several processes) or one process"),
        ]
        for bad, why in refused:
            if bad:
                raise RematError(f"RematTrainer cannot honour {why}.")
        self.memory_budget = memory_budget
        self.remat_options = dict(remat_options or {})
        self.remat_step: Any = None  # the remat.RematStep that ran the last optimizer step
        self._remat_steps: dict[int, Any] = {}  # number of micro-batches -> its RematStep
        self._micro_batches: list[Any] = []  # this optimizer step's, as get_batch_samples fetched them
        self._num_items: Any = None
        self._results: tuple[list[torch.Tensor], torch.Tensor] | None = None  # the step's losses and gradient norm
        self._reported = False
        self._optimizer_stepped = False  # the graph ran this optimizer step: Trainer's optimizer.step() is then done

    @property
    def remat_report(self) -> Any:
        return None if self.remat_step is None or self.remat_step._last is None else self.remat_step.report

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._micro_batches, self._num_items, self._results = list(batches), num_items, None
        return batches, num_items

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        index = next((i for i, b in enumerate(self._micro_batches) if b is inputs), None)
        if index is None:
            raise RematError(
                "RematTrainer.training_step runs a whole optimizer step and takes its micro-batches from the trainer's "
                "loop (get_batch_samples); it was called with a batch that loop did not fetch. Call trainer.train(), "
                "or use a plain Trainer to run training_step by hand."
            )
        if index == 0:
            self._results = self._run_whole_step(model)
        assert self._results is not None
        return self._results[0][index]

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        return self._step_grad_norm()

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return super()._get_grad_norm(model, grad_norm=self._step_grad_norm())

    def _step_grad_norm(self) -> torch.Tensor:
        if self._results is None:
            raise RematError("RematTrainer: the gradient norm is asked for before the optimizer step's graph ran")
        return self._results[1]

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer steps its optimizer after the micro-batches; remat's graph already did.
        real = self.optimizer
        self.optimizer = _SteppedInGraph(real, self)
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            self.optimizer = real

    def _whole_step(self, model: torch.nn.Module, optimizer: Any, batch: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One optimizer step as Trainer takes it, traced by remat: each micro-batch through
        Trainer's own training_step (its compute_loss, loss scaling and backward), then
        its clipping, then the optimizer. Gradients start and end cleared, as around
        Trainer's step (it zeroes them after each)."""
        model.zero_grad()
        trainer = super()
        losses = []
        micro_batches = batch["micro_batches"]
        for i, inputs in enumerate(micro_batches):
            # Data parallel: gradients synced in the last micro-batch's backward pass only, as
            # Trainer syncs them (the graph runs inside the first one's no_sync()).
            last = i == len(micro_batches) - 1
            with _gradient_sync(model) if last else self.accelerator.no_sync(model):
                losses.append(trainer.training_step(model, inputs, batch["num_items_in_batch"]))
        if self.args.max_grad_norm > 0:
            grad_norm = trainer._clip_grad_norm(model)
        else:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), math.inf)
        optimizer.step()
        model.zero_grad()
        return losses, grad_norm

    def _run_whole_step(self, model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
        import remat

        batch = {"micro_batches": self._micro_batches, "num_items_in_batch": self._num_items}
        optimizer = self.optimizer.wrapped if isinstance(self.optimizer, _SteppedInGraph) else self.optimizer
        gradient_state = self.accelerator.gradient_state
        syncs = gradient_state.sync_gradients
        gradient_state._set_sync_gradients(True)  # the graph's optimizer.step() is the step's last micro-batch's
        try:
            # One step per number of micro-batches (an epoch's last optimizer step may have fewer).
            step = self._remat_steps.get(len(self._micro_batches))
            if step is None or step.model is not model or step.optimizer is not optimizer:
                step = remat.compile(self._whole_step, model, optimizer, batch, self.memory_budget, **self.remat_options)
                self._remat_steps[len(self._micro_batches)] = step
            self.remat_step = step
            results = step(batch)
        finally:
            gradient_state._set_sync_gradients(syncs)
        self._optimizer_stepped = True
        if not self._reported and self.remat_report is not None:
            self._reported = True
            logger.info("remat: %s", _describe(self.remat_report))
            self.log(_report_logs(self.remat_report))  # once, where Trainer's logs go (console, report_to)
        return results


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """A DistributedDataParallel model's gradient sync on for the block (what no_sync() turns off)."""
    if not hasattr(model, "require_backward_grad_sync"):
        yield
        return
    was = model.require_backward_grad_sync
    model.require_backward_grad_sync = True
    try:
        yield
    finally:
        model.require_backward_grad_sync = was


def _report_logs(report: Any) -> dict[str, float]:
    mib = 2**20
    logs = {
        "remat_predicted_peak_mib": round(report.predicted_peak_bytes / mib, 2),
        "remat_no_recompute_peak_mib": round(report.baseline_peak_bytes / mib, 2),
        "remat_recomputed": float(report.num_recomputed),
    }
    if report.measured_peak_bytes is not None:
        logs["remat_measured_peak_mib"] = round(report.measured_peak_bytes / mib, 2)
    return logs


class _SteppedInGraph:
    """The trainer's optimizer while remat runs its steps: `step()` was taken by the graph;
    everything else (state_dict for checkpoints, param_groups, train/eval) is the optimizer's."""

    def __init__(self, wrapped: Any, trainer: RematTrainerMixin):
        self.wrapped, self._trainer = wrapped, trainer

    def step(self, closure: Any = None) -> None:
        if not self._trainer._optimizer_stepped:
            raise RematError("RematTrainer: optimizer.step() was called without remat's graph having run the step")
        self._trainer._optimizer_stepped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def _describe(report: Any) -> str:
    mib = 2**20
    measured = f"{report.measured_peak_bytes / mib:.1f} MiB" if report.measured_peak_bytes is not None else "not measured"
    planned = f"{report.num_recomputed} activations recomputed ({report.plan.planner})" if report.plan else "no recomputation"
    return f"peak predicted {report.predicted_peak_bytes / mib:.1f} MiB, measured {measured}, {planned}; without remat's plan {report.baseline_peak_bytes / mib:.1f} MiB"


class RematTrainer(RematTrainerMixin, Trainer):
    """`transformers.Trainer` whose optimizer steps run through remat under `memory_budget`."""
