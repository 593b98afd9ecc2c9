"""Blockwise-scaled FP8 GEMMs in one Pallas kernel (Triton on NVIDIA GPUs), and a check that
the compiled program really feeds FP8 operands to its dots.

The kernel computes, for FP8 operands `a [P, C]`, `b [Q, C]` (both contiguous along the
contraction axis C, the layout FP8 tensor cores want) and float32 scales per contraction block:

  out[p, q] = sum_kb  sa[p, kb] * sb[q, kb] * (a[p, kb-block] . b[q, kb-block])

Each K-block's dot takes the FP8 tiles as they are (`preferred_element_type=float32`), its
float32 result is scaled inside the loop and added to a float32 accumulator, and the output is
cast once to the requested dtype. That one kernel serves the three GEMMs of `linear`
(DESIGN.md, "FP8 numerics"), by what it is handed:

  fprop  y  = x @ w       a = x  (1xB groups along K),   b = w^T (BxB blocks -> per-row of b)
  dgrad  dx = dy @ w^T    a = dy (1xB groups along N),   b = w   (the same BxB blocks)
  wgrad  dw = x^T @ dy    a = x^T, b = dy^T, both in Bx1 groups over tokens (M is contracted)

The quantization is the jnp code of `jetrl.precision.quantize` (XLA fuses it with the transposes
and the padding), so the FP8 values and scales are bit-identical to the XLA path. In interpret
mode the results agree with the XLA path to float32 rounding; on a GPU, each block's 128-term
sum has the tensor cores' accumulation precision (below). Partial tiles are padded with zeros
in the wrapper (a zero never changes a sum) and the padded rows/columns are sliced off.

Accumulation: on Hopper, Triton runs an FP8 dot on the wgmma tensor cores only if it may let
the tensor core accumulate some products at its own (reduced) precision before adding them to
the float32 accumulator (`maxNumImpreciseAcc` >= 32); otherwise it falls back to the older
mma.sync path. Each K-block's dot (`block` = 128 products) is therefore emitted with
maxNumImpreciseAcc = block: the tensor cores sum one block, and the scale-and-add in float32
after it is the promotion step, every 128 products (the interval DeepSeek-V3 uses). The
Pallas lowering of `lax.dot_general` has no such knob, so the kernel's dot is a small primitive
with its own Triton lowering rule (`Tiles.fast_accum=False` uses plain `lax.dot_general`).

Mixed formats (E4M3 activations or weights with E5M2 gradients) are upcast to bf16 inside the
kernel before the dot: the Pallas Triton lowering accepts a dot only on equal element types, and
bf16 holds every E4M3 and E5M2 value exactly, so the result is the same; that GEMM then runs on
bf16 tensor cores (with FP8 loads). E4M3 gradients, the default, keep all three GEMMs in FP8.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jax_core
from jax.interpreters import mlir
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.formats import E4M3, E5M2, format_dtype
from jetrl.precision.quantize import quantize

_FP8 = (np.dtype(E4M3), np.dtype(E5M2))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pow2_at_least(n: int, lo: int) -> int:
  return max(lo, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Output tile (bm x bn), Triton warps per program, software-pipelining depth, how many row
  tiles run next to each other (grouped launch order, for L2 reuse of the b tiles), and whether
  the tensor cores may sum each K-block before the float32 promotion (see the module doc)."""
  bm: int = 128
  bn: int = 128
  num_warps: int = 8
  num_stages: int = 3
  group_m: int = 8
  fast_accum: bool = True

  def __post_init__(self):
    for name in ("bm", "bn"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")


def default_tiles(p: int, q: int) -> Tiles:
  """Tiles for an out[p, q] GEMM: 128x128 for large ones, narrower rows for decode-sized p."""
  bm = min(128, _pow2_at_least(p, 16))
  bn = min(128, _pow2_at_least(q, 16))
  # The float32 accumulator and one K-block's partial product both live in registers:
  # keep them at <= 128 registers per thread together (a 128x128 tile takes 8 warps).
  warps = max(4, min(8, bm * bn // 2048))
  return Tiles(bm=bm, bn=bn, num_warps=warps, num_stages=4 if bm * bn <= 64 * 128 else 3)


# --- One K-block's dot: a [m, k] . b [n, k]^T -> float32 [m, n] ------------------------------

def _block_dot_ref(a, b, *, max_imprecise: int):
  del max_imprecise  # XLA (interpret mode, CPU) computes the dot in float32.
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


_block_dot_p = jax_core.Primitive("fp8_block_dot")
_block_dot_p.def_impl(_block_dot_ref)
_block_dot_p.def_abstract_eval(
    lambda a, b, *, max_imprecise: jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32))
mlir.register_lowering(_block_dot_p, mlir.lower_fun(_block_dot_ref, multiple_results=False))


def _register_triton_rule() -> Optional[str]:
  """Teach the Pallas Triton lowering to emit the dot with maxNumImpreciseAcc (private API:
  returns why not, and the kernel then uses lax.dot_general)."""
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir.dialects import arith  # pylint: disable=import-outside-toplevel
    from jax._src.pallas.triton import lowering as tl  # pylint: disable=import-outside-toplevel
    tt = tl.tt_dialect
    plain_rule = tl.triton_lowering_rules[lax.dot_general_p]
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"

  def rule(ctx, a, b, *, max_imprecise):
    try:
      m, n = ctx.avals_out[0].shape
      acc_t = ir.RankedTensorType.get([m, n], ir.F32Type.get())
      acc = arith.constant(acc_t, ir.DenseElementsAttr.get_splat(
          acc_t, ir.FloatAttr.get(ir.F32Type.get(), 0.0)))
      return tt.dot(a, tt.trans(b, (1, 0)), acc, max_num_imprecise_acc=max_imprecise)
    except Exception:  # pylint: disable=broad-except
      # A JAX whose Triton bindings differ: the plain FP8 dot (mma.sync on Hopper).
      return plain_rule(ctx, a, b, dimension_numbers=(((1,), (1,)), ((), ())),
                        out_sharding=None, precision=None,
                        preferred_element_type=jnp.float32)

  tl.triton_lowering_rules[_block_dot_p] = rule
  return None


FAST_ACCUM_UNAVAILABLE = _register_triton_rule()


def _block_dot(a, b, fast: bool, bk: int):
  if fast and FAST_ACCUM_UNAVAILABLE is None and a.dtype == b.dtype and np.dtype(a.dtype) in _FP8:
    return _block_dot_p.bind(a, b, max_imprecise=bk)
  return _block_dot_ref(a, b, max_imprecise=0)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, nk: int, bk: int, upcast, fast: bool):
  """One bm x bn output tile: loop over the contraction blocks, scale each partial, add."""
  bm, bn = o_ref.shape

  def body(kb, acc):
    start = pl.multiple_of(kb * bk, bk)
    a = a_ref[:, pl.ds(start, bk)]
    b = b_ref[:, pl.ds(start, bk)]
    if upcast is not None:
      a, b = a.astype(upcast), b.astype(upcast)
    part = _block_dot(a, b, fast, bk)
    scale = sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]
    return acc + scale * part

  acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_ij(pid, n_p: int, n_q: int, group: int):
  """Program id -> (row tile, column tile), `group` row tiles at a time (grouped order)."""
  per_group = group * n_q
  first = lax.div(pid, per_group) * group
  size = jnp.minimum(n_p - first, group)
  within = lax.rem(pid, per_group)
  return first + lax.rem(within, size), lax.div(within, size)


def scaled_matmul_nt(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, *,
                     block: int = 128, out_dtype=jnp.bfloat16, interpret: bool = False,
                     tiles: Optional[Tiles] = None) -> jax.Array:
  """out [P, Q] = sum_kb sa[:, kb] sb[:, kb]^T * (a[:, kb] @ b[:, kb]^T), float32 inside.

  a: [P, C] and b: [Q, C], float8_e4m3fn or float8_e5m2. sa: [P, ceil(C / block)] and
  sb: [Q, ceil(C / block)], float32. block: the contraction block of the scales (and the
  kernel's K tile). interpret: run in Pallas interpret mode (CPU). tiles: None for
  `default_tiles(P, Q)`.
  """
  for name, v in (("a", a), ("b", b)):
    if v.ndim != 2 or np.dtype(v.dtype) not in _FP8:
      raise ValueError(f"scaled_matmul_nt: {name} must be a 2-D float8_e4m3fn or float8_e5m2 "
                       f"array, got {v.dtype}{list(v.shape)}")
  (p, c), q = a.shape, b.shape[0]
  if b.shape[1] != c:
    raise ValueError(f"scaled_matmul_nt: a {a.shape} and b {b.shape} must share the last axis")
  nk = _cdiv(c, block)
  for name, s, rows in (("sa", sa, p), ("sb", sb, q)):
    if tuple(s.shape) != (rows, nk):
      raise ValueError(f"scaled_matmul_nt: {name} must have shape {(rows, nk)} (rows x "
                       f"ceil({c}/{block})), got {tuple(s.shape)}")
  if p == 0 or q == 0 or c == 0:
    return jnp.zeros((p, q), out_dtype)
  t = tiles or default_tiles(p, q)
  pp, qp, cp = _cdiv(p, t.bm) * t.bm, _cdiv(q, t.bn) * t.bn, nk * block
  # Zeros in the padding: padded contraction entries add nothing, padded rows are cut off.
  a = jnp.pad(a, ((0, pp - p), (0, cp - c)))
  b = jnp.pad(b, ((0, qp - q), (0, cp - c)))
  sa_t = jnp.pad(sa.astype(jnp.float32).T, ((0, 0), (0, pp - p)))
  sb_t = jnp.pad(sb.astype(jnp.float32).T, ((0, 0), (0, qp - q)))
  if max(pp, qp) * cp >= 2**31:
    raise ValueError(f"scaled_matmul_nt: operands of {max(pp, qp)} x {cp} entries exceed the "
                     "kernel's 32-bit offsets; split the GEMM")
  n_p, n_q = pp // t.bm, qp // t.bn
  group = max(1, min(t.group_m, n_p))
  upcast = None if a.dtype == b.dtype else jnp.bfloat16
  row = lambda i: _grouped_ij(i, n_p, n_q, group)[0]
  col = lambda i: _grouped_ij(i, n_p, n_q, group)[1]
  out = pl.pallas_call(
      functools.partial(_kernel, nk=nk, bk=block, upcast=upcast, fast=t.fast_accum),
      out_shape=jax.ShapeDtypeStruct((pp, qp), out_dtype),
      grid=(n_p * n_q,),
      in_specs=[pl.BlockSpec((t.bm, cp), lambda i: (row(i), 0)),
                pl.BlockSpec((nk, t.bm), lambda i: (0, row(i))),
                pl.BlockSpec((t.bn, cp), lambda i: (col(i), 0)),
                pl.BlockSpec((nk, t.bn), lambda i: (0, col(i)))],
      out_specs=pl.BlockSpec((t.bm, t.bn), lambda i: (row(i), col(i))),
      compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
      interpret=interpret,
      name="fp8_blockwise_gemm",
  )(a, sa_t, b, sb_t)
  return out[:p, :q]


# --- The three GEMMs of `linear` ------------------------------------------------------------

def _quant(x: jax.Array, g, group: tuple[int, int], fmt: str):
  """FP8 (q, scale) of a 2-D operand: `group` tiles for block scaling, one scale for tensor.

  The tiles must be those of `linear`'s XLA path (linear._blocks) so both see the same bits.
  """
  tile = tuple(x.shape) if g.scaling == "tensor" else group
  return quantize(x, tile, format_dtype(fmt), g.pow2_scale)


def _weight_scales_per_row(ws: jax.Array, block: int, rows: int, nk: int) -> jax.Array:
  """[nR, nk] per-(row block, K block) weight scales -> [rows, nk] per row."""
  if ws.shape == (1, 1):
    return jnp.broadcast_to(ws, (rows, nk))
  return jnp.repeat(ws, block, axis=0, total_repeat_length=ws.shape[0] * block)[:rows]


def fprop(x: jax.Array, wq: jax.Array, ws: jax.Array, g, out_dtype, *,
          interpret: bool = False) -> jax.Array:
  """y [M, N] = x [M, K] @ w, with w already quantized (wq [K, N], ws its block scales)."""
  (m, k), n, blk = x.shape, wq.shape[1], g.block
  xq, xs = _quant(x, g, (1, blk), g.fmt)
  nk = _cdiv(k, blk)
  sb = _weight_scales_per_row(ws.T, blk, n, nk)
  return scaled_matmul_nt(xq, jnp.broadcast_to(xs, (m, nk)), wq.T, sb, block=blk,
                          out_dtype=out_dtype, interpret=interpret)


def dgrad(dy: jax.Array, wq: jax.Array, ws: jax.Array, g, out_dtype, *,
          interpret: bool = False) -> jax.Array:
  """dx [M, K] = dy [M, N] @ w^T with the same weight blocks as the forward (wq [K, N])."""
  (m, n), k, blk = dy.shape, wq.shape[0], g.block
  dq, ds = _quant(dy, g, (1, blk), g.grad_fmt)
  nn = _cdiv(n, blk)
  sb = _weight_scales_per_row(ws, blk, k, nn)
  return scaled_matmul_nt(dq, jnp.broadcast_to(ds, (m, nn)), wq, sb, block=blk,
                          out_dtype=out_dtype, interpret=interpret)


def wgrad(x: jax.Array, dy: jax.Array, g, out_dtype, *, interpret: bool = False) -> jax.Array:
  """dw [K, N] = x^T @ dy, contracting over tokens; x and dy in Bx1 groups (B tokens)."""
  (m, k), n, blk = x.shape, dy.shape[1], g.block
  xq, xs = _quant(x, g, (blk, 1), g.fmt)
  dq, ds = _quant(dy, g, (blk, 1), g.grad_fmt)
  nm = _cdiv(m, blk)
  return scaled_matmul_nt(xq.T, jnp.broadcast_to(xs.T, (k, nm)), dq.T,
                          jnp.broadcast_to(ds.T, (n, nm)), block=blk, out_dtype=out_dtype,
                          interpret=interpret)


# --- Is it really FP8? -------------------------------------------------------------------------

_F8_NAMES = ("f8e4m3fn", "f8e5m2", "f8E4M3FN", "f8E5M2", "f8e4m3", "f8E4M3")
_GEMM_TARGET = re.compile(r"matmul|gemm|triton|cublas", re.I)
_TT_DOT = re.compile(r"tt\.dot .*?:\s*tensor<(?:\d+x)+(\w+)>\s*\*\s*tensor<(?:\d+x)+(\w+)>")
_HLO_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")


def _is_f8(t: str) -> bool:
  return t.lower().startswith("f8")


@dataclasses.dataclass(frozen=True)
class Fp8Check:
  """What `check_fp8_in_compiled` found. Each GEMM entry reads 'op(operand types)'."""
  ok: bool
  stage: str                       # "compiled" (optimized HLO) or "lowered" (StableHLO)
  platform: str
  fp8_gemms: tuple[str, ...]       # dots / GEMM calls whose matrix operands are FP8
  other_gemms: tuple[str, ...]     # dots / GEMM calls on other types
  upcasts: tuple[str, ...]         # dots fed by a convert from FP8 (upcast before the dot)
  kernel_dots: tuple[str, ...]     # tt.dot operand types inside Pallas Triton kernels (and
                                   # maxNumImpreciseAcc, when set: wgmma-eligible FP8 dots)
  notes: tuple[str, ...] = ()

  def summary(self) -> str:
    head = "PASS" if self.ok else "FAIL"
    parts = [f"{head} [{self.stage}, {self.platform}] {len(self.fp8_gemms)} FP8 GEMM(s)"]
    if self.kernel_dots:
      parts.append(f"kernel dots {sorted(set(self.kernel_dots))}")
    if self.other_gemms:
      parts.append(f"{len(self.other_gemms)} non-FP8 GEMM(s) e.g. {self.other_gemms[0]}")
    if self.upcasts:
      parts.append(f"upcast before dot: {self.upcasts[0]}")
    parts += list(self.notes)
    return "; ".join(parts)


def _walk(op):
  for region in op.regions:
    for blk in region.blocks:
      for child in blk.operations:
        yield child
        yield from _walk(child.operation)


def _triton_dots(custom_call) -> tuple[list[str], Optional[str]]:
  """tt.dot operand types of the Triton module embedded in a Pallas custom call (best effort:
  it uses JAX's private Triton dialect context)."""
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    from jax._src.pallas.triton import lowering as tl  # pylint: disable=import-outside-toplevel
    cfg = ir.DictAttr(custom_call.attributes["mhlo.backend_config"])
    raw = ir.StringAttr(cfg["ir"]).value_bytes
    with tl._new_ir_context():  # pylint: disable=protected-access
      text = str(ir.Module.parse(raw))
  except Exception as e:  # pylint: disable=broad-except
    return [], f"Triton IR not decoded ({type(e).__name__}: {e})"
  dots = []
  for line in text.splitlines():
    m = _TT_DOT.search(line)
    if m:
      acc = re.search(r"maxNumImpreciseAcc = (\d+)", line)
      dots.append(f"tt.dot({m.group(1)}, {m.group(2)})"
                  + (f" maxNumImpreciseAcc={acc.group(1)}" if acc else ""))
  return dots, None


def _lowered_gemms(lowered):
  """GEMM ops of a lowered (StableHLO) program: (fp8, other, kernel_dots, notes)."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  fp8, other, kdots, notes = [], [], [], []
  def elem(v):
    try:
      return str(ir.RankedTensorType(v.type).element_type)
    except ValueError:
      return str(v.type)

  for op in _walk(lowered.compiler_ir("stablehlo").operation):
    name = op.operation.name
    if name not in ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.custom_call"):
      continue
    types = [elem(v) for v in op.operands]
    if name in ("stablehlo.dot_general", "stablehlo.dot"):
      (fp8 if all(_is_f8(t) for t in types[:2]) else other).append(f"dot({', '.join(types)})")
    elif name == "stablehlo.custom_call":
      target = ir.StringAttr(op.attributes["call_target_name"]).value
      if not _GEMM_TARGET.search(target):
        continue
      desc = f"custom_call {target}({', '.join(types)})"
      (fp8 if sum(_is_f8(t) for t in types) >= 2 else other).append(desc)
      if "triton" in target:
        dots, note = _triton_dots(op)
        kdots += dots
        if note:
          notes.append(note)
  return fp8, other, kdots, notes


def _split_operands(rest: str) -> list[str]:
  """'a, f32[2,3]{1,0} %b), attrs' -> ['a', 'f32[2,3]{1,0} %b'] (top-level commas only)."""
  depth, cur, out = 0, "", []
  for ch in rest:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        break
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  out.append(cur.strip())
  return [o for o in out if o]


def _elem(type_text: str) -> str:
  m = re.match(r"\s*([a-z][a-z0-9]*)\[", type_text)
  return m.group(1) if m else "?"


def _parse_hlo(hlo_text: str) -> dict:
  """name -> {op, elem, operands [(elem, name)], comp, root, calls, param, line}."""
  defs, comp = {}, ""
  header = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")
  for line in hlo_text.splitlines():
    h = header.match(line)
    if h and "=" not in line.split("(")[0]:
      comp = h.group(1)
      continue
    m = _HLO_LINE.match(line)
    if not m:
      continue
    ops = []
    for o in _split_operands(m.group("rest")):
      name = o.split()[-1].lstrip("%")
      ops.append((_elem(o) if "[" in o.split()[0] else None, name))
    calls = re.search(r"calls=%?([^\s,]+)", line)
    param = re.match(r"(\d+)\)", m.group("rest")) if m.group("op") == "parameter" else None
    defs[m.group("name")] = dict(
        op=m.group("op"), elem=_elem(m.group("type")), operands=ops, comp=comp,
        root=line.lstrip().startswith("ROOT"), calls=calls.group(1) if calls else None,
        param=int(param.group(1)) if param else None, line=line)
  for d in defs.values():  # operand types that the printer left out
    d["operands"] = [(t or defs.get(n, {}).get("elem", "?"), n) for t, n in d["operands"]]
  return defs


def compiled_hlo_gemms(hlo_text: str):
  """GEMMs of an optimized HLO module's text: (fp8, other, upcasts)."""
  defs = _parse_hlo(hlo_text)
  roots = {d["comp"]: n for n, d in defs.items() if d["root"]}
  callers = {}
  for n, d in defs.items():
    if d["calls"]:
      callers.setdefault(d["calls"], []).append(n)

  def from_f8_convert(name, depth=0):
    """Is `name` an FP8 value converted up, through layout ops and fusion boundaries?"""
    d = defs.get(name)
    if d is None or depth > 16:
      return False
    op = d["op"]
    if op == "convert":
      return bool(d["operands"]) and _is_f8(d["operands"][0][0])
    if op == "parameter" and d["param"] is not None:
      outer = callers.get(d["comp"], [])
      return any(d["param"] < len(defs[c]["operands"]) and
                 from_f8_convert(defs[c]["operands"][d["param"]][1], depth + 1) for c in outer)
    if op == "fusion" and d["calls"] in roots:
      return from_f8_convert(roots[d["calls"]], depth + 1)
    if op in ("bitcast", "copy", "transpose", "reshape", "multiply", "broadcast"):
      return any(from_f8_convert(n, depth + 1) for _, n in d["operands"])
    return False

  with_dot = {d["comp"] for d in defs.values() if d["op"] == "dot"}
  fp8, other, upcasts = [], [], []
  for d in defs.values():
    types = [t for t, _ in d["operands"]]
    if (d["op"] == "fusion" and "triton" in d["line"].lower() and d["calls"] not in with_dot
        and sum(_is_f8(t) for t in types) >= 2):
      # A Triton kernel that XLA keeps as a fusion with no dot to inspect (other Triton
      # fusions, such as reductions, are not GEMMs and are not counted).
      fp8.append(f"triton fusion({', '.join(types)})")
    if d["op"] == "dot":
      desc = f"dot({', '.join(types[:2])})"
      if all(_is_f8(t) for t in types[:2]):
        fp8.append(desc)
      else:
        other.append(desc)
        if any(from_f8_convert(n) for _, n in d["operands"][:2]):
          upcasts.append(desc)
    elif d["op"] == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', d["line"])
      target = target.group(1) if target else "?"
      if _GEMM_TARGET.search(target):
        desc = f"custom-call {target}({', '.join(types)})"
        (fp8 if sum(_is_f8(t) for t in types) >= 2 else other).append(desc)
  return fp8, other, upcasts


def _platform(name: Optional[str]) -> str:
  name = name or jax.default_backend()
  return {"gpu": "cuda"}.get(name, name)


def check_fp8_in_compiled(fn, *args, platform: Optional[str] = None,
                          compile: Optional[bool] = None,  # pylint: disable=redefined-builtin
                          require_all: bool = False) -> Fp8Check:
  """Lower (and, on a GPU, compile) `fn(*args)` and check that its GEMMs take FP8 operands.

  platform: lower for this platform ("cuda", "cpu", ...; default: the local backend). Lowering
    for "cuda" works on a machine without a GPU.
  compile: inspect the optimized HLO of the compiled program (default: when `platform` is the
    local GPU). Otherwise the lowered StableHLO is inspected.
  require_all: fail if any GEMM runs on non-FP8 operands (default: at least one FP8 GEMM).

  Passes when at least one dot or GEMM call (Pallas Triton kernel, cuBLASLt FP8 call, XLA dot)
  takes FP8 matrix operands, no dot is fed by a convert from FP8 (XLA upcasting before the
  dot), and every tt.dot inside a Pallas Triton kernel takes FP8 operands.
  """
  plat = _platform(platform)
  local = _platform(None)
  traced = jax.jit(fn).trace(*args)
  lowered = traced.lower(lowering_platforms=(plat,))
  fp8, other, kdots, notes = _lowered_gemms(lowered)
  upcasts: list[str] = []
  if compile is None:
    compile = plat == local and plat in ("cuda", "rocm")
  stage = "lowered"
  if compile:
    if plat != local:
      raise ValueError(f"check_fp8_in_compiled: cannot compile for {plat!r} on a {local!r} host")
    fp8, other, upcasts = compiled_hlo_gemms(lowered.compile().as_text())
    stage = "compiled"
  kernel_ok = all(_is_f8(t) for d in kdots
                  for t in re.match(r"tt\.dot\((\w+), (\w+)\)", d).groups())
  ok = bool(fp8) and not upcasts and kernel_ok and not (require_all and other)
  return Fp8Check(ok=ok, stage=stage, platform=plat, fp8_gemms=tuple(fp8),
                  other_gemms=tuple(other), upcasts=tuple(upcasts), kernel_dots=tuple(kdots),
                  notes=tuple(notes))


def ptx_fp8_mma_lines(dump_dir: str) -> dict:
  """Count FP8 tensor-core instructions in the PTX files XLA dumped (--xla_dump_to).

  Returns {file name: {"wgmma": n, "mma.sync": n}} for the files with any FP8 MMA line
  (an e4m3 or e5m2 operand). wgmma is Hopper's fast path. Best effort: which kernels' PTX XLA
  writes out depends on its version.
  """
  import glob  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  pat = re.compile(r"\b(wgmma\.mma_async|mma\.sync)\S*\.(e4m3|e5m2)")
  counts = {}
  for path in glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True):
    found = {"wgmma": 0, "mma.sync": 0}
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        m = pat.search(line)
        if m:
          found["wgmma" if m.group(1).startswith("wgmma") else "mma.sync"] += 1
    if any(found.values()):
      counts[os.path.basename(path)] = found
  return counts
