"""PyTorch Lightning with remat: add `RematCallback(memory_budget=...)` to the Trainer's
callbacks. The module stays as it is (training_step, configure_optimizers, self.log);
each optimizer step runs as one remat graph.

    pip install 'remat[lightning]'
    python examples/lightning_module.py
"""

import lightning as L
import torch

from remat.integrations.lightning import RematCallback


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        blocks = [m for _ in range(4) for m in (torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Dropout(0.1))]
        self.net = torch.nn.Sequential(*blocks, torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)  # computed in remat's graph, logged at every step
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warm_up, "interval": "step"}}


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(1280, 128), torch.randint(0, 10, (1280,)))
remat_callback = RematCallback(memory_budget=0.7)
trainer = L.Trainer(max_steps=5, accelerator="cpu", callbacks=[remat_callback], gradient_clip_val=1.0,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=256))

report = remat_callback.report
print(f"loss {trainer.callback_metrics['train_loss']:.4f}; peak predicted {report.predicted_peak_bytes:,} B, "
      f"measured {report.measured_peak_bytes:,} B; {report.num_recomputed} activations recomputed")
