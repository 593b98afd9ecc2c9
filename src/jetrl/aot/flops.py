"""FLOPs of the instructions of a compiled program's HLO (jetrl.aot.hlo), 2 per multiply-add:
dots and convolutions (inside fusions or as cuBLAS / cuBLASLt / jetrl GEMM custom calls), and
the Pallas kernels whose custom call carries no dot (jetrl's GEMMs, JAX's flash attention).
`jetrl.aot.kernels` calls these for each kernel it finds; elementwise work is not counted."""

from __future__ import annotations

import math
import re

from jetrl.aot.hlo import Instr, shapes


def dims(attrs: str, key: str) -> tuple[int, ...]:
  m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
  return tuple(int(v) for v in m.group(1).split(",") if v) if m else ()


def dot_flops(ins: Instr, table: dict[str, Instr]) -> float:
  out = shapes(ins.type)
  lhs = table.get(ins.operands[0]) if ins.operands else None
  if not out or lhs is None:
    return 0.0
  lhs_dims = shapes(lhs.type)[0][1]
  k = math.prod(lhs_dims[d] for d in dims(ins.attrs, "lhs_contracting_dims"))
  return 2.0 * math.prod(out[0][1]) * k


def conv_flops(ins: Instr, table: dict[str, Instr]) -> float:
  out = shapes(ins.type)
  rhs = table.get(ins.operands[1]) if len(ins.operands) > 1 else None
  m = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
  if not out or rhs is None or not m:
    return 0.0
  rdims = shapes(rhs.type)[0][1]
  o = m.group(1).find("o")
  per_out = math.prod(rdims) / max(rdims[o], 1) if o >= 0 else math.prod(rdims)
  return 2.0 * math.prod(out[0][1]) * per_out


def custom_gemm_flops(ins: Instr, table: dict[str, Instr], target: str) -> float:
  ops = [table[o] for o in ins.operands if o in table]
  out = shapes(ins.type)
  if len(ops) < 2 or not out:
    return 0.0
  res = out[0][1]
  if target == "jetrl_fp8_blockwise_gemm":  # a [P, C] . b [Q, C]^T
    return 2.0 * math.prod(res) * shapes(ops[0].type)[0][1][-1]
  contract = re.search(r'"lhs_contracting_dimensions":\["?([0-9]+)', ins.attrs)
  lhs = shapes(ops[0].type)[0][1]
  k = lhs[int(contract.group(1))] if contract else lhs[-1]
  return 2.0 * math.prod(res) * k


# Matmuls of [T, D] x [D, T] size per (row, head) that JAX's Pallas flash-attention kernels
# (jax.experimental.pallas.ops.gpu.attention) run, by kernel name: the forward QK^T and PV;
# the backward recomputes QK^T in its dK/dV loop and in its dQ loop, and computes dV, dP
# (twice: once per loop), dK and dQ. Causal: each loop stops at the diagonal, half the tiles.
FLASH_MATMULS = {"mha_forward": 2, "mha_backward": 7}


# jetrl's Pallas GEMMs (jetrl.kernels.gemm_pallas), whose operand a is [P, C] and result
# [P, Q]: 2 P Q C FLOPs.
PALLAS_GEMMS = ("fp8_decode_gemm", "fp8_blockwise_gemm")


def pallas_flops(ins: Instr, table: dict[str, Instr]) -> float:
  """FLOPs of a Pallas call (its custom call carries no dot to count): jetrl's GEMM kernels'
  (`PALLAS_GEMMS`), and the flash-attention kernels', 2 per multiply-add of
  FLASH_MATMULS[name] matmuls over q's [B, T, H, D], halved (causal)."""
  g = re.search(r'name = \\?"(' + "|".join(PALLAS_GEMMS) + r')\\?"', ins.attrs)
  if g and ins.operands and ins.operands[0] in table:
    a, out = shapes(table[ins.operands[0]].type), shapes(ins.type)
    if a and out and len(a[0][1]) == 2 and len(out[0][1]) == 2:
      return 2.0 * math.prod(out[0][1]) * a[0][1][1]
    return 0.0
  m = re.search(r'name = \\?"(mha_forward|mha_backward)\\?"', ins.attrs)
  if not m or not ins.operands or ins.operands[0] not in table:
    return 0.0
  q = shapes(table[ins.operands[0]].type)
  if not q or len(q[0][1]) != 4:
    return 0.0
  b, t, h, d = q[0][1]
  return FLASH_MATMULS[m.group(1)] * 2.0 * b * h * t * t * d * 0.5


def gemm_dtype(operands: list, table: dict) -> str:
  """ "f8" if either operand is FP8, "f32" if both are 32-bit floats, else "bf16"."""
  dts = [shapes(table[o].type)[0][0] for o in operands[:2] if o in table and shapes(table[o].type)]
  if any(d.startswith("f8") for d in dts):
    return "f8"
  if dts and all(d in ("f32", "f64") for d in dts):
    return "f32"
  return "bf16"
