"""The FP8 KV cache (`kv_cache="fp8"`): its layout and bytes, the decode attention reading FP8
keys and values with their scales (the Pallas kernel in interpret mode, against a float64
attention over the dequantized keys and values), and a decode step traced for a GPU and run
here against the CPU's."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jetrl import models as M
from jetrl.kernels import decode_attention as da
from jetrl.kernels import resolve_plan
from jetrl.kernels.device import Device
from jetrl.models.cache import cache_bytes
from jetrl.precision import get_recipe
from jetrl.precision.kv_cache import quantize_kv
from model_helpers import perturbed, tiny_config

BF16 = jnp.bfloat16
JET8 = get_recipe("jet", kv_cache="fp8")


def _nbytes(cache):
  return sum(a.nbytes for a in cache.k + cache.v + cache.k_scale + cache.v_scale + cache.v_exp)


@pytest.mark.parametrize("preset_or_dh", ["tiny", 128, 192])
def test_the_cache_holds_fp8_values_and_scales_in_half_the_bytes(preset_or_dh):
  if preset_or_dh == "tiny":
    cfg = M.get_config("tiny")  # head size 64: one group of 64 a head
  else:
    dh = preset_or_dh
    cfg = tiny_config("llama", vocab=64, d_model=128, heads=(4, 2, dh), d_ff=128)
  b, s = 3, 40
  groups = -(-cfg.head_dim // 128)  # 192: a group of 128 and one of 64
  plain = M.init_cache(cfg, b, s, BF16, precision=get_recipe("jet").rollout)
  fp8 = M.init_cache(cfg, b, s, BF16, precision=JET8.rollout)
  assert fp8.k[0].dtype == jnp.float8_e4m3fn and fp8.v[0].dtype == jnp.float8_e4m3fn
  assert fp8.k[0].shape == plain.k[0].shape == (b, cfg.n_kv_heads, s, cfg.head_dim)
  assert fp8.k_scale[0].shape == (b, cfg.n_kv_heads, s, groups)
  assert fp8.k_scale[0].dtype == jnp.float32 and len(fp8.v_scale) == cfg.n_layers
  assert plain.k_scale == () and plain.v_scale == ()
  # By hand: bf16 keys and values 2 bytes an entry; FP8 ones 1 byte plus 4 a group.
  entries = 2 * cfg.n_layers * b * s * cfg.n_kv_heads
  assert _nbytes(plain) == cache_bytes(cfg, b, s, 2) == entries * cfg.head_dim * 2
  assert _nbytes(fp8) == cache_bytes(cfg, b, s, 2, fp8=True)
  assert _nbytes(fp8) == _nbytes(plain) // 2 + entries * 4 * groups
  # jet_exact's FP8 cache keeps no value exponents (its attention grids at every step).
  exact = M.init_cache(cfg, b, s, BF16, precision=get_recipe("jet_exact", kv_cache="fp8").rollout)
  assert exact.v_exp == () and _nbytes(exact) == _nbytes(fp8)


def test_a_cache_of_the_wrong_kind_is_refused():
  cfg = M.get_config("tiny")
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  tok = jnp.zeros((2, 1), jnp.int32)
  kw = dict(positions=jnp.zeros((2, 1), jnp.int32), token_mask=jnp.ones((2, 1), bool))
  with pytest.raises(ValueError, match="cache.k_scale must be 2 per-layer arrays"):
    M.forward_cached(params, cfg, tok, M.init_cache(cfg, 2, 8), precision=JET8.rollout, **kw)
  with pytest.raises(ValueError, match="cache.k_scale must be empty"):
    c = M.init_cache(cfg, 2, 8, precision=JET8.rollout)
    M.forward_cached(params, cfg, tok, c, precision=get_recipe("jet").rollout, **kw)


def _dequantized64(q, s):
  """The values attention reads from E4M3 q [..., Dh <= 128] with one scale a head s [..., 1]:
  q * s (exact in float64), rounded to bf16 (via float32, as the spec's float32 product)."""
  x = np.asarray(q).astype(np.float64) * np.asarray(s, np.float64)
  return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _attention64(q, k, v, allowed):
  """float64 GQA attention of one query a row: q [B, 1, H, Dh], k / v [B, Hkv, S, Dh],
  allowed [B, S] -> [B, 1, H * Dh]."""
  q = np.asarray(q, np.float64)
  b, _, h, dh = q.shape
  g = h // k.shape[1]
  out = np.zeros((b, h, dh))
  for i in range(b):
    for head in range(h):
      sc = k[i, head // g] @ q[i, 0, head] / np.sqrt(dh)
      sc = np.where(allowed[i], sc, -np.inf)
      p = np.exp(sc - sc.max())
      out[i, head] = p @ v[i, head // g] / p.sum()
  return out.reshape(b, 1, h * dh)


@pytest.mark.parametrize("dh", [64, 128])
def test_the_decode_kernel_reads_fp8_keys_and_values_against_float64(dh):
  """Six query heads a kv head, holes in the mask, keys and values of rows and heads of very
  different magnitudes (the scales carry them), and slots past n_slots that hold huge values
  and NaN scales the kernel must not read."""
  rng = np.random.default_rng(dh)
  b, h, hkv, s, n = 3, 6, 2, 192, 128
  q = jnp.asarray(rng.normal(size=(b, 1, h, dh)), BF16)
  mag = lambda lo, hi: np.exp(rng.uniform(lo, hi, size=(b, hkv, s, 1)))
  k = jnp.asarray(rng.normal(size=(b, hkv, s, dh)) * mag(-4, 1), BF16)
  v = jnp.asarray(rng.normal(size=(b, hkv, s, dh)) * mag(-6, 6), BF16)
  (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
  ks, vs = ks.at[:, :, n:].set(jnp.nan), vs.at[:, :, n:].set(jnp.nan)  # never read
  kq = kq.at[:, :, n:].set(448.0)
  mask = rng.random((b, s)) < 0.6
  mask[:, 0] = True
  got = da.decode_attention(q, kq, vq, jnp.asarray(mask), n, BF16, scales=(ks, vs), interpret=True)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  kd, vd = _dequantized64(kq, ks)[:, :, :n], _dequantized64(vq, vs)[:, :, :n]
  ref = _attention64(q, kd, vd, mask[:, :n])
  # The kernel rounds its probabilities to bf16 and sums in float32: within that rounding of
  # the largest value its row's kv head holds.
  tol = 2e-2 * np.abs(vd).max(axis=(2, 3)).repeat(h // hkv * dh, axis=1).reshape(ref.shape)
  assert np.all(np.abs(np.asarray(got, np.float64) - ref) <= tol)
  # The same kernel over a bf16 cache of the dequantized values gives the same bits.
  kb = (kq.astype(jnp.float32) * ks).astype(BF16)
  vb = (vq.astype(jnp.float32) * vs).astype(BF16)
  plain = da.decode_attention(q, kb, vb, jnp.asarray(mask), n, BF16, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain, np.float32))
  with pytest.raises(ValueError, match="head size up to 128"):
    wide = jnp.zeros((b, hkv, s, 256), jnp.float8_e4m3fn)
    da.decode_attention(
      jnp.zeros((b, 1, h, 256), BF16), wide, wide, jnp.asarray(mask), n, BF16,
      scales=(ks, vs), interpret=True,
    )  # fmt: skip


# Head size 128, a fused q / k / v rollout weight and no q / k norm: without an FP8 cache a GPU
# decode step runs the fused attention-block kernel (which writes a bf16 cache).
CFG = tiny_config("qwen2", vocab=96, d_model=256, heads=(4, 2, 128), d_ff=384, max_seq_len=256)


@pytest.fixture(scope="module")
def decode_runs():
  """A prefill of 2 rows x 24 tokens into an FP8 cache, then one decode step: on the CPU, and
  traced for a GPU and run here (its Pallas kernels interpreted)."""
  params = perturbed(M.init_params(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.05)
  prec = JET8.rollout
  weights = M.rollout_weights(params, prec)
  rows, prompt = 2, 24
  tokens = jax.random.randint(jax.random.PRNGKey(2), (rows, prompt + 1), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(prompt + 1), (rows, prompt + 1))
  cache = M.init_cache(CFG, rows, 64, precision=prec)
  _, cache = M.forward_cached(weights, CFG, tokens[:, :prompt], cache, positions=pos[:, :prompt],
                              token_mask=jnp.ones((rows, prompt), bool), precision=prec)  # fmt: skip
  full = M.forward(params, CFG, tokens, precision=JET8.train)[:, -1]
  p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)

  def step(plan):
    return lambda w, c, t: M.forward_cached(
      w, CFG, t, c, positions=pos[:, prompt:], token_mask=jnp.ones((rows, 1), bool),
      precision=prec, attend_slots=64, plan=plan,
    )  # fmt: skip

  gpu = resolve_plan(prec, Device("gpu", "9.0", interpret=True))
  args = (weights, cache, tokens[:, prompt:])
  return {
    "cpu": jax.jit(step(resolve_plan(prec)))(*args),
    "gpu": jax.jit(step(gpu))(*args),
    "jaxpr": str(jax.make_jaxpr(step(gpu))(*args)),
    "forward": full,
    "float32": M.forward(p32, CFG, tokens)[:, -1],  # no rounding to FP8 or bf16
  }


def test_a_gpu_decode_step_reads_the_fp8_cache_in_the_one_kernel(decode_runs):
  jaxpr = decode_runs["jaxpr"]
  assert jaxpr.count("name=decode_attention_64slots") == CFG.n_layers
  assert "decode_step_attention" not in jaxpr and "decode_norm_quant" not in jaxpr
  (logits, cache), (gpu_logits, gpu_cache) = decode_runs["cpu"], decode_runs["gpu"]
  # The prefill's slots are kept as they were. The new slot (24) of the first layer is
  # quantized from the same keys and values on either path, so it is the same; a later
  # layer's come after an attention summed in another order.
  for i, (a, b) in enumerate(zip(gpu_cache.k + gpu_cache.v, cache.k + cache.v)):
    assert a.dtype == jnp.float8_e4m3fn
    a, b = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
    np.testing.assert_array_equal(a if i % CFG.n_layers == 0 else np.delete(a, 24, axis=2),
                                  b if i % CFG.n_layers == 0 else np.delete(b, 24, axis=2))  # fmt: skip
  for i, (a, b) in enumerate(
    zip(gpu_cache.k_scale + gpu_cache.v_scale, cache.k_scale + cache.v_scale)
  ):
    np.testing.assert_array_equal(np.delete(a, 24, axis=2), np.delete(b, 24, axis=2))
    np.testing.assert_allclose(a[:, :, 24], b[:, :, 24], rtol=0 if i % CFG.n_layers == 0 else 0.1)
  assert int(gpu_cache.index) == 25
  # The CPU's decode step is the training forward's (which reads the same rounded keys and
  # values) up to the engine's floor. The kernel sums in another order (and FP8 values moved
  # across a rounding boundary by that): as far from a float32 forward as the CPU's decode
  # step is, and nearer to the CPU's than that (the criteria of the bf16 cache's kernels,
  # tests/models/test_decode_fused.py).
  err = lambda a: float(jnp.mean(jnp.abs(a[:, -1] - decode_runs["float32"])))
  assert float(jnp.mean(jnp.abs(logits[:, -1] - decode_runs["forward"]))) <= 0.25 * err(logits)
  assert err(gpu_logits) <= 1.15 * err(logits), (err(gpu_logits), err(logits))
  assert float(jnp.mean(jnp.abs(gpu_logits - logits))) <= 0.7 * err(logits)
