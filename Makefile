# One entry point for newcomers, developers and CI.
#   make demo   set up everything, then train the elastic example on the embedded store
#   make test   set up everything (venv, torch, dev tools, etcd), run the checks and the tests
#   make check  ruff + strict mypy
#   make bench  benchmarks against torchrun (see docs/benchmarks.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup etcd check test demo bench bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

etcd:
	@bash scripts/ensure-etcd.sh

check: setup
	$(PY) -m ruff check src tests bench examples
	$(PY) -m ruff format --check src tests bench examples
	$(PY) -m mypy

test: setup etcd check
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/elastrun --standalone --nproc-per-node=2 examples/train.py $(DEMO_ARGS)

bench: setup etcd
	$(PY) -m bench $(BENCH_ARGS)

bench-quick: setup etcd
	$(PY) -m bench --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
