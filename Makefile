# Two commands do all the set-up on a fresh machine:
#   make demo   trains a small MoE model on CPU with every callback and logs it
#   make test   runs the whole test suite
# Both create .venv, install torch==2.13.0 first (the CPU wheel where pip finds one, as on the
# CI machines; elsewhere add --index-url https://download.pytorch.org/whl/cpu to avoid CUDA
# packages), then the package with its extras.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.trainvitals-installed
RUN_DIR ?= runs/demo

.PHONY: demo test lint bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --run-dir $(RUN_DIR)

test: $(STAMP)
	$(PY) -m ruff check trainvitals tests examples benchmarks
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_writer.py

clean:
	rm -rf $(VENV) runs
