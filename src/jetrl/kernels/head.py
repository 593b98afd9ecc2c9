"""The LM head: float32 logits of hidden states, not quantized, and the per-token log-prob
and entropy of a chunk of them (`jetrl.models.logprobs`), in the implementation a `Plan` picks:
"dot16" (compiled for a GPU: the 16-bit head with its backward in that dtype, `head_dot`, and
the stats' one-pass backward, `head_stats`), "xla", or "exact" (the batch-invariant head,
exact_ops)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import exact_ops
from jetrl.precision import truncation
from jetrl.precision.formats import dot_precision


def _head_dot(h, w, tied: bool):
  dims = (((h.ndim - 1,), (1 if tied else 0,)), ((), ()))
  return jax.lax.dot_general(
    h, w, dims, precision=dot_precision(h, w), preferred_element_type=jnp.float32
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_dot(h: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
  """float32 logits [..., V] of h [..., D] and the head w ([V, D] tied, [D, V] untied), both
  in the 16-bit compute dtype, with the backward's GEMMs in that dtype too.

  JAX's own transpose of a bf16 dot with a float32 result multiplies the float32 logit
  gradient: the two backward GEMMs (dh, dw), [tokens x 151936] for a Qwen vocabulary, then run
  in TF32, at half the bf16 rate on Hopper (docs/benchmarks.md, "Compiled programs"). Here the
  logit gradient is rounded to the compute dtype first (as `linear`'s custom VJP takes its
  bf16 output gradient) and both GEMMs accumulate in float32. The head takes this form when
  compiling for a GPU; on the CPU the float32 products cost no more, and are kept.
  """
  return _head_dot(h, w, tied)


def _head_dot_fwd(h, w, tied):
  return _head_dot(h, w, tied), (h, w)


def _head_dot_bwd(tied, res, g):
  h, w = res
  g = g.astype(h.dtype)
  f32 = jnp.float32
  lead = tuple(range(h.ndim - 1))  # the token axes
  last = h.ndim - 1
  if tied:  # logits = h . w^T, w [V, D]
    dh = jax.lax.dot_general(g, w, (((last,), (0,)), ((), ())), preferred_element_type=f32)
    dw = jax.lax.dot_general(g, h, ((lead, lead), ((), ())), preferred_element_type=f32)
  else:  # logits = h . w, w [D, V]
    dh = jax.lax.dot_general(g, w, (((last,), (1,)), ((), ())), preferred_element_type=f32)
    dw = jax.lax.dot_general(h, g, ((lead, lead), ((), ())), preferred_element_type=f32)
  return dh.astype(h.dtype), dw.astype(w.dtype)


head_dot.defvjp(_head_dot_fwd, _head_dot_bwd)


def dense(h: jax.Array, w: jax.Array, tied: bool, cd, dot16: bool) -> jax.Array:
  """float32 logits of h under the head w in cd; dot16 (a GPU's): `head_dot` for 16-bit cd."""
  if dot16 and jnp.dtype(cd).itemsize == 2:
    return head_dot(h.astype(cd), w.astype(cd), tied)
  dims = (((h.ndim - 1,), (1 if tied else 0,)), ((), ()))
  return jax.lax.dot_general(
    h.astype(cd),
    w.astype(cd),
    dims,
    precision=dot_precision(cd),
    preferred_element_type=jnp.float32,
  )


def logits(h, w, tied: bool, cd, impl: str, grids=None, *, kernel: bool = False) -> jax.Array:
  """float32 logits [..., V] of hidden states h [..., D] by the head block `impl`; grids: a
  rollout's gridded head (`exact_ops.grid_lm_head`), which the exact head reads instead of w;
  kernel: the exact head's dots in the CPU kernels (`cpu_kernels.usable` for the plan's
  device)."""
  reference = lambda a, w_: dense(a, w_, tied, cd, impl == "dot16")
  if impl != "exact":
    return reference(h, w)
  if grids is not None:
    return exact_ops.lm_head_grids(h, grids, tied, cd, reference=reference, kernel=kernel)
  return exact_ops.lm_head(h, w, tied, cd, reference=reference, kernel=kernel)


def stats_of_logits(z, targets, keep=None):
  """(logp of the targets, entropy, lse) of float32 logits z [B, C, V]; keep [B, C, V]: the
  tokens of a truncated distribution (the others have probability 0)."""
  if keep is not None:
    z_kept = jnp.where(keep, z, -jnp.inf)
    lse = jax.nn.logsumexp(z_kept, axis=-1)
    z_target = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(z_kept - lse[..., None])  # exactly 0 outside the set
    entropy = lse - jnp.sum(p * jnp.where(keep, z, 0.0), axis=-1)
    return z_target - lse, entropy, lse
  lse = jax.nn.logsumexp(z, axis=-1)
  z_target = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
  entropy = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
  return z_target - lse, entropy, lse


def chunk_stats(
  h, targets, w, tied: bool, cd, temperature, impl: str, top_k=None, top_p=1.0, *, kernel=False
):
  """(logp [B, C], entropy [B, C]) of hidden states [B, C, D] under the head w by `impl`
  ("exact": the batch-invariant head and log-softmax, exact_ops, its dots in the CPU kernels
  with `kernel`), of the distribution truncated by top-k / top-p when they cut
  (`jetrl.precision.truncation`)."""
  if impl == "exact":
    ref = lambda hc, tc, w_, temp: chunk_stats(hc, tc, w_, tied, cd, temp, "xla", top_k, top_p)
    return exact_ops.chunk_stats(
      h, targets, w, temperature, tied, cd, ref, top_k, top_p, kernel=kernel
    )
  z = logits(h, w, tied, cd, impl) / temperature  # float32 [B, C, V]
  keep = None
  if truncation.is_truncated(top_k, top_p, z.shape[-1]):
    keep = truncation.with_targets(truncation.keep_mask(z, top_k, top_p), targets)
  return stats_of_logits(z, targets, keep)[:2]


def _head_logits(h, w, tied: bool, cd, temperature, dot16: bool):
  return dense(h, w, tied, cd, dot16) / temperature  # float32 [B, C, V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def head_stats(h, w, targets, temperature, tied: bool, cd, dot16: bool = True):
  """`chunk_stats` on a GPU ("dot16") with a backward of one elementwise pass over the
  logits: (logp [B, C], entropy [B, C]) of hidden states h [B, C, D] and the head w.
  The backward recomputes the logits z and forms their gradient directly,
    dz = g_logp * (onehot(target) - p) + g_ent * p * (lse - entropy - z),  p = softmax(z),
  where JAX's own transpose of the forward takes a scatter (the target's gather), several
  reductions and a pass per operation over the [B, C, V] float32 logits. Only lse and the
  entropy are kept from the forward.
  """
  return _head_stats_fwd(h, w, targets, temperature, tied, cd, dot16)[0]


def _head_stats_fwd(h, w, targets, temperature, tied, cd, dot16):
  logits_ = _head_logits(h, w, tied, cd, temperature, dot16)
  logp, entropy, lse = stats_of_logits(logits_, targets)
  return (logp, entropy), (h, w, targets, temperature, lse, entropy)


def _head_stats_bwd(tied, cd, dot16, res, g):
  h, w, targets, temperature, lse, entropy = res
  g_logp, g_ent = g
  z, vjp = jax.vjp(lambda a, b, t: _head_logits(a, b, tied, cd, t, dot16), h, w, temperature)
  lse = lse[..., None]
  p = jnp.exp(z - lse)
  onehot = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
  s = lse - entropy[..., None]
  dz = g_logp[..., None] * (onehot.astype(z.dtype) - p) + g_ent[..., None] * p * (s - z)
  dh, dw, dt = vjp(dz)
  return dh, dw, np.zeros(targets.shape, jax.dtypes.float0), dt


head_stats.defvjp(_head_stats_fwd, _head_stats_bwd)
