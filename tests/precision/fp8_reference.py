"""Independent numpy references for the FP8 numerics (docs/numerics.md).

Written from the spec with explicit tile loops, float64 amax and ml_dtypes casts; shares no
code with jetrl.precision.
"""

import itertools
import math

import ml_dtypes
import numpy as np

F8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def ref_quantize(x, block, fmt="e4m3", pow2_scale=False):
  x = np.asarray(x, dtype=np.float32)
  fmax = FMAX[fmt]
  nt = [math.ceil(s / b) for s, b in zip(x.shape, block)]
  scale = np.zeros(nt, np.float32)
  q = np.zeros(x.shape, F8[fmt])
  r = np.float32(1.0 / fmax)
  for idx in itertools.product(*[range(n) for n in nt]):
    sl = tuple(slice(i * b, min((i + 1) * b, s)) for i, b, s in zip(idx, block, x.shape))
    tile = x[sl].astype(np.float64)
    with np.errstate(invalid="ignore"):
      amax = np.float32(np.max(np.abs(tile)))  # exact: max of float32 values
    if np.isnan(tile).any():
      amax = np.float32(np.nan)
    with np.errstate(over="ignore", invalid="ignore"):
      s = np.float32(amax * r)
    if pow2_scale and np.isfinite(s) and s > 0:
      s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
    if s == 0:
      s = np.float32(1.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
      inv = np.float32(np.float32(1.0) / s)
      v = np.clip(x[sl] * inv, -fmax, fmax).astype(np.float32)
    scale[idx] = s
    q[sl] = v.astype(F8[fmt])
  return q, scale


def ref_dequantize(q, scale, block):
  q = np.asarray(q).astype(np.float64)
  out = np.empty(q.shape, np.float64)
  for idx in itertools.product(*[range(n) for n in scale.shape]):
    sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
    out[sl] = q[sl] * np.float64(scale[idx])
  return out


def ref_fake(x, block, fmt="e4m3"):
  q, s = ref_quantize(x, block, fmt)
  return ref_dequantize(q, s, block)


def to_bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def ref_exact_gemm(x, w, b=128):
  """The blockwise formula in numpy: per K block, an exact float64 dot of the E4M3 values,
  times float64(sx) * float64(sw), rounded to float32; the blocks added in float32 in order."""
  xq, sx = ref_quantize(x, (1, b))
  wq, sw = ref_quantize(w, (b, b))
  xq, wq = xq.astype(np.float64), wq.astype(np.float64)
  sw_cols = np.repeat(sw, b, axis=1)[:, : w.shape[1]].astype(np.float64)
  acc = None
  for kb in range(sx.shape[1]):
    blk = slice(kb * b, (kb + 1) * b)
    d = xq[:, blk] @ wq[blk]  # exact in float64 whatever numpy's order (<= 128 E4M3 products)
    t = (d * (sx[:, kb].astype(np.float64)[:, None] * sw_cols[kb][None, :])).astype(np.float32)
    acc = t if acc is None else (acc + t).astype(np.float32)
  return acc
