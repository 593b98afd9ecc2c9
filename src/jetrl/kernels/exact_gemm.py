"""The batch-invariant FP8 forward GEMM (`jetrl.precision.exact.fp8_fprop`, its specification)
on the CPU kernel where it serves, else as specified (XLA).

On the CPU, in a process with one device, `fp8_fprop` runs as one kernel call (`cpu_kernels`:
the same arithmetic, the same bits) when that kernel is available; with more devices XLA would
gather a custom call's operands onto each of them, so the XLA path runs.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import cpu_kernels as _cpu_kernels
from jetrl.precision import exact as _exact
from jetrl.precision.recipes import Fp8Gemm
from jetrl.precision.weights import quantize_weight


def fp8_fprop(x2: jax.Array, q: jax.Array, s: jax.Array, g, *, kernel: bool) -> jax.Array:
  """`jetrl.precision.exact.fp8_fprop`: float32 [M, N] from x2 [M, K] and FP8 weights q, s;
  `kernel`: in the CPU kernel (where the plan's device can run it, `Plan.exact_kernels`), else
  by the XLA path (the same bits)."""
  xq, sx = _exact.fp8_fprop_input(x2, q, s, g)
  if kernel:
    return _cpu_kernels.exact_fp8_gemm(xq, sx, q, s, g.block)
  return _exact.fp8_fprop_quantized(xq, sx, q, s, g)


def _kernel_matches_xla() -> Optional[str]:
  """The CPU kernel's `fp8_fprop` against the XLA path's, bit for bit (what is wrong, or None):
  a small GEMM with every kind of tail (M not a multiple of 4, K of 128, N of 32 or 128)."""
  g = Fp8Gemm(scaling="block")  # jet_exact's fprop
  rng = np.random.default_rng(0)
  x = rng.standard_normal((7, 300)).astype(np.float32) * np.exp(rng.uniform(-6, 3, (7, 300)))
  w = rng.standard_normal((300, 161)).astype(np.float32) * 0.05
  x, w = jnp.asarray(x), jnp.asarray(w)
  q, s, _ = quantize_weight(w, g)
  with jax.default_device(jax.devices("cpu")[0]):
    fn = lambda kernel: jax.jit(lambda x, q, s: fp8_fprop(x, q, s, g, kernel=kernel))
    got = np.asarray(fn(True)(x, q, s))
    want = np.asarray(fn(False)(x, q, s))
  if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
    bad = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    return f"self-check: {bad} of {got.size} GEMM outputs differ from the XLA path's bits"
  return None


_cpu_kernels.add_self_check(_kernel_matches_xla)
