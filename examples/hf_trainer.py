"""Hugging Face Trainer with remat: `RematTrainer` takes `memory_budget=` and otherwise
Trainer's own arguments. Each optimizer step (its micro-batches, clipping and the
optimizer's update) runs as one remat graph; logging, evaluation, checkpoints and the
scheduler are Trainer's.

    python examples/hf_trainer.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from remat.integrations.transformers import RematTrainer

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
rows = [torch.randint(0, 256, (64,)) for _ in range(48)]
train_dataset = [{"input_ids": r, "labels": r} for r in rows]  # any Dataset of dicts works

args = TrainingArguments(
    output_dir="/tmp/remat-hf-trainer", per_device_train_batch_size=8, gradient_accumulation_steps=2,
    max_steps=3, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
    use_cpu=True, disable_tqdm=True,
)
trainer = RematTrainer(model=model, args=args, train_dataset=train_dataset, memory_budget=0.5)
trainer.train()

report = trainer.remat_report  # the last batch shape's: predicted and measured peak, the plan
print(f"peak predicted {report.predicted_peak_bytes:,} B, measured {report.measured_peak_bytes:,} B, "
      f"without recomputation {report.baseline_peak_bytes:,} B; {report.num_recomputed} activations recomputed")
