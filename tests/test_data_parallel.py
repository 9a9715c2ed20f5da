"""Data-parallel training: a DDP-wrapped model through remat on 2 gloo processes (127.0.0.1).

Each test spawns two ranks once (tests/support/ranks.two_ranks, with a process-group timeout and
an overall deadline, so a hang fails the test instead of CI); tests/support/ddp_workers.py holds what
each rank runs."""

from __future__ import annotations

from tests.support import ddp_workers
from tests.support.ranks import two_ranks


# (id, model, optimizer, budget, micro-batches, DDP's bucket_cap_mb)
CASES = [
    # A foreach AdamW's update buckets inside DDP's small gradient buckets.
    ("bert-tiny-foreach-small-ddp-buckets", "bert-tiny", "adamw-foreach", 0.5, 1, 0.02),
    ("resnet-tiny-sgd", "resnet-tiny", "sgd", 0.5, 1, None),
    ("bert-tiny-no_sync-accumulation", "bert-tiny", "sgd", 0.65, 2, None),
    ("bert-tiny-two-optimizers", "bert-tiny", "sgd+adamw", 0.5, 1, None),
]


def test_bitwise_equal_to_eager_ddp_on_every_rank():
    calls = [("train_like_eager", (model, optimizer, budget, 3, micro_batches, 4, cap)) for _, model, optimizer, budget, micro_batches, cap in CASES]
    per_rank = two_ranks(ddp_workers.several, calls)
    for case, results in zip(CASES, zip(*per_rank)):
        _check_ddp_case(case, list(results))


def _check_ddp_case(case: tuple, results: list[dict]) -> None:
    name, model, _, _, _, bucket_cap_mb = case
    for rank, r in enumerate(results):
        assert r["num_recomputed"] > 0, (name, rank, r)  # the budget makes it recompute
        # Gradients are all-reduced in DDP's buckets: fewer all-reduces than gradients, more with
        # smaller buckets; ResNet-tiny at 0.5 fits only with each gradient on its own.
        if model == "resnet-tiny":
            assert r["collectives"] == r["gradients"], (name, rank, r)
        else:
            assert 0 < r["collectives"] < r["gradients"], (name, rank, r)
        if bucket_cap_mb is not None:
            assert r["collectives"] >= 4, (name, rank, r)
        assert r["losses_equal"] and r["state_equal"] and r["state_tensors"] > 0, (name, rank, r)
        # One graph on every rank: the same prediction, and the measured peak is the
        # prediction (every thread's frees counted: remat.profile.allocator), give or take
        # a collective's buffers (up to two gradients' bytes) that gloo's worker let go of
        # after the caller had moved on.
        assert r["predicted_peak_bytes"] == results[0]["predicted_peak_bytes"], name
        slack = 0.01 * r["predicted_peak_bytes"] + 2 * r["largest_gradient_bytes"]
        assert abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= slack, (name, rank, r)
    # Parameters and optimizer state are the same on both ranks (buffers are each rank's
    # own after its last forward, as in eager DDP), and so is the order of the collectives.
    assert results[0]["digest"] == results[1]["digest"], name
    assert results[0]["collective_order"] == results[1]["collective_order"], name
    # Updates that move into the backward pass go right after their gradient's all-reduce is
    # waited for (a bucket of one), or the view of the bucket's result that is the gradient.
    # With DDP's default buckets bert-tiny's gradients are one bucket, reduced at the end.
    follow = results[0]["moved_updates_follow"]
    assert all("wait_tensor" in target or "aten.view" in target for target in follow.values()), (name, follow)
    if bucket_cap_mb is not None:
        assert follow, (name, results[0])


def test_a_rank_that_fails_stops_every_rank_with_its_error():
    own, other = two_ranks(ddp_workers.failing_capture)[::-1]
    assert "rank one's step breaks" in own and "rank 1 failed capturing the step" in own, own
    assert other.startswith("RankFailed: rank 1 failed capturing the step") and "rank one's step breaks" in other, other


def test_ranks_with_different_batches_stop_together_and_can_go_on():
    for rank, (raised, after) in enumerate(two_ranks(ddp_workers.diverging_batch)):
        assert raised.startswith("RankFailed: the ranks differ in the batch's shapes"), (rank, raised)
        assert after == "ran after"


def test_refused_settings_unused_parameters_buffer_options_and_gradient_hooks():
    """Four small cases in one spawn: settings the graph cannot honour are refused (a frozen
    parameter's gradient, not read across ranks, named in a warning); unused parameters with
    find_unused_parameters keep no gradient; options that only change DDP's buffers train
    the same; hooks on the parameters' gradients run as in eager DDP."""
    calls = [("refusals", ()), ("unused_found", ()), ("options_like_eager", ()), ("hooks_like_eager", ())]
    for refused, unused, options, hooks in two_ranks(ddp_workers.several, calls):
        assert "communication hook" in refused["comm_hook"]
        assert "find_unused_parameters=True" in refused["unused"]
        assert "no_sync()" in refused["no_sync_outside"]
        assert "1 parameters that require no gradient hold one" in refused["frozen_gradient"] and "across ranks" in refused["frozen_gradient"], refused
        assert "gradient accumulation across calls" in refused["across_calls"] and "loop over them inside" in refused["across_calls"]
        assert unused["state_equal"] and unused["unused_grad"], unused
        assert options == {"static_graph": True, "gradient_as_bucket_view": True}, options
        assert hooks["state_equal"], hooks


def test_a_teacher_and_an_ema_outside_a_ddp_model_train_bitwise_on_every_rank():
    results = two_ranks(ddp_workers.distill_like_eager, 0.5, 3)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["state_equal"] and r["ema_equal"], (rank, r)
        assert r["outside_inputs"] > 0 and r["num_recomputed"] > 0, (rank, r)
    assert results[0]["ema_digest"] == results[1]["ema_digest"]  # the averaged gradients: the same weights, the same EMA
