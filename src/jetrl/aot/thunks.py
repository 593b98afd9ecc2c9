"""How a compiled GPU program launches its kernels: XLA's thunk sequence.

XLA's GPU runtime runs a program as a sequence of thunks. Runs of kernels may be recorded into
a command buffer (a CUDA graph) and launched as one; the others (custom calls such as cuBLAS
and jetrl's FFI GEMM, and whatever sits between them) are launched one by one. XLA writes the
sequence it will run to `*.thunk_sequence_after_thunk_passes.txt` when dumping (`--xla_dump_to`);
`launch_counts` reads it: per call of the program, how many thunks are launched alone, how
many command buffers are launched, and how many kernels run inside them, each line weighted by
the trip counts of the `while` loops around it (given in the order the loops appear, as
`jetrl.aot.kernels.kernels` visits them).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

_LINE = re.compile(r"^(\s*)(\d+): (k\w+)")
_HEADER = re.compile(r"^\s*(condition|body):\s*$")
# Thunks that launch nothing themselves (control flow, grouping).
_CONTAINERS = {"kWhile", "kConditional", "kSequential", "kCommandBuffer"}


@dataclasses.dataclass
class ThunkLaunches:
  """Per call: thunks launched alone, command buffers launched, kernels inside them."""

  alone: int = 0
  graphs: int = 0
  in_graph: int = 0


def launch_counts(text: str, trips: Sequence[int]) -> ThunkLaunches:
  out = ThunkLaunches()
  trips = list(trips)
  # stack of (indent, kind, multiplier, in_graph) for open containers
  stack: list[list] = []
  mult, graph = 1, False
  pending_while = None  # (indent, trips) of the kWhile whose condition/body headers follow

  def close_to(indent: int):
    nonlocal mult, graph
    while stack and indent <= stack[-1][0]:
      stack.pop()
      mult = stack[-1][2] if stack else 1
      graph = stack[-1][3] if stack else False

  for line in text.splitlines():
    h = _HEADER.match(line)
    if h and pending_while is not None:
      w_indent, n, base, base_graph = pending_while
      # headers sit at or near the while's indent: its children are deeper than the while
      while stack and stack[-1][1] in ("condition", "body") and stack[-1][0] == w_indent:
        stack.pop()
      m = base * (n + 1 if h.group(1) == "condition" else n)
      stack.append([w_indent, h.group(1), m, base_graph])
      mult, graph = m, base_graph
      continue
    m = _LINE.match(line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(3)
    close_to(indent)
    if kind == "kWhile":
      n = trips.pop(0) if trips else 1
      pending_while = (indent, n, mult, graph)
      continue
    if kind == "kCommandBuffer":
      if not graph:
        out.graphs += mult
      stack.append([indent, kind, mult, True])
      graph = True
      continue
    if kind in _CONTAINERS:
      stack.append([indent, kind, mult, graph])
      continue
    if graph:
      out.in_graph += mult
    else:
      out.alone += mult
  return out
