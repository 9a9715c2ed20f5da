"""What tests and benchmarks share: the random-model generator and its check
(random_models), the training-loop idioms (loop_idioms), the `transformers`
architectures (architectures), what each data-parallel rank runs (ddp_workers,
fsdp_workers) and how two ranks are launched and compared (ranks).

Benchmarks import it as `tests.support` and are run from the repository root as
modules: `python -m benchmarks.long_randomized`.
"""
