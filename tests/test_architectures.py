"""Model coverage, the fast version: real `transformers` architectures, tiny configs.

The full table (small configs, timing) is `python -m benchmarks.architectures`; see
docs/RESULTS.md. Here each model is compiled at budget 0.5 (or, if the planner refuses
0.5, at the smallest peak it says it can reach), trained 3 steps bitwise against eager,
and its measured peak compared with the prediction and the budget.
"""

from __future__ import annotations

import pytest

from tests.support.architectures import run_one

# Kernel scratch the graph does not show (see tests/support/random_models.py).
SLACK = 128 * 1024


@pytest.mark.parametrize("name", ["gpt2", "t5", "lstm", "mixtral", "wav2vec2"])
def test_transformers_architecture_trains_bitwise_within_budget(name: str) -> None:
    row = run_one(name, size="tiny", budget=0.5, steps=3, pairs=0, profile_runs=1)
    assert row.status == "ok", row.error
    assert row.grads_match, row.error
    assert row.predicted_peak_bytes is not None and row.measured_peak_bytes is not None
    assert row.predicted_peak_bytes < row.baseline_peak_bytes, "budget 0.5 should make remat recompute something"
    assert abs(row.measured_peak_bytes - row.predicted_peak_bytes) <= max(0.03 * row.predicted_peak_bytes, SLACK)


def test_debertas_own_loss_trains_bitwise_with_its_labels_selected_by_value() -> None:
    # With problem_type unset, DeBERTa keeps the examples whose label is not negative
    # (`(labels >= 0).nonzero()`): a size from the batch's values, fixed at the example's
    # (ops/known_values.py).
    import torch
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    from tests.support.architectures import run_model

    torch.manual_seed(0)
    config = DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                             max_position_embeddings=32, num_labels=3, attn_implementation="eager")
    model = DebertaV2ForSequenceClassification(config).train()
    assert model.config.problem_type is None
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 64, (2, 16), generator=g), "labels": torch.randint(0, 3, (2,), generator=g)}
    row = run_model("deberta-v2", model, batch, "tiny", budget=0.5, steps=3, pairs=0, profile_runs=1)
    assert row.status == "ok" and row.grads_match, row.error
    assert row.measured_peak_bytes == row.predicted_peak_bytes
