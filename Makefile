# The README's two commands: `make demo` and `make test`. Both set up .venv first.
# constraints.txt pins torch==2.13.0 so pip takes this machine's local CPU wheel
# instead of the registry's newest build with its GBs of CUDA packages.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test clean distclean

demo: $(STAMP)
	$(VENV)/bin/remat demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=15 tests

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
