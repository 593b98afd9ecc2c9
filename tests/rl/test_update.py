"""The jitted update step: exact first-minibatch ratio, learning direction, NaN skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import get_recipe
from jetrl.rl import (OptimizerConfig, UpdateConfig, init_train_state, make_train_batch,
                      policy_logprobs, update_step)
from jetrl.sampling import SamplingConfig, sample

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def setup(tiny_model):
  cfg, params = tiny_model
  sc = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, stop_ids=(3,))
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(1), sc, get_recipe("bf16").rollout)
  adv = np.array([1.0, -1.0] * 4, np.float32)
  batch = make_train_batch(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask,
                           out.logprobs, adv)
  return cfg, params, batch


def step(state, batch, key, ucfg, lr, precision, model_config):
  return update_step(state, batch, key, model_config=model_config, cfg=ucfg,
                     optimizer=OptimizerConfig(lr=lr), precision=precision)


def seq_logprob(params, cfg, batch, precision):
  lp, _ = jax.jit(policy_logprobs, static_argnames=("model_config", "precision"))(
      params, model_config=cfg, batch=batch, precision=precision)
  return np.asarray((lp * batch.mask).sum(1))


def test_ratio_is_one_at_first_minibatch_and_loss_matches_numpy(setup):
  cfg, params, batch = setup
  ucfg = UpdateConfig(loss="dapo", aggregation="token", old_logp="recompute")
  state = init_train_state(params, ucfg)
  _, m = step(state, batch, jax.random.PRNGKey(0), ucfg, 1e-3, get_recipe("fp32").train, cfg)
  assert abs(float(m["ratio_mean"]) - 1.0) < 1e-6
  assert float(m["clip_frac_low"]) == 0 and float(m["clip_frac_high"]) == 0
  # ratio 1: the clipped and unclipped objectives agree, = -sum(A * n_tokens) / sum(n_tokens).
  mask = np.asarray(batch.mask)
  ref = -(np.asarray(batch.advantages) * mask.sum(1)).sum() / mask.sum()
  assert abs(float(m["pg_loss"]) - ref) < 1e-5, (float(m["pg_loss"]), ref)
  assert float(m["skipped_updates"]) == 0 and float(m["optimizer_steps"]) == 1
  assert float(m["learning_rate"]) == np.float32(1e-3)
  for k in ("agree/abs_diff_mean", "agree/kl_k3", "grad_norm", "entropy"):
    assert np.isfinite(float(m[k])), k


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_updates_move_logprobs_in_the_advantage_direction(setup, recipe):
  cfg, params, batch = setup
  prec = get_recipe(recipe).train
  ucfg = UpdateConfig(loss="grpo", minibatches=2, micro_batches=2)
  state = init_train_state(params, ucfg)
  before = seq_logprob(state.params, cfg, batch, prec)
  for i in range(4):
    state, m = step(state, batch, jax.random.PRNGKey(i), ucfg, 3e-3, prec, cfg)
  after = seq_logprob(state.params, cfg, batch, prec)
  delta = after - before
  pos, neg = np.asarray(batch.advantages) > 0, np.asarray(batch.advantages) < 0
  assert delta[pos].mean() > 0.5 and delta[neg].mean() < -0.5, (recipe, delta)
  assert int(state.step) == 4 * 2 and int(state.skipped) == 0


def test_nan_batch_is_skipped_counted_and_params_stay_finite(setup):
  cfg, params, batch = setup
  ucfg = UpdateConfig(loss="grpo", minibatches=2, micro_batches=2)
  state = init_train_state(params, ucfg)
  before = jax.tree_util.tree_map(np.asarray, state.params)
  bad = batch._replace(advantages=batch.advantages.at[0].set(jnp.nan))
  state, m = step(state, bad, jax.random.PRNGKey(0), ucfg, 3e-3, get_recipe("bf16").train, cfg)
  # The minibatch holding row 0 is skipped; the other one still updates.
  assert int(state.skipped) == 1 and float(m["skipped_updates"]) == 1
  assert int(state.step) == 1
  leaves = jax.tree_util.tree_leaves(state.params)
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  # A batch that is all NaN leaves params exactly as they were.
  state2 = init_train_state(before, ucfg)
  allbad = batch._replace(advantages=jnp.full_like(batch.advantages, jnp.nan))
  state2, m2 = step(state2, allbad, jax.random.PRNGKey(0), ucfg, 3e-3,
                    get_recipe("bf16").train, cfg)
  assert int(state2.skipped) == 2 and int(state2.step) == 0
  for a, b in zip(jax.tree_util.tree_leaves(state2.params), jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_update_with_finite_gradients_but_nan_result_is_skipped(setup):
  """A NaN in the optimizer state: loss and gradients are finite, the new params would not be."""
  cfg, params, batch = setup
  ucfg = UpdateConfig(loss="grpo", minibatches=2, micro_batches=2)
  state = init_train_state(params, ucfg)
  before = jax.tree_util.tree_map(np.asarray, state.params)
  paths = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  target = next(path for path, leaf in paths if "mu" in jax.tree_util.keystr(path)
                and leaf.ndim == 2)
  poisoned = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[0, 0].set(jnp.nan) if path == target else x, state.opt_state)
  state, m = step(state._replace(opt_state=poisoned), batch, jax.random.PRNGKey(0), ucfg, 3e-3,
                  get_recipe("bf16").train, cfg)
  assert int(state.skipped) == 2 and int(state.step) == 0 and float(m["skipped_updates"]) == 2
  for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_micro_batch_accumulation_is_exact(setup):
  cfg, params, batch = setup
  outs = {}
  for micro in (1, 4):
    ucfg = UpdateConfig(loss="grpo", micro_batches=micro)
    state = init_train_state(params, ucfg)
    _, m = step(state, batch, jax.random.PRNGKey(0), ucfg, 1e-3, get_recipe("fp32").train, cfg)
    outs[micro] = {k: float(m[k]) for k in ("loss", "grad_norm", "entropy")}
  for k in outs[1]:
    assert abs(outs[1][k] - outs[4][k]) <= 1e-5 * max(1.0, abs(outs[1][k])), (k, outs)


def test_bf16_master_weights(setup):
  cfg, params, batch = setup
  ucfg = UpdateConfig(master_dtype="bfloat16", kl_coef=0.1)
  state = init_train_state(params, ucfg)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(state.params))
  state, m = step(state, batch, jax.random.PRNGKey(0), ucfg, 1e-3, get_recipe("jet").train, cfg)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(state.params))
  assert int(state.step) == 1 and np.isfinite(float(m["kl"]))


def test_config_errors(setup):
  with pytest.raises(ValueError, match="loss"):
    UpdateConfig(loss="ppo2")
  with pytest.raises(ValueError, match="is_method"):
    UpdateConfig(is_method="clip")
  with pytest.raises(ValueError, match="old_logp"):
    UpdateConfig(old_logp="ref")
  for field in ("kl_coef", "clip_high", "is_cap"):
    for bad in (float("nan"), float("inf")):
      with pytest.raises(ValueError, match=f"{field}: must be a finite number"):
        UpdateConfig(**{field: bad})
  for field in ("lr", "max_grad_norm", "weight_decay", "eps"):
    for bad in (float("nan"), float("inf")):
      with pytest.raises(ValueError, match=f"{field}: must be a finite number"):
        OptimizerConfig(**{field: bad})
  with pytest.raises(ValueError, match=r"weight_decay: must be in \[0, 10\]"):
    OptimizerConfig(weight_decay=-0.1)
  cfg, params, batch = setup
  ucfg = UpdateConfig(minibatches=3)
  with pytest.raises(ValueError, match="does not split"):
    update_step(init_train_state(params, ucfg), batch, jax.random.PRNGKey(0), model_config=cfg,
                cfg=ucfg, precision=None)
  with pytest.raises(ValueError, match="temperature must be > 0"):
    update_step(init_train_state(params), batch, jax.random.PRNGKey(0), model_config=cfg,
                cfg=UpdateConfig(), precision=None, temperature=0.0)
