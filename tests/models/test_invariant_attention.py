"""The batch-invariant attention (`jetrl.kernels.invariant_attention`) in Pallas interpret mode:
against float64 numpy, and token t's output bit for bit the same in a training forward's
causal attention (rows left-padded differently), a prefill into a longer cache and a decode
step over the cache read in place (other slots holding other values, the last key block
running past the cache's end); its backward (the flash kernels') against the standard
attention's."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jetrl.kernels import attention as attn
from jetrl.kernels import invariant_attention as ia

BF16 = jnp.bfloat16
H, HKV, DH = 4, 2, 64
T = 70  # a row's tokens: two key blocks and a part
PADS = (3, 0, 11)  # left padding of the training rows
WIDTH = 84  # the training rows' slots


def _causal(mask, **kw):
  return jax.jit(
    lambda q, k, v: ia.attend_causal(
      q, k, v, mask, BF16, interpret=True, reference=attn.attend, **kw
    )
  )


@pytest.fixture(scope="module")
def cached():
  return jax.jit(lambda q, k, v, sl: ia.attend_cache(q, k, v, sl, BF16, interpret=True))


def _rand(rng, *shape):
  return np.asarray(rng.standard_normal(shape), ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def seq():
  """One sequence's q [T, H, Dh], k, v [T, HKV, Dh]."""
  rng = np.random.default_rng(0)
  return _rand(rng, T, H, DH) * 2, _rand(rng, T, HKV, DH) * 2, _rand(rng, T, HKV, DH)


def _place(seq, pads, width, rng):
  """Rows of `width` slots: the sequence after pads[r] pad slots (random values elsewhere);
  q [B, W, H, Dh], k, v [B, W, HKV, Dh], real [B, W]."""
  q0, k0, v0 = seq
  b = len(pads)
  q, k, v = (_rand(rng, b, width, n, DH) for n in (H, HKV, HKV))
  real = np.zeros((b, width), bool)
  for r, p in enumerate(pads):
    n = min(T, width - p)
    q[r, p : p + n], k[r, p : p + n], v[r, p : p + n] = q0[:n], k0[:n], v0[:n]
    real[r, p : p + n] = True
  return q, k, v, real


def _ref64(q, k, v, real):
  """float64 causal attention of bf16-valued operands (probabilities not rounded)."""
  g = H // HKV
  kk = np.repeat(k.astype(np.float64), g, axis=2)
  vv = np.repeat(v.astype(np.float64), g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), kk) / np.sqrt(DH)
  t = q.shape[1]
  ok = np.tril(np.ones((t, t), bool))[None] & real[:, None, :]
  s = np.where(ok[:, None], s, -np.inf)
  with np.errstate(invalid="ignore"):  # pad queries see nothing: NaN rows, not compared
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p, vv).reshape(q.shape[0], t, -1)


@pytest.fixture(scope="module")
def training(seq):
  """The training forward's causal attention over rows of WIDTH slots, left-padded by PADS."""
  q, k, v, real = _place(seq, PADS, WIDTH, np.random.default_rng(1))
  out = _causal(jnp.asarray(real), flash_backward=None)(q, k, v)
  return np.asarray(out.astype(jnp.float32)), (q, k, v, real)


def test_matches_float64(training):
  out, (q, k, v, real) = training
  assert np.isfinite(out).all()  # pad queries too
  want = _ref64(q, k, v, real)
  for r, p in enumerate(PADS):  # the real queries
    n = min(T, WIDTH - p)
    got, ref = out[r, p : p + n], want[r, p : p + n]
    assert np.abs(got - ref).max() <= 2**-7 * np.abs(ref).max()  # bf16 probabilities, output


def test_token_output_is_the_same_in_training_prefill_and_decode(cached, seq, training):
  out, _ = training
  want = out[1, :T]  # row 1 has no padding: token t at slot t
  for r, p in enumerate(PADS):
    n = min(T, WIDTH - p)
    np.testing.assert_array_equal(out[r, p : p + n], want[:n], err_msg=f"training row {r}")
  rng = np.random.default_rng(3)
  # A prefill of the first 40 tokens into a 100-slot cache, 5 and 9 pads first.
  pads, width, n = (5, 9), 100, 40
  q, k, v, real = _place(seq, pads, width, rng)
  kc, vc = (np.swapaxes(a, 1, 2) for a in (k, v))  # the cache's layout
  slots = np.arange(width)
  real &= slots[None] < np.array(pads)[:, None] + n  # the cache holds the prompt only
  sl = ia.slots(jnp.asarray(real), jnp.int32(0), width)
  got = np.asarray(cached(q, kc, vc, sl).astype(jnp.float32))
  np.testing.assert_array_equal(got[0, 5 : 5 + n], want[:n], err_msg="prefill")
  # Decode steps: token t's one query over the cache's slots up to its own, one shared index
  # (row 1's sequence at other slots, row 0's last block past the cache's end at t = 69).
  for t in (40, 63, 64, 69):
    idx = pads[0] + t
    q1 = q[:, idx][:, None]
    real_t = real | ((slots[None] <= idx) & (slots[None] >= np.array(pads)[:, None]))
    sl = ia.slots(jnp.asarray(real_t), jnp.int32(idx), 1)
    got = np.asarray(cached(q1, kc, vc, sl).astype(jnp.float32))
    np.testing.assert_array_equal(got[0, 0], want[t], err_msg=f"decode step {t}")


def test_the_backward_is_the_flash_kernels(seq):
  """The gradients through the flash kernels' backward (fed the invariant forward's output
  and log-sum-exp) against the standard attention's autodiff, pad queries' outputs weighted
  zero (they reach no loss)."""
  q, k, v, real = _place(seq, (2,), 80, np.random.default_rng(2))
  mask = jnp.asarray(real)
  w = np.random.default_rng(4).standard_normal((1, 80, H * DH)) * real[..., None]
  bwd = functools.partial(attn.attend_flash_backward, interpret=True)
  kern = lambda q, k, v: ia.attend_causal(
    q, k, v, mask, BF16, interpret=True, flash_backward=bwd, reference=None
  )
  allowed = jnp.tril(jnp.ones((80, 80), bool))[None] & mask[:, None, :]
  heads = lambda a: jnp.swapaxes(a, 1, 2)
  ref = lambda q, k, v: attn.attend(q, heads(k), heads(v), allowed, BF16)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)
  args = tuple(jnp.asarray(a) for a in (q, k, v))
  got = jax.jit(jax.grad(loss(kern), argnums=(0, 1, 2)))(*args)
  want = jax.grad(loss(ref), argnums=(0, 1, 2))(*args)
  for a, b in zip(got, want):  # the same function of nearly the same forward values
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    assert np.abs(a - b).max() <= 0.02 * np.abs(b).max()
