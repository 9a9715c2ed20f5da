"""FSDP2 (`fully_shard`): a sharded model through remat on 2 gloo processes (127.0.0.1).

Each test spawns two ranks (tests/support/ranks.two_ranks, with a process-group timeout and
an overall deadline, so a hang fails the test instead of CI); tests/support/fsdp_workers.py
holds what each rank runs."""

from __future__ import annotations

from tests.support import fsdp_workers
from tests.support.ranks import two_ranks


def test_bitwise_equal_to_eager_fsdp2_on_every_rank():
    # AdamW at 0.6, the gradients clipped (clip_grad_norm_ to 0.05, which clips; its norm
    # returned beside the loss, compared too).
    _check_like_eager(two_ranks(fsdp_workers.train_like_eager, "bert-tiny", "adamw", 0.6, 3, 1, False, 0.05), 0.6, 1, uneven=False)


def test_uneven_shards_train_bitwise_equal_to_eager_fsdp2():
    # A GPT-2 whose vocabulary 2 ranks do not divide (SGD, two micro-batches, from the state
    # FSDP2 made, copied into padded shards once), then an MLP whose 1-row layer leaves
    # rank 1 no rows (nothing to recompute in it: the shards alone). One process group.
    gpt2, mlp = zip(*two_ranks(fsdp_workers.uneven_cases))
    _check_like_eager(gpt2, 0.6, 2, uneven=True)
    _check_like_eager(mlp, 1.0, 1, uneven=True)


def test_mixed_precision_policies_train_bitwise_equal_to_eager_fsdp2():
    # FSDP2's casts are in the graph: each module's shards cast before their all-gather, its
    # floating inputs cast, its gradients cast to the reduce dtype before the reduce-scatter
    # (divided before and after it in float16, as FSDP2 divides) and back to the shards' dtype.
    titan, half = zip(*two_ranks(fsdp_workers.mixed_precision_cases))
    _check_like_eager(titan, 0.6, 1, uneven=False)
    _check_like_eager(half, 0.8, 2, uneven=False)
    for r in titan:
        assert (r["gathered_dtypes"], r["reduced_dtypes"], r["loss_dtype"]) == (["torch.bfloat16"], ["torch.float32"], "torch.bfloat16"), r
    for r in half:
        assert (r["gathered_dtypes"], r["reduced_dtypes"], r["loss_dtype"]) == (["torch.float16"], ["torch.float16"], "torch.float16"), r


def _check_like_eager(results, budget, micro_batches, uneven):
    for rank, r in enumerate(results):
        assert (r["uneven_params"] > 0) == uneven, (rank, r)
        # Loss at every step, full parameters and optimizer state after the last, bitwise;
        # the model and optimizer left as FSDP2 keeps them (DTensors), and FSDP2 trains on.
        assert r["losses_equal"] and r["state_equal"] and r["state_tensors"] > r["sharded_params"], (rank, r)
        assert r["still_dtensors"] and r["state_dtensors"] and r["eager_after_equal"], (rank, r)
        # The collectives are in the graph, one of each per sharded module as FSDP2 issues
        # them: its parameters gathered in each forward pass (some gathered again before their
        # backward reader: FSDP2's reshard-after-forward, chosen by the planner), their
        # gradients reduce-scattered in each backward pass.
        assert (r["num_recomputed"] > 0 and r["gathered_again"] > 0) == (budget < 1), (rank, r)
        assert r["gathers"] == r["sharded_modules"] * micro_batches + r["gathered_again"], (rank, r)
        assert r["reduce_scatters"] == r["sharded_modules"] * micro_batches, (rank, r)
        # One plan on every rank, within the budget, and the allocator's measured peak is
        # the prediction, gloo's buffers included (the measurement counts the frees of its
        # worker threads too: remat.profile.allocator). Mostly to the byte; but a worker
        # sometimes lets a finished collective's buffers go only after the caller has moved
        # on (seen: +196 KiB on one rank of bert-tiny; +28 KiB, a reduce-scatter's input and
        # output, on the small MLP), so twice one module's bytes of slack.
        assert r["predicted_peak_bytes"] == results[0]["predicted_peak_bytes"] <= r["budget_bytes"]
        slack = 0.01 * r["predicted_peak_bytes"] + 2 * r["largest_module_bytes"]
        assert abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= slack, (rank, r)
    assert results[0]["digest"] == results[1]["digest"]  # the ranks agree


def test_a_rank_that_fails_stops_every_rank_with_its_error():
    own, other = two_ranks(fsdp_workers.failing_capture)[::-1]
    assert "rank one's step breaks" in own and "rank 1 failed capturing the step" in own, own
    assert other.startswith("RankFailed: rank 1 failed capturing the step") and "rank one's step breaks" in other, other


def test_what_the_graph_would_not_reproduce_is_refused_by_name():
    for out in two_ranks(fsdp_workers.refusals):
        assert "make the optimizer after fully_shard(model)" in out["optimizer_first"], out
        assert "1.0-norm of sharded gradients" in out["one_norm"] and "use norm_type=2" in out["one_norm"], out
        assert "reads the gradient of" in out["gradient_sum"] and "aten.sum" in out["gradient_sum"], out
        assert "together with other tensors" in out["mixed_norms"], out
        assert "shards unevenly" in out["uneven_clip"] and "pad_to_multiple_of" in out["uneven_clip"], out
        assert "outside its module's forward" in out["penalty"], out
        assert "Adafactor" in out["adafactor"], out
        assert "CPUOffloadPolicy" in out["cpu_offload"] and "remove it" in out["cpu_offload"], out
        assert "set_requires_gradient_sync(False)" in out["sync_off"] and "inside train_step" in out["sync_off"], out


def test_remat_run_fsdp_measures_each_rank_under_a_precision_policy(capsys):
    # `remat run --fsdp --fsdp-precision bf16`: eager FSDP2 and remat sharded under the same
    # policy (bfloat16 gathers, float32 reductions), AdamW (whose copy for eager FSDP2 is made
    # from the settings its constructor takes), checked bitwise and measured on each rank.
    import json

    from remat.cli import main

    args = ["run", "--model", "bert-tiny", "--batch-size", "4", "--budget", "0.7", "--nproc", "2", "--fsdp"]
    rc = main([*args, "--fsdp-precision", "bf16", "--optimizer", "adamw", "--check", "--pairs", "1", "--steps", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for r in out["ranks"]:
        assert (r["wrapper"], r["fsdp_precision"], r["grads_match"]) == ("FSDP2", "bf16", True), r
        assert r["num_recomputed"] > 0 and r["predicted_peak_bytes"] <= r["budget_bytes"], r
        # Near the prediction: gloo's worker threads may free a finished collective's buffers
        # late (the slack _check_like_eager allows; seen: +100 KB on one rank here).
        assert abs(r["peak_bytes_measured"] - r["predicted_peak_bytes"]) <= 0.1 * r["predicted_peak_bytes"], r
    assert main(["run", "--model", "bert-tiny", "--batch-size", "4", "--budget", "0.7", "--fsdp-precision", "bf16"]) == 2
    assert "--fsdp-precision sets FSDP2's MixedPrecisionPolicy; add --fsdp" in capsys.readouterr().err
