"""Data-parallel training: a DDP-wrapped model through remat on 2 gloo processes (127.0.0.1).

Each test spawns two ranks (tests/support/ranks.two_ranks, with a process-group timeout and
an overall deadline, so a hang fails the test instead of CI); tests/support/ddp_workers.py holds what
each rank runs."""

from __future__ import annotations

import pytest

from tests.support import ddp_workers
from tests.support.ranks import two_ranks


@pytest.mark.parametrize(
    "model, optimizer, budget, micro_batches, bucket_cap_mb",
    [("bert-tiny", "adamw", 0.5, 1, 0.02), ("resnet-tiny", "sgd", 0.5, 1, None), ("bert-tiny", "sgd", 0.6, 2, None),
     ("bert-tiny", "sgd+adamw", 0.5, 1, None), ("bert-tiny", "adamw-foreach", 0.5, 1, None)],
    ids=["bert-tiny-adamw-small-ddp-buckets", "resnet-tiny-sgd", "bert-tiny-no_sync-accumulation", "bert-tiny-two-optimizers",
         "bert-tiny-foreach-buckets"],
)  # fmt: skip
def test_bitwise_equal_to_eager_ddp_on_every_rank(model, optimizer, budget, micro_batches, bucket_cap_mb):
    results = two_ranks(ddp_workers.train_like_eager, model, optimizer, budget, 3, micro_batches, 4, bucket_cap_mb)
    for rank, r in enumerate(results):
        assert r["num_recomputed"] > 0, (rank, r)  # the budget makes it recompute
        # Gradients are all-reduced in DDP's buckets: fewer all-reduces than gradients, more with
        # smaller buckets; ResNet-tiny at 0.5 fits only with each gradient on its own.
        if model == "resnet-tiny":
            assert r["collectives"] == r["gradients"], (rank, r)
        else:
            assert 0 < r["collectives"] < r["gradients"], (rank, r)
        if bucket_cap_mb is not None:
            assert r["collectives"] >= 4, (rank, r)
        assert r["losses_equal"] and r["state_equal"] and r["state_tensors"] > 0, (rank, r)
        # One graph on every rank: the same prediction, and the measured peak is the
        # prediction (every thread's frees counted: remat.profile.allocator), give or take
        # a collective's buffers (up to two gradients' bytes) that gloo's worker let go of
        # after the caller had moved on.
        assert r["predicted_peak_bytes"] == results[0]["predicted_peak_bytes"]
        slack = 0.01 * r["predicted_peak_bytes"] + 2 * r["largest_gradient_bytes"]
        assert abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= slack, (rank, r)
    # Parameters and optimizer state are the same on both ranks (buffers are each rank's
    # own after its last forward, as in eager DDP), and so is the order of the collectives.
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["collective_order"] == results[1]["collective_order"]
    # Updates that move into the backward pass go right after their gradient's all-reduce is
    # waited for (a bucket of one), or the view of the bucket's result that is the gradient.
    # With DDP's default buckets bert-tiny's gradients are one bucket, reduced at the end.
    follow = results[0]["moved_updates_follow"]
    assert all("wait_tensor" in target or "aten.view" in target for target in follow.values()), follow
    if bucket_cap_mb is not None:
        assert follow, results[0]


def test_a_rank_that_fails_stops_every_rank_with_its_error():
    own, other = two_ranks(ddp_workers.failing_capture)[::-1]
    assert "rank one's step breaks" in own and "rank 1 failed capturing the step" in own, own
    assert other.startswith("RankFailed: rank 1 failed capturing the step") and "rank one's step breaks" in other, other


def test_ranks_with_different_batches_stop_together_and_can_go_on():
    for rank, (raised, after) in enumerate(two_ranks(ddp_workers.diverging_batch)):
        assert raised.startswith("RankFailed: the ranks differ in the batch's shapes"), (rank, raised)
        assert after == "ran after"


def test_settings_the_graph_cannot_honour_are_refused():
    for out in two_ranks(ddp_workers.refusals):
        assert "communication hook" in out["comm_hook"]
        assert "find_unused_parameters=True" in out["unused"]
        assert "no_sync()" in out["no_sync_outside"]


def test_unused_parameters_with_find_unused_keep_no_gradient():
    for r in two_ranks(ddp_workers.unused_found):
        assert r["state_equal"] and r["unused_grad"]


def test_options_that_only_change_ddps_buffers_train_the_same():
    for r in two_ranks(ddp_workers.options_like_eager):
        assert r == {"static_graph": True, "gradient_as_bucket_view": True}, r


def test_gradient_hooks_on_the_parameters_run_as_in_eager_ddp():
    for r in two_ranks(ddp_workers.hooks_like_eager):
        assert r["state_equal"], r


def test_a_teacher_and_an_ema_outside_a_ddp_model_train_bitwise_on_every_rank():
    results = two_ranks(ddp_workers.distill_like_eager, 0.5, 3)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["state_equal"] and r["ema_equal"], (rank, r)
        assert r["outside_inputs"] > 0 and r["num_recomputed"] > 0, (rank, r)
    assert results[0]["ema_digest"] == results[1]["ema_digest"]  # the averaged gradients: the same weights, the same EMA
