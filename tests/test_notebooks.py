"""The Colab notebooks under notebooks/: committed without outputs, and executable top to bottom.

The execution test runs each notebook with nbclient in a `python3` kernel of this interpreter
(jupyter_client starts a kernel spec whose command is `python` with `sys.executable`; the test
checks the kernel's `sys.prefix`), after replacing its `parameters` cell with the smallest
settings (a 1-layer tiny model, a 10-step SFT, 2 RL steps), and fails on any cell error.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"
)
NOTEBOOKS = ("quickstart.ipynb", "precision_study.ipynb")

# Injected in place of each notebook's `parameters` cell. The two share their task, model,
# warm-start and RL sizes, so that with the persistent compilation cache below the second
# notebook reuses most of the first one's compiled functions.
SMALLEST = {
  "quickstart.ipynb": (
    "SMALL = True\n"
    "OVERRIDES = dict(n_layers=1, length=1, sft_steps=10, sft_batch=8, max_new_tokens=24,\n"
    "                 rl_steps=2, prompts_per_step=2, group_size=2, rl_lr=5e-5,\n"
    "                 temperature=0.7, eval_size=4)\n"
  ),
  "precision_study.ipynb": (
    "SMALL = True\n"
    "OVERRIDES = dict(recipes=('fp8_rollout', 'jet'), corrected=(), lengths=(1,), seeds=(0,),\n"
    "                 token_margin=2, steps=2, prompts_per_step=2, model={'n_layers': 1},\n"
    "                 sampling={'n': 2}, eval={'every': None, 'size': 4},\n"
    "                 sft={'steps': 10, 'batch_size': 8})\n"
    "REPORT_DIR = ''\n"
  ),
}


def _load(name):
  return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
  nb = _load(name)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [], f"{name}: cell {i} has outputs; strip them before committing"
      assert cell.execution_count is None, f"{name}: cell {i} has an execution count"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_has_one_parameters_cell(name):
  tagged = [c for c in _load(name).cells if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"{name}: expected one cell tagged 'parameters', found {len(tagged)}"
  assert "SMALL" in tagged[0].source and "OVERRIDES" in tagged[0].source


def _with_smallest_parameters(nb, name):
  for cell in nb.cells:
    if "parameters" in cell.metadata.get("tags", []):
      cell.source = SMALLEST[name]
  # First cell: record the kernel's interpreter, so the test can check it is this venv's.
  probe = nbformat.v4.new_code_cell("import sys; print('KERNEL_PREFIX=' + sys.prefix)")
  nb.cells.insert(0, probe)
  return nb


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_compilation_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, tmp_path, jax_cache_dir, monkeypatch):
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  nb = _with_smallest_parameters(_load(name), name)
  # The kernel inherits this environment: a JAX compilation cache shared by both notebooks.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax_cache_dir)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  client = nbclient.NotebookClient(
    nb,
    kernel_name="python3",
    timeout=600,
    allow_errors=False,
    resources={"metadata": {"path": str(tmp_path)}},
  )
  t0 = time.time()
  client.execute()  # raises CellExecutionError on the first failing cell
  print(f"{name}: executed in {time.time() - t0:.1f}s")
  probe_out = "".join(o.get("text", "") for o in nb.cells[0].outputs)
  assert f"KERNEL_PREFIX={sys.prefix}" in probe_out, (
    f"the python3 kernel ran another interpreter: {probe_out!r}, expected prefix {sys.prefix}"
  )
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.outputs
    if o.get("output_type") == "error"
  ]
  assert not errors
  # The quickstart's three figures are shown (a run's own plots must not take pyplot off the
  # notebook's inline backend: they once did, and every figure came out blank).
  if name == "quickstart.ipynb":
    images = [
      o
      for c in nb.cells
      if c.cell_type == "code"
      for o in c.outputs
      if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 3, f"{len(images)} figures shown, expected 3"
