"""The decode step's attention as reductions (`attend_one`, taken when compiling for a GPU)
against a float64 reference and against `attend`'s dots on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.kernels import Device, resolve_plan
from jetrl.kernels import attention as attn
from jetrl.models.attention import causal_mask


def _reference(q, k, v, allowed):
  """float64 masked GQA attention of one query per row: q [B, 1, H, Dh], k / v [B, Hkv, S,
  Dh], allowed [B, 1, S] -> [B, 1, H * Dh]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, _, h, dh = q.shape
  hkv = k.shape[1]
  out = np.zeros((b, h, dh))
  for i in range(b):
    for head in range(h):
      g = head // (h // hkv)
      s = k[i, g] @ q[i, 0, head] / np.sqrt(dh)
      s = np.where(np.asarray(allowed)[i, 0], s, -np.inf)
      p = np.exp(s - s.max())
      out[i, head] = (p / p.sum()) @ v[i, g]
  return out.reshape(b, 1, h * dh)


def _inputs(cd, b=3, h=6, hkv=2, s=40, dh=16, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, 1, h, dh)), cd)
  k = jnp.asarray(rng.normal(size=(b, hkv, s, dh)), cd)
  v = jnp.asarray(rng.normal(size=(b, hkv, s, dh)), cd)
  allowed = rng.random((b, 1, s)) < 0.7
  allowed[:, :, 0] = True  # every row sees a slot
  return q, k, v, jnp.asarray(allowed)


@pytest.mark.parametrize("cd, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_attend_one_matches_float64(cd, tol):
  q, k, v, allowed = _inputs(cd)
  got = np.asarray(jax.jit(lambda *a: attn.attend_one(*a, cd))(q, k, v, allowed), np.float64)
  np.testing.assert_allclose(got, _reference(q, k, v, allowed), atol=tol, rtol=tol)


def test_attend_one_is_attend_up_to_summation_order():
  """The same rounding points as `attend` (bf16 probabilities, float32 sums): on the CPU the
  two agree to a few bf16 ulps of the output, far closer than either to a float32 run."""
  cd = jnp.bfloat16
  q, k, v, allowed = _inputs(cd, seed=1)
  one = np.asarray(attn.attend_one(q, k, v, allowed, cd), np.float32)
  dots = np.asarray(attn.attend(q, k, v, allowed, cd), np.float32)
  ulp = np.abs(dots) * 2.0**-7 + 1e-6
  assert np.max(np.abs(one - dots) / ulp) <= 2.0


def test_attend_takes_the_reductions_only_when_compiling_for_a_gpu():
  cd = jnp.bfloat16
  q, k, v, allowed = _inputs(cd)
  dots = lambda dev: str(jax.make_jaxpr(lambda *a: attn.attend(*a, cd, dev=dev))(q, k, v, allowed))
  assert "dot_general" in dots(Device("cpu"))  # the CPU: attend's two dots
  gpu = Device("gpu", "9.0", compiling=True)
  assert "dot_general" not in dots(gpu)
  # A prefill (several queries a row) keeps the dots on a GPU too.
  q2 = jnp.concatenate([q, q], axis=1)
  a2 = jnp.concatenate([allowed, allowed], axis=1)
  assert "dot_general" in str(jax.make_jaxpr(lambda *a: attn.attend(*a, cd, dev=gpu))(q2, k, v, a2))


def _self_attention_inputs(b=2, t=100, h=4, hkv=2, dh=16, seed=3):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, t, hkv, dh)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, t, hkv, dh)), jnp.float32)
  mask = np.ones((b, t), bool)
  mask[1, :37] = False  # a left-padded row
  return q, k, v, jnp.asarray(mask)


def _dense(q, k, v, mask):
  allowed = causal_mask(mask, q.shape[0], q.shape[1])
  return attn.attend(q, attn.heads_first(k), attn.heads_first(v), allowed, jnp.float32)


def _flash(q, k, v, mask):
  return attn.attend_flash(q, k, v, mask, jnp.float32, interpret=True)


@pytest.fixture(scope="module")
def flash_and_dense():
  """Forward values and the gradients of a masked weighted sum, both ways (interpret mode:
  the Pallas kernels run on the CPU device, also on a GPU machine, where float32 dots would
  be TF32 and the comparison would measure that instead)."""
  with jax.default_device(jax.devices("cpu")[0]):
    q, k, v, mask = _self_attention_inputs()
    w = jnp.asarray(np.random.default_rng(9).normal(size=(2, 100, 64)), jnp.float32)
    w = w * mask[:, :, None]  # the loss sees real tokens only, as the update's does

    def run(fn):
      loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask) * w)
      out = jax.jit(lambda q, k, v: fn(q, k, v, mask))(q, k, v)
      grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
      return np.asarray(out), [np.asarray(g) for g in grads]

    return run(_flash), run(_dense), (q, k, v, mask)


def test_flash_attention_matches_the_float64_reference(flash_and_dense):
  (out, _), _, (q, k, v, mask) = flash_and_dense
  m = np.asarray(mask)
  for i in range(q.shape[0]):
    for t in np.flatnonzero(m[i]):
      allowed = (np.arange(q.shape[1]) <= t) & m[i]
      ref = _reference(
        q[i : i + 1, t : t + 1],
        attn.heads_first(k)[i : i + 1],
        attn.heads_first(v)[i : i + 1],
        jnp.asarray(allowed)[None, None],
      )
      np.testing.assert_allclose(out[i, t], ref[0, 0], atol=2e-5, rtol=2e-5)


def test_flash_attention_gradients_match_the_dense_attention(flash_and_dense):
  """Forward on real tokens and the gradients of a loss over them: the Pallas kernels'
  custom backward against JAX's autodiff of `attend` (float32, so only summation order
  differs). Pad queries' outputs differ by design (the loss never sees them)."""
  (out_f, grads_f), (out_d, grads_d), (_, _, _, mask) = flash_and_dense
  m = np.asarray(mask)
  np.testing.assert_allclose(out_f[m], out_d[m], atol=2e-5, rtol=2e-5)
  for gf, gd, name in zip(grads_f, grads_d, "qkv"):
    np.testing.assert_allclose(gf, gd, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
  assert np.abs(grads_f[1]).max() > 0.01  # the kv heads' gradients, summed over their groups


def test_use_flash_only_for_a_gpu_and_long_enough_rows():
  from jetrl.precision import get_recipe

  bf = jnp.bfloat16
  assert not attn.use_flash(None, 1024, 128, bf, Device("cpu"))
  gpu = Device("gpu", "9.0", compiling=True)
  assert attn.use_flash(None, 1023, 128, bf, gpu) and attn.use_flash(
    get_recipe("jet").train, 128, 64, bf, gpu
  )
  assert not attn.use_flash(None, 64, 128, bf, gpu)  # short rows: XLA's dense attention
  assert not attn.use_flash(None, 1024, 96, bf, gpu)  # the kernel's tiles need a power of two
  assert not attn.use_flash(get_recipe("jet_exact").train, 1024, 128, bf, gpu)  # exact sums
  # A float32 model attends in float32 (the kernel's float32 dots are TF32 on a GPU).
  assert not attn.use_flash(get_recipe("fp32").train, 1024, 128, jnp.float32, gpu)


def test_the_one_kernel_decode_attention_matches_float64():
  """models/decode_attention.py in interpret mode: six query heads a kv head (not a power of
  two), holes in the mask, and slots past n_slots that hold huge values it must not read."""
  from jetrl.kernels import decode_attention as da

  cd = jnp.bfloat16
  q, k, v, _ = _inputs(cd, b=3, h=6, hkv=2, s=192, dh=64, seed=5)
  rng = np.random.default_rng(5)
  mask = rng.random((3, 192)) < 0.6
  mask[:, 0] = True
  k = k.at[:, :, 128:].set(1e4)  # past n_slots = 128: never read
  v = v.at[:, :, 128:].set(jnp.nan)
  got = da.decode_attention(q, k, v, jnp.asarray(mask), 128, cd, interpret=True)
  allowed = jnp.asarray(mask[:, None, :128])
  ref = _reference(q, k[:, :, :128], v[:, :, :128], allowed)
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=2e-2, rtol=2e-2)
  with pytest.raises(ValueError, match="multiple of 64"):
    da.decode_attention(q, k, v, jnp.asarray(mask), 100, cd, interpret=True)


def test_a_gpu_decode_step_attends_in_the_one_kernel():
  """forward_cached compiled for a GPU: a decode step over whole chunks of slots traces the
  Pallas kernel; the CPU keeps `attend`."""
  from jetrl import models as M

  cfg = M.get_config("tiny")
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  cache = M.init_cache(cfg, 2, 128)
  tok = jnp.zeros((2, 1), jnp.int32)

  def step(dev):
    f = lambda p, c, x: M.forward_cached(
      p, cfg, x, c, positions=jnp.zeros((2, 1), jnp.int32), token_mask=jnp.ones((2, 1), bool),
      plan=resolve_plan(None, dev),
    )  # fmt: skip
    return str(jax.make_jaxpr(f)(params, cache, tok))

  assert "pallas_call" not in step(Device("cpu"))
  assert step(Device("gpu", "9.0", compiling=True)).count("name=decode_attention") == cfg.n_layers
