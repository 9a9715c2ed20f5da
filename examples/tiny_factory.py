"""An example factory for `--model examples.tiny_factory:build`: your own model, optimizer,
batch and training step, handed to every remat command.

    remat profile --model examples.tiny_factory:build --batch-size 32
    remat run --model examples.tiny_factory:build --batch-size 32 --budget 0.5 --check
"""

import torch
from torch import nn


def build(batch_size: int, device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256),
        nn.Linear(256, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batch = (torch.randn(batch_size, 64, device=device), torch.randint(0, 10, (batch_size,), device=device))

    def train_step(model, optimizer, batch):
        x, y = batch
        optimizer.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss, logits.detach()

    return model, optimizer, batch, train_step
