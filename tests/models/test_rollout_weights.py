"""Rollout weights: fused projections keep every part's FP8 values; the fused model computes the
same function as the unfused one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import (
  check_params,
  forward_cached,
  fuse_projections,
  init_cache,
  init_params,
  rollout_weights,
)
from jetrl.precision import get_recipe, quantize
from model_helpers import tiny_config

# Widths that are multiples of 128, so that a blockwise FP8 recipe may fuse.
CFG = tiny_config(vocab=64, d_model=128, heads=(2, 1, 128), d_ff=256, max_seq_len=64, qkv_bias=True)


@pytest.fixture(scope="module")
def params():
  p = init_params(CFG, jax.random.PRNGKey(0))
  # Non-zero biases, so that a bias added to the wrong part shows.
  layers = dict(p["layers"])
  for i, name in enumerate(("bq", "bk", "bv")):
    layers[name] = 0.1 * jax.random.normal(jax.random.PRNGKey(10 + i), layers[name].shape)
  return dict(p, layers=layers)


def test_fused_fp8_blocks_are_the_parts_blocks(params):
  jet = get_recipe("jet").rollout
  fused = rollout_weights(params, jet, fuse=True)["layers"][0]
  assert set(fused) >= {"wqkv", "w_gate_up"} and "wq" not in fused and "w_up" not in fused
  q, s = fused["wqkv"].kn()
  w = params["layers"]
  col = 0
  for name in ("wq", "wk", "wv"):
    ref_q, ref_s = quantize(w[name][0], (128, 128))
    n = ref_q.shape[1]
    np.testing.assert_array_equal(
      np.asarray(q[:, col : col + n]).view(np.uint8), np.asarray(ref_q).view(np.uint8)
    )
    np.testing.assert_array_equal(
      np.asarray(s[:, col // 128 : (col + n) // 128]), np.asarray(ref_s)
    )
    col += n


def test_unaligned_or_per_tensor_weights_are_not_fused(params):
  cfg = tiny_config(vocab=64, d_model=64, heads=(2, 1, 32), d_ff=96, n_layers=1, max_seq_len=32)
  p = init_params(cfg, jax.random.PRNGKey(1))
  layers = fuse_projections(p, get_recipe("jet").rollout)["layers"]
  assert "wqkv" not in layers and "w_gate_up" not in layers  # 32-wide parts: blocks straddle
  assert "wqkv" in fuse_projections(p, get_recipe("bf16").rollout)["layers"]  # no FP8: any width
  assert "wqkv" not in fuse_projections(params, get_recipe("fp8_tensor").rollout)["layers"]


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_fused_model_computes_the_same_logits(params, recipe):
  prec = get_recipe(recipe).rollout
  tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 9), 0, CFG.vocab_size)
  mask = jnp.ones((3, 9), bool).at[0, :4].set(False)
  pos = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  out = {}
  for fuse in (False, True):
    w = rollout_weights(params, prec, fuse=fuse)
    check_params(w, CFG, allow_unstacked=True)
    cache = init_cache(CFG, 3, 16, jnp.bfloat16)
    logits, _ = jax.jit(
      lambda w_, c_: forward_cached(
        w_, CFG, tokens, c_, positions=pos, token_mask=mask, precision=prec
      )
    )(w, cache)
    out[fuse] = np.asarray(logits, np.float64)
  # The same FP8 values and bf16 operands; only the GEMM's column grouping differs, which can
  # move a last bit that FP8 rounding in the next layer occasionally amplifies (jet).
  d = np.abs(out[True] - out[False])
  assert d.max() <= (1e-2 if recipe == "bf16" else 3e-2) * np.abs(out[False]).max()
  assert d.mean() <= 5e-3 * np.abs(out[False]).mean()
