"""Shared test set-up."""

import os

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


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
