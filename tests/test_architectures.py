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
