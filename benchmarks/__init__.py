"""Benchmarks: each a script that writes its figures (and plots) to files. Those that
share the tests' models and idioms (tests/support) run from the repository root as
modules: `python -m benchmarks.long_randomized`, `-m benchmarks.training_loops`,
`-m benchmarks.architectures`."""
