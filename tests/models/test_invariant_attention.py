"""The batch-invariant attention (`jetrl.kernels.invariant_attention`) in Pallas interpret mode:
against float64 numpy, and token t's output bit for bit the same in a training forward's
causal attention, a prefill into a longer cache, a decode step over the cache (other slots
holding other values) and the same row moved right by more left padding among other rows."""

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


@pytest.fixture(scope="module")
def fn():
  return jax.jit(lambda q, k, v, ok: ia.attend(q, k, v, ok, BF16, interpret=True, reference=None))


def _rand(rng, *shape):
  return np.asarray(rng.standard_normal(shape), ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def seq():
  """One sequence's q [T, H, Dh], k, v [HKV, T, Dh]."""
  rng = np.random.default_rng(0)
  return _rand(rng, T, H, DH) * 2, _rand(rng, HKV, T, DH) * 2, _rand(rng, HKV, T, DH)


def _place(seq, pads, width, rng):
  """Rows of `width` slots: the sequence after pads[r] pad slots (random values elsewhere)."""
  q0, k0, v0 = seq
  b = len(pads)
  q, k, v = (
    _rand(rng, b, width, H, DH),
    _rand(rng, b, HKV, width, DH),
    _rand(rng, b, HKV, width, DH),
  )
  real = np.zeros((b, width), bool)
  for r, p in enumerate(pads):
    n = min(T, width - p)
    q[r, p : p + n], k[r, :, p : p + n], v[r, :, p : p + n] = q0[:n], k0[:, :n], v0[:, :n]
    real[r, p : p + n] = True
  return q, k, v, real


def _ref64(q, k, v, ok):
  """float64 attention of bf16-valued operands (probabilities not rounded)."""
  g = H // HKV
  kk = np.repeat(k.astype(np.float64), g, axis=1)
  vv = np.repeat(v.astype(np.float64), g, axis=1)
  s = np.einsum("bthd,bhsd->bhts", q.astype(np.float64), kk) / np.sqrt(DH)
  s = np.where(ok[:, None], s, -np.inf)
  with np.errstate(invalid="ignore"):  # pad queries see nothing: NaN rows, not compared
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bhsd->bthd", p, vv).reshape(q.shape[0], q.shape[1], -1)


@pytest.fixture(scope="module")
def training(fn, seq):
  """The training forward's causal attention over rows of 96 slots, left-padded by PADS."""
  q, k, v, real = _place(seq, PADS, 96, np.random.default_rng(1))
  ok = np.tril(np.ones((96, 96), bool))[None] & real[:, None, :]
  return np.asarray(fn(q, k, v, ok).astype(jnp.float32)), (q, k, v, ok)


def test_matches_float64(training):
  out, (q, k, v, ok) = training
  want = _ref64(q, k, v, ok)
  for r, p in enumerate(PADS):  # the real queries
    got, ref = out[r, p : p + T], want[r, p : p + T]
    assert np.abs(got - ref).max() <= 2**-7 * np.abs(ref).max()  # bf16 probabilities, output


def test_reference_attention_is_the_backward(seq):
  q, k, v, real = _place(seq, (2,), 80, np.random.default_rng(2))
  ok = np.tril(np.ones((80, 80), bool))[None] & real[:, None, :]
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, ok).astype(jnp.float32) ** 2)
  kern = lambda q, k, v, a: ia.attend(q, k, v, a, BF16, interpret=True, reference=attn.attend)
  ref = lambda q, k, v, a: attn.attend(q, k, v, a, BF16)
  args = tuple(jnp.asarray(a) for a in (q, k, v))
  got = jax.grad(loss(kern), argnums=(0, 1, 2))(*args)
  want = jax.grad(loss(ref), argnums=(0, 1, 2))(*args)
  for a, b in zip(got, want):  # the same function of nearly the same forward values
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()


def test_token_output_is_the_same_in_training_prefill_and_decode(fn, seq, training):
  out, _ = training
  want = out[1, :T]  # row 1 has no padding: token t at slot t
  for r, p in enumerate(PADS):
    np.testing.assert_array_equal(out[r, p : p + T], want, err_msg=f"training row {r}")
  rng = np.random.default_rng(3)
  # A prefill of the first 40 tokens into a 128-slot cache, 5 pads first, other rows beside it.
  pads, width, n = (5, 9), 128, 40
  q, k, v, real = _place(seq, pads, width, rng)
  slots = np.arange(width)
  real &= slots[None] < np.array(pads)[:, None] + n  # the cache holds the prompt only
  ok = (slots[None, :] <= slots[:, None])[None] & real[:, None, :]
  got = np.asarray(fn(q, k, v, ok).astype(jnp.float32))
  np.testing.assert_array_equal(got[0, 5 : 5 + n], want[:n], err_msg="prefill")
  # Decode steps: token t's one query over the cache's slots up to its own.
  for t in (40, 63, 64, 69):
    idx = np.array(pads) + t
    q1 = np.stack([q[r, i] for r, i in enumerate(idx)])[:, None]
    real_t = real | ((slots[None] <= idx[:, None]) & (slots[None] >= np.array(pads)[:, None]))
    ok1 = (real_t & (slots[None] <= idx[:, None]))[:, None]
    got = np.asarray(fn(q1, k, v, ok1).astype(jnp.float32))
    np.testing.assert_array_equal(got[0, 0], want[t], err_msg=f"decode step {t}")
