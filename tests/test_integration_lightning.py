"""RematCallback against plain Lightning: a LightningModule's training_step and
configure_optimizers (AdamW, a per-step warm-up scheduler), gradient clipping, dropout,
validation between steps, default callbacks and `self.log`: the parameters, optimizer
state, logged values, step counters and progress bitwise equal, in fp32 and bf16-mixed;
what the callback cannot honour is refused by name. A manually optimized module whose
training_step runs a step compiled with remat.compile counts its steps as Lightning does."""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning")
import remat  # noqa: E402
from remat.errors import RematError  # noqa: E402
from remat.integrations.lightning import RematCallback  # noqa: E402


class _Net(L.LightningModule):
    def __init__(self, use_batch_idx: bool = False, log_a_float: bool = False):
        super().__init__()
        blocks = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.1))]
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 4))
        self.use_batch_idx, self.log_a_float = use_batch_idx, log_a_float

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"logit_mean": logits.mean().float(), "loss_item": loss.item()})
        if self.use_batch_idx and batch_idx % 2 == 0:
            loss = loss * 1.0
        if self.log_a_float:
            self.log("half", 0.5)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warm_up = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm_up, "interval": "step"}}


class _Seen(L.Callback):
    """What the loop holds after each batch: the logged values and the step counter."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, outputs["loss"].clone(), {k: v.clone() for k, v in trainer.callback_metrics.items()}))


def _data(n: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(n)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=128)


def _fit(tmp_path, extra: list, precision: str = "32-true", module: L.LightningModule | None = None, **trainer_args):
    torch.manual_seed(0)
    module = module or _Net()
    seen = _Seen()
    if "plugins" not in trainer_args:  # a precision plugin given says the precision itself
        trainer_args["precision"] = precision
    trainer = L.Trainer(
        max_steps=6, callbacks=[seen, *extra], default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
        accelerator="cpu", limit_val_batches=1, **{"gradient_clip_val": 1.0, "val_check_interval": 3, **trainer_args},
    )
    trainer.fit(module, _data(1024), _data(128))
    opt = trainer.optimizers[0]
    state = [p.detach().clone() for p in module.parameters()] + [t.clone() for s in opt.state.values() for t in s.values()]
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.state_dict()
    return seen.rows, state, progress, trainer


def _equal_rows(a, b) -> bool:
    return len(a) == len(b) and all(
        sa == sb and torch.equal(la, lb) and ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
        for (sa, la, ma), (sb, lb, mb) in zip(a, b)
    )


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_step_through_remat_is_bitwise(tmp_path, precision):
    eager_rows, eager_state, eager_progress, _ = _fit(tmp_path / "eager", [], precision)
    callback = RematCallback(memory_budget=0.9)
    rows, state, progress, trainer = _fit(tmp_path / "remat", [callback], precision)
    assert len(callback.step._graphs) == 1 and callback.report.num_recomputed > 0
    assert callback.report.measured_peak_bytes == callback.report.predicted_peak_bytes
    assert {"train_loss", "logit_mean", "loss_item", "val_loss"} <= set(rows[-1][2])
    assert _equal_rows(rows, eager_rows)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert progress == eager_progress
    assert "optimizer_step" not in vars(trainer.lightning_module)  # the module as it was after fit


class _NetByStep(_Net):
    """A warm-up and a term every other step computed in training_step from
    `self.global_step`, and a weight from `self.current_epoch`: counts the loop moves, behind
    properties of the module and its trainer."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y) * min(1.0, (self.global_step + 1) / 3)
        if self.global_step % 2 == 0:
            loss = loss + 0.01 * self.net[0].weight.pow(2).mean()
        loss = loss * (1.0 + 0.1 * self.current_epoch)
        self.log("train_loss", loss)
        return loss


def test_a_training_step_computing_with_global_step_and_current_epoch_trains_as_eager_does(tmp_path):
    # Each count is read at every call once it has changed (a graph held the first step's
    # before, with no error): a graph per side of what the step compares, not one per step.
    eager_rows, eager_state, eager_progress, _ = _fit(tmp_path / "eager", [], module=_NetByStep(), limit_train_batches=2, val_check_interval=2)
    callback = RematCallback(memory_budget=0.9)
    rows, state, progress, _ = _fit(tmp_path / "remat", [callback], module=_NetByStep(), limit_train_batches=2, val_check_interval=2)
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6] and _equal_rows(rows, eager_rows)
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state, strict=True)) and progress == eager_progress
    counts = {n.rsplit(".", 2)[0] for n in callback.step._read}
    assert counts == {"trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step", "trainer.fit_loop.epoch_progress"}, counts
    assert len(callback.step._graphs) <= 5


class _NetWithMetric(_Net):
    """The canonical torchmetrics pattern: a metric held by the module, called in
    training_step, and the metric object itself logged per step and per epoch."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4, validate_args=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits.argmax(-1), y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits, y)


class _NetLoggingRate(_Net):
    """The warm-up's rate logged in training_step, as a learning-rate monitor would show it."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()

    def training_step(self, batch, batch_idx):
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)


def test_the_schedulers_rate_logged_in_training_step_is_each_steps_own(tmp_path):
    # Lightning steps the scheduler after the update, outside the compiled step: the rate is
    # read from it at each call, not the one the trace saw.
    eager_rows, eager_state, _, _ = _fit(tmp_path / "eager", [], module=_NetLoggingRate())
    callback = RematCallback(memory_budget=0.9)
    rows, state, _, _ = _fit(tmp_path / "remat", [callback], module=_NetLoggingRate())
    assert _equal_rows(rows, eager_rows) and len(callback.step._graphs) == 1
    assert [float(r[2]["lr"]) for r in rows[:3]] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state, strict=True))


def test_a_torchmetrics_metric_logged_as_an_object_logs_each_steps_value_bitwise(tmp_path):
    # Lightning reads the batch's value from the metric when the log is made again after a
    # run: the metric's update must be in place by then, or each step logs the one before.
    eager_rows, eager_state, _, eager_trainer = _fit(tmp_path / "eager", [], module=_NetWithMetric(seed=0))
    callback = RematCallback(memory_budget=0.9)
    rows, state, _, trainer = _fit(tmp_path / "remat", [callback], module=_NetWithMetric(seed=0))
    assert "train_acc_step" in rows[0][2] and len(rows) == 6
    assert _equal_rows(rows, eager_rows)
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state, strict=True))
    assert torch.equal(trainer.lightning_module.train_acc.compute(), eager_trainer.lightning_module.train_acc.compute())
    assert len(callback.step._graphs) == 1  # the module's table of metrics filled before compiling, as its first log fills it


def test_lightning_fp16_with_its_grad_scaler_is_bitwise(tmp_path):
    """precision="16-mixed" (on a GPU; on CPU Lightning turns it into bf16, so the plugin is
    given a CPU scaler here): the plugin's GradScaler, which the step reaches only through
    the module's trainer, is read and updated by the graph; the first steps overflow and
    their updates are skipped, as in eager."""
    from lightning.pytorch.plugins import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2))

    eager_rows, eager_state, eager_progress, eager_trainer = _fit(tmp_path / "eager", [], plugins=[plugin()])
    callback = RematCallback(memory_budget=0.9)
    rows, state, progress, trainer = _fit(tmp_path / "remat", [callback], plugins=[plugin()])
    eager_scale, scale = (float(t.precision_plugin.scaler.get_scale()) for t in (eager_trainer, trainer))
    assert eager_scale < 2.0**24 and scale == eager_scale  # it backed off: steps were skipped
    assert callback.report.num_recomputed > 0
    assert _equal_rows(rows, eager_rows)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert progress == eager_progress


def test_accumulate_grad_batches_is_bitwise(tmp_path):
    """accumulate_grad_batches=3 over epochs of 8 batches: each round's first batch clears the
    gradients, the next adds to them, the third steps the optimizer (and an epoch's last
    batch steps after two): three graphs, bitwise with eager Lightning's rows and state."""
    eager_rows, eager_state, eager_progress, _ = _fit(tmp_path / "eager", [], accumulate_grad_batches=3)
    callback = RematCallback(memory_budget=0.9)
    rows, state, progress, trainer = _fit(tmp_path / "remat", [callback], accumulate_grad_batches=3)
    assert trainer.global_step == 6 and len(rows) == 16  # rounds of 3, 3 and 2 batches in each of two epochs
    assert set(callback.accumulating) == {True, False}
    steps = [callback.step, *callback.accumulating.values()]
    assert all(s.report.measured_peak_bytes == s.report.predicted_peak_bytes for s in steps)
    assert _equal_rows(rows, eager_rows)
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert progress == eager_progress
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)


@pytest.mark.parametrize(
    "module, trainer_args, match",
    [
        (_Net(use_batch_idx=True), {}, "computes with batch_idx"),
        (_Net(log_a_float=True), {}, "logs 'half' as a Python number"),
    ],
)
def test_what_the_callback_cannot_honour_is_refused(tmp_path, module, trainer_args, match):
    with pytest.raises(RematError, match=match):
        _fit(tmp_path, [RematCallback(memory_budget=0.9)], module=module, **trainer_args)


class _Manual(_Net):
    """Manual optimization with the step's body compiled by remat.compile in training_step."""

    step = None  # a class attribute: the module's own attributes (compile keys on them) hold no None before it

    def __init__(self, use_remat: bool):
        super().__init__()
        self.automatic_optimization, self.use_remat = False, use_remat

    @staticmethod
    def body(module, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module.net(batch[0]), batch[1])
        module.manual_backward(loss)
        module.clip_gradients(optimizer, gradient_clip_val=1.0)
        optimizer.step()  # Lightning's optimizer: the manual loop counts the step
        return loss.detach()

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        if self.use_remat and self.step is None:
            self.step = remat.compile(_Manual.body, self, optimizer, batch, memory_budget=0.9, profile_runs=1)
        loss = self.step(batch) if self.use_remat else _Manual.body(self, optimizer, batch)
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        return loss


def test_a_manually_optimized_step_compiled_in_training_step_counts_as_lightning_does(tmp_path):
    modules = []
    for use_remat in (False, True):
        torch.manual_seed(0)
        modules.append(_Manual(use_remat))
    rows, state, _, trainer = _fit(tmp_path / "eager", [], module=modules[0], gradient_clip_val=None)
    remat_rows, remat_state, _, remat_trainer = _fit(tmp_path / "remat", [], module=modules[1], gradient_clip_val=None)
    assert [r[0] for r in remat_rows] == [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]  # global_step: the manual loop's count
    assert remat_trainer.global_step == trainer.global_step == 6  # the fit stopped at max_steps
    assert _equal_rows(remat_rows, rows)
    assert len(state) == len(remat_state) and all(torch.equal(a, b) for a, b in zip(state, remat_state))
    step = remat_trainer.lightning_module.step
    assert step.report.num_recomputed > 0 and len(step._graphs) == 1


def test_compiling_with_lightning_loaded_loads_its_integration():
    # A script that compiles a LightningModule's step itself never imports remat.integrations.lightning.
    import subprocess
    import sys

    code = (
        "import sys, torch, lightning.pytorch, remat\n"
        "assert 'remat.integrations.lightning' not in sys.modules\n"
        "def step(model, optimizer, batch):\n"
        "    model.zero_grad()\n"
        "    loss = model(batch).sum()\n"
        "    loss.backward()\n"
        "    return loss\n"
        "remat.compile(step, torch.nn.Linear(2, 2), None, torch.randn(3, 2), memory_budget=None, profile_runs=1, measure=False)\n"
        "assert 'remat.integrations.lightning' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
