"""SwiGLU with its FP8 groups, forward and backward, each in one Pallas kernel.

Under a blockwise FP8 recipe the MLP's elementwise operator sits between GEMMs that read it
quantized: h = silu(gate) * up feeds the down projection (1 x 128 groups for its fprop, 128 x 1
for its wgrad), and its backward's dgate, dup feed gate's and up's dgrad (1 x 128) and wgrad
(128 x 1). XLA computes the operator in one fusion that writes bf16, then each quantization
reads it again. These kernels write the FP8 groups themselves:

  swiglu_rows(gate, up)          h's 1 x 128 groups          (the forward; down's fprop)
  swiglu_backward(gate, up, dh)  h's 128 x 1 groups          (down's wgrad)
                                 dgate's and dup's 1 x 128   (gate's and up's dgrad)
                                 and 128 x 1 groups          (their wgrad)

Arithmetic, float32 inside, bf16 (the compute dtype, cd) between operators:
  forward   jax.nn.silu in cd, operation for operation (as the XLA forward and the decode
            step's kernel round it): sig = cd(1 / cd(1 + cd(exp(-g)))), s = cd(g * sig),
            h = cd(s * up);
  backward  du = cd(dh * s), as JAX's transpose of the product rounds it, and
            dg = cd(((dh * up) * sig) * (1 + g * (1 - sig))) in float32 from the forward's
            sig, rounded once (JAX's autodiff of the bf16 forward rounds after every
            operation: the same value to a bf16 rounding or two).
Each FP8 group is then `quantize`'s of that bf16 value, bit for bit (the arithmetic of
`quant_kernel.quantize_groups`); tests/precision/test_swiglu_kernel.py checks both against
float64 and `quantize` in interpret mode. Tiles are 128 x 128: a tile holds whole 1 x 128 and
128 x 1 groups, so rows and columns need no second pass. Scales come out as quant_kernel's
(transposed for 1 x 128 groups), the layout the cuBLASLt GEMM reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.kernels import quant_kernel as _qk
from jetrl.kernels import partition

B = _qk.B


def round_to(a, cd):
  """a (float32) rounded to cd and back: a value between operators."""
  return a.astype(cd).astype(jnp.float32)


def silu_cd(gate, cd):
  """(sig, silu) of gate (float32 values of cd numbers), each rounded to cd as jax.nn.silu in
  cd rounds them: sig = 1 / (1 + exp(-x)), silu = x * sig."""
  f32 = jnp.float32
  sig = round_to(f32(1.0) / round_to(f32(1.0) + round_to(jnp.exp(-gate), cd), cd), cd)
  return sig, round_to(gate * sig, cd)


def swiglu_rows_kernel(g_ref, u_ref, q_ref, s_ref, *h_refs, cd, dtype, interpret: bool):
  """h = silu(gate) * up of a tile, quantized in 1 x 128 groups (h_refs: the bf16 h, tests)."""
  _, s = silu_cd(g_ref[...].astype(jnp.float32), cd)
  h = round_to(s * u_ref[...].astype(jnp.float32), cd)
  _qk.emit_rows(h, q_ref, s_ref, dtype, interpret)
  if h_refs:
    h_refs[0][...] = h.astype(h_refs[0].dtype)


def _check(name: str, *arrays):
  shape = arrays[0].shape
  if any(a.shape != shape for a in arrays) or len(shape) != 2 or shape[0] % B or shape[1] % B:
    raise ValueError(
      f"{name}: 2-D operands of one shape [M, F], M and F multiples of {B}; got "
      f"{[a.shape for a in arrays]}"
    )
  return shape


def _params():
  return plgpu.CompilerParams(num_warps=8, num_stages=2)


def swiglu_rows(gate, up, cd, dtype, *, interpret: bool = False, values: bool = False):
  """(q [M, F], s_t [F/128, M]): h = silu(gate) * up in 1 x 128 groups, one kernel.
  values=True also returns the bf16 h that was quantized (for tests)."""
  _check("swiglu_rows", gate, up)
  if values:
    return _rows_local(gate, up, cd=cd, dtype=dtype, interpret=interpret, values=True)
  names = (jnp.dtype(cd).name, jnp.dtype(dtype).name)
  return _partitioned("rows", names, interpret)(gate, up)


def swiglu_gate_up_rows(
  gate_up, cd, dtype, *, rows: int = B, interpret=False, values=False, name="fp8_swiglu_gate_up"
):
  """(q [M, F], s_t [F/128, M]) of h = silu(gate) * up for the fused gate / up output
  gate_up [M, 2F] (gate the first F columns), `rows` rows x 128 columns a program: the
  kernel reads both halves where they lie (no split copies). What a rollout's forward, whose
  gate / up weights are one, hands to the down GEMM (`layers.swiglu`, the decode step's
  `decode_fused.swiglu_quant`). values=True also returns the bf16 h (tests)."""
  m, f2 = gate_up.shape
  f = f2 // 2
  if m % rows or f % B or f2 != 2 * f:
    raise ValueError(
      f"{name}: rows a multiple of {rows}, 2 F columns with F a multiple of {B}; "
      f"got {gate_up.shape}"
    )
  nf = f // B
  block = lambda off: pl.BlockSpec((rows, B), lambda i, j: (i, off + j))
  out_shape = [jax.ShapeDtypeStruct((m, f), dtype), jax.ShapeDtypeStruct((nf, m), jnp.float32)]
  out_specs = [block(0), pl.BlockSpec((1, rows), lambda i, j: (j, i))]
  if values:
    out_shape.append(jax.ShapeDtypeStruct((m, f), cd))
    out_specs.append(block(0))
  return pl.pallas_call(
    functools.partial(swiglu_rows_kernel, cd=cd, dtype=dtype, interpret=interpret),
    out_shape=tuple(out_shape),
    grid=(m // rows, nf),
    in_specs=[block(0), block(nf)],
    out_specs=tuple(out_specs),
    compiler_params=plgpu.CompilerParams(num_warps=4 if rows < B else 8, num_stages=1),
    interpret=interpret,
    name=name,
  )(gate_up, gate_up)


@functools.lru_cache(maxsize=None)
def _partitioned(kind: str, dtypes: tuple, interpret: bool):
  """The kernel sharded as its operands are on a mesh (jetrl.kernels.partition): whole
  128 x 128 tiles per device."""
  dt = [jnp.dtype(d) for d in dtypes]
  ties, block = {"mb": "m", "fb": "f"}, {"m": B, "f": B}
  if kind == "rows":
    fn = functools.partial(_rows_local, cd=dt[0], dtype=dt[1], interpret=interpret)
    return partition.sharded(fn, "m f, m f -> m f, fb m", ties=ties, block=block)
  fn = functools.partial(
    _backward_local, cd=dt[0], act_dtype=dt[1], row_dtype=dt[2], col_dtype=dt[3],
    interpret=interpret,
  )  # fmt: skip
  outs = ", ".join(["f m, mb f"] + ["m f, fb m, f m, mb f"] * 2)
  return partition.sharded(fn, "m f, m f, m f -> " + outs, ties=ties, block=block)


def _rows_local(gate, up, *, cd, dtype, interpret: bool, values: bool = False):
  m, f = gate.shape
  tile = pl.BlockSpec((B, B), lambda i, j: (i, j))
  out_shape = [jax.ShapeDtypeStruct((m, f), dtype), jax.ShapeDtypeStruct((f // B, m), jnp.float32)]
  out_specs = [tile, pl.BlockSpec((1, B), lambda i, j: (j, i))]
  if values:
    out_shape.append(jax.ShapeDtypeStruct((m, f), cd))
    out_specs.append(tile)
  return pl.pallas_call(
    functools.partial(swiglu_rows_kernel, cd=cd, dtype=dtype, interpret=interpret),
    out_shape=tuple(out_shape),
    grid=(m // B, f // B),
    in_specs=[tile, tile],
    out_specs=tuple(out_specs),
    compiler_params=_params(),
    interpret=interpret,
    name="fp8_swiglu_rows",
  )(gate, up)


def _backward_kernel(
  g_ref, u_ref, dh_ref, *refs, cd, act_dtype, row_dtype, col_dtype, interpret: bool, values: bool
):
  f32 = jnp.float32
  gate, up, dh = (r[...].astype(f32) for r in (g_ref, u_ref, dh_ref))
  sig, s = silu_cd(gate, cd)
  h = round_to(s * up, cd)
  du = round_to(dh * s, cd)
  dg = round_to(((dh * up) * sig) * (f32(1.0) + gate * (f32(1.0) - sig)), cd)
  refs = list(refs)
  _qk.emit_cols(h, refs.pop(0), refs.pop(0), act_dtype, interpret)
  for d in (dg, du):
    _qk.emit_rows(d, refs.pop(0), refs.pop(0), row_dtype, interpret)
    _qk.emit_cols(d, refs.pop(0), refs.pop(0), col_dtype, interpret)
  if values:
    for v in (h, dg, du):
      out = refs.pop(0)
      out[...] = v.astype(out.dtype)


def swiglu_backward(
  gate,
  up,
  dh,
  cd,
  act_dtype,
  row_dtype,
  col_dtype,
  *,
  interpret: bool = False,
  values: bool = False,
):
  """The backward of h = silu(gate) * up from dh, with every FP8 group its GEMMs read, in one
  kernel. Returns ((h_q_t, h_s), (dg_q, dg_s_t), (dg_q_t, dg_s), (du_q, du_s_t), (du_q_t,
  du_s)) plus, with values=True, the bf16 (h, dg, du) that were quantized:

    h_q_t [F, M] act_dtype, h_s [M/128, F]     h's 128 x 1 groups, transposed
    d*_q [M, F] row_dtype, d*_s_t [F/128, M]   1 x 128 groups, scales transposed
    d*_q_t [F, M] col_dtype, d*_s [M/128, F]   128 x 1 groups, transposed
  """
  _check("swiglu_backward", gate, up, dh)
  if values:
    outs = _backward_local(
      gate, up, dh, cd=cd, act_dtype=act_dtype, row_dtype=row_dtype, col_dtype=col_dtype,
      interpret=interpret, values=True,
    )  # fmt: skip
  else:
    names = tuple(jnp.dtype(d).name for d in (cd, act_dtype, row_dtype, col_dtype))
    outs = _partitioned("backward", names, interpret)(gate, up, dh)
  pairs = tuple((outs[2 * i], outs[2 * i + 1]) for i in range(5))
  return pairs + (tuple(outs[10:]),) if values else pairs


def _backward_local(
  gate, up, dh, *, cd, act_dtype, row_dtype, col_dtype, interpret: bool, values: bool = False
):
  m, f = gate.shape
  tile = pl.BlockSpec((B, B), lambda i, j: (i, j))
  tile_t = pl.BlockSpec((B, B), lambda i, j: (j, i))
  rows_s = pl.BlockSpec((1, B), lambda i, j: (j, i))
  cols_s = pl.BlockSpec((1, B), lambda i, j: (i, j))
  f32 = jnp.float32

  def cols(dtype):
    return [jax.ShapeDtypeStruct((f, m), dtype), jax.ShapeDtypeStruct((m // B, f), f32)], [
      tile_t,
      cols_s,
    ]

  def rows(dtype):
    return [jax.ShapeDtypeStruct((m, f), dtype), jax.ShapeDtypeStruct((f // B, m), f32)], [
      tile,
      rows_s,
    ]

  parts = [cols(act_dtype), rows(row_dtype), cols(col_dtype), rows(row_dtype), cols(col_dtype)]
  out_shape = [s for p in parts for s in p[0]]
  out_specs = [s for p in parts for s in p[1]]
  if values:
    out_shape += [jax.ShapeDtypeStruct((m, f), cd)] * 3
    out_specs += [tile] * 3
  outs = pl.pallas_call(
    functools.partial(
      _backward_kernel,
      cd=cd,
      act_dtype=act_dtype,
      row_dtype=row_dtype,
      col_dtype=col_dtype,
      interpret=interpret,
      values=values,
    ),
    out_shape=tuple(out_shape),
    grid=(m // B, f // B),
    in_specs=[tile, tile, tile],
    out_specs=tuple(out_specs),
    compiler_params=_params(),
    interpret=interpret,
    name="fp8_swiglu_backward",
  )(gate, up, dh)
  return tuple(outs)
