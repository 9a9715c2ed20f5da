"""fp16 mixed precision with torch.amp.GradScaler through remat: the scaler's overflow
check, skipped update and scale update are all in the graph, so a step whose gradients
overflow is skipped exactly as in eager. A fused optimizer (`fused=True`) skips the update
in its kernel; an unfused one, as here, runs it with its writes masked where the check
found an inf. (On a GPU use "cuda" for the scaler and autocast.)

    python examples/fp16_grad_scaler.py
"""

import torch

import remat

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)  # skipped when a gradient is inf or nan
    scaler.update()  # the scale backs off after an overflow, grows after growth_interval good steps
    return loss.detach()


batches = [{"x": torch.randn(1024, 256) * (1e5 if i == 2 else 1.0), "y": torch.randint(0, 10, (1024,))} for i in range(6)]
step = remat.compile(train_step, model, optimizer, batches[0], memory_budget=0.8)
for i, batch in enumerate(batches):
    loss = step(batch)
    print(f"step {i}: loss {loss.item():.4f}, scale {scaler.get_scale():.0f}")  # step 2 overflows: its update is skipped
print(f"peak predicted {step.report.predicted_peak_bytes:,} B, measured {step.report.measured_peak_bytes:,} B")
