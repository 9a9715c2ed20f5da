"""RematTrainer against a plain Hugging Face Trainer with the same arguments: every
logged loss, gradient norm and learning rate, the final parameters and optimizer state
bitwise equal, with gradient accumulation (an epoch's last step with fewer micro-batches),
warm-up, clipping, evaluation between steps, Trainer's default optimizer (fused AdamW),
dropout, a checkpoint and a resumed run; batches collated into a BatchEncoding, as
DataCollatorWithPadding (Trainer's default collator with a tokenizer) makes them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

from remat.errors import RematError
from remat.integrations.transformers import RematTrainer, RematTrainerMixin

_CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)


def _data(n: int = 40, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _encoded(rows: list[dict[str, torch.Tensor]]) -> BatchEncoding:
    return BatchEncoding(default_data_collator(rows))


def _train(cls: type, out, max_steps: int = 6, resume: str | None = None, **kwargs):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_CONFIG)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=max_steps,
        gradient_accumulation_steps=2, warmup_steps=2, max_grad_norm=1.0, learning_rate=1e-3, logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    trainer = cls(model=model, args=args, train_dataset=_data(), eval_dataset=_data(16), data_collator=_encoded, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    kept = ("loss", "grad_norm", "learning_rate", "eval_loss")
    logs = [{k: v for k, v in e.items() if k in kept} for e in trainer.state.log_history if any(k in e for k in kept)]
    opt = trainer.optimizer.optimizer
    state = [t for st in opt.state.values() for t in st.values()]
    return trainer, logs, [p.detach().clone() for p in model.parameters()], state


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _train(Trainer, tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="module")
def remat_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("remat")
    return out, _train(RematTrainer, out, memory_budget=0.5)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_trains_bitwise_like_trainer(eager, remat_run):
    _, (trainer, logs, params, state) = remat_run
    _, eager_logs, eager_params, eager_state = eager
    assert trainer.optimizer.optimizer.param_groups[0]["fused"]  # Trainer's default: fused AdamW
    assert sum("loss" in e for e in logs) == 6 and sum("eval_loss" in e for e in logs) == 3
    assert logs == eager_logs  # loss, grad_norm and learning_rate at every step, eval_loss between
    assert _same(params, eager_params) and _same(state, eager_state)


def test_compiles_once_per_step_shape_and_saves_memory(remat_run):
    _, (trainer, *_rest) = remat_run
    # 40 rows, 5 batches of 8, 2 micro-batches a step: steps of 2, 2 and 1 micro-batches.
    assert sorted(trainer._remat_steps) == [1, 2]
    assert all(len(step._graphs) == 1 for step in trainer._remat_steps.values())
    report = trainer._remat_steps[2].report
    assert report.num_recomputed > 0
    assert report.measured_peak_bytes == report.predicted_peak_bytes < report.baseline_peak_bytes


def test_resumes_from_a_checkpoint_bitwise(eager, remat_run):
    out, _ = remat_run
    _, _, resumed_params, resumed_state = _train(RematTrainer, out, resume=str(out / "checkpoint-3"), memory_budget=0.5)
    _, _, eager_params, eager_state = eager
    assert _same(resumed_params, eager_params) and _same(resumed_state, eager_state)


class _WeightedLoss(Trainer):
    """A user's trainer that changes compute_loss, as TRL's trainers do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, inputs["labels"][:, 1:].reshape(-1)) * 0.5
        return (loss, outputs) if return_outputs else loss


class _RematWeightedLoss(RematTrainerMixin, _WeightedLoss):
    pass


def test_mixin_keeps_the_users_compute_loss(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="remat.integrations.transformers"):
        trainer, logs, params, _ = _train(_RematWeightedLoss, tmp_path / "r", max_steps=3, memory_budget=0.5)
    _, eager_logs, eager_params, _ = _train(_WeightedLoss, tmp_path / "e", max_steps=3)
    assert logs == eager_logs and _same(params, eager_params)
    reports = [r for r in caplog.records if r.getMessage().startswith("remat: peak predicted")]
    assert len(reports) == 1  # logged once, not at every step
    logged = [e for e in trainer.state.log_history if "remat_measured_peak_mib" in e]
    assert len(logged) == 1 and logged[0]["remat_measured_peak_mib"] == logged[0]["remat_predicted_peak_mib"]


def test_a_setting_it_cannot_honour_is_refused_at_construction(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, use_cpu=True, report_to=[])
    with pytest.raises(RematError, match="torch_compile=True: remat compiles the step itself"):
        RematTrainer(model=GPT2LMHeadModel(_CONFIG), args=args, train_dataset=_data(8))


def test_training_step_outside_the_loop_is_refused(remat_run):
    _, (trainer, *_rest) = remat_run
    batch = {k: v.unsqueeze(0) for k, v in _data(1)[0].items()}
    with pytest.raises(RematError, match="trainer.train"):
        trainer.training_step(trainer.model, batch)


def test_under_ddp_with_accumulation_it_trains_like_trainer():
    """torchrun, 2 gloo ranks: Trainer wraps the model in DDP and syncs gradients in each
    optimizer step's last micro-batch; RematTrainer's graph does the same, bitwise."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tests.support.trainer_ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "DONE rank 0" in done.stderr and "DONE rank 1" in done.stderr  # both ranks trained to the end
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["remat"]["wrapped"] == "DistributedDataParallel"
    assert len(result["remat"]["logs"]) == 3
    assert result["remat"] == result["trainer"]
