"""A GPU decode step's fused kernels (models/decode_attention.decode_step_attention,
models/decode_fused.py) in interpret mode on the CPU: each against an independent reference
(float64 numpy, the XLA forward's own ops, `quantize` bit for bit), and a whole decode step
traced for a GPU and run here (a plan for `Device("gpu", interpret=True)`) against the CPU's forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.models import attention as attn
from jetrl.kernels import decode_attention as da
from jetrl.kernels import decode_fused as fu
from jetrl.models.layers import apply_rope, rms_norm
from jetrl.kernels import Device, linear, resolve_plan
from jetrl.precision import QuantizedInput, get_recipe, prequantize_weight, quantize
from model_helpers import perturbed, tiny_config

BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
B, H, HKV, DH, S, N, IDX = 3, 6, 2, 128, 192, 128, 77


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else
                                                 jnp.uint16 if a.dtype.itemsize == 2 else
                                                 jnp.uint32))  # fmt: skip


def _ulps(a, b):
  """|a - b| in bf16 ulps of b (float32 views of bf16 arrays)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.abs(a - b) / np.maximum(np.abs(b) * 2.0**-8, 1e-30)


@pytest.fixture(scope="module")
def step_inputs():
  rng = np.random.default_rng(0)
  y = jnp.asarray(rng.normal(size=(B, 1, (H + 2 * HKV) * DH)), BF16)
  bias = tuple(
    jnp.asarray(0.5 * rng.normal(size=(n * DH,)), BF16) for n in (H, HKV, HKV)
  )  # fmt: skip
  ang = rng.uniform(0, 6, size=(B, 1, DH // 2))
  ang = np.concatenate([ang, ang], -1)
  cos, sin = jnp.asarray(np.cos(ang), BF16), jnp.asarray(np.sin(ang), BF16)
  kc = jnp.asarray(rng.normal(size=(B, HKV, S, DH)), BF16).at[:, :, N:].set(1e4)
  vc = jnp.asarray(rng.normal(size=(B, HKV, S, DH)), BF16).at[:, :, N:].set(jnp.nan)
  mask = rng.random((B, S)) < 0.6
  mask[:, IDX] = True
  mask[:, IDX + 1 :] = False
  mask[2, IDX] = False  # a row whose new token is masked (a finished row)
  mask[:, 0] = True
  return y, bias, cos, sin, kc, vc, jnp.asarray(mask)


def _step(inputs, quant=None):
  y, bias, cos, sin, kc, vc, mask = inputs
  return da.decode_step_attention(
    y, bias, cos, sin, kc, vc, mask, jnp.int32(IDX), N, BF16, n_heads=H, quant=quant,
    interpret=True,
  )  # fmt: skip


def _reference_qkv(inputs):
  """The XLA forward's q / k / v: the bias added in bf16, then `layers.apply_rope`."""
  y, bias, cos, sin = inputs[:4]
  yy = y + jnp.concatenate(bias)
  q = yy[..., : H * DH].reshape(B, 1, H, DH)
  k = yy[..., H * DH : (H + HKV) * DH].reshape(B, 1, HKV, DH)
  v = yy[..., (H + HKV) * DH :].reshape(B, 1, HKV, DH)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def test_step_attention_writes_the_cache_as_the_xla_forward(step_inputs):
  q, k, v = _reference_qkv(step_inputs)
  kc, vc = step_inputs[4:6]
  _, k2, v2 = _step(step_inputs)
  want_k = jax.lax.dynamic_update_slice(kc, attn.heads_first(k), (0, 0, IDX, 0))
  want_v = jax.lax.dynamic_update_slice(vc, attn.heads_first(v), (0, 0, IDX, 0))
  np.testing.assert_array_equal(_bits(k2), _bits(want_k))  # RoPE's rounding points kept
  np.testing.assert_array_equal(_bits(v2), _bits(want_v))  # slots past n_slots untouched


def test_step_attention_matches_float64(step_inputs):
  q, k, v = _reference_qkv(step_inputs)
  kc, vc, mask = step_inputs[4:]
  kr = np.asarray(jax.lax.dynamic_update_slice(kc, attn.heads_first(k), (0, 0, IDX, 0)), np.float64)
  vr = np.asarray(jax.lax.dynamic_update_slice(vc, attn.heads_first(v), (0, 0, IDX, 0)), np.float64)
  q64, m = np.asarray(q, np.float64), np.asarray(mask)
  want = np.zeros((B, H, DH))
  for i in range(B):
    for h in range(H):
      g = h // (H // HKV)
      s = kr[i, g, :N] @ q64[i, 0, h] / np.sqrt(DH)
      s = np.where(m[i, :N], s, -np.inf)
      p = np.exp(s - s.max())
      want[i, h] = (p / p.sum()) @ vr[i, g, :N]
  out, _, _ = _step(step_inputs)
  np.testing.assert_allclose(np.asarray(out, np.float64).reshape(B, H, DH), want, atol=2e-2)
  # and as close to the unfused kernel over the updated cache as float32 reordering allows
  seen = mask & (jnp.arange(S) <= IDX)[None]
  old = da.decode_attention(q, jnp.asarray(kr, BF16), jnp.asarray(vr, BF16), seen, N, BF16,
                            interpret=True)  # fmt: skip
  assert np.max(np.abs(np.asarray(out, np.float32) - np.asarray(old, np.float32))) <= 2**-8


def test_step_attention_quantized_output_is_quantize_of_its_output(step_inputs):
  out, _, _ = _step(step_inputs)
  (q, s_t), k2, v2 = _step(step_inputs, quant=E4M3)
  want_q, want_s = quantize(out.reshape(B, H * DH), (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(q), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(s_t), np.asarray(want_s).T)
  with pytest.raises(ValueError, match="multiple of 64"):
    y, bias, cos, sin, kc, vc, mask = step_inputs
    da.decode_step_attention(y, bias, cos, sin, kc, vc, mask, jnp.int32(IDX), 100, BF16,
                             n_heads=H, interpret=True)  # fmt: skip


@pytest.mark.parametrize("residual", [False, True])
def test_norm_quant(residual):
  rng = np.random.default_rng(1)
  m, d = 16, 384
  x = jnp.asarray(3 * rng.normal(size=(m, d)), BF16)
  delta = jnp.asarray(rng.normal(size=(m, d)), BF16) if residual else None
  w = jnp.asarray(1 + 0.1 * rng.normal(size=(d,)), BF16)
  x_new, qin, h = fu.norm_quant(x, delta, w, 1e-6, BF16, E4M3, interpret=True, values=True)
  want_x = x + delta if residual else x
  np.testing.assert_array_equal(_bits(x_new), _bits(want_x))
  # The norm: within one bf16 ulp of layers.rms_norm (its statistic summed in another order),
  # and of float64.
  want_h = rms_norm(want_x, w, 1e-6, BF16)
  assert np.max(_ulps(h, want_h)) <= 2.0 and np.mean(_bits(h) == _bits(want_h)) > 0.95
  x64 = np.asarray(want_x, np.float64)
  h64 = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(h, np.float64), h64, rtol=2e-2, atol=1e-2)
  # The quantization: quantize's, bit for bit, of the value it stands for.
  want_q, want_s = quantize(h, (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(qin.q), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(qin.scale_t), np.asarray(want_s).T)


def test_swiglu_quant():
  rng = np.random.default_rng(2)
  m, f = 16, 256
  gu = jnp.asarray(2 * rng.normal(size=(m, 2 * f)), BF16)
  qin, h = fu.swiglu_quant(gu, BF16, E4M3, interpret=True, values=True)
  gate, up = jnp.split(gu, 2, axis=-1)
  want = jax.nn.silu(gate) * up  # layers.swiglu's product, its operations rounded as here
  np.testing.assert_array_equal(_bits(h), _bits(want))
  g64, u64 = np.asarray(gate, np.float64), np.asarray(up, np.float64)
  np.testing.assert_allclose(np.asarray(h, np.float64), g64 / (1 + np.exp(-g64)) * u64,
                             rtol=3e-2, atol=1e-2)  # fmt: skip
  want_q, want_s = quantize(h, (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(qin.q), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(qin.scale_t), np.asarray(want_s).T)
  with pytest.raises(ValueError, match="multiple of 8"):
    fu.swiglu_quant(gu[:5], BF16, E4M3, interpret=True)


def test_linear_of_a_quantized_input_is_linear_of_the_activation():
  """XLA's FP8 fprop from the given groups: the same product as quantizing x itself."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(16, 256)), BF16)
  w = jnp.asarray(0.05 * rng.normal(size=(256, 384)), jnp.float32)
  rollout = get_recipe("jet").rollout
  wq = prequantize_weight(w, rollout.fprop)
  q, s = quantize(x, (1, 128), E4M3)
  got = linear(QuantizedInput(q, s.T), wq, rollout)
  np.testing.assert_array_equal(_bits(got), _bits(linear(x, wq, rollout)))
  with pytest.raises(ValueError, match="forward-only FP8 precision"):
    linear(QuantizedInput(q, s.T), wq, get_recipe("jet").train)
  with pytest.raises(ValueError, match="not batch-invariant"):
    linear(QuantizedInput(q, s.T), wq, get_recipe("jet_exact").rollout)
  with pytest.raises(ValueError, match="QuantizedWeight"):
    linear(QuantizedInput(q, s.T), w, rollout)
  with pytest.raises(ValueError, match="scales"):
    linear(QuantizedInput(q, s), wq, rollout)


# A decode step traced for a GPU and run here: head size 128 and widths of whole groups (the
# fused path's shapes), biases (Qwen's), 8 rows, a cache of one 64-slot chunk.
CFG = tiny_config("qwen2", vocab=96, d_model=256, heads=(4, 2, 128), d_ff=384, max_seq_len=64)


@pytest.fixture(scope="module")
def decode_runs():
  params = perturbed(M.init_params(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.05)
  rows, prompt = 8, 5
  tokens = jax.random.randint(jax.random.PRNGKey(2), (rows, prompt + 1), 0, CFG.vocab_size)
  p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
  runs = {"float32": M.forward(p32, CFG, tokens)[:, -1]}  # the reference: no rounding to bf16
  for recipe in ("bf16", "jet"):
    prec = get_recipe(recipe).rollout
    weights = M.rollout_weights(params, prec)
    cache = M.init_cache(CFG, rows, 64)
    pos = jnp.broadcast_to(jnp.arange(prompt + 1), (rows, prompt + 1))
    ones = jnp.ones((rows, 1), bool)
    _, cache = M.forward_cached(weights, CFG, tokens[:, :prompt], cache, positions=pos[:, :prompt],
                                token_mask=jnp.ones((rows, prompt), bool), precision=prec)  # fmt: skip

    def step(plan=None):
      return lambda w, c, t: M.forward_cached(
        w, CFG, t, c, positions=pos[:, prompt:], token_mask=ones, precision=prec, attend_slots=64,
        plan=plan,
      )  # fmt: skip

    plain = jax.jit(step())(weights, cache, tokens[:, prompt:])
    on_gpu = resolve_plan(prec, Device("gpu", interpret=True))  # a GPU's program, run here
    jaxpr = str(jax.make_jaxpr(step(on_gpu))(weights, cache, tokens[:, prompt:]))
    gpu = jax.jit(step(on_gpu))(weights, cache, tokens[:, prompt:])
    runs[recipe] = (plain, gpu, jaxpr)
  return runs


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_a_gpu_decode_step_run_here_matches_the_cpu_forward(decode_runs, recipe):
  (logits, cache), (gpu_logits, gpu_cache), jaxpr = decode_runs[recipe]
  assert jaxpr.count("name=decode_step_attention") == CFG.n_layers
  fused = jaxpr.count("name=decode_norm_quant"), jaxpr.count("name=decode_swiglu_quant")
  assert fused == ((2 * CFG.n_layers, CFG.n_layers) if recipe == "jet" else (0, 0))
  # Summed in other orders (and under jet, FP8 values moved across a rounding boundary by
  # them): as far from a float32 forward as the CPU's forward is, and nearer to it than that.
  ref = decode_runs["float32"]
  err = lambda a: float(jnp.mean(jnp.abs(a[:, -1] - ref)))
  assert err(gpu_logits) <= 1.15 * err(logits), (err(gpu_logits), err(logits))
  assert float(jnp.mean(jnp.abs(gpu_logits - logits))) <= 0.7 * err(logits)
  for a, b in zip(gpu_cache.k + gpu_cache.v, cache.k + cache.v):
    assert np.mean(_bits(a) == _bits(b)) > 0.97
  np.testing.assert_array_equal(np.asarray(gpu_cache.mask), np.asarray(cache.mask))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Triton kernels")
def test_the_compiled_kernels_quantize_what_they_compute(step_inputs):
  """On a GPU: the kernels compiled, not interpreted. Their FP8 values and scales are
  `quantize`'s of the bf16 value each computed; the cache write is the XLA forward's."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(64, 1536)), BF16)
  d = jnp.asarray(rng.normal(size=(64, 1536)), BF16)
  w = jnp.asarray(1 + 0.1 * rng.normal(size=(1536,)), BF16)
  x_new, qin, h = fu.norm_quant(x, d, w, 1e-6, BF16, E4M3, values=True)
  want_q, want_s = quantize(h, (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(qin.q), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(qin.scale_t), np.asarray(want_s).T)
  np.testing.assert_array_equal(_bits(x_new), _bits(x + d))
  gu = jnp.asarray(rng.normal(size=(64, 2 * 1024)), BF16)
  qin, h = fu.swiglu_quant(gu, BF16, E4M3, values=True)
  want_q, want_s = quantize(h, (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(qin.q), _bits(want_q))
  y, bias, cos, sin, kc, vc, mask = step_inputs
  run = lambda quant: da.decode_step_attention(
    y, bias, cos, sin, kc, vc, mask, jnp.int32(IDX), N, BF16, n_heads=H, quant=quant
  )
  out, k2, _ = run(None)
  (q, s_t), _, _ = run(E4M3)
  want_q, want_s = quantize(out.reshape(B, H * DH), (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(q), _bits(want_q))
  np.testing.assert_array_equal(_bits(k2), _bits(_step(step_inputs)[1]))
