"""Gradient accumulation across calls, as nanoGPT's loop does it: the compiled step runs one
micro-batch's forward and backward, and the loop steps the optimizer every ACCUMULATE
calls. Each call adds its gradients to those it finds set, as eager's backward does; remat
keeps one graph for a call that finds none (the first of each round, after zero_grad())
and one for a call that finds them set (which it takes as inputs, in place).

    python examples/gradient_accumulation.py
"""

import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat

ACCUMULATE = 4
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
data = torch.randint(0, 256, (4096,))


def get_batch(batch_size=8, length=64):
    starts = torch.randint(0, len(data) - length - 1, (batch_size,))
    x = torch.stack([data[s : s + length + 1] for s in starts])
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def micro_step(model, optimizer, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    (loss / ACCUMULATE).backward()  # adds to the gradients the last micro-step left
    return loss.detach()


step = remat.compile(micro_step, model, optimizer, get_batch(), memory_budget=0.5)
for it in range(3):
    for group in optimizer.param_groups:  # a cosine schedule, set by hand
        group["lr"] = 6e-4 * 0.5 * (1 + math.cos(math.pi * it / 3))
    losses = [step(get_batch()).item() for _ in range(ACCUMULATE)]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iteration {it}: loss {sum(losses) / ACCUMULATE:.4f}, grad norm {norm:.3f}")
print(f"{step.report.num_recomputed} activations recomputed in the graph that adds to set gradients")
print(f"peak predicted {step.report.predicted_peak_bytes:,} B, measured {step.report.measured_peak_bytes:,} B")
