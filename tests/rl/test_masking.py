"""`masked_mean`, the token mean the losses and the SFT step use: the mean over the masked-in
positions (a 0/1 float mask or a bool one), 0 when none are, and a NaN outside the mask does
not reach it (one inside does)."""

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.rl.masking import masked_mean


def test_masked_mean_against_numpy_and_hand_values():
  x = np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], np.float32)
  mask = np.array([[1, 0, 1], [0, 1, 1]], np.float32)
  assert float(masked_mean(x, mask)) == (1.0 + 4.0 + 16.0 + 32.0) / 4
  assert float(masked_mean(x, mask.astype(bool))) == (1.0 + 4.0 + 16.0 + 32.0) / 4
  assert float(masked_mean(x, np.zeros_like(mask))) == 0.0  # no token: 0, not NaN
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 33)).astype(np.float32)
  mask = (rng.random((4, 33)) < 0.5).astype(np.float32)
  ref = (x.astype(np.float64) * mask).sum() / mask.sum()
  np.testing.assert_allclose(float(masked_mean(x, mask)), ref, rtol=1e-6)
  # The gradient: 1 / (masked-in count) at each masked-in position, 0 elsewhere.
  grad = jax.grad(lambda v: masked_mean(v, mask))(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(grad), mask / mask.sum(), rtol=1e-6)


def test_a_nan_outside_the_mask_is_ignored_and_one_inside_is_not():
  x = np.array([[1.0, np.nan, 3.0]], np.float32)
  assert float(masked_mean(x, np.array([[1, 0, 1]], np.float32))) == 2.0
  assert np.isnan(float(masked_mean(x, np.array([[1, 1, 1]], np.float32))))
  # Multiplying by the mask instead would let it through: nan * 0 is nan.
  assert np.isnan((x * np.array([[1, 0, 1]], np.float32)).sum())
