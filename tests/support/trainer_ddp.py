"""Run by tests/test_integration_transformers.py under torchrun (2 gloo ranks): a plain
Trainer and a RematTrainer, the same tiny GPT-2 and data, DDP through Accelerate with
gradient accumulation; rank 0 prints one JSON line with what each left (a digest of the
parameters, the logged losses and gradient norms)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from remat.integrations.transformers import RematTrainer


def _train(cls: type, **kwargs) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32))
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (16,), generator=g) for _ in range(48)]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, ddp_backend="gloo",
        disable_tqdm=True, seed=0,
    )
    trainer = cls(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows], **kwargs)
    trainer.train()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "digest": digest,
        "logs": [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e],
    }


if __name__ == "__main__":
    result = {"trainer": _train(Trainer), "remat": _train(RematTrainer, memory_budget=0.7)}
    rank = dist.get_rank()
    if rank == 0:
        print("RESULT " + json.dumps(result))
    # A gloo process group left to the interpreter's exit can abort the process (SIGABRT,
    # "terminate called without an active exception") while its worker threads are torn
    # down; Trainer leaves it open. Close it, say so, and leave without the interpreter's
    # teardown, where a full-suite run still aborted after closing it.
    dist.barrier()
    dist.destroy_process_group()
    print(f"DONE rank {rank}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
