"""The LM head with its backward in bf16 (`jetrl.kernels.head.head_dot`, a GPU's form of `lm_head`)
against a float64 reference of the same rounding points."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jetrl.kernels import Device, head, resolve_plan
from jetrl.models import layers


def _bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("tied", [False, True])
def test_head_dot_values_and_gradients(tied):
  rng = np.random.default_rng(int(tied))
  b, t, d, v = 2, 3, 32, 48
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(v, d) if tied else (d, v)), jnp.bfloat16)
  g = rng.normal(size=(b, t, v)).astype(np.float32)  # a float32 logit gradient
  logits, vjp = jax.vjp(lambda a, c: head.head_dot(a, c, tied), h, w)
  dh, dw = vjp(jnp.asarray(g))
  h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
  wk = w64.T if tied else w64  # [D, V]
  np.testing.assert_allclose(np.asarray(logits), h64 @ wk, rtol=1e-5, atol=1e-5)
  g64 = _bf16(g)  # the gradient rounded to bf16, then float32 sums, then bf16 results
  ref_dh = g64 @ wk.T
  ref_dw_dv = np.einsum("btd,btv->dv", h64, g64)
  ref_dw = ref_dw_dv.T if tied else ref_dw_dv
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(dh, np.float64), _bf16(ref_dh), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(dw, np.float64), _bf16(ref_dw), rtol=1e-2, atol=1e-2)
  # Not the float32 products of JAX's own transpose: the rounding of g shows.
  assert np.abs(np.asarray(dh, np.float64) - _bf16(np.asarray(g, np.float64) @ wk.T)).max() > 0


def test_lm_head_takes_it_only_when_compiling_for_a_gpu():
  from jetrl.models import get_config, init_params

  cfg = get_config("tiny")
  params = init_params(cfg, jax.random.PRNGKey(0))
  h = jnp.zeros((2, 3, cfg.d_model), jnp.bfloat16)
  jaxpr = lambda plan=None: str(
    jax.make_jaxpr(lambda p, x: layers.lm_head(x, p, cfg, jnp.bfloat16, plan))(params, h)
  )
  if jax.default_backend() == "cpu":
    assert "custom_vjp" not in jaxpr()
  assert "custom_vjp" not in jaxpr(resolve_plan(None, Device("cpu")))
  assert "custom_vjp" in jaxpr(resolve_plan(None, Device("gpu", "9.0", compiling=True)))
