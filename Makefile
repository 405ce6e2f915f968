# One entry point for newcomers, developers and CI.
#   make demo   set up what the demo needs (elastrun + torch + numpy), then train the example with a
#               worker killed partway: elastrun restarts it and training resumes (examples/demo.py);
#               then again with memory checkpoints: 0 steps redone
#   make test   set up everything (venv, torch, dev tools, etcd), run the checks and the tests
#   make test-fast  the checks and the fast tests (unit, stores) for daily work
#   make soak   the long series and soaks that `make test` runs short (see below)
#   make check  ruff + strict mypy
#   make bench  benchmarks against torchrun (see docs/benchmarks.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The exact torch of CI and the demo: its CPU wheel. A bare range would let pip pick the
# registry's newest torch, a CUDA build of several GB. Keep equal to the `dev` extra's pin.
TORCH_PIN := torch==2.13.0
DEMO_STAMP := $(VENV)/.demo-installed
DEV_STAMP := $(VENV)/.dev-installed

# Test processes in parallel (pytest-xdist): most tests wait on the processes
# they start, not on the CPU, so more processes than cores pay off. PYTEST_JOBS=0
# runs the tests in this process, one after the other. Work stealing: a process
# that ran out of tests takes some of a busy one's, so long tests do not queue
# behind each other at the end. On 2 cores, 5 processes fill more of the time the
# tests spend waiting (leases, timeouts) than 4: fresh clones' suites took 8 min 39 s
# and 9 min 36 s, against 8 min 38 s and 9 min 9 s with 4 (the machine varies more
# than that); with two CPU hogs beside it, it passes (12 min 36 s in all).
PYTEST_JOBS ?= 5
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_JOBS) --dist worksteal

.PHONY: setup setup-demo etcd chromium check test test-fast soak demo bench bench-quick clean

setup: $(DEV_STAMP)
setup-demo: $(DEMO_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The demo needs elastrun and its torch extra (torch, numpy) only.
$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[torch]' '$(TORCH_PIN)'
	touch $@

# Tests and checks: the `dev` extra (torch, etcd client, pytest, mypy, ruff, ...).
$(DEV_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

etcd:
	@bash scripts/ensure-etcd.sh

# A headless browser for the timeline's browser test (Debian's chromium).
chromium:
	@bash scripts/ensure-chromium.sh

check: setup
	$(PY) -m ruff check src tests bench examples
	$(PY) -m ruff format --check src tests bench examples
	$(PY) -m mypy

# Every test but a whole benchmark's (marked `bench`: its runs are bounded in time,
# so it belongs where the machine is quiet: `make soak`). The checks (`make check`)
# are one of the tests (tests/unit/test_static_checks.py), run beside the others.
test: setup etcd chromium
	$(PYTEST) -m "not bench" $(PYTEST_ARGS)

# The fast subset for daily work (about a minute): pure logic and the stores.
test-fast: setup etcd check
	$(PYTEST) -m "not slow" tests/unit tests/store $(PYTEST_ARGS)

# What `make test` runs short, at full length (10-15 minutes on 2 cores): the
# clean-exit series 30 runs each instead of 2 (tests/integration/test_clean_exit.py),
# the churn soak 10 minutes instead of 12 s (tests/faults/test_faults.py), and, with
# ELASTRUN_SOAK=1 (tests/helpers.py soak_or), three stalls of the store's host instead
# of two, 5 random faults among hot spares instead of 3, all planted-ballot jobs, the
# wheel on every declared Python, 20 natural root-cause races instead of 1; and the benchmark smoke test (marked `bench`) that
# `make test` leaves out.
SERIES_RUNS ?= 30
SOAK_SECONDS ?= 600
soak: setup etcd
	ELASTRUN_SOAK=1 ELASTRUN_SERIES_RUNS=$(SERIES_RUNS) ELASTRUN_SOAK_SECONDS=$(SOAK_SECONDS) \
		$(PYTEST) -m "slow or bench" $(PYTEST_ARGS)

demo: setup-demo
	$(PY) examples/demo.py $(DEMO_ARGS)

bench: setup etcd
	$(PY) -m bench $(BENCH_ARGS)
	$(PY) -m bench.goodput
	$(PY) -m bench.fault_attribution
	$(PY) -m bench.memory_save
	$(PY) -m bench.in_process_restart
	$(PY) -m bench.compile_restart
	$(PY) -m bench.standby_fork
	$(PY) -m bench.goodput --setup-heavy
	$(PY) -m bench.goodput_accounting
	$(PY) -m bench.metrics_scrape

bench-quick: setup etcd
	$(PY) -m bench --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
