# The README's two commands: `make demo` and `make test`. Both set up .venv first.
# constraints.txt pins torch==2.13.0 so pip takes this machine's local CPU wheel
# instead of the registry's newest build with its GBs of CUDA packages.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all clean distclean

demo: $(STAMP)
	$(VENV)/bin/remat demo

# Two workers, one intra-op thread each: the 2-core CI machine does twice the work of one
# process, without OpenMP threads of two processes spinning against each other. A test
# module runs whole on one worker (--dist loadfile), so its module fixtures are made once;
# the longest files go first (tests/conftest.py), not the ones with most tests.
# `test` leaves out the tests marked slow (other processes, Inductor: tests/conftest.py),
# `test-slow` runs them, `test-all` both; CI runs both (.ci/run).
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

test-all: test test-slow

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Build outputs and caches; keeps .venv (reinstalling torch is slow).
clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Everything `make clean` removes, and the virtual environment too.
distclean: clean
	rm -rf $(VENV)
