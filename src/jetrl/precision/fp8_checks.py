"""Is it really FP8? Checks of a lowered or compiled program's GEMMs, and of dumped PTX.

`check_fp8_in_compiled(fn, *args)` lowers (and, on a GPU, compiles) `fn` and lists its dots and
GEMM calls (XLA dots, cuBLASLt calls, jetrl's own cuBLASLt FP8 custom call, Pallas Triton
kernels and the `tt.dot`s inside them) by operand type: a program passes when FP8 operands
reach the matrix units and no dot is fed by an upcast from FP8.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax

# --- Is it really FP8? -------------------------------------------------------------------------

_F8_NAMES = ("f8e4m3fn", "f8e5m2", "f8E4M3FN", "f8E5M2", "f8e4m3", "f8E4M3")
_GEMM_TARGET = re.compile(r"matmul|gemm|triton|cublas", re.I)
_TT_DOT = re.compile(r"tt\.dot .*?:\s*tensor<(?:\d+x)+(\w+)>\s*\*\s*tensor<(?:\d+x)+(\w+)>")
_HLO_LINE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)


def _is_f8(t: str) -> bool:
  return t.lower().startswith("f8")


@dataclasses.dataclass(frozen=True)
class Fp8Check:
  """What `check_fp8_in_compiled` found. Each GEMM entry reads 'op(operand types)'."""

  ok: bool
  stage: str  # "compiled" (optimized HLO) or "lowered" (StableHLO)
  platform: str
  fp8_gemms: tuple[str, ...]  # dots / GEMM calls whose matrix operands are FP8
  other_gemms: tuple[str, ...]  # dots / GEMM calls on other types
  upcasts: tuple[str, ...]  # dots fed by a convert from FP8 (upcast before the dot)
  kernel_dots: tuple[str, ...]  # tt.dot operand types inside Pallas Triton kernels (and
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
      dots.append(
        f"tt.dot({m.group(1)}, {m.group(2)})"
        + (f" maxNumImpreciseAcc={acc.group(1)}" if acc else "")
      )
  return dots, None


def _lowered_gemms(lowered):
  """GEMM ops of a lowered (StableHLO) program: (fp8, other, kernel_dots, notes, no_dot),
  no_dot the names of the Pallas Triton kernels with no tt.dot (quantization, norms: not
  GEMMs, and not counted as such)."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel

  fp8, other, kdots, notes, no_dot = [], [], [], [], set()

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
      if "triton" in target:
        dots, note = _triton_dots(op)
        if note:
          notes.append(note)
        elif not dots:  # a kernel without a dot: not a GEMM
          no_dot.add(_kernel_name(op))
          continue
        kdots += dots
      desc = f"custom_call {target}({', '.join(types)})"
      (fp8 if sum(_is_f8(t) for t in types) >= 2 else other).append(desc)
  no_dot.discard("")
  return fp8, other, kdots, notes, no_dot


def _kernel_name(custom_call) -> str:
  """The `name` a Pallas Triton call was given ("" when it has none)."""
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel

    cfg = ir.DictAttr(custom_call.attributes["mhlo.backend_config"])
    return ir.StringAttr(cfg["name"]).value
  except Exception:  # pylint: disable=broad-except
    return ""


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
      op=m.group("op"),
      elem=_elem(m.group("type")),
      operands=ops,
      comp=comp,
      root=line.lstrip().startswith("ROOT"),
      calls=calls.group(1) if calls else None,
      param=int(param.group(1)) if param else None,
      line=line,
    )
  for d in defs.values():  # operand types that the printer left out
    d["operands"] = [(t or defs.get(n, {}).get("elem", "?"), n) for t, n in d["operands"]]
  return defs


def compiled_hlo_gemms(hlo_text: str, no_dot_kernels=()):
  """GEMMs of an optimized HLO module's text: (fp8, other, upcasts). no_dot_kernels: names of
  Pallas kernels known to hold no dot (`_lowered_gemms`); their Triton calls, which name them
  in their op_name, are not counted."""
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
      return any(
        d["param"] < len(defs[c]["operands"])
        and from_f8_convert(defs[c]["operands"][d["param"]][1], depth + 1)
        for c in outer
      )
    if op == "fusion" and d["calls"] in roots:
      return from_f8_convert(roots[d["calls"]], depth + 1)
    if op in ("bitcast", "copy", "transpose", "reshape", "multiply", "broadcast"):
      return any(from_f8_convert(n, depth + 1) for _, n in d["operands"])
    return False

  with_dot = {d["comp"] for d in defs.values() if d["op"] == "dot"}
  fp8, other, upcasts = [], [], []
  for d in defs.values():
    types = [t for t, _ in d["operands"]]
    if (
      d["op"] == "fusion"
      and "triton" in d["line"].lower()
      and d["calls"] not in with_dot
      and sum(_is_f8(t) for t in types) >= 2
    ):
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
      op_name = re.search(r'op_name="([^"]*)"', d["line"])
      if "triton" in target and op_name and any(k in op_name.group(1) for k in no_dot_kernels):
        continue
      if _GEMM_TARGET.search(target):
        desc = f"custom-call {target}({', '.join(types)})"
        (fp8 if sum(_is_f8(t) for t in types) >= 2 else other).append(desc)
  return fp8, other, upcasts


def _platform(name: Optional[str]) -> str:
  name = name or jax.default_backend()
  return {"gpu": "cuda"}.get(name, name)


def check_fp8_in_compiled(
  fn,
  *args,
  platform: Optional[str] = None,
  compile: Optional[bool] = None,  # pylint: disable=redefined-builtin
  require_all: bool = False,
) -> Fp8Check:
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
  fp8, other, kdots, notes, no_dot = _lowered_gemms(lowered)
  upcasts: list[str] = []
  if compile is None:
    compile = plat == local and plat in ("cuda", "rocm")
  stage = "lowered"
  if compile:
    if plat != local:
      raise ValueError(f"check_fp8_in_compiled: cannot compile for {plat!r} on a {local!r} host")
    fp8, other, upcasts = compiled_hlo_gemms(lowered.compile().as_text(), no_dot)
    stage = "compiled"
  kernel_ok = all(
    _is_f8(t) for d in kdots for t in re.match(r"tt\.dot\((\w+), (\w+)\)", d).groups()
  )
  ok = bool(fp8) and not upcasts and kernel_ok and not (require_all and other)
  return Fp8Check(
    ok=ok,
    stage=stage,
    platform=plat,
    fp8_gemms=tuple(fp8),
    other_gemms=tuple(other),
    upcasts=tuple(upcasts),
    kernel_dots=tuple(kdots),
    notes=tuple(notes),
  )


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
