"""`jet_exact`'s gridded KV cache and LM head: keys, values and LM head weights rounded to
their grids once, against a reference written with Python integers (exact by construction),
bit for bit; and the cached decode against the full-sequence forward.

The reference follows the formula of docs/numerics.md ("Bitwise on-policy"): each vector on
the grid 2^(e - bits) of its own largest entry, integer dots, the probabilities' two levels of
16 bits. Its exponentials are `exp64`'s (tested against numpy in tests/precision).
"""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jetrl import models as M
from jetrl.kernels import Device, KernelConfig
from jetrl.kernels import attention as attn
from jetrl.kernels import exact_ops
from jetrl.models.params import LM_HEAD_GRID
from jetrl.precision import get_recipe
from jetrl.precision.exact import dot_bits

EXACT = get_recipe("jet_exact")
# The suite's fast-compile XLA flags (tests/conftest.py), left out of the decode case's process.
FAST_COMPILE_FLAG_NAMES = (
  "--xla_backend_optimization_level",
  "--xla_llvm_disable_expensive_passes",
)
BF16 = ml_dtypes.bfloat16
B, HKV, G, DH, S = 2, 2, 2, 64, 12


def _grid(x, bits, floor=None):
  """(integers n, exponent e): x ~= n 2^(e - bits), 2^e > max |x|, e >= floor (bits - 126
  for bf16 vectors, -900 for float64 ones)."""
  x = np.asarray(x, np.float64)
  top = float(np.abs(x).max())
  e = max(math.frexp(top)[1] if top > 0 else -1000, bits - 126 if floor is None else floor)
  return [int(v) for v in np.round(np.ldexp(x, bits - e))], e


def _bf16(x):
  return np.asarray(x, np.float64).astype(BF16)


def _round_bf16_values(x):
  """Random values with entries of very different sizes, rounded to bf16."""
  return _bf16(x * np.exp(3 * np.random.default_rng(1).standard_normal(x.shape)))


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  q = _round_bf16_values(rng.standard_normal((B, S, HKV * G, DH)))
  k = _round_bf16_values(rng.standard_normal((B, HKV, S, DH)))
  v = _round_bf16_values(rng.standard_normal((B, HKV, S, DH)))
  k[0, 1, 3] = 0.0  # an all-zero key and value row
  v[1, 0, 5] = 0.0
  allowed = np.tril(np.ones((S, S), bool))[None].repeat(B, 0)
  allowed[1, :, :4] = False  # left padding of row 1
  return q, k, v, allowed


def test_grids_equal_the_integer_reference(qkv):
  _, k, v, _ = qkv
  kg = np.asarray(exact_ops.grid_keys(jnp.asarray(k), jnp.bfloat16))
  vg, fv = exact_ops.grid_values(jnp.asarray(v), jnp.bfloat16)
  assert kg.dtype == BF16 and np.asarray(fv).dtype == np.int32
  for b in range(B):
    for h in range(HKV):
      for s in range(S):
        n, e = _grid(k[b, h, s], dot_bits(DH)[1])
        np.testing.assert_array_equal(
          kg[b, h, s].astype(np.float64), np.ldexp(n, e - dot_bits(DH)[1])
        )
        n, f = _grid(v[b, h, s], exact_ops.PV_BITS[1])
        np.testing.assert_array_equal(
          np.asarray(vg)[b, h, s].astype(np.float64), np.ldexp(n, f - exact_ops.PV_BITS[1])
        )
        assert int(fv[b, h, s, 0]) == f


def _exact_sum_one_level(e):
  top = float(np.max(e))
  ex = max(math.frexp(top)[1] if top > 0 else -1000, -900)
  bits = 53 - 16
  return math.ldexp(sum(int(round(math.ldexp(x, bits - ex))) for x in e), ex - bits)


def _ref_attend(q, k, v, allowed):
  """out [B, T, H * Dh] as bf16, from Python integer dots (module doc)."""
  t = q.shape[1]
  qb, kb = dot_bits(DH)
  vb, pb = exact_ops.PV_BITS[1], exact_ops.PV_BITS[0]
  scale = float(np.float32(DH**-0.5))
  out = np.zeros((B, t, HKV * G, DH), BF16)
  for b in range(B):
    for h in range(HKV):
      keys = [_grid(k[b, h, s], kb) for s in range(S)]
      vals = [_grid(v[b, h, s], vb) for s in range(S)]
      for g in range(G):
        for i in range(t):
          nq, eq = _grid(q[b, i, h * G + g], qb)
          scores = np.array(
            [
              math.ldexp(sum(a * c for a, c in zip(nq, nk)), eq + ek - qb - kb)
              if allowed[b, i, s]
              else exact_ops.MASK_VALUE
              for s, (nk, ek) in enumerate(keys)
            ]
          )
          e = np.asarray(exact_ops.exp64((scores - scores.max()) * scale))
          probs = (e / _exact_sum_one_level(e)).astype(BF16).astype(np.float64)
          pf = [math.ldexp(p, f) for p, (_, f) in zip(probs, vals)]
          hi, ep = _grid(pf, pb, floor=-900)
          lo = [
            int(round(math.ldexp(x - math.ldexp(n, ep - pb), 2 * pb - ep))) for x, n in zip(pf, hi)
          ]
          for d in range(DH):
            dot_hi = sum(n * nv[d] for n, (nv, _) in zip(hi, vals))
            dot_lo = sum(n * nv[d] for n, (nv, _) in zip(lo, vals))
            out[b, i, h * G + g, d] = math.ldexp(dot_hi, ep - pb - vb) + math.ldexp(
              dot_lo, ep - 2 * pb - vb
            )
  return out.reshape(B, t, HKV * G * DH)


def test_attention_full_and_over_a_gridded_cache_equal_the_reference(qkv):
  q, k, v, allowed = qkv
  cd = jnp.bfloat16
  full = jax.jit(lambda *a: attn.attend(*a, cd, exact=True))(q, k, v, allowed)
  np.testing.assert_array_equal(np.asarray(full), _ref_attend(q, k, v, allowed))
  # A decode step's query (the last one) over a cache gridded when its slots were written.
  zeros = np.zeros((B, HKV, S + 3, DH), BF16)  # 3 slots not yet written
  start = (0, 0, 0, 0)
  kc, vc, ec = attn.write_grids(
    jnp.asarray(zeros),
    jnp.asarray(zeros),
    jnp.zeros((B, HKV, S + 3, 1), jnp.int32),
    jnp.asarray(k),
    jnp.asarray(v),
    start,
    cd,
  )
  allowed_c = np.concatenate([allowed[:, -1:], np.zeros((B, 1, 3), bool)], -1)
  # On the CPU's exact kernels where this process can run them, and on XLA's path: the same bits.
  for dev in (Device("cpu"), Device("cpu", kernels=KernelConfig(exact_cpu_kernel=False))):
    step = jax.jit(lambda *a: attn.attend_grids(*a, cd, dev))(q[:, -1:], kc, vc, ec, allowed_c)
    want = _ref_attend(q[:, -1:], k, v, allowed[:, -1:])
    np.testing.assert_array_equal(np.asarray(step), want)


def test_lm_head_from_gridded_weights_equals_the_reference():
  rng = np.random.default_rng(2)
  d, vocab = 256, 40
  h = _round_bf16_values(rng.standard_normal((3, d)))
  w = (rng.standard_normal((d, vocab)) * 0.05).astype(np.float32)
  w[:, 7] *= 1e-4
  hb, wb = dot_bits(d)
  ref = np.zeros((3, vocab), np.float32)
  cols = [_grid(_bf16(w[:, j]), wb) for j in range(vocab)]
  for r in range(3):
    nh, eh = _grid(h[r], hb)
    for j, (nw, ew) in enumerate(cols):
      ref[r, j] = math.ldexp(sum(a * c for a, c in zip(nh, nw)), eh + ew - hb - wb)
  cd = jnp.bfloat16
  wg = exact_ops.grid_lm_head(jnp.asarray(w), False, cd)
  got = exact_ops.lm_head_grids(jnp.asarray(h), wg, False, cd, reference=None)
  np.testing.assert_array_equal(np.asarray(got), ref)
  got_t = exact_ops.lm_head_grids(
    jnp.asarray(h), exact_ops.grid_lm_head(jnp.asarray(w.T), True, cd), True, cd, None
  )
  np.testing.assert_array_equal(np.asarray(got_t), ref)


def test_gridded_cache_layout_and_rollout_weights():
  cfg = M.get_config("tiny")
  plain = M.init_cache(cfg, 3, 10, jnp.bfloat16)
  grids = M.init_cache(cfg, 3, 10, jnp.bfloat16, precision=EXACT.rollout)
  assert (
    plain.v_exp == () and M.init_cache(cfg, 3, 10, precision=get_recipe("jet").rollout).v_exp == ()
  )
  assert [a.shape for a in grids.v_exp] == [(3, cfg.n_kv_heads, 10, 1)] * cfg.n_layers
  assert all(a.dtype == jnp.int32 for a in grids.v_exp)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  assert LM_HEAD_GRID in M.rollout_weights(params, EXACT.rollout)
  assert LM_HEAD_GRID not in M.rollout_weights(params, get_recipe("jet").rollout)
  tok = jnp.ones((3, 1), jnp.int32)
  with pytest.raises(ValueError, match="not batch-invariant"):
    M.forward_cached(
      params,
      cfg,
      tok,
      grids,
      positions=tok,
      token_mask=tok > 0,
      precision=get_recipe("jet").rollout,
    )


def test_decode_over_gridded_and_plain_caches_equals_the_full_forward():
  """Prefill then one token at a time, left padding: the gridded cache, the plain cache
  (gridded whole at every step) and the full-sequence forward give the same logits
  (`_exact_cache_decode_case.py`, in a process of its own with XLA's default flags: see there)."""
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in FAST_COMPILE_FLAG_NAMES
  )
  out = subprocess.run(
    [sys.executable, os.path.join(here, "_exact_cache_decode_case.py")],
    capture_output=True, text=True, env=env, timeout=900,
  )  # fmt: skip
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
