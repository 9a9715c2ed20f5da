"""PyTorch Lightning with remat: `RematCallback`, added to a `lightning.Trainer`'s callbacks.

Lightning's loop stays its own (schedulers, logging, checkpoints, validation, the step
counter). What changes is one optimizer step: where the loop calls the module's
`optimizer_step` hook (automatic optimization), the callback runs that step as one remat
graph: Lightning's own closure (the module's `training_step`, `zero_grad`, `backward`
with its hooks), its precision plugin and gradient clipping, and the optimizer's update,
traced once with the batch as the graph's input. What the step logs with `self.log` is
computed in the graph and logged after each run with that step's values (step_prints).
With `accumulate_grad_batches`, a batch whose gradients only accumulate (the loop calls
its closure alone) runs that closure as a remat graph too: one for the first batch of
each round (it clears the gradients), one for the others (they add to them).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loops.optimization.automatic import ClosureResult
except ImportError as e:  # an optional extra
    raise ImportError(f"remat.integrations.lightning needs PyTorch Lightning: pip install 'remat[lightning]' ({e})") from e

from remat.capture.state import library_objects, step_prints
from remat.errors import RematError

# The hooks Lightning runs inside an optimizer step: run once, while the step is traced,
# their tensor work is in the graph but what else they do (a callback's Python state) is not.
_HOOKS_IN_THE_STEP = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


class RematCallback(Callback):
    """`lightning.Trainer(callbacks=[RematCallback(memory_budget=0.5)])`: each optimizer
    step of `fit` runs through remat under `memory_budget` (as `remat.compile`'s: a fraction
    of the activation peak, a cap such as "6GiB", or None); `remat_options` are other
    `remat.compile` keywords. `callback.report` is remat's report for the last batch shape.

    Supported: automatic optimization with one optimizer (and its schedulers),
    `gradient_clip_val`, `accumulate_grad_batches`, precision plugins (fp16 with its
    GradScaler too), `self.log` of tensors in `training_step`.
    Refused by name: several processes (DDP strategies), manual optimization, several optimizers,
    an `optimizer_step` of the module's own, and callbacks that act inside the
    step (`on_after_backward`, ...). `training_step` may not compute with `batch_idx`
    (it is read once, at capture): the error says so."""

    def __init__(self, memory_budget: str | int | float | None = 0.5, **remat_options: Any):
        self.memory_budget = memory_budget
        self.remat_options = remat_options
        self.step: Any = None  # the remat.RematStep
        self.accumulating: dict[bool, Any] = {}  # a batch that only accumulates: its remat.RematStep, by whether it is a round's first
        self._module: LightningModule | None = None
        self._trainer: Any = None

    @property
    def report(self) -> Any:
        return None if self.step is None or self.step._last is None else self.step.report

    def on_fit_start(self, trainer: Any, pl_module: LightningModule) -> None:
        _check_supported(trainer, pl_module, self)
        self._module, self._trainer = pl_module, trainer
        _find_metrics(pl_module)
        pl_module.optimizer_step = self._optimizer_step  # the loop looks the hook up on the module
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        loop._make_closure = self._closure_maker(loop._make_closure)  # type: ignore[method-assign]

    def on_fit_end(self, trainer: Any, pl_module: LightningModule) -> None:
        self._put_back(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: LightningModule, exception: BaseException) -> None:
        self._put_back(trainer, pl_module)

    @staticmethod
    def _put_back(trainer: Any, pl_module: LightningModule) -> None:
        vars(pl_module).pop("optimizer_step", None)
        vars(trainer.fit_loop.epoch_loop.automatic_optimization).pop("_make_closure", None)

    def _closure_maker(self, make: Any) -> Any:
        """Lightning's closure maker, whose closure runs through remat where the loop calls it
        alone: a batch that accumulates its gradients, with no optimizer step."""

        def made(kwargs: Any, optimizer: Any, batch_idx: int) -> Any:
            closure = make(kwargs, optimizer, batch_idx)
            if self._trainer.fit_loop._should_accumulate():
                closure.closure = lambda: self._accumulating_step(closure, kwargs, optimizer, batch_idx)
            return closure

        return made

    def _accumulating_step(self, closure: Any, kwargs: Any, optimizer: Any, batch_idx: int) -> ClosureResult:
        import remat

        module, trainer = self._module, self._trainer
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        counted = progress.state_dict()
        first = closure._zero_grad_fn is not None  # a round's first batch: it clears the gradients before its backward

        def micro_step(module: LightningModule, optimizer: Any, batch: Any) -> dict[str, Any]:
            """Lightning's closure, as its loop runs it alone, with this batch."""
            result = _with_batch(kwargs, batch, batch_idx, lambda: type(closure).closure(closure))
            return {"loss": result.loss, "extra": result.extra}

        step = self.accumulating.get(first)
        if step is None or step.model is not module or step.optimizer is not optimizer:
            step = self.accumulating[first] = remat.compile(micro_step, module, optimizer, kwargs["batch"], self.memory_budget, **self.remat_options)
        out = step(kwargs["batch"])
        progress.load_state_dict(counted)  # the traces counted their zero_grad(); count this batch's once
        if first:
            _count_zero_grad(progress)
        return ClosureResult(out["loss"], extra=out["extra"])

    def _optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        import remat

        module, trainer = self._module, self._trainer
        assert module is not None
        kwargs = optimizer_closure._step_fn.args[0]  # what the loop passes training_step: batch, batch_idx
        batch = kwargs["batch"]
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        counted = progress.state_dict()

        def whole_step(module: LightningModule, optimizer: Any, batch: Any) -> dict[str, Any]:
            """Lightning's step, as its loop runs it, with this batch."""
            _with_batch(kwargs, batch, batch_idx, lambda: LightningModule.optimizer_step(module, epoch, _BatchIndex(batch_idx), optimizer, optimizer_closure))
            result, optimizer_closure._result = optimizer_closure._result, None  # set again after each run
            return {"loss": result.loss, "extra": result.extra}

        if self.step is None or self.step.model is not module or self.step.optimizer is not optimizer:
            self.step = remat.compile(whole_step, module, optimizer, batch, self.memory_budget, **self.remat_options)
        out = self.step(batch)
        # The traces counted their zero_grad() as the loop counts it; count this step's once.
        progress.load_state_dict(counted)
        if optimizer_closure._zero_grad_fn is not None:
            _count_zero_grad(progress)
        optimizer_closure._result = ClosureResult(out["loss"], extra=out["extra"])


def _with_batch(kwargs: dict[str, Any], batch: Any, batch_idx: int, run: Any) -> Any:
    """`run()` with the loop's training_step arguments set to this batch (and its index as
    _BatchIndex), put back after."""
    saved = dict(kwargs)
    kwargs["batch"] = batch
    if "batch_idx" in kwargs:
        kwargs["batch_idx"] = _BatchIndex(batch_idx)
    try:
        return run()
    finally:
        kwargs.update(saved)


def _find_metrics(module: LightningModule) -> None:
    """Fill the table of the module's torchmetrics metrics that its first `self.log` of a
    metric fills (as that call fills it). The logs run again after each step, so otherwise
    the first step's would fill it, a change to the module after the step was compiled,
    which compiles the step again."""
    if vars(module).get("_metric_attributes", 0) is not None:
        return
    try:
        from torchmetrics import Metric
    except ImportError:
        return
    metrics = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
    if metrics:  # none: the table stays unset, and a metric logged is refused by Lightning as it would be
        module._metric_attributes = metrics


def _count_zero_grad(progress: Any) -> None:
    zero_grad = progress.optimizer.zero_grad
    zero_grad.increment_ready(), zero_grad.increment_started(), zero_grad.increment_completed()


def _log_again(real: Any, module: LightningModule, *args: Any, **kwargs: Any) -> None:
    """`self.log(...)` made again after a run, with that step's values, as training_step made it."""
    where = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        real(module, *args, **kwargs)
    finally:
        module._current_fx_name = where


def _tensor_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    value = args[1] if len(args) > 1 else kwargs.get("value", kwargs.get("dictionary"))
    values = value.values() if isinstance(value, dict) else [value]
    if any(type(v) in (int, float) for v in values):  # a number .item() gave while tracing is the graph's
        name = args[0] if args and isinstance(args[0], str) else "a value"
        raise RematError(
            f"training_step logs {name!r} as a Python number; under remat the step is traced once, so it would be "
            "logged with its value at capture. Log a tensor or loss.item() (remat computes them at every step), or "
            "log the number in on_train_batch_end."
        )


for _name in ("log", "log_dict"):
    step_prints.record_calls_of(step_prints.RecordedMethod(LightningModule, _name, _log_again, _tensor_values))


def _trainer_state(module: LightningModule) -> list[tuple[str, Any]]:
    """What of the trainer a step changes, deeper than the library walk goes (library_objects):
    the GradScaler of its precision plugin ("16-mixed"), whose scale the step reads and
    updates and which is made at its first use; and, where a manually optimized module's
    step is compiled with remat.compile, the manual loop's count of optimizer steps, which
    each `optimizer.step()` adds to and `trainer.global_step` reads."""
    trainer = vars(module).get("_trainer")
    if trainer is None:
        return []
    roots = []
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is not None:
        roots.append(("trainer.precision_plugin.scaler", scaler))
    fit_loop = getattr(trainer, "fit_loop", None)
    progress = getattr(getattr(getattr(fit_loop, "epoch_loop", None), "manual_optimization", None), "optim_step_progress", None)
    if progress is not None and not module.automatic_optimization:
        roots.append(("trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress", progress))
    # The counts `self.global_step` and `self.current_epoch` read, which the loop moves
    # between steps: watched where a step reads them (library_objects.recording_reads).
    steps = getattr(getattr(getattr(getattr(getattr(fit_loop, "epoch_loop", None), "automatic_optimization", None), "optim_progress", None), "optimizer", None), "step", None)
    if steps is not None and module.automatic_optimization:
        roots.append(("trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step", steps))
    if getattr(fit_loop, "epoch_progress", None) is not None:
        roots.append(("trainer.fit_loop.epoch_progress", fit_loop.epoch_progress))
    return roots


library_objects.reach_through(LightningModule, _trainer_state)


class _BatchIndex(int):
    """`batch_idx` as training_step gets it under remat: passing it on is fine, computing
    with it is refused (the step is traced once, with the first batch's index)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RematError(
            "training_step computes with batch_idx, which remat reads once, when it traces the step (the graph would "
            "use the first batch's index at every step). Do that work in on_train_batch_start or on_train_batch_end, "
            "which get batch_idx at every step, or drop RematCallback."
        )

    __index__ = __int__ = __float__ = __bool__ = __hash__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _refuse
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __pow__ = __format__ = __str__ = __repr__ = _refuse


def _check_supported(trainer: Any, module: LightningModule, callback: RematCallback) -> None:
    def refuse(what: str, instead: str) -> None:
        raise RematError(f"RematCallback: {what}. {instead}")

    if trainer.world_size > 1:
        refuse(
            f"the trainer runs {trainer.world_size} processes ({type(trainer.strategy).__name__})",
            "RematCallback runs on one process for now; for data parallel, compile your step with remat.compile "
            "on a DistributedDataParallel model (docs: README, Data parallel).",
        )
    if not module.automatic_optimization:
        refuse(
            "the module uses manual optimization",
            "Compile the step's body with remat.compile in training_step yourself (docs/integrations/lightning.md, "
            "Manual optimization), or use automatic optimization.",
        )
    if len(trainer.optimizers) != 1:
        refuse(f"configure_optimizers returns {len(trainer.optimizers)} optimizers", "remat runs one optimizer step per batch: return one optimizer (its schedulers may be several).")
    if type(module).optimizer_step is not LightningModule.optimizer_step:
        refuse(
            f"{type(module).__name__} overrides optimizer_step",
            "remat runs Lightning's own step; set the learning rate with a scheduler from configure_optimizers (LambdaLR for a warm-up).",
        )
    for other in trainer.callbacks:
        hooks = [h for h in _HOOKS_IN_THE_STEP if other is not callback and getattr(type(other), h) is not getattr(Callback, h)]
        if hooks:
            refuse(
                f"the callback {type(other).__name__} acts inside the optimizer step ({', '.join(hooks)})",
                "remat traces the step once, so such a hook would run once; move its work to on_train_batch_end, or drop RematCallback.",
            )
