"""Shared test set-up."""

import os

import pytest

# Never reach for the Hugging Face hub: every model here is built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# The test files that take longest, longest first (the Makefile turns off xdist's own order,
# by number of tests): started first, they end before the short ones that fill the two
# workers' last minutes, where started last one of them would run on alone.
_LONGEST_FIRST = [
    "test_training_loops.py", "test_data_parallel.py", "test_fsdp.py", "test_runtime.py", "test_examples.py",
    "test_user_state.py", "test_capture.py", "test_read_numbers.py", "test_bench.py", "test_readme_examples.py",
    "test_updates_in_backward.py", "test_integration_transformers.py", "test_randomized.py",
]


# Marked `slow`: the tests that start other processes (two gloo ranks, a script as a user
# runs it, the CLI's runs) or compile with Inductor, a third of the suite's time. `make
# test` runs the rest, in under ten minutes on the 2-core machine; `make test-slow` these;
# CI (.ci/run) both.
_SLOW_FILES = {
    "test_data_parallel.py", "test_fsdp.py", "test_readme_examples.py", "test_examples.py", "test_inductor_regions.py",
    "test_bench.py", "test_frontier.py",
}
_SLOW_TESTS = {
    "test_integration_transformers.py::test_under_ddp_with_accumulation_it_trains_like_trainer",
    "test_value_checks.py::test_checks_hold_under_compiled_regions",
    "test_capture.py::test_torchs_lines_are_not_named_as_the_users_where_its_packages_are_reached_through_a_symlink",
    "test_read_numbers.py::test_a_script_piped_to_python_has_its_loop_count_read_as_a_files_would",
    "test_integration_lightning.py::test_compiling_with_lightning_loaded_loads_its_integration",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts other processes or compiles with Inductor (make test-slow; CI runs it)")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in _SLOW_FILES or f"{item.path.name}::{item.originalname}" in _SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
