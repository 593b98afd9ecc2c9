"""The jitted update step: exact first-minibatch ratio, learning direction, NaN skipping, and
the loss's gradient against a float64 numpy derivation of the ratio (PPO's, GSPO's sequence
ratio, CISPO's clipped weight) and the IS weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.config import ConfigError
from jetrl.precision import get_recipe
from jetrl.rl import (
  OptimizerConfig,
  UpdateConfig,
  init_train_state,
  make_train_batch,
  policy_logprobs,
  update_step,
)
from jetrl.rl.update import StepSpec, accumulate, pre_update, train_step
from jetrl.sampling import SamplingConfig, sample

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def setup(tiny_model):
  cfg, params = tiny_model
  sc = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, stop_ids=(3,))
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(1), sc, get_recipe("bf16").rollout)
  adv = np.array([1.0, -1.0] * 4, np.float32)
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv
  )
  return cfg, params, batch


def step(state, batch, key, ucfg, lr, precision, model_config, **optimizer):
  return update_step(
    state,
    batch,
    key,
    model_config=model_config,
    cfg=ucfg,
    optimizer=OptimizerConfig(lr=lr, **optimizer),
    precision=precision,
  )


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def seq_logprob(params, cfg, batch, precision):
  lp, _ = jax.jit(policy_logprobs, static_argnames=("model_config", "precision"))(
    params, model_config=cfg, batch=batch, precision=precision
  )
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
  assert "kl" not in m  # no reference policy (kl_coef = 0): no KL to report


def np_policy_gradient(
  lp_new, lp_old_pre, lp_rollout, adv, mask, *, loss, old_logp, is_method, cap, clip_low, clip_high
):
  """d loss / d log pi_theta per token, in float64, from the definitions:
  r = pi_theta / pi_old (pi_old: the pre-update forward, or the rollout with old_logp="rollout"),
  w = min(pi_old / pi_rollout, C) (tis) or 1[1/C <= pi_old / pi_rollout <= C] (mis), a constant;
  grpo:  l = -w min(r A, clip(r) A), averaged over each row's tokens, then over rows;
  gspo:  the same with r replaced by the row's s = exp(mean of its tokens' log r), so that
         d l / d log pi_t = -w s A / n where the clip on s does not bind;
  cispo: l = -w sg(clip(r)) A log pi, a token mean: d l / d log pi_t = -w clip(r) A / N."""
  lp_new, lp_old_pre, lp_rollout = (
    np.asarray(a, np.float64) for a in (lp_new, lp_old_pre, lp_rollout)
  )
  old = lp_old_pre if old_logp == "recompute" else lp_rollout
  r = np.exp(lp_new - old)
  a = np.asarray(adv, np.float64)[:, None] * np.ones_like(r)
  rho = np.exp(lp_old_pre - lp_rollout)
  w = {
    "none": np.ones_like(r),
    "tis": np.minimum(rho, cap),
    "mis": ((rho >= 1 / cap) & (rho <= cap)).astype(np.float64),
  }[is_method]
  m = np.asarray(mask, np.float64)
  n = m.sum(1)
  if loss == "cispo":
    binds = (r > 1 + clip_high) | (r < 1 - clip_low)  # the weight is clipped, the token kept
    return -m * w * np.clip(r, 1 - clip_low, 1 + clip_high) * a / m.sum(), binds[m > 0].mean(), w
  if loss == "gspo":
    r = np.exp(((np.log(r)) * m).sum(1, keepdims=True) / np.maximum(n, 1)[:, None]) * m
  # The unclipped term r A is the minimum (and carries the gradient r A) unless the clip binds.
  binds = ((a > 0) & (r > 1 + clip_high)) | ((a < 0) & (r < 1 - clip_low))
  dl = np.where(binds, 0.0, -w * r * a)
  rows = (n > 0).sum()
  return m * dl / np.maximum(n, 1)[:, None] / rows, binds[m > 0].mean(), w


def test_loss_gradient_matches_hand_derivation(setup):
  """The update's gradient with respect to the params is J^T g, with J the Jacobian of the
  training log-probs and g the per-token gradient derived in numpy: the PPO ratio uses the
  pre-update forward (not the rollout) as the old policy, and TIS / MIS weight it by
  min(pi_old / pi_rollout, C) once; with old_logp="rollout" the ratio is pi_theta / pi_rollout.
  GSPO and CISPO take the same ratio and weights (GSPO with clip 0.04 here: its sequence
  ratios lie in [0.92, 1.06], so that some clip, and at its own 3e-4 / 4e-4 all would)."""
  cfg, params, batch = setup
  prec = get_recipe("fp32").train
  lp = lambda p: policy_logprobs(p, cfg, batch, prec)[0]
  pre = np.asarray(lp(params))
  # A rollout that disagrees with the training forward: ratios pi_old / pi_rollout from 0.4 to
  # 2.5, so TIS truncates some tokens at C = 1.5 and MIS drops some.
  rng = np.random.default_rng(0)
  shift = rng.uniform(np.log(0.4), np.log(2.5), pre.shape).astype(np.float32)
  batch = batch._replace(rollout_logprobs=jnp.asarray(pre - shift))
  # The policy has moved since the rollout (a later minibatch): ratios pi_theta / pi_old != 1.
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))
  moved = jax.tree_util.tree_map(
    lambda x: x + 0.2 * jnp.std(x) * jax.random.normal(next(keys), x.shape), params
  )
  lp_new, vjp = jax.vjp(lp, moved)
  mask = np.asarray(batch.mask).astype(bool)
  cases = [("grpo", "recompute", "tis"), ("grpo", "recompute", "mis"), ("grpo", "rollout", "none")]
  cases += [("gspo", "recompute", "tis"), ("cispo", "recompute", "mis")]
  for loss, old_logp, is_method in cases:
    clips = {"grpo": (0.2, 0.2), "gspo": (0.04, 0.04), "cispo": (1.0, 0.28)}[loss]
    kw = dict(loss=loss, old_logp=old_logp, is_method=is_method)
    kw.update(clip_low=clips[0], clip_high=clips[1])
    ucfg = UpdateConfig(is_cap=1.5, **kw)
    spec = StepSpec(
      model_config=cfg,
      cfg=ucfg,
      precision=prec,
      temperature=1.0,
      remat=False,
      max_tokens=batch.targets.shape[1],
    )
    extra, _, _ = pre_update(init_train_state(params, ucfg), batch, spec, (0,))
    np.testing.assert_allclose(  # the same forward, compiled in another program: to rounding
      np.asarray(extra["old_logp"]),
      pre if old_logp == "recompute" else pre - shift,
      rtol=1e-6,
      atol=1e-6,
    )
    grads, _, _ = accumulate(moved, batch, extra, spec)
    g, clip_frac, w = np_policy_gradient(
      lp_new,
      pre,
      pre - shift,
      batch.advantages,
      batch.mask,
      cap=1.5,
      **kw,
    )
    np.testing.assert_allclose(np.asarray(extra["is_w"])[mask], w[mask], rtol=1e-6)
    assert 0 < clip_frac < 0.9, (loss, old_logp, clip_frac)  # both branches are exercised
    if is_method == "tis":
      assert 0 < (w[mask] == 1.5).mean() < 1
    if is_method == "mis":
      assert 0 < (w[mask] == 0).mean() < 1
    (ref,) = vjp(jnp.asarray(g, jnp.float32))
    got, want = _flat(grads), _flat(ref)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(
      got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{loss}, {old_logp}, {is_method}"
    )


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_gspo_and_cispo_run_through_update_step(setup, loss):
  """One update with the loss's own defaults; on-policy at the first minibatch every ratio is
  1 and nothing clips, so GSPO's loss is GRPO's (-mean of the rows' advantages)."""
  cfg, params, batch = setup
  ucfg = UpdateConfig(loss=loss)
  state = init_train_state(params, ucfg)
  state, m = step(state, batch, jax.random.PRNGKey(0), ucfg, 1e-3, get_recipe("fp32").train, cfg)
  assert int(state.step) == 1 and int(state.skipped) == 0
  assert abs(float(m["ratio_mean"]) - 1.0) < 1e-6
  assert float(m["clip_frac_low"]) == 0 and float(m["clip_frac_high"]) == 0
  assert all(np.isfinite(np.asarray(v)).all() for v in m.values())
  if loss == "gspo":
    rows = np.asarray(batch.mask).sum(1) > 0
    ref = -np.asarray(batch.advantages)[rows].mean()
    assert abs(float(m["pg_loss"]) - ref) < 1e-5, (float(m["pg_loss"]), ref)


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
  state2, m2 = step(
    state2, allbad, jax.random.PRNGKey(0), ucfg, 3e-3, get_recipe("bf16").train, cfg
  )
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
  target = next(
    path for path, leaf in paths if "mu" in jax.tree_util.keystr(path) and leaf.ndim == 2
  )
  poisoned = jax.tree_util.tree_map_with_path(
    lambda path, x: x.at[0, 0].set(jnp.nan) if path == target else x, state.opt_state
  )
  state, m = step(
    state._replace(opt_state=poisoned),
    batch,
    jax.random.PRNGKey(0),
    ucfg,
    3e-3,
    get_recipe("bf16").train,
    cfg,
  )
  assert int(state.skipped) == 2 and int(state.step) == 0 and float(m["skipped_updates"]) == 2
  for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)


def _dots(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("micro", [1, 2])
def test_auto_old_logp_runs_one_forward_fewer_with_the_same_update_and_metrics(setup, micro):
  """The default update of one epoch of one minibatch takes the ratio's old log-probs from its
  own forward: its program holds one forward's GEMMs fewer than `recompute`'s, its params move
  as recompute's do (float32, where the two forwards agree to rounding), and its agreement and
  IS metrics are those of a rollout shifted from the training forward by a known amount,
  computed in numpy from that shift alone.

  The step compared is AdamW's first with eps = 1, which moves a parameter by lr g / (|g| + 1):
  smooth in the gradient g, so that gradients equal to rounding give steps equal to rounding.
  With the default eps (1e-8) the first step is lr g / (|g| + 1e-8), a sign for all but the
  smallest gradients, and a gradient of about 1e-8 that rounds differently moves its parameter
  by a visible fraction of lr (seen: 1.6e-5 at lr 1e-3, 6 of 656k, with XLA's full LLVM
  pipeline on the CPU)."""
  cfg, params, batch = setup
  prec = get_recipe("fp32").train
  lp = np.asarray(
    jax.jit(policy_logprobs, static_argnames=("model_config", "precision"))(
      params, model_config=cfg, batch=batch, precision=prec
    )[0]
  )
  rng = np.random.default_rng(5)
  shift = rng.uniform(np.log(0.5), np.log(2.0), lp.shape).astype(np.float32)
  batch = batch._replace(rollout_logprobs=jnp.asarray(lp - shift))
  mask = np.asarray(batch.mask).astype(bool)
  d = shift[mask].astype(np.float64)  # train - rollout, token by token
  new, metrics, dots = {}, {}, {}
  for old in ("auto", "recompute"):
    ucfg = UpdateConfig(old_logp=old, is_method="tis", is_cap=1.5, micro_batches=micro)
    state = init_train_state(params, ucfg)
    fn = functools.partial(
      train_step, model_config=cfg, cfg=ucfg, optimizer=OptimizerConfig(lr=1e-3), precision=prec
    )
    dots[old] = _dots(fn, state, batch, jax.random.PRNGKey(0))
    state, m = step(state, batch, jax.random.PRNGKey(0), ucfg, 1e-3, prec, cfg, eps=1.0)
    new[old] = _flat(state.params) - _flat(params)
    metrics[old] = {k: float(np.asarray(v)) for k, v in m.items() if np.ndim(v) == 0}
  forward = _dots(lambda p: policy_logprobs(p, cfg, batch, prec)[0], params)
  assert forward > 0 and dots["recompute"] - dots["auto"] == forward, (dots, forward)
  moved = np.abs(new["recompute"])
  assert (moved > 0).mean() > 0.5, (moved > 0).mean()  # the step moved most params
  np.testing.assert_allclose(new["auto"], new["recompute"], rtol=1e-3, atol=1e-4 * moved.max())
  want = {
    "agree/abs_diff_mean": np.abs(d).mean(),
    "agree/abs_diff_max": np.abs(d).max(),
    "agree/kl_k3": (np.exp(d) - 1 - d).mean(),
    "is_mean_weight": np.minimum(np.exp(d), 1.5).mean(),
    "is_frac_truncated": (np.exp(d) > 1.5).mean(),
  }
  for old in ("auto", "recompute"):
    for k, v in want.items():
      assert abs(metrics[old][k] - v) <= 1e-5 * max(1.0, abs(v)), (old, k, metrics[old][k], v)
  assert 0 < want["is_frac_truncated"] < 1
  assert metrics["auto"]["ratio_mean"] == 1.0  # exactly: the ratio's both sides are one forward


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
  # The reference is the initial policy, so at the first step (params equal to it) the k3 KL
  # is 0 up to rounding (it was once measured against all-zero log-probs: 50.9).
  assert int(state.step) == 1 and 0.0 <= float(m["kl"]) < 1e-3, float(m["kl"])


def test_config_errors(setup):
  with pytest.raises(ValueError, match="loss"):
    UpdateConfig(loss="ppo2")
  with pytest.raises(ValueError, match="is_method"):
    UpdateConfig(is_method="clip")
  with pytest.raises(ValueError, match="old_logp"):
    UpdateConfig(old_logp="ref")
  assert UpdateConfig().old_logp == "auto"
  assert UpdateConfig().resolved_old_logp == "same_forward"
  for kw in (dict(ppo_epochs=2), dict(minibatches=2)):
    assert UpdateConfig(**kw).resolved_old_logp == "recompute", kw
  with pytest.raises(ConfigError, match="old_logp: 'same_forward' .* ppo_epochs=1"):
    UpdateConfig(old_logp="same_forward", ppo_epochs=2)
  for method in ("tis", "mis", "seq_tis", "seq_mis"):
    with pytest.raises(
      ConfigError,
      match=r"old_logp: 'rollout' cannot be combined with "
      rf"is_method='{method}'.*a second time",
    ):
      UpdateConfig(old_logp="rollout", is_method=method)
  UpdateConfig(old_logp="rollout")  # without a correction: the rollout as the old policy
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
    update_step(
      init_train_state(params, ucfg),
      batch,
      jax.random.PRNGKey(0),
      model_config=cfg,
      cfg=ucfg,
      precision=None,
    )
  with pytest.raises(ValueError, match="temperature must be > 0"):
    update_step(
      init_train_state(params),
      batch,
      jax.random.PRNGKey(0),
      model_config=cfg,
      cfg=UpdateConfig(),
      precision=None,
      temperature=0.0,
    )
