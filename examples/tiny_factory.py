"""An example factory for `--model examples.tiny_factory:build`: your own model, optimizer,
batch and training step, handed to every remat command.

    remat profile --model examples.tiny_factory:build --batch-size 32
    remat run --model examples.tiny_factory:build --batch-size 32 --budget 0.5 --check
    remat run --model examples.tiny_factory:build_muon --batch-size 512 --budget 0.75 --check

`build_muon` trains with two optimizers, Muon on the weight matrices and AdamW on the rest,
handed over as a list: the step gets the list and steps each.
"""

import torch
from torch import nn


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256),
        nn.Linear(256, 10),
    ).to(device)


def build(batch_size: int, device: str = "cpu"):
    model = _model(device)
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


def build_muon(batch_size: int, device: str = "cpu"):
    model = _model(device)
    params = list(model.parameters())
    optimizers = [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02, weight_decay=0.01),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-3, weight_decay=0.01),
    ]
    batch = (torch.randn(batch_size, 64, device=device), torch.randint(0, 10, (batch_size,), device=device))

    def train_step(model, optimizers, batch):
        x, y = batch
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        return loss

    return model, optimizers, batch, train_step
