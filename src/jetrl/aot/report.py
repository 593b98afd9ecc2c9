"""Tables of compiled-program figures (jetrl.aot.compile) for the compile report.

Counts, bytes, FLOPs and the memory plan are facts of the compiled program; times are the
cost model's estimates and every line that shows one says "est.".
"""

from __future__ import annotations

import collections
from typing import Optional

from jetrl.aot import cost as _cost
from jetrl.aot.compile import Compiled
from jetrl.aot.kernels import KINDS, Kernel
from jetrl.aot.targets import GIB, TARGETS, Target

GEMM_KINDS = ("cublas", "gemm_fusion", "cublaslt_fp8", "jetrl_fp8_ffi", "pallas")


def by_kind(kernels, loop_only: bool = False, per: float = 1.0) -> dict:
  """Launches per kind (over `per` calls or steps)."""
  c = collections.Counter()
  for k in kernels:
    if loop_only and k.loop is None:
      continue
    c[k.kind] += k.count / per
  return {kind: c[kind] for kind in KINDS if c[kind]}


def step_kernels(c: Compiled) -> list[tuple[str, int, list[Kernel]]]:
  """(loop name, trips, kernels of one iteration) for each top-level `while` of a program
  whose loops are data-dependent (the decode loop's segments)."""
  loops = collections.OrderedDict()
  for k in c.launches.kernels:
    if k.loop is not None:
      loops.setdefault(k.loop, []).append(k)
  out = []
  for (name, ks), trips in zip(loops.items(), c.steps):
    one = [Kernel(**{**k.__dict__, "count": k.count // max(trips, 1)}) for k in ks]
    out.append((name, trips, one))
  return out


def summary(c: Compiled, target: Target, params: _cost.CostParams) -> dict:
  """A program's figures as one flat dict (the JSON the report writes)."""
  ks = c.launches.kernels
  total = lambda f: sum(f(k) * k.count for k in ks)
  est = _cost.program_seconds(c.launches, target, params)
  row = dict(
    program=c.name,
    kernels=int(total(lambda k: 1)),
    by_kind={k: int(v) for k, v in by_kind(ks).items()},
    read_gb=total(lambda k: k.bytes_read) / 1e9,
    written_gb=total(lambda k: k.bytes_written) / 1e9,
    gflop=total(lambda k: k.flops) / 1e9,
    loop_iterations=c.launches.iterations,
    est_ms=est * 1e3,
    memory=c.memory,
    peak_gib=c.peak_bytes / GIB,
    fits=c.peak_bytes <= target.hbm_bytes,
    compile_s=c.compile_s,
    launches=c.launches.thunks,
  )
  steps = step_kernels(c)
  if steps:
    n = sum(t for _, t, _ in steps)
    per_step = lambda f: sum(t * sum(f(k) * k.count for k in ks1) for _, t, ks1 in steps) / n
    row["decode_step"] = dict(
      kernels=per_step(lambda k: 1),
      by_kind={
        kind: sum(t * by_kind(ks1).get(kind, 0) for _, t, ks1 in steps) / n for kind in KINDS
      },
      mb=per_step(lambda k: k.bytes) / 1e6,
      gflop=per_step(lambda k: k.flops) / 1e9,
      est_us=1e6
      * (
        sum(t * _cost.program_seconds(None, target, params, kernels=ks1) for _, t, ks1 in steps) / n
        + params.iteration_us * 1e-6
      ),
      segments=[dict(trips=t, kernels=sum(k.count for k in ks1)) for _, t, ks1 in steps],
    )
    row["decode_step"]["by_kind"] = {k: v for k, v in row["decode_step"]["by_kind"].items() if v}
  if c.tokens:
    row["tokens"] = c.tokens
  return row


def top(c: Compiled, key: str, n: int = 5) -> list[Kernel]:
  f = (lambda k: k.bytes * k.count) if key == "bytes" else (lambda k: k.flops * k.count)
  return [k for k in sorted(c.launches.kernels, key=f, reverse=True)[:n] if f(k) > 0]


def collectives(c: Compiled) -> Optional[dict]:
  ks = [k for k in c.launches.kernels if k.kind == "collective"]
  if not ks:
    return None
  return dict(launches=sum(k.count for k in ks), gb=sum(k.bytes * k.count for k in ks) / 1e9)


def _gib(b: float) -> str:
  return f"{b / GIB:.2f}"


def lines(compiled: list[Compiled], target: Target, params, calib: dict, n_top: int = 5):
  """The printed report: one table of programs, then each program's details."""
  err = calib.get("errors", {}).get("held_out")
  note = (
    f"calibrated on recorded H200 runs; held-out median |error| {100 * err['median_abs']:.0f}%,"
    f" max {100 * err['max_abs']:.0f}%"
    if err
    else "uncalibrated defaults"
  )
  fitted_on = TARGETS.get(calib.get("target", ""))
  if err and (fitted_on is None or fitted_on.device_kind != target.device_kind):
    note = (
      f"constants fitted on H200 runs, never checked on {target.name}: only its counts, "
      "bytes and memory plan are facts"
    )
  out = [
    "Figures of the compiled program (kernels, bytes, FLOPs, memory plan); 'est.' columns are",
    f"cost-model ESTIMATES, not measurements ({note}).",
    "",
    "| program | kernels | GEMM kernels | fusions | copies | collectives | read GB | written GB"
    " | GFLOP | est. ms | peak GiB | fits |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  rows = [summary(c, target, params) for c in compiled]
  for r in rows:
    bk = r["by_kind"]
    gemms = sum(bk.get(k, 0) for k in GEMM_KINDS)
    fusions = bk.get("fusion", 0) + bk.get("triton_fusion", 0)
    out.append(
      f"| {r['program']} | {r['kernels']} | {gemms} | {fusions} | {bk.get('copy', 0)} | "
      f"{bk.get('collective', 0)} | {r['read_gb']:.3f} | {r['written_gb']:.3f} | "
      f"{r['gflop']:.1f} | {r['est_ms']:.3f} | {r['peak_gib']:.2f} | "
      f"{'yes' if r['fits'] else 'NO'} |"
    )
  for c, r in zip(compiled, rows):
    out.append("")
    out.append(f"{c.name}: compiled in {c.compile_s:.0f} s; kernels by kind: {r['by_kind']}")
    m = c.memory
    out.append(
      f"  memory plan: arguments {_gib(m['argument'])} GiB, outputs {_gib(m['output'])}, "
      f"aliased {_gib(m['alias'])}, temporaries {_gib(m['temp'])}; peak {r['peak_gib']:.2f} GiB "
      f"of {target.hbm_gib:.0f} GiB ({'fits' if r['fits'] else 'does NOT fit'})"
    )
    th = c.launches.thunks
    if th:
      out.append(
        f"  launches (XLA's thunk sequence): {th['alone']} on their own, {th['graphs']} CUDA "
        f"graphs holding {th['in_graph']} kernels"
      )
    if "decode_step" in r:
      d = r["decode_step"]
      kinds = ", ".join(f"{k} {v:.0f}" for k, v in d["by_kind"].items())
      out.append(
        f"  per decode step: {d['kernels']:.0f} kernels ({kinds}); {d['mb']:.1f} MB; "
        f"{d['gflop']:.2f} GFLOP; est. {d['est_us']:.0f} us/step"
      )
    if c.tokens and c.name in ("update", "sft"):
      est_s = r["est_ms"] / 1e3
      out.append(f"  est. {c.tokens / est_s:.0f} tokens/s")
    coll = collectives(c)
    if coll:
      out.append(f"  collectives: {coll['launches']} launches, {coll['gb']:.3f} GB per call")
    for key in ("bytes", "flops"):
      ks = top(c, key, n_top)
      if ks:
        out.append(f"  top kernels by {key} (per call):")
        for k in ks:
          out.append(
            f"    {k.kind:<14} {k.name:<40} x{k.count:<5} {k.bytes * k.count / 1e6:10.1f} MB "
            f"{k.flops * k.count / 1e9:10.2f} GFLOP"
          )
  return out, rows
