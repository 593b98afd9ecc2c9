"""A decode step's layers under an FP8 rollout with the quantization inside the operators.

At a decode step's few rows a GPU's time is its kernel count (docs/benchmarks.md, "Compiled
programs"). Quantizing each projection's input in its own kernel would add one kernel before
each of a layer's four GEMMs; here the operator before each GEMM writes its output already
quantized, as a `jetrl.precision.QuantizedInput` (1 x 128 groups, scales transposed, the
values and scales of `quantize` for the value it stands for):

  residual add + RMSNorm -> q / k / v GEMM    (`norm_quant`)
  bias + RoPE + cache write + attention -> o  (`decode_attention.decode_step_attention`)
  residual add + RMSNorm -> gate / up GEMM    (`norm_quant`)
  SwiGLU -> down GEMM                          (`swiglu_quant`)

so a layer is eight kernels, as under bf16. Each kernel keeps the XLA forward's rounding
points (bf16 between operations); its sums run in another order (the RMS statistic summed
over 128-column groups), so its bf16 value may differ from XLA's in the last bit, and the FP8
values are then `quantize`'s of that value (tests/models/test_decode_fused.py, interpret mode).
Compiled for a GPU only (`applies`); the CPU keeps the XLA forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.kernels import decode_attention as _da
from jetrl.precision import QuantizedInput, QuantizedWeight
from jetrl.kernels import quant_kernel as _qk
from jetrl.kernels import swiglu_kernel as _sk
from jetrl.precision.formats import dtype_from_name, format_dtype

G = _qk.B  # the 1 x 128 group
ROWS = 8  # rows a program of `swiglu_quant` takes (a decode step has tens of rows)
# Rows a program of `norm_quant` takes. Its programs are rows alone (a row's statistic needs
# the whole row), so each is one row: at 8 rows a program a 64-row step ran 8 programs on an
# H200's 132 multiprocessors, 13.2 us a call, 20% of jet's decode step (docs/device/
# 2026-12-04-h200-1); one row a program runs 64.
NORM_ROWS = 1


def _r(a, cd):
  return a.astype(cd).astype(jnp.float32)


def _norm_kernel(*refs, groups: int, eps: float, cd, residual: bool, dtype, interpret: bool):
  f32 = jnp.float32
  refs = list(refs)
  x_ref = refs.pop(0)
  d_ref = refs.pop(0) if residual else None
  w_ref, xo_ref, q_ref, s_ref = refs[:4]
  h_ref = refs[4] if len(refs) > 4 else None  # the bf16 value quantized (tests only)
  cols = [pl.ds(i * G, G) for i in range(groups)]

  def x_of(c):
    x = x_ref[:, c].astype(f32)
    return x if d_ref is None else _r(x + d_ref[:, c].astype(f32), cd)  # x + delta, in cd

  total = jnp.zeros((x_ref.shape[0],), f32)
  for c in cols:
    x = x_of(c)
    xo_ref[:, c] = x.astype(xo_ref.dtype)
    total = total + jnp.sum(x * x, axis=1)
  inv = jax.lax.rsqrt(total / f32(groups * G) + f32(eps))
  for i, c in enumerate(cols):
    h = _r(_r(x_of(c) * inv[:, None], cd) * w_ref[c].astype(f32), cd)  # as layers.rms_norm
    q, s = _qk.quantize_groups(h, dtype, interpret)
    q_ref[:, c] = q
    s_ref[pl.ds(i, 1), :] = s[None, :]
    if h_ref is not None:
      h_ref[:, c] = h.astype(h_ref.dtype)


def norm_quant(x, delta, weight, eps: float, cd, dtype, *, interpret=False, values=False):
  """(x + delta, the QuantizedInput of rms_norm(x + delta) * weight) for x, delta [M, D] in
  cd (delta None: x itself), weight [D], in one kernel. values=True also returns the bf16
  norm output that was quantized (for tests)."""
  m, d = x.shape
  if m % NORM_ROWS or d % G:
    raise ValueError(f"norm_quant: rows a multiple of {NORM_ROWS}, columns of {G}; got {x.shape}")
  rows = pl.BlockSpec((NORM_ROWS, d), lambda i: (i, 0))
  args = [x] + ([delta] if delta is not None else []) + [weight]
  in_specs = [rows] * (2 if delta is not None else 1) + [pl.BlockSpec((d,), lambda i: (0,))]
  out_shape = [
    jax.ShapeDtypeStruct((m, d), cd),
    jax.ShapeDtypeStruct((m, d), dtype),
    jax.ShapeDtypeStruct((d // G, m), jnp.float32),
  ]
  out_specs = [rows, rows, pl.BlockSpec((d // G, NORM_ROWS), lambda i: (0, i))]
  if values:
    out_shape.append(jax.ShapeDtypeStruct((m, d), cd))
    out_specs.append(rows)
  outs = pl.pallas_call(
    functools.partial(
      _norm_kernel,
      groups=d // G,
      eps=float(eps),
      cd=cd,
      residual=delta is not None,
      dtype=dtype,
      interpret=interpret,
    ),
    out_shape=tuple(out_shape),
    grid=(m // NORM_ROWS,),
    in_specs=in_specs,
    out_specs=tuple(out_specs),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="decode_norm_quant",
  )(*args)
  result = (outs[0], QuantizedInput(outs[1], outs[2]))
  return result + (outs[3],) if values else result


def swiglu_quant(gate_up, cd, dtype, *, interpret=False, values=False):
  """The QuantizedInput of silu(gate) * up for the fused gate / up output [M, 2F] (gate the
  first F columns, as `layers.swiglu` splits it), in one kernel of ROWS rows a program
  (`swiglu_kernel.swiglu_gate_up_rows`). values=True also returns the bf16 product that was
  quantized (for tests)."""
  outs = _sk.swiglu_gate_up_rows(
    gate_up, cd, dtype, rows=ROWS, interpret=interpret, values=values, name="decode_swiglu_quant"
  )
  result = QuantizedInput(outs[0], outs[1])
  return (result, outs[2]) if values else result


def applies(layers, config, plan, rows: int, n_slots: int) -> bool:
  """Whether a decode step's layers run here: compiling for a GPU, a rollout's FP8 forward
  whose every projection runs on cuBLASLt from a QuantizedInput (`gemms.takes_quantized_input`)
  with fused q / k / v and gate / up weights, head size 128, whole groups and row blocks,
  and the one-kernel attention's shapes."""
  precision = plan.precision
  if not plan.gpu or precision is None or precision.dgrad is not None:
    return False
  g = precision.fprop
  if g is None or precision.batch_invariant or config.head_dim != G or rows % ROWS:
    return False
  if not _da.supported(n_slots, config.head_dim) or not all(
    _da.fuses_layer(layer, config) for layer in layers
  ):
    return False
  names = ("wqkv", "wo", "w_gate_up", "w_down")
  cd = dtype_from_name(precision.compute_dtype)
  for layer in layers:
    for name in names:
      w = layer.get(name)
      if not isinstance(w, QuantizedWeight) or w.q.dtype != format_dtype(g.fmt):
        return False
      k, n = w.shape
      if k % G or not plan.takes_quantized_input(g, rows, n, k, cd):
        return False
  return True


def layers_step(x, layers, config, plan, cd, cos, sin, cache, seen, index, n):
  """The layers of a decode step (`applies`): x [B, 1, D] the embedded tokens; returns the
  last layer's residual stream [B, 1, D] and the new per-layer keys and values."""
  b, _, d = x.shape
  dtype = format_dtype(plan.precision.fprop.fmt)
  eps = config.rms_eps
  interpret = plan.interpret
  x2, delta = x.reshape(b, d), None
  new_k, new_v = [], []
  for i, layer in enumerate(layers):
    x2, hq = norm_quant(x2, delta, layer["attn_norm"], eps, cd, dtype, interpret=interpret)
    y = plan.linear(hq, layer["wqkv"])
    oq, kc, vc = _da.decode_step_attention(
      y[:, None], _da.qkv_bias(layer), cos, sin, cache.k[i], cache.v[i], seen, index, n, cd,
      n_heads=config.n_heads, quant=dtype, interpret=interpret,
    )  # fmt: skip
    x2, hq = norm_quant(x2, plan.linear(QuantizedInput(*oq), layer["wo"]),
                        layer["mlp_norm"], eps, cd, dtype, interpret=interpret)  # fmt: skip
    gu = plan.linear(hq, layer["w_gate_up"])
    delta = plan.linear(swiglu_quant(gu, cd, dtype, interpret=interpret),
                        layer["w_down"])  # fmt: skip
    new_k.append(kc)
    new_v.append(vc)
  x2 = x2 + delta
  return x2.reshape(b, 1, d), new_k, new_v
