"""The gradient measures against hand-computed values, and the trainer's gradient against the
gradient of the GRPO surrogate written out here."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import get_config, init_params
from jetrl.precision import Precision
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.rl.update_config import UpdateConfig
from jetrl.sampling import SamplingConfig, sample
from jetrl.study import gradients as G


def test_cosine_and_relative_difference_by_hand():
  a, b = np.array([3.0, 4.0, 0.0]), np.array([4.0, 3.0, 0.0])
  assert G.cosine(a, b) == pytest.approx(24 / 25)
  # |a - b| = sqrt(2), |b| = 5
  assert G.relative_difference(a, b) == pytest.approx(np.sqrt(2) / 5)
  assert G.cosine(a, -a) == pytest.approx(-1.0)
  assert np.isnan(G.cosine(a, np.zeros(3)))
  assert np.isnan(G.relative_difference(a, np.zeros(3)))
  with pytest.raises(ValueError, match="one length"):
    G.cosine(a, b[:2])


def test_flat_orders_leaves_and_promotes():
  tree = {"b": jnp.ones((2,), jnp.bfloat16), "a": jnp.arange(3, dtype=jnp.float32)}
  np.testing.assert_array_equal(G.flat(tree), [0.0, 1.0, 2.0, 1.0, 1.0])
  assert G.flat(tree).dtype == np.float64


def test_sequence_ratios_and_ess_by_hand():
  train = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
  roll = np.array([[-1.5, -2.0, -2.0], [-0.5, -1.0, 0.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]])
  lr = G.sequence_log_ratios(train, roll, mask)
  np.testing.assert_allclose(lr, [0.5 + 0 - 1.0, 0 + 0.5])  # the masked -9 is left out
  # weights e^-0.5 and e^0.5: (w1 + w2)^2 / (2 (w1^2 + w2^2))
  w = np.exp([-0.5, 0.5])
  assert G.sequence_ess(lr) == pytest.approx(w.sum() ** 2 / (2 * (w**2).sum()))
  assert G.sequence_ess(np.zeros(7)) == pytest.approx(1.0)
  assert G.sequence_ess([0.0, 800.0, 0.0, 0.0]) == pytest.approx(0.25)  # no overflow
  with pytest.raises(ValueError, match="finite"):
    G.sequence_ess([0.0, np.inf])


@pytest.fixture(scope="module")
def setup():
  cfg = dataclasses.replace(get_config("tiny"), max_seq_len=32)
  params = init_params(cfg, jax.random.PRNGKey(0))
  sc = SamplingConfig(max_new_tokens=6, temperature=1.0, n=2, pad_id=0)
  out = sample(params, cfg, [[1, 2, 3], [4, 5]], jax.random.PRNGKey(1), sc, None)
  adv = jnp.array([1.0, -1.0, 0.5, -0.5])
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv
  )
  return cfg, params, batch


def test_trainer_gradient_is_the_grpo_surrogates(setup):
  """On the first step with recomputed old log-probs the PPO ratio is 1 and unclipped, so the
  GRPO gradient is that of -(1/R') sum_i A_i mean_t log p(y_it) over the R' rows with tokens."""
  cfg, params, batch = setup
  f32 = Precision("float32")
  ucfg = UpdateConfig(loss="grpo")
  g, clipped = G.trainer_gradient(
    params, batch, model_config=cfg, cfg=ucfg, precision=f32, temperature=1.0
  )
  assert float(clipped) == 0.0

  def surrogate(p):
    lp, _ = policy_logprobs(p, cfg, batch, f32, temperature=1.0)
    m = batch.mask
    per_row = jnp.sum(lp * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0)
    rows = jnp.sum(jnp.sum(m, 1) > 0)
    return -jnp.sum(batch.advantages * per_row) / rows

  want = jax.grad(surrogate)(params)
  np.testing.assert_allclose(G.flat(g), G.flat(want), rtol=2e-5, atol=1e-7)


def test_trainer_gradient_refuses_what_it_cannot_measure(setup):
  cfg, params, batch = setup
  for bad in (UpdateConfig(minibatches=2), UpdateConfig(kl_coef=0.1)):
    with pytest.raises(ValueError, match="minibatches = 1"):
      G.trainer_gradient(params, batch, model_config=cfg, cfg=bad, precision=None, temperature=1.0)


def test_same_forward_old_logp_makes_the_first_ratio_one(setup):
  """A pre-update forward that rounds a token 2 nats away (as a separate FP8 program can)
  scales or clips that token's gradient under old_logp='recompute'; 'same_forward' takes the
  ratio's denominator from the differentiated forward, so the gradient is the surrogate's."""
  from jetrl.rl.update import StepSpec, accumulate

  cfg, params, batch = setup
  f32 = Precision("float32")
  lp, _ = policy_logprobs(params, cfg, batch, f32, temperature=1.0)
  off = lp.at[:, 0].add(-2.0)  # every row's first token: ratio e^2 under 'recompute'
  extra = dict(old_logp=off, is_w=jnp.ones_like(lp))

  def grad(old_logp):
    ucfg = UpdateConfig(loss="grpo", old_logp=old_logp)
    spec = StepSpec(cfg, ucfg, f32, 1.0, False, batch.targets.shape[1])
    return G.flat(jax.jit(lambda p: accumulate(p, batch, extra, spec)[0])(params))

  def surrogate(p):
    lp, _ = policy_logprobs(p, cfg, batch, f32, temperature=1.0)
    m = batch.mask
    per_row = jnp.sum(lp * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0)
    return -jnp.sum(batch.advantages * per_row) / jnp.sum(jnp.sum(m, 1) > 0)

  want = G.flat(jax.grad(surrogate)(params))
  np.testing.assert_allclose(grad("same_forward"), want, rtol=2e-5, atol=1e-7)
  assert G.relative_difference(grad("recompute"), want) > 0.1


def test_same_forward_needs_one_step_per_batch():
  from jetrl.config import ConfigError

  for kw in (dict(ppo_epochs=2), dict(minibatches=2)):
    with pytest.raises(ConfigError, match="same_forward"):
      UpdateConfig(old_logp="same_forward", **kw)
