"""Optimized HLO text, parsed: computations of instructions with their result types.

`parse_module(compiled.as_text())` gives each computation's instructions (name, result type,
opcode, operands, attributes); `shapes` / `nbytes` read HLO types. What the instructions
launch is `jetrl.aot.kernels`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "s4": 0.5,
  "u4": 0.5,
  "token": 0,
}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")


def dtype_bytes(dtype: str) -> float:
  if dtype not in DTYPE_BYTES and not dtype.startswith("f8"):
    raise ValueError(f"unknown HLO element type {dtype!r}")
  return DTYPE_BYTES.get(dtype, 1)


def shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of each array in an HLO type ("bf16[8,128]{1,0}" or a tuple of them)."""
  out = []
  for dt, dims in _SHAPE.findall(type_text):
    out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
  return out


def nbytes(type_text: str) -> float:
  return sum(dtype_bytes(dt) * math.prod(d) for dt, d in shapes(type_text))


@dataclasses.dataclass
class Instr:
  name: str
  type: str  # result type text
  opcode: str
  operands: list[str]
  attrs: str
  root: bool = False
  args: str = ""  # the text between the opcode's parentheses


def _match_paren(s: str, i: int) -> int:
  """Index just past the parenthesis group opening at s[i]."""
  depth = 0
  for j in range(i, len(s)):
    c = s[j]
    if c == "(":
      depth += 1
    elif c == ")":
      depth -= 1
      if depth == 0:
        return j + 1
  raise ValueError(f"unbalanced parentheses in HLO line: {s[:200]}")


def parse_instr(line: str) -> Optional[Instr]:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):
    end = _match_paren(rest, 0)
    type_text, rest = rest[:end], rest[end:].lstrip()
  else:
    sp = rest.index(" ")
    type_text, rest = rest[:sp], rest[sp + 1 :]
  op_end = rest.index("(")
  opcode = rest[:op_end]
  end = _match_paren(rest, op_end)
  inner = rest[op_end + 1 : end - 1]
  operands = re.findall(r"%([\w.\-]+)", inner)
  return Instr(
    m.group(2), type_text, opcode, operands, rest[end:], root=bool(m.group(1)), args=inner
  )


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instr]]
  entry: str

  def table(self, comp: str) -> dict[str, Instr]:
    return {i.name: i for i in self.computations[comp]}


def parse_module(text: str) -> Module:
  comps: dict[str, list[Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      current = h.group(2)
      comps[current] = []
      if h.group(1):
        entry = current
      continue
    if current is None:
      continue
    if line.startswith("}"):
      current = None
      continue
    ins = parse_instr(line)
    if ins is not None:
      comps[current].append(ins)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module(comps, entry)
