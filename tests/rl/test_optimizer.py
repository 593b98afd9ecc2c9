"""The optimizer of every run: the learning-rate schedules against their formulas, one AdamW
step against numpy, and the skip of non-finite steps (an optax transformation)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jetrl.rl.optimizer import (
  OptimizerConfig,
  learning_rate_schedule,
  make_optimizer,
  schedule_key,
  skip_non_finite,
)


def test_constant_schedule_with_warmup():
  lr = learning_rate_schedule(OptimizerConfig(lr=0.1, warmup_steps=4), total_steps=100)
  assert [float(lr(i)) for i in range(6)] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1])
  assert float(learning_rate_schedule(OptimizerConfig(lr=0.1), 10)(0)) == pytest.approx(0.1)


def test_cosine_schedule_matches_its_formula():
  cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=2, end_lr_ratio=0.1)
  lr = learning_rate_schedule(cfg, total_steps=10)
  for t in range(12):
    if t < 2:
      want = t / 2
    else:
      frac = min(t - 2, 8) / 8
      want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
    assert float(lr(t)) == pytest.approx(want, abs=1e-6), t
  # A warmup longer than the run is cut to the run's length.
  short = learning_rate_schedule(cfg.__class__(lr=1.0, warmup_steps=20), total_steps=4)
  assert [float(short(i)) for i in range(4)] == pytest.approx([0.0, 0.25, 0.5, 0.75])


def test_schedule_key_says_when_the_length_matters():
  const, cosine = OptimizerConfig(), OptimizerConfig(schedule="cosine")
  assert schedule_key(const, 30) == schedule_key(const, 40)
  assert schedule_key(cosine, 30) != schedule_key(cosine, 40)
  warm = OptimizerConfig(warmup_steps=35)
  assert schedule_key(warm, 30) != schedule_key(warm, 40)


def test_one_step_matches_numpy_clip_and_adamw():
  cfg = OptimizerConfig(lr=0.01, max_grad_norm=1.0, weight_decay=0.1, b1=0.9, b2=0.99, eps=1e-6)
  params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5]])}
  grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
  opt = make_optimizer(cfg, total_steps=10)
  updates, state = opt.update(grads, opt.init(params), params)
  norm = 5.0  # sqrt(3^2 + 4^2): clipped to 1
  for k in params:
    g = np.asarray(grads[k]) / norm
    m, v = 0.1 * g, 0.01 * g * g
    m_hat, v_hat = m / 0.1, v / 0.01
    want = -0.01 * (m_hat / (np.sqrt(v_hat) + 1e-6) + 0.1 * np.asarray(params[k]))
    np.testing.assert_allclose(np.asarray(updates[k]), want, rtol=1e-5, atol=1e-7)
  assert int(state.applied) == 1 and int(state.skipped) == 0 and bool(state.last_ok)


def _tree_equal(a, b):
  return all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


@pytest.mark.parametrize("case", ["nan_grad", "inf_loss", "nan_state", "overflowing_params"])
def test_non_finite_steps_are_skipped_and_counted(case):
  # Adam steps of size ~1e37: finite, but enough to push a param near the float32 maximum past
  # it.
  opt = skip_non_finite(optax.chain(optax.scale_by_adam(), optax.scale(-1e37)))
  params = {"w": jnp.array([1.0, 2.0])}
  grads = {"w": jnp.array([0.5, -0.5])}
  state = opt.init(params)
  value = 1.0
  if case == "nan_grad":
    grads = {"w": jnp.array([jnp.nan, 0.5])}
  elif case == "inf_loss":
    value = jnp.inf
  elif case == "nan_state":  # finite loss and gradients, a NaN already in the moments
    mu = state.inner[0].mu
    state = state._replace(
      inner=(state.inner[0]._replace(mu={"w": mu["w"].at[0].set(jnp.nan)}), state.inner[1])
    )
  else:  # an update that would take a param past float32's largest value
    params = {"w": jnp.array([3.39e38, 0.0], jnp.float32)}
    grads = {"w": jnp.array([-1.0, 1.0])}
  update = jax.jit(opt.update)
  updates, new = update(grads, state, params, value=value)
  assert not bool(new.last_ok) and int(new.skipped) == 1 and int(new.applied) == 0
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree_util.tree_leaves(updates))
  assert _tree_equal(new.inner, state.inner)  # the optimizer state is the old one
  # The next finite step is applied (and the NaN state case stays skipped: it never clears).
  fine = {"w": jnp.array([0.5, -0.5])}
  params = {"w": jnp.array([1.0, 2.0])}
  updates, new2 = update(fine, new, params, value=1.0)
  assert bool(new2.last_ok) == (case != "nan_state")
  assert int(new2.applied) + int(new2.skipped) == 2


def test_a_finite_step_equals_the_inner_transformation():
  inner = optax.adamw(1e-2)
  opt = skip_non_finite(inner)
  params = {"w": jnp.arange(4.0)}
  grads = {"w": jnp.array([0.1, -0.2, 0.3, -0.4])}
  want, _ = inner.update(grads, inner.init(params), params)
  got, state = opt.update(grads, opt.init(params), params, value=jnp.float32(2.0))
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
  assert int(state.applied) == 1
