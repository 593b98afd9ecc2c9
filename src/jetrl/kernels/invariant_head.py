"""The batch-invariant LM head for GPUs (`Plan`'s "invariant" head): logits from the fixed-tile
bf16 GEMM (`invariant_gemm.matmul_nt`), and the temperature-scaled log-softmax of the token
from `exact_ops.log_softmax_stats` (exact sums over the vocabulary, exp64 / log64: an
order-free per-row reduction, the same bits in any program and on any device).

The sampler records log p(token) from these logits (`Plan.choice_logprobs`), the training
forward computes (log p, entropy) of each chunk from the same logits (`chunk_stats`): a token's
logits depend on its own hidden state alone, so the two log-probs are equal bit for bit.

The backward is jet's GPU head's (`head.head_stats`'s one-pass backward, from the forward's
lse and entropy; `head.head_dot` for the logits): only the forward values are the kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetrl.kernels import exact_ops
from jetrl.kernels import head as _head
from jetrl.kernels import invariant_gemm as _ig
from jetrl.precision import truncation
from jetrl.precision.exact import F64, x64
from jetrl.precision.exact_math import log64, with_reference_vjp


def head_rows(w: jax.Array, tied: bool, cd) -> jax.Array:
  """The head's weights as the kernel reads them: one row per vocabulary entry, [V, D] in cd."""
  return (w if tied else w.T).astype(cd)


def _logits(h: jax.Array, rows: jax.Array, cd, interpret: bool) -> jax.Array:
  lead, d = h.shape[:-1], h.shape[-1]
  z = _ig.matmul_nt(h.reshape(-1, d).astype(cd), rows, interpret=interpret)
  return z.reshape(*lead, rows.shape[0])


def logits(h, w, tied: bool, cd, *, interpret: bool) -> jax.Array:
  """float32 logits [..., V] of h [..., D] under the head w ([V, D] tied, [D, V] untied; a
  rollout passes it in cd once, `Plan.head_grid`). Differentiated as jet's GPU head
  (`head.dense` with the 16-bit backward)."""
  return with_reference_vjp(
    lambda a, w_: _logits(a, head_rows(w_, tied, cd), cd, interpret),
    lambda a, w_: _head.dense(a, w_, tied, cd, True),
    h,
    w,
  )


def _stats(h, w, targets, temperature, tied, cd, interpret):
  """(logp, entropy, lse of z / T) of a chunk, the log-softmax exact (`log_softmax_stats`)."""
  z = _logits(h, head_rows(w, tied, cd), cd, interpret)
  inv_t = exact_ops.inverse_temperature(temperature)
  logp, ent = exact_ops.log_softmax_stats(z, targets, inv_t)
  top = jnp.max(z, axis=-1)
  with x64():  # lse of z * inv_t, for the backward's softmax (jet's formula)
    e = exact_ops.exp64((z.astype(F64) - top.astype(F64)[..., None]) * inv_t.astype(F64))
    lse = (top.astype(F64) * inv_t.astype(F64) + log64(jnp.sum(e, axis=-1))).astype(jnp.float32)
  return logp, ent, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunk_stats(h, w, targets, temperature, tied: bool, cd, interpret: bool):
  return _stats(h, w, targets, temperature, tied, cd, interpret)[:2]


def _chunk_fwd(h, w, targets, temperature, tied, cd, interpret):
  logp, ent, lse = _stats(h, w, targets, temperature, tied, cd, interpret)
  return (logp, ent), (h, w, targets, temperature, lse, ent)


def _chunk_bwd(tied, cd, interpret, res, g):
  return _head._head_stats_bwd(tied, cd, True, res, g)  # pylint: disable=protected-access


_chunk_stats.defvjp(_chunk_fwd, _chunk_bwd)


def chunk_stats(h, targets, w, tied: bool, cd, temperature, *, interpret: bool, top_k, top_p):
  """(logp [B, C], entropy [B, C]) of hidden states h [B, C, D]: the token's log-prob as the
  sampler records it from the same logits (`exact_ops.token_logprobs_from_logits`), bit for
  bit. Under top-k / top-p truncation, of the truncated distribution (the exact rule,
  `truncation.keep_mask_exact`), differentiated as jet's truncated head (the caller
  checkpoints it); else one custom VJP with jet's one-pass backward (`head.head_stats`)."""
  temperature = jnp.asarray(temperature, jnp.float32)
  targets = targets.astype(jnp.int32)
  if not truncation.is_truncated(top_k, top_p, w.shape[0 if tied else -1]):
    return _chunk_stats(h, w, targets, temperature, tied, cd, interpret)

  def exact(h, targets, w, temperature):
    z = _logits(h, head_rows(w, tied, cd), cd, interpret)
    inv_t = exact_ops.inverse_temperature(temperature)
    keep = exact_ops.truncated_keep(z, targets, inv_t, top_k, top_p)
    return exact_ops.log_softmax_stats(z, targets, inv_t, keep)

  def reference(h, targets, w, temperature):
    return _head.chunk_stats(h, targets, w, tied, cd, temperature, "dot16", top_k, top_p)

  return with_reference_vjp(exact, reference, h, targets, w, temperature)


__all__ = ["head_rows", "logits", "chunk_stats"]
