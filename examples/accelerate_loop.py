"""A plain Accelerate loop with remat: `accelerator.prepare` as usual, then the step
(forward, `accelerator.backward`, `accelerator.clip_grad_norm_`, the optimizer) through
`remat.compile`. To accumulate gradients, give the step the micro-batches of one optimizer
step and loop inside it (no `accelerator.accumulate`): `accelerator.backward` still divides
each loss by `gradient_accumulation_steps`.

    python examples/accelerate_loop.py
"""

import torch
from accelerate import Accelerator
from transformers import BertConfig, BertForSequenceClassification

import remat

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=128, vocab_size=300, num_labels=3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
batches = [{"input_ids": torch.randint(0, 300, (8, 32)), "labels": torch.randint(0, 3, (8,))} for _ in range(6)]
loader = torch.utils.data.DataLoader(batches, batch_size=None)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)


def train_step(model, optimizer, micro_batches):
    optimizer.zero_grad()
    losses = []
    for batch in micro_batches:
        losses.append(model(**batch).loss)
        accelerator.backward(losses[-1])
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return [loss.detach() for loss in losses]


micro_batches = list(loader)
pairs = [micro_batches[i : i + 2] for i in range(0, len(micro_batches), 2)]
step = remat.compile(train_step, model, optimizer, pairs[0], memory_budget=0.6)
for pair in pairs:
    losses = step(pair)
    scheduler.step()
    accelerator.print("loss", sum(loss.item() for loss in losses) / len(losses))
print(f"peak predicted {step.report.predicted_peak_bytes:,} B, measured {step.report.measured_peak_bytes:,} B")
