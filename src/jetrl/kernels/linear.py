"""`linear(x, w, precision)` on the kernels: `jetrl.precision.linear` with its GEMMs computed
by a `Plan` (where each `Fp8Gemm.gemm_backend` says: cuBLASLt, Pallas or XLA; the
batch-invariant forward GEMM on the CPU kernel where it serves). The FP8 values and scales are
`quantize`'s on every backend."""

from __future__ import annotations

from typing import Optional

import jax

from jetrl.kernels.plan import Plan, resolve_plan
from jetrl.precision.linear import linear as _precision_linear
from jetrl.precision.recipes import Precision


def linear(
  x: jax.Array, w, precision: Optional[Precision] = None, plan: Optional[Plan] = None
) -> jax.Array:
  """`jetrl.precision.linear(x, w, precision)` with its GEMMs on `plan`'s kernels (default: the
  plan resolved for `precision` on the device traced for now, `resolve_plan`)."""
  plan = resolve_plan(precision) if plan is None else plan
  return _precision_linear(x, w, precision, gemms=plan)
