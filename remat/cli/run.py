"""`remat run`: train with the rewritten graph, check it against eager, measure it.

Everything is measured in one process: eager and remat each train their own identical
copy of the model, their peaks come from the same allocator tracker, and their times are
taken alternately (DESIGN.md, "Measuring time").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from remat.budget import GiB
from remat.defaults import DEFAULT_PLANNER


def configure_run(p: argparse.ArgumentParser) -> None:
    from remat.cli.common import add_model_arguments

    add_model_arguments(p, 'fraction of the activation peak (e.g. 0.5), an absolute cap ("6GiB", bytes), or "none" for no recomputation')
    p.add_argument("--steps", type=int, default=3, metavar="N", help="training steps to run after the measurements (default: 3)")
    p.add_argument("--pairs", type=int, default=5, metavar="K", help="alternating eager/remat timing pairs (default: 5)")
    p.add_argument(
        "--check",
        action="store_true",
        help="first compare 3 steps bitwise against eager PyTorch; with --backend inductor, one step within a stated tolerance "
        "(eager and a float64 copy), then the losses of 20 more",
    )
    p.add_argument(
        "--backend",
        choices=("eager", "inductor"),
        default="eager",
        help="eager: the plan runs op by op, bitwise like eager PyTorch (default); inductor: the plan's regions compiled by "
        "Inductor (fused kernels, the plan's order kept; not bitwise)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="with --device cuda: after its first call, replay the step as one CUDA graph (static shapes; random ops "
        "not recomputed; bitwise like the graph it replays)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms): some kernels (atomic adds on a GPU, "
        "accumulating index_put on a CPU) differ from run to run, so eager differs from itself and --check "
        "cannot compare bitwise without it (--check says so when it finds eager differing from itself)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="clear gradients before the forward pass instead of after the update, so that each step leaves its "
        "gradients set and --check compares them too (they then live to the end of the step)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="data parallel: N processes on this machine (gloo on 127.0.0.1), the model wrapped in DistributedDataParallel; "
        "--batch-size is per process. Measures each rank against eager DDP and DDP with HF's checkpointing (CPU only)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc: shard the model with FSDP2 (fully_shard on each block and the root) instead of DDP, and "
        "measure each rank against eager FSDP2 and FSDP2 with HF's checkpointing",
    )
    p.add_argument(
        "--fsdp-precision",
        choices=("bf16", "fp16"),
        default=None,
        help="with --fsdp: every module under a MixedPrecisionPolicy, its parameters gathered in this dtype and its "
        "gradients reduced in float32 (torchtitan's default with bf16), in eager FSDP2 and remat alike",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; progress goes to stderr")


def _budget_arg(text: str) -> Any:
    return None if text.strip().lower() == "none" else text


def _use_deterministic_algorithms() -> None:
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts; required by the flag
    torch.use_deterministic_algorithms(True)


def _check(
    train_step: Any, eager_model: Any, eager_opt: Any, spec: Any, step: Any, seed: int, say: Any, fresh: Any, backend: str
) -> tuple[bool, list[str], bool, Any]:
    """--check: 3 steps against eager, bitwise; where they differ, whether eager differs from
    itself (a nondeterministic kernel), said if so. A compiled backend: within a tolerance of
    eager and a float64 reference. (match, mismatches, eager differs from itself, the tolerance result)"""
    import torch

    from remat.measurement.check import check_against_eager, eager_differs_from_itself
    from remat.measurement.tolerance import check_within_tolerance

    if backend != "eager":
        say("checking a step against eager PyTorch and a float64 reference, then 20 steps' losses ...")
        tolerance = check_within_tolerance(train_step, eager_model, eager_opt, spec.model, spec.optimizer, step, spec.batch, seed=seed, loss_steps=20)
        say(tolerance.summary())
        return tolerance.within, tolerance.failures, False, tolerance

    say("checking 3 steps against eager PyTorch ...")
    result = check_against_eager(train_step, eager_model, eager_opt, spec.model, spec.optimizer, step, spec.batch, steps=3, seed=seed)
    say(result.summary())
    itself: list[str] = []
    if not result.match and not torch.are_deterministic_algorithms_enabled():
        again = fresh()
        itself = eager_differs_from_itself(train_step, again.model, again.optimizer, again.batch, seed)
    if itself:
        say(
            f"eager PyTorch differs from itself on this model ({len(itself)} mismatches between two eager steps "
            f"from the same state; first: {itself[0]}): a kernel is nondeterministic, so no comparison can be "
            "bitwise. Compare with --deterministic."
        )
    return result.match, result.mismatches, bool(itself), None


def run_one(
    model: str, batch_size: int, budget: Any,
    *,
    planner: str = DEFAULT_PLANNER, optimizer: str = "sgd", steps: int = 3, pairs: int = 5, check: bool = False,
    device: str = "cpu", seed: int = 0, progress: bool = True, deterministic: bool = False, keep_grads: bool = False,
    lean_ops: bool = True, backend: str = "eager", cuda_graph: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Compile, optionally check, measure and time one configuration; the `--json` object."""
    import torch
    import torch.utils._pytree as pytree

    if deterministic:
        _use_deterministic_algorithms()

    import remat
    from remat.cli.common import UsageError, _positive, load_workload
    from remat.measurement.call_time import measure_call_time
    from remat.measurement.check import time_alternating, twin
    from remat.profile.allocator import measure_step_peak
    from remat.capture.step_inputs import flat_inputs, run_captured

    _positive(pairs, "--pairs")
    if steps < 0:
        raise UsageError(f"--steps must be 0 or more, got {steps}")

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    # The usual loop clears gradients after the update; kept, --check compares them too.
    spec = load_workload(model, batch_size, optimizer, device, seed, zero_grad_first=keep_grads)
    opt, train_step = spec.optimizer, spec.train_step
    eager_model, eager_opt = twin(spec.model, opt)

    t0 = time.perf_counter()
    say(f"compiling {model} (batch {batch_size}, budget {budget}, planner {planner}, backend {backend}) ...")
    step = remat.compile(
        train_step, spec.model, opt, spec.batch, memory_budget=budget, planner=planner, progress=progress, lean_ops=lean_ops,
        backend=backend, cuda_graph=cuda_graph,
    )  # fmt: skip
    report = step.report
    say(
        f"compiled in {time.perf_counter() - t0:.1f} s: {report.num_recomputed} activations recomputed, "
        f"predicted peak {report.predicted_peak_bytes / GiB:.3f} GiB (no recomputation: {report.baseline_peak_bytes / GiB:.3f} GiB)"
    )

    grads_match, mismatches, eager_nondeterministic, tolerance = None, [], False, None
    if check:
        fresh = lambda: load_workload(model, batch_size, optimizer, device, seed, zero_grad_first=keep_grads)  # noqa: E731
        grads_match, mismatches, eager_nondeterministic, tolerance = _check(train_step, eager_model, eager_opt, spec, step, seed, say, fresh, backend)
    else:
        step(spec.batch)  # the first step of a shape measures its peak
        train_step(eager_model, eager_opt, spec.batch)

    persistent = report.persistent_bytes
    for p in spec.model.parameters():  # not held through the measurements below (remat's step drops them too)
        p.grad = None
    eager_measured = measure_step_peak(lambda: train_step(eager_model, eager_opt, spec.batch), device, eager_model)
    eager_peak = persistent + eager_measured.peak_bytes
    # The captured graph without recomputation, run on the eager copy: the baseline remat starts from.
    tg = step.compiled_for(spec.batch).tg
    base_inputs = flat_inputs(tg, eager_model, eager_opt, spec.batch)
    baseline_measured = persistent + measure_step_peak(lambda: run_captured(tg, tg.gm, eager_model, base_inputs), device, eager_model).peak_bytes

    say(f"timing eager vs remat, {pairs} alternating pairs ...")
    timing = time_alternating(lambda: train_step(eager_model, eager_opt, spec.batch), lambda: step(spec.batch), pairs=pairs, device=device)
    call_time, losses = measure_call_time(step, spec.batch, steps=3), []  # three more steps, the graph timed apart
    for i in range(steps):
        losses.append(float(pytree.tree_leaves(step(spec.batch))[0]))  # the loss: first of what train_step returns
        say(f"step {i + 1}/{steps}: loss {losses[-1]:.6f}")

    plan, base_iter = report.plan, report.profile.iteration_seconds
    predicted_overhead = plan.predicted_overhead_seconds if plan else 0.0
    return {
        "model": model,
        "batch_size": batch_size,
        "optimizer": optimizer,
        "device": device,
        "planner": planner if plan else None,
        "budget": budget,
        "budget_bytes": report.budget_bytes,
        "persistent_bytes": persistent,
        "eager_peak_bytes": eager_peak,
        "baseline_peak_bytes": baseline_measured,
        "baseline_peak_bytes_predicted": report.baseline_peak_bytes,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "peak_bytes_measured": report.measured_peak_bytes,
        "eager_reserved_peak_bytes": None if eager_measured.reserved_peak_bytes is None else persistent + eager_measured.reserved_peak_bytes,
        "reserved_peak_bytes_measured": report.measured_reserved_peak_bytes,
        "eager_activation_peak_bytes": eager_peak - persistent,
        "activation_peak_bytes_measured": (report.measured_peak_bytes or 0) - persistent,
        "eager_iteration_seconds": timing.a_seconds,
        "iteration_seconds": timing.b_seconds,
        "overhead_ratio": timing.ratio,
        "overhead_ratio_spread": list(timing.ratio_spread),
        "timing_pairs": timing.pairs,
        **call_time.fields(timing.b_seconds),
        "predicted_overhead_ratio": (base_iter + predicted_overhead) / base_iter if base_iter else None,
        "predicted_overhead_seconds": predicted_overhead,
        # The time model's step: the graph's ops on the host and device timelines, plus the
        # host's own work around the graph as measured (call_host_seconds).
        "predicted_graph_seconds": report.predicted_time.seconds if report.predicted_time else None,
        "predicted_iteration_seconds": report.predicted_time.seconds + call_time.host_seconds if report.predicted_time else None,
        "time_model": report.predicted_time.to_dict() if report.predicted_time else None,
        "num_recomputed": report.num_recomputed,
        "recompute_ops": report.copies,
        "updates_in_backward": bool(plan and plan.updates_in_backward), "updates_note": plan.updates_note if plan else "",
        "lean_ops": list(plan.lean_ops) if plan else [], "lean_ops_note": plan.meta.get("lean_ops_note", "") if plan else "",
        "grads_match": grads_match,
        "backend": backend, "regions": report.regions, "region_splits": report.region_splits, "regions_slower": report.regions_slower,
        **{k: v for k, v in report.to_dict().items() if k.startswith("cuda_graph")},
        "tolerance": None if tolerance is None else tolerance.to_dict(),
        "mismatches": mismatches[:20],
        "eager_nondeterministic": eager_nondeterministic,
        "compile_seconds": report.compile_seconds,
        "deterministic": deterministic,
        "losses": losses,
        "torch": torch.__version__,
    }


def cmd_run(args: argparse.Namespace) -> int:
    from remat.cli.common import UsageError
    from remat.measurement.report import console_for

    if args.nproc != 1 or args.fsdp or args.fsdp_precision:
        if args.backend != "eager":
            raise UsageError("--backend inductor runs one process; with --nproc or --fsdp use the default backend (eager)")
        if args.cuda_graph:
            raise UsageError("--cuda-graph runs one process; with --nproc or --fsdp leave it out")
        return _run_data_parallel(args)
    if args.cuda_graph and not args.device.startswith("cuda"):
        raise UsageError(f"--cuda-graph replays the step on a GPU: use it with --device cuda (got --device {args.device})")
    result = run_one(
        args.model,
        args.batch_size,
        _budget_arg(args.budget),
        planner=args.planner,
        optimizer=args.optimizer,
        steps=args.steps,
        pairs=args.pairs,
        check=args.check,
        device=args.device,
        seed=args.seed,
        deterministic=args.deterministic,
        keep_grads=args.keep_grads,
        lean_ops=not args.no_lean_ops,
        backend=args.backend,
        cuda_graph=args.cuda_graph,
    )
    if args.json:
        print(json.dumps(result))
    else:
        console = console_for(sys.stdout)
        mib = 2**20
        console.print(
            f"{result['model']} batch {result['batch_size']}: peak eager {result['eager_peak_bytes'] / mib:.1f} MiB, "
            f"remat {result['peak_bytes_measured'] / mib:.1f} MiB measured / {result['predicted_peak_bytes'] / mib:.1f} MiB predicted; "
            f"time ratio remat/eager {result['overhead_ratio']:.3f} "
            f"(spread {result['overhead_ratio_spread'][0]:.3f}-{result['overhead_ratio_spread'][1]:.3f}); "
            f"{result['num_recomputed']} activations recomputed"
            + (f"; step {result['back_to_back_seconds'] * 1e3:.1f} ms measured (steps one after another) / {result['predicted_iteration_seconds'] * 1e3:.1f} ms predicted"
               if result["predicted_iteration_seconds"] else "")
            + ("; optimizer updates in the backward pass" if result["updates_in_backward"] else "")
            + (f"; {len(result['lean_ops'])} backward ops write into a dying input" if result["lean_ops"] else "")
            + ("" if result["grads_match"] is None or result["tolerance"] else f"; bitwise equal to eager: {result['grads_match']}")
            + (f"; {result['regions']} regions compiled by Inductor" if result["backend"] == "inductor" else "")
            + (f" ({result['regions_slower']} more ran slower compiled: op by op)" if result.get("regions_slower") else "")
            + ("" if not result["tolerance"] else f"; within tolerance of eager: {result['grads_match']} "
               f"(largest difference {result['tolerance']['largest_difference']:.3g})")
        )
    return 0 if result["grads_match"] is not False else 1


def _run_data_parallel(args: argparse.Namespace) -> int:
    """`remat run --nproc N`: every rank's measurements (remat.measurement.data_parallel)."""
    from remat.cli.common import UsageError, check_model_args
    from remat.launch import run_ranks
    from remat.measurement.data_parallel import RankConfig, measure_rank
    from remat.measurement.report import console_for

    if args.fsdp_precision and not args.fsdp:
        raise UsageError("--fsdp-precision sets FSDP2's MixedPrecisionPolicy; add --fsdp (under DDP use torch.autocast in the step)")
    if args.nproc < 2:
        raise UsageError(f"--nproc must be 2 or more for data parallel{' (--fsdp shards across them)' if args.fsdp else ''} (1: one process, the default), got {args.nproc}")
    if args.device != "cpu":
        raise UsageError("--nproc runs gloo processes on the CPU; on GPUs launch your own script with torchrun (one GPU per rank)")
    check_model_args(args.model, args.batch_size, args.optimizer, args.device)
    config = RankConfig(
        model=args.model, batch_size=args.batch_size, budget=_budget_arg(args.budget), planner=args.planner, optimizer=args.optimizer,
        steps=args.steps, pairs=args.pairs, check=args.check, seed=args.seed, lean_ops=not args.no_lean_ops, baselines=("hf",),
        fsdp=args.fsdp, fsdp_precision=args.fsdp_precision,
    )  # fmt: skip
    print(f"running {args.model} on {args.nproc} processes (batch {args.batch_size} each) ...", file=sys.stderr, flush=True)
    results = run_ranks(measure_rank, args.nproc, (config,), timeout_s=3600, pg_timeout_s=600)
    if args.json:
        print(json.dumps({"nproc": args.nproc, "ranks": results}))
    else:
        console = console_for(sys.stdout)
        mib = 2**20
        for r in results:
            hf, wrapper = "", r["wrapper"] + (f" ({r['fsdp_precision']} gathers)" if r.get("fsdp_precision") else "")
            if "hf_activation_peak_bytes" in r:
                hf = f"; {wrapper}+HF {r['hf_activation_peak_bytes'] / mib:.1f} MiB at {r['hf_overhead_ratio']:.3f}x"
            console.print(
                f"rank {r['rank']}: activation peak eager {wrapper} {r['eager_activation_peak_bytes'] / mib:.1f} MiB, remat "
                f"{r['activation_peak_bytes_measured'] / mib:.1f} MiB measured / {r['predicted_activation_peak_bytes'] / mib:.1f} MiB "
                f"predicted at {r['overhead_ratio']:.3f}x eager {wrapper}'s time{hf}; {r['num_recomputed']} recomputed, "
                f"{r['collectives']} collectives in the graph"
                + ("" if r["grads_match"] is None else f"; bitwise equal to eager {wrapper}: {r['grads_match']}")
            )
    return 0 if all(r["grads_match"] is not False for r in results) else 1
