"""Every metric name jetrl.rl.metrics lists is written by an update step, and every metric key
the experiments read is one of those written: a benchmark column cannot read a key that nothing
writes (it would be NaN, or missing, in every run)."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import numpy as np
import pytest

from jetrl.precision import get_recipe
from jetrl.rl import UpdateConfig, init_train_state, make_train_batch, update_step
from jetrl.rl import metrics as M

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


@pytest.fixture(scope="module")
def written(tiny_model):
  """The keys of one tiny update step's metrics."""
  cfg, params = tiny_model
  rng = np.random.default_rng(0)
  rows, p_len, c_len = 2, 3, 4
  ones = lambda shape: np.ones(shape, bool)
  batch = make_train_batch(
    rng.integers(1, cfg.vocab_size, (rows, p_len)).astype(np.int32),
    ones((rows, p_len)),
    rng.integers(1, cfg.vocab_size, (rows, c_len)).astype(np.int32),
    ones((rows, c_len)),
    (-rng.random((rows, c_len))).astype(np.float32),
    np.array([1.0, -1.0], np.float32),
  )
  ucfg = UpdateConfig()
  state = init_train_state(params, ucfg)
  _, m = update_step(
    state,
    batch,
    jax.random.PRNGKey(0),
    model_config=cfg,
    cfg=ucfg,
    precision=get_recipe("fp32").train,
    bin_edges=(0, 2),
  )
  return set(m)


def _metrics_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
  """(names bound to the jetrl.rl.metrics module, {local name: imported constant})."""
  modules, names = set(), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "jetrl.rl":
      modules |= {a.asname or a.name for a in node.names if a.name == "metrics"}
    elif isinstance(node, ast.ImportFrom) and node.module == "jetrl.rl.metrics":
      names.update({a.asname or a.name: a.name for a in node.names})
    elif isinstance(node, ast.Import):
      modules |= {a.asname for a in node.names if a.name == "jetrl.rl.metrics" and a.asname}
  return modules, names


def _is_metrics_dict(node: ast.AST) -> bool:
  return isinstance(node, ast.Name) and "metric" in node.id.lower()


def metric_reads(source: str) -> tuple[list[str], list[str]]:
  """(the metric keys a script reads, its reads with a silent default).

  Keys: the string constants of jetrl.rl.metrics the script names, the keys it reads from a
  variable named like `metrics` (`metrics["k"]`, `metrics.get("k")`), and any "agree/..." text."""
  tree = ast.parse(source)
  modules, names = _metrics_aliases(tree)
  keys, silent = [], []
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in modules
    ):
      value = getattr(M, node.attr, None)
      keys += [value] if isinstance(value, str) and node.attr.isupper() else []
    elif isinstance(node, ast.Name) and node.id in names:
      value = getattr(M, names[node.id], None)
      keys += [value] if isinstance(value, str) else []
    elif isinstance(node, ast.Subscript) and _is_metrics_dict(node.value):
      if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        keys.append(node.slice.value)
    elif (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr == "get"
      and _is_metrics_dict(node.func.value)
    ):
      silent.append(ast.unparse(node))
      if node.args and isinstance(node.args[0], ast.Constant):
        keys.append(node.args[0].value)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if node.value.startswith(M.AGREE_PREFIX) and len(node.value) > len(M.AGREE_PREFIX):
        keys.append(node.value)
  return sorted(set(keys)), silent


def test_the_scan_finds_reads_and_silent_defaults():
  keys, silent = metric_reads(
    "from jetrl.rl import metrics as M\n"
    "from jetrl.rl.metrics import KL_K3\n"
    "a = metrics.get('agree/mean_abs_diff', 0.0)\n"
    "b = step_metrics['loss'] + M.read(m, M.SKIPPED_UPDATES) + KL_K3\n"
  )
  assert keys == ["agree/mean_abs_diff", "kl_k3", "loss", "skipped_updates"]
  assert silent == ["metrics.get('agree/mean_abs_diff', 0.0)"]


def test_every_listed_metric_is_written(written):
  assert set(M.UPDATE_KEYS) <= written, sorted(set(M.UPDATE_KEYS) - written)
  assert {M.agree(k) for k in M.AGREEMENT_KEYS} <= written
  assert M.AGREE_ABS_DIFF_MEAN in written


def test_experiments_read_only_written_metrics(written):
  bad = []
  for path in sorted(EXPERIMENTS.glob("*.py")):
    keys, silent = metric_reads(path.read_text(encoding="utf-8"))
    # An agreement key alone is read from agreement_metrics' own dict (the update's "agree/k").
    bad += [
      f"{path.name}: reads {k!r}" for k in keys if {k, M.AGREE_PREFIX + k}.isdisjoint(written)
    ]
    bad += [f"{path.name}: {s} (a missing metric must be an error: M.read)" for s in silent]
  assert not bad, "\n".join(bad)


def test_read_names_the_missing_key():
  with pytest.raises(KeyError, match="agree/mean_abs_diff"):
    M.read({"loss": 1.0}, "agree/mean_abs_diff")
  with pytest.raises(KeyError, match="not an agreement metric"):
    M.agree("mean_abs_diff")
