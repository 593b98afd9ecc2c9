"""GSPO and CISPO (jetrl.rl.ratio_losses) against hand-computed values and float64 numpy, and
the loss table (jetrl.rl.objective) that makes them `update.loss` choices."""

import math

import jax
import numpy as np
import pytest

from jetrl.config import ConfigError, from_dict
from jetrl.rl import (
  IS_METHODS,
  LOSS_SPECS,
  LOSSES,
  UpdateConfig,
  cispo_loss,
  gspo_loss,
  ppo_clip_loss,
)
from jetrl.rl.objective import total_loss
from loss_refs import hand_batch, np_aggregate, policy_value_and_grad

AGGS = ("token", "seq_mean_token_mean", "constant")


def gspo(logp, old, adv, mask, w=None, **kw):
  return policy_value_and_grad(gspo_loss, logp, old, adv, mask, w, **kw)


def cispo(logp, old, adv, mask, w=None, **kw):
  return policy_value_and_grad(cispo_loss, logp, old, adv, mask, w, **kw)


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_computed_sequence_ratio_clip_and_gradient():
  """Three sequences, clip 0.2 both sides, per-sequence advantages (1, -1, -1):
  row 0: log-ratios (0.3, -0.1, 0.1): s = exp(mean) = exp(0.1) = 1.105, inside the clip range
    (the product, exp(0.3) = 1.35, would clip): l = -exp(0.1), d l / d logp_t = -exp(0.1) / 3;
  row 1: one token of ratio 0.5, A = -1: the lower clip binds, l = 0.8, no gradient;
  row 2: two tokens of ratio 1.5, A = -1: unclipped (1.5 > 1.2), l = 1.5, d l / d logp_t = 1.5 / 2.
  The loss is the mean over the sequences, so every gradient is divided by G = 3."""
  old = np.full((3, 3), -1.0, np.float32)
  log_ratio = np.array([[0.3, -0.1, 0.1], [math.log(0.5), 0, 0], [math.log(1.5)] * 2 + [0]])
  logp = (old + log_ratio).astype(np.float32)
  mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0]], bool)
  adv = np.array([1.0, -1.0, -1.0], np.float32)
  loss, num, den, metrics, g = gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
  assert float(den) == 3.0
  np.testing.assert_allclose(loss, (-math.exp(0.1) + 0.8 + 1.5) / 3, rtol=1e-6)
  want = np.array([[-math.exp(0.1) / 9] * 3, [0, 0, 0], [1.5 / 6, 1.5 / 6, 0]])
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(
    metrics["ratio_mean"], (3 * math.exp(0.1) + 0.5 + 2 * 1.5) / 6, rtol=1e-6
  )
  assert float(metrics["clip_frac_low"]) == pytest.approx(1 / 6)
  assert float(metrics["clip_frac_high"]) == 0.0 and float(metrics["n_tokens"]) == 6


def test_gspo_default_clip_range_is_the_papers():
  """[1 - 3e-4, 1 + 4e-4]: a sequence ratio exp(2e-4) is inside, exp(1e-3) clips (A > 0)."""
  old = np.full((2, 4), -2.0, np.float32)
  logp = (old + np.array([[2e-4] * 4, [1e-3] * 4])).astype(np.float32)
  mask = np.ones((2, 4), bool)
  loss, _, _, metrics, g = gspo(logp, old, np.ones(2, np.float32), mask)
  np.testing.assert_allclose(loss, -(math.exp(2e-4) + 1 + 4e-4) / 2, rtol=1e-6)
  np.testing.assert_allclose(g[0], -math.exp(2e-4) / 8, rtol=1e-4)
  assert np.all(np.asarray(g[1]) == 0) and float(metrics["clip_frac_high"]) == 0.5


def np_gspo_objective(logp, old, adv, mask, clip_low, clip_high, seq_w):
  """GSPO's objective in float64 from the paper's sequence form: the mean over sequences with
  tokens of -seq_w_i * min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log-ratio)."""
  m = mask.astype(np.float64)
  n = m.sum(1)
  s = np.exp(((logp - old) * m).sum(1) / np.maximum(n, 1))
  obj = np.minimum(s * adv, np.clip(s, 1 - clip_low, 1 + clip_high) * adv)
  return -(seq_w * obj)[n > 0].sum() / (n > 0).sum()


def test_gspo_matches_float64_sequence_objective_and_its_finite_differences():
  """The GSPO-token computation against the sequence-level objective, value and gradient (by
  central differences in float64), with per-sequence weights (as seq_tis / seq_mis give)."""
  logp, old, mask = hand_batch()
  logp, old = logp[[0, 2, 3]], old[[0, 2, 3]]
  old[2] = logp[2] + np.array([0.3, -0.2, 0.1, 0.05, -0.1], np.float32)  # a ratio near 1
  mask = mask[[0, 2, 3]]
  adv = np.array([1.5, 0.7, -0.4], np.float32)
  seq_w = np.array([0.5, 2.0, 1.0])
  w = np.broadcast_to(seq_w[:, None], logp.shape).astype(np.float32)
  loss, _, _, _, g = gspo(logp, old, adv, mask, w, clip_low=0.2, clip_high=0.28)
  args = (old.astype(np.float64), adv.astype(np.float64), mask, 0.2, 0.28, seq_w)
  lp64 = logp.astype(np.float64)
  np.testing.assert_allclose(loss, np_gspo_objective(lp64, *args), rtol=1e-5)
  fd = np.zeros_like(lp64)
  for idx in zip(*np.nonzero(mask)):
    e = np.zeros_like(lp64)
    e[idx] = 1e-6
    fd[idx] = (np_gspo_objective(lp64 + e, *args) - np_gspo_objective(lp64 - e, *args)) / 2e-6
  assert np.abs(fd).max() > 0.01  # not every sequence is clipped
  np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGS)
def test_gspo_token_weights_and_aggregations_match_numpy(aggregation):
  """Per-token weights (tis / mis) in the GSPO-token form: token t of sequence i has the loss
  -w_it min(s_i A_i, clip(s_i) A_i) and the gradient -w_it s_i A_i (0 where the clip binds)
  through its own log-prob, aggregated like any per-token loss."""
  logp, old, mask = hand_batch()
  old[3] = logp[3] - 0.05  # s = exp(0.05): inside [0.8, 1.28]
  adv = np.array([1.5, -2.0, -0.7, 0.3], np.float32)
  w = np.random.default_rng(0).uniform(0.0, 2.0, logp.shape).astype(np.float32)
  loss, num, den, _, g = gspo(
    logp, old, adv, mask, w, clip_low=0.2, clip_high=0.28, aggregation=aggregation
  )
  m = mask.astype(np.float64)
  n = m.sum(1)
  s = np.exp(((logp.astype(np.float64) - old) * m).sum(1) / np.maximum(n, 1))[:, None]
  a = np.asarray(adv, np.float64)[:, None]
  unclipped, clipped = -s * a, -np.clip(s, 0.8, 1.28) * a
  loss_t = w * np.maximum(unclipped, clipped) * m
  grad_t = w * np.where(unclipped >= clipped, -s * a, 0.0)
  ref_num, ref_den, dnum = np_aggregate(loss_t, mask, aggregation)
  assert float(den) == ref_den
  np.testing.assert_allclose(num, ref_num, rtol=1e-5)
  np.testing.assert_allclose(loss, ref_num / ref_den, rtol=1e-5)
  np.testing.assert_allclose(g, dnum * grad_t * m / ref_den, rtol=1e-5, atol=1e-30)
  assert np.abs(np.asarray(g)[3]).max() > 0 and np.all(np.asarray(g)[2] == 0)  # row 2 clips


# ---------------------------------------------------------------- CISPO


def test_cispo_hand_computed_clipped_weight_keeps_every_token():
  """Token mean over N = 3 tokens of -sg(clip(r, 0, 1.28)) * A * log pi:
  (r, A, log pi) = (1.5, 1, -1.0): weight 1.28, l = 1.28, d l / d log pi = -1.28 / 3
                   (PPO's min drops this token: its gradient is 0);
                   (1.1, 1, -2.0): weight 1.1, l = 2.2, gradient -1.1 / 3;
                   (0.1, -1, -0.5): weight 0.1 (no lower bound), l = -0.05, gradient +0.1 / 3."""
  logp = np.array([[-1.0, -2.0], [-0.5, 7.0]], np.float32)
  old = logp - np.log(np.array([[1.5, 1.1], [0.1, 1.0]], np.float32))
  mask = np.array([[1, 1], [1, 0]], bool)
  adv = np.array([1.0, -1.0], np.float32)
  loss, _, den, metrics, g = cispo(logp, old, adv, mask)
  assert float(den) == 3.0
  np.testing.assert_allclose(loss, (1.28 + 2.2 - 0.05) / 3, rtol=1e-5)
  np.testing.assert_allclose(g, [[-1.28 / 3, -1.1 / 3], [0.1 / 3, 0.0]], rtol=1e-5)
  assert float(metrics["clip_frac_high"]) == pytest.approx(1 / 3)
  assert float(metrics["clip_frac_low"]) == 0.0
  *_, g_ppo = policy_value_and_grad(ppo_clip_loss, logp, old, adv, mask, clip_high=0.28)
  assert float(g_ppo[0, 0]) == 0.0  # the token CISPO keeps
  *_, metrics_low, g_low = cispo(logp, old, adv, mask, clip_low=0.2)
  np.testing.assert_allclose(g_low[1, 0], 0.8 / 3, rtol=1e-5)  # the weight clipped up to 0.8
  assert float(metrics_low["clip_frac_low"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("aggregation", AGGS)
def test_cispo_matches_numpy_and_no_gradient_into_constants(aggregation):
  logp, old, mask = hand_batch()  # ratios from exp(-50) to exp(50): the weight bounds them
  adv = np.array([1.5, -2.0, -0.7, 0.3], np.float32)
  w = np.random.default_rng(1).uniform(0.0, 2.0, logp.shape).astype(np.float32)
  kw = dict(clip_low=1.0, clip_high=0.28, aggregation=aggregation)
  loss, num, den, _, g = cispo(logp, old, adv, mask, w, **kw)
  m = mask.astype(np.float64)
  lp = np.where(mask, logp.astype(np.float64), 0.0)
  weight = np.clip(np.exp(lp - np.where(mask, old, 0.0)), 0.0, 1.28)
  a = np.asarray(adv, np.float64)[:, None]
  ref_num, ref_den, dnum = np_aggregate(-w * weight * a * lp * m, mask, aggregation)
  assert float(den) == ref_den
  np.testing.assert_allclose(loss, ref_num / ref_den, rtol=1e-5)
  np.testing.assert_allclose(g, dnum * -w * weight * a * m / ref_den, rtol=1e-5, atol=1e-30)
  assert np.all(np.isfinite(np.asarray(g)))

  def f(o, ad, ww):
    return cispo_loss(logp, o, ad, mask, is_weights=ww, **kw)[0]

  for grad in jax.grad(f, argnums=(0, 1, 2))(old, adv, w):
    assert np.all(np.asarray(grad) == 0)


def test_clip_low_bounds():
  logp, old, mask = hand_batch()
  adv = np.ones(4, np.float32)
  with pytest.raises(ValueError, match=r"clip_low must be <= 1"):
    cispo_loss(logp, old, adv, mask, clip_low=1.5)
  for fn in (ppo_clip_loss, gspo_loss):
    with pytest.raises(ValueError, match=r"clip_low must be < 1"):
      fn(logp, old, adv, mask, clip_low=1.0)


# ---------------------------------------------------------------- the loss table


def test_table_gives_the_config_choices_and_defaults():
  assert LOSSES == tuple(LOSS_SPECS) == ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
  with pytest.raises(ConfigError, match=r"loss: 'ppo' is not accepted.*'gspo', 'cispo'"):
    UpdateConfig(loss="ppo")
  defaults = {  # (clip_low, clip_high, aggregation, advantage): those before the table
    "grpo": (0.2, 0.2, "seq_mean_token_mean", "grpo"),
    "dapo": (0.2, 0.28, "token", "grpo"),
    "dr_grpo": (0.2, 0.2, "constant", "dr_grpo"),
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean", "grpo"),
    "cispo": (1.0, 0.28, "token", "grpo"),
  }
  for name, want in defaults.items():
    u = UpdateConfig(loss=name)
    got = (u.resolved_clip_low, u.resolved_clip_high, u.resolved_aggregation, u.resolved_advantage)
    assert got == want, name
    assert LOSS_SPECS[name].summary in UpdateConfig.__dataclass_fields__["loss"].metadata["help"]
  u = UpdateConfig(loss="gspo", clip_low=0.1, clip_high=0.3, aggregation="token")
  assert (u.resolved_clip_low, u.resolved_clip_high, u.resolved_aggregation) == (0.1, 0.3, "token")
  # A stored config from before the table (clip_low always written, 0.2) reads the same.
  old = from_dict(UpdateConfig, {"loss": "dapo", "clip_low": 0.2, "clip_high": None})
  assert (old.resolved_clip_low, old.resolved_clip_high) == (0.2, 0.28)


def test_clip_low_of_one_only_where_the_ratio_is_detached():
  assert UpdateConfig(loss="cispo", clip_low=1.0).resolved_clip_low == 1.0
  for name in ("grpo", "gspo"):
    with pytest.raises(ConfigError, match=rf"^clip_low: must be < 1 .*loss '{name}'"):
      UpdateConfig(loss=name, clip_low=1.0)
  # Every loss composes with the IS corrections and with the rollout as the old policy.
  for name in LOSSES:
    for method in IS_METHODS:
      UpdateConfig(loss=name, is_method=method)
    UpdateConfig(loss=name, old_logp="rollout")


def test_total_loss_is_one_linear_expression_of_the_terms():
  terms = dict(pg=1.5, entropy=2.0, kl=4.0)
  assert total_loss(terms, UpdateConfig(entropy_coef=0.25)) == 1.5 - 0.5
  assert total_loss(terms, UpdateConfig(entropy_coef=0.25, kl_coef=0.5)) == 1.5 - 0.5 + 2.0
