"""Kernels of a compiled program, read from its optimized HLO text (jetrl.aot.hlo).

`kernels(text, steps)` walks the entry computation of `compiled.as_text()` and what it runs
(`while` bodies and conditions, `call`s, `conditional` branches) and returns one `Kernel` per
instruction that launches device work: a fusion, a custom call (cuBLAS, cuBLASLt, jetrl's FFI
GEMM, a Pallas/Triton kernel), a copy, a collective, or another unfused op. Bookkeeping
instructions (parameters, tuples, get-tuple-element, bitcasts, constants, the `-done` half of
an async pair) launch nothing and are not counted.

Bytes are HBM traffic estimated from shapes: a kernel reads its operands and writes its
result, except that (a) a fusion parameter used only through slices reads just the slices,
(b) an in-place dynamic-update-slice fusion reads and writes only the update, and (c) a
custom call's scratch workspace (its trailing u8/s8 result) is not traffic, and (d) an operand
passed twice is read once. FLOPs are counted by `jetrl.aot.flops`: dots and convolutions
(inside fusions or as cuBLAS / cuBLASLt / jetrl GEMM custom calls) and the Pallas GEMM and
flash-attention kernels, 2 per multiply-add; elementwise work is not counted.

Each kernel has a multiplicity `count`: how often one call of the program runs it (a `while`
body runs `known_trip_count` times, or the number the caller passes in `steps` for loops
whose count depends on the data, such as the decode loop).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

from jetrl.aot import flops as _flops
from jetrl.aot.hlo import Instr, Module, dtype_bytes, nbytes, parse_module, shapes

# Instructions that launch nothing.
FREE = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "constant",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
  "add-dependency",
  "domain",
}
COLLECTIVES = {
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-broadcast",
  "ragged-all-to-all",
}
GEMM_TARGETS = {
  "__cublas$gemm": "cublas",
  "__cublas$lt$matmul": "cublas",
  "__cublas$lt$matmul$f8": "cublaslt_fp8",
  "jetrl_fp8_blockwise_gemm": "jetrl_fp8_ffi",
}
KINDS = (
  "fusion",
  "triton_fusion",
  "gemm_fusion",
  "cublas",
  "cublaslt_fp8",
  "jetrl_fp8_ffi",
  "pallas",
  "cudnn",
  "custom_call",
  "copy",
  "collective",
  "other",
)


@dataclasses.dataclass
class Kernel:
  """One launch site: `count` launches per call of the program."""

  name: str
  kind: str
  computation: str
  bytes_read: float
  bytes_written: float
  flops: float
  count: int
  gemm_dtype: str = ""  # the element type of its GEMM's operands ("f8", "bf16", "f32"); "" none
  loop: Optional[str] = None  # the `while` instruction whose body it is in (innermost)
  programs: int = 0  # thread blocks it runs, where known (`_programs`); 0: enough to fill a GPU

  @property
  def bytes(self) -> float:
    return self.bytes_read + self.bytes_written

  @property
  def fp8(self) -> bool:
    return self.gemm_dtype == "f8"


def _attr(attrs: str, key: str) -> Optional[str]:
  m = re.search(rf"\b{re.escape(key)}=%?([\w.\-$]+)", attrs)
  return m.group(1) if m else None


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
  if m:
    return re.findall(r"%([\w.\-]+)", m.group(1))
  one = _attr(attrs, key)
  return [one] if one else []


# A decode step's attention kernels (jetrl.kernels.decode_attention) are given the whole KV
# cache but read only its first n slots, n in their name, and the fused one writes a single
# slot of the caches it updates in place (aliased outputs of the caches' shape).
SLOT_KERNEL = re.compile(r'name = \\?"decode_(?:step_)?attention_(\d+)slots\\?"')


def _slot_traffic(ins: Instr, table: dict[str, Instr], read: float, written: float, programs=0):
  """(bytes read, bytes written) of a decode attention kernel (`SLOT_KERNEL`); others as
  given. Operands [B, Hkv, S, Dh] count n of their S slots, once per program that reads them:
  a grid of `programs` over B x Hkv caches reads each programs / (B Hkv) times (a program per
  query head reads its kv head's slots again for each query head of the group); results of
  that rank, one slot."""
  m = SLOT_KERNEL.search(ins.attrs)
  if not m:
    return read, written
  n = int(m.group(1))
  read = 0.0
  for o in ins.operands:
    if o in table:
      (dt, dims), *rest = shapes(table[o].type) or [("", ())]
      size = nbytes(table[o].type)
      if not rest and len(dims) == 4 and dims[2] >= n:
        times = max(1.0, programs / (dims[0] * dims[1])) if programs else 1.0
        read += size * n / dims[2] * times
      else:
        read += size
  written = 0.0
  for dt, dims in shapes(ins.type):
    size = dtype_bytes(dt) * math.prod(dims)
    written += size / dims[2] if len(dims) == 4 else size
  return read, written


# cuBLASLt's blockwise-scaled FP8 GEMM runs 128 x 128 output tiles, one thread block each (the
# nvjet ..._128x128_... kernels of the 2026-12-04 H200 profile); with few tiles it split the
# contraction only where it was long: K = 8960 (70 blocks) ran split-K, K = 1536 (12) did not.
# The split's factor is not in the profile; 4 gives its measured time (12 us a call for the
# 64 x 8960 x 1536 down projection against 9.7 us for o's 12 tiles at K = 1536).
FP8_GEMM_TILE = 128
FP8_SPLIT_K_BLOCKS = 32
FP8_SPLIT_K = 4


def _programs(ins: Instr, table: dict[str, Instr], kind: str) -> int:
  """Thread blocks of a kernel, where the program says: a Pallas kernel's grid (its backend
  config), jetrl's FP8 GEMM's output tiles (times FP8_SPLIT_K where its contraction is long
  enough for cuBLASLt to split it). 0 otherwise (XLA's own kernels and cuBLAS pick their
  tiles to fill the device)."""
  if kind == "pallas":
    dims = [int(v) for v in re.findall(r"grid_[xyz] = (\d+)", ins.attrs)]
    return math.prod(dims) if dims else 0
  if kind == "jetrl_fp8_ffi":
    res = shapes(ins.type)
    a = table.get(ins.operands[0]) if ins.operands else None
    if not res or len(res[0][1]) != 2 or a is None:
      return 0
    p, q = res[0][1]
    c = shapes(a.type)[0][1][-1]
    tiles = -(-p // FP8_GEMM_TILE) * -(-q // FP8_GEMM_TILE)
    return tiles * (FP8_SPLIT_K if -(-c // FP8_GEMM_TILE) >= FP8_SPLIT_K_BLOCKS else 1)
  return 0


def _fusion_traffic(mod: Module, ins: Instr, outer: dict[str, Instr]):
  """(bytes read, bytes written, flops, GEMM operand type) of a fusion, from its fused
  computation."""
  called = _called(ins.attrs, "calls")
  comp = called[0] if called else None
  if comp not in mod.computations:
    read = sum(nbytes(outer[o].type) for o in ins.operands if o in outer)
    return read, nbytes(ins.type), 0.0, ""
  body = mod.computations[comp]
  table = {i.name: i for i in body}
  users: dict[str, list[Instr]] = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  params = [i for i in body if i.opcode == "parameter"]

  def slice_bytes(name: str) -> Optional[float]:
    """Bytes read of a value used only through (dynamic) slices / gathers, via bitcasts."""
    total = 0.0
    for u in users.get(name, []):
      if u.opcode in ("slice", "dynamic-slice", "gather"):
        total += nbytes(u.type)
      elif u.opcode == "bitcast":
        sub = slice_bytes(u.name)
        if sub is None:
          return None
        total += sub
      elif u.opcode == "dynamic-update-slice" and u.operands and u.operands[0] == name:
        continue  # the buffer updated in place: only the update moves
      else:
        return None
    return total

  read = 0.0
  for p in params:
    full = nbytes(p.type)
    part = slice_bytes(p.name)
    read += full if part is None else min(full, part)
  root = next((i for i in body if i.root), body[-1])
  written = nbytes(ins.type)
  roots = [root] if root.opcode != "tuple" else [table[o] for o in root.operands if o in table]
  for r in roots:
    if r.opcode == "dynamic-update-slice" and len(r.operands) > 1 and r.operands[1] in table:
      written -= nbytes(r.type) - nbytes(table[r.operands[1]].type)
  flops, gemm = 0.0, ""
  for i in body:
    if i.opcode in ("dot", "convolution"):
      flops += _flops.dot_flops(i, table) if i.opcode == "dot" else _flops.conv_flops(i, table)
      gemm = _flops.gemm_dtype(i.operands, table)
  return read, max(written, 0.0), flops, gemm


def _fusion_kind(attrs: str) -> str:
  if "__triton_gemm" in attrs or "__triton_nested_gemm_fusion" in attrs:
    return "gemm_fusion"
  if "__cudnn$" in attrs:
    return "cudnn"
  if '"kind":"__triton' in attrs:
    return "triton_fusion"
  return "fusion"


def _trip_count(attrs: str) -> Optional[int]:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  return int(m.group(1)) if m else None


@dataclasses.dataclass
class Launches:
  """What one call of a compiled program runs: its kernels, and how many `while`
  iterations (each one a round trip to the host for the loop's predicate on a GPU)."""

  kernels: list[Kernel]
  iterations: int
  trips: list[int] = dataclasses.field(default_factory=list)  # each loop's, in visit order
  thunks: Optional[dict] = None  # GPU launches: {"alone", "graphs", "in_graph"} (jetrl.aot.thunks)


def kernels(text: str, steps: Sequence[int] = ()) -> Launches:
  """The kernels one call of the compiled program launches (see the module doc).

  steps: trip counts of the data-dependent `while` loops, in the order they appear (a loop
  with a known trip count uses that; one with neither counts once)."""
  mod = parse_module(text)
  out: list[Kernel] = []
  free_steps = list(steps)
  iterations = [0]
  trips_seen: list[int] = []

  def walk(comp: str, count: int, loop: Optional[str]):
    table = mod.table(comp)
    for ins in mod.computations[comp]:
      op = ins.opcode
      if op in FREE or op.endswith("-done"):
        continue
      if op == "while":
        trips = _trip_count(ins.attrs)
        if trips is None:
          trips = free_steps.pop(0) if free_steps else 1
        iterations[0] += count * trips
        trips_seen.append(trips)
        cond = _attr(ins.attrs, "condition")
        body = _attr(ins.attrs, "body")
        # The condition runs once more than the body.
        if cond in mod.computations:
          walk(cond, count * (trips + 1), ins.name)
        if body in mod.computations:
          walk(body, count * trips, ins.name)
        continue
      if op == "call":
        for c in _called(ins.attrs, "to_apply"):
          walk(c, count, loop)
        continue
      if op == "conditional":
        branches = _called(ins.attrs, "branch_computations") or [
          c
          for c in (_attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation"))
          if c
        ]
        if branches:  # the first branch stands for whichever runs
          walk(branches[0], count, loop)
        continue
      # An operand passed twice (a kernel reading the two halves of one array, each program its
      # own block of each) is one buffer read once.
      read = sum(nbytes(table[o].type) for o in dict.fromkeys(ins.operands) if o in table)
      written = nbytes(ins.type)
      flops, gemm = 0.0, ""
      base = op.removesuffix("-start")
      if op == "fusion":
        kind = _fusion_kind(ins.attrs)
        read, written, flops, gemm = _fusion_traffic(mod, ins, table)
        if gemm and kind == "fusion":  # a dot or convolution fused with its neighbours (TPU)
          kind = "gemm_fusion"
      elif op == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        target = m.group(1) if m else ""
        res = shapes(ins.type)
        if len(res) > 1 and res[-1][0] in ("u8", "s8"):  # scratch workspace
          written -= dtype_bytes(res[-1][0]) * math.prod(res[-1][1])
        if target in GEMM_TARGETS:
          kind = GEMM_TARGETS[target]
          flops = _flops.custom_gemm_flops(ins, table, target)
          gemm = _flops.gemm_dtype(ins.operands, table)
        elif "triton" in target:
          kind = "pallas"
          flops = _flops.pallas_flops(ins, table)
          read, written = _slot_traffic(ins, table, read, written, _programs(ins, table, kind))
          gemm = _flops.gemm_dtype(ins.operands, table) if flops else ""
        elif "cudnn" in target:
          kind = "cudnn"
        else:
          kind = "custom_call"
      elif op in ("copy", "copy-start"):
        kind = "copy"
      elif base in COLLECTIVES:
        kind = "collective"
      elif op in ("dot", "convolution"):
        kind, gemm = "cublas", _flops.gemm_dtype(ins.operands, table)
        flops = _flops.dot_flops(ins, table) if op == "dot" else _flops.conv_flops(ins, table)
      else:
        kind = "other"
        if op == "dynamic-update-slice" and len(ins.operands) > 1:
          upd = nbytes(table[ins.operands[1]].type) if ins.operands[1] in table else 0
          read, written = upd, upd
      programs = _programs(ins, table, kind) if op == "custom-call" else 0
      out.append(
        Kernel(ins.name, kind, comp, read, max(written, 0.0), flops, count, gemm, loop, programs)
      )

  walk(mod.entry, 1, None)
  return Launches(out, iterations[0], trips_seen)
