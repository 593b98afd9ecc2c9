"""Batch-invariant RMSNorm for GPUs (Pallas, lowered through Triton): `jet_exact`'s norms where a
GPU computes them (`Plan.norm` under the "invariant" plan).

One program a row: the row's squares summed in float32 in a fixed order (chunks of C columns
in order, each column's partial sum in its lane, then the C lanes reduced by the one shape's
tree), var = sum / D, then y = (x rsqrt(var + eps)) in the compute dtype times the weight in
it. Every row is the same instructions whatever the rows around it, so a token's norm is the
same in the training forward, the prefill and a decode step. The sum is float32 in a fixed
order, not the CPU's exact sum (`exact_ops.rms_norm`): on a GPU the bits are batch-invariant,
not the CPU's (docs/numerics.md, "Bitwise on-policy: `jet_exact`", on GPUs).

The backward is the standard norm's (`norm_kernel.rms_norm_cd`'s autodiff), on the same inputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.exact_math import with_reference_vjp

MAX_CHUNK = 1024  # columns a load


def chunk(d: int) -> int:
  """The columns a load (the largest power of two dividing D, at most MAX_CHUNK), 0 where the
  kernel does not take D (a chunk under 32 columns)."""
  c = min(d & -d, MAX_CHUNK)
  return c if c >= 32 else 0


def _kernel(x_ref, w_ref, o_ref, *, d: int, c: int, eps: float, cd):
  f32 = jnp.float32
  acc = jnp.zeros((c,), f32)
  for i in range(d // c):  # the chunks in order: each lane's partial sum
    xi = x_ref[pl.ds(i * c, c)].astype(f32)
    acc = acc + xi * xi
  var = jnp.sum(acc) / f32(d)
  r = lax.rsqrt(var + f32(eps))
  for i in range(d // c):
    xi = x_ref[pl.ds(i * c, c)].astype(f32)
    y = (xi * r).astype(cd) * w_ref[pl.ds(i * c, c)].astype(cd)
    o_ref[pl.ds(i * c, c)] = y.astype(o_ref.dtype)


def _norm(x, weight, eps: float, cd, interpret: bool):
  d = x.shape[-1]
  m = math.prod(x.shape[:-1])
  c = chunk(d)
  out = pl.pallas_call(
    functools.partial(_kernel, d=d, c=c, eps=float(eps), cd=cd),
    out_shape=jax.ShapeDtypeStruct((m, d), cd),
    grid=(m,),
    in_specs=[
      pl.BlockSpec((None, d), lambda i: (i, 0)),
      pl.BlockSpec((d,), lambda i: (0,)),
    ],
    out_specs=pl.BlockSpec((None, d), lambda i: (i, 0)),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="invariant_rms_norm",
  )(x.reshape(m, d), weight)
  return out.reshape(x.shape)


def rms_norm(x, weight, eps: float, cd, *, interpret: bool, reference):
  """x / rms(x) * weight over the last axis (D with `chunk(D)`), the statistic in float32, out
  in cd; differentiated as `reference(x, weight, eps, cd)`."""
  return with_reference_vjp(
    lambda a, w: _norm(a, w, eps, cd, interpret), lambda a, w: reference(a, w, eps, cd), x, weight
  )
