"""An estimate of a compiled program's time on its target, from its kernels (jetrl.aot.kernels).

Per kernel: max(bytes / (HBM bandwidth x bw_eff), FLOPs / (peak x gemm_eff)) / occupancy,
where occupancy = min(1, programs / the target's multiprocessors) for a kernel whose thread
blocks the program fixes (a Pallas grid, cuBLASLt FP8 tiles: `Kernel.programs`; a kernel of 8
programs on an H200's 132 multiprocessors gets 8/132 of its bandwidth), plus its
launch: launch_us on its own, in_graph_us inside a command buffer (a CUDA graph, which costs
graph_us to launch), as XLA's thunk sequence for the program says (jetrl.aot.thunks; every
kernel on its own where there is none);
with the target's published peaks (FP8 for a GEMM on FP8 operands, the float32 one, TF32 on
a GPU, for float32 operands, else bf16) and gemm_eff by GEMM kind (FP8, or not); a
collective moves the larger of its operands and result over the device-to-device link at
the published rate, not overlapped with compute (no measurement of one was recorded to fit
on: a pessimistic, unfitted term); plus iteration_us for each `while` iteration
(on a GPU the loop's predicate goes to the host and back every iteration). The free
constants are fitted on recorded H200 measurements (`experiments/calibrate_cost_model.py`,
which also reports the error on the measurements not fitted on) and kept in
`calibration.json` beside this file.

Every time it gives is an estimate of a program that was compiled, not run; the report says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Optional

from jetrl.aot.kernels import Kernel, Launches
from jetrl.aot.targets import Target

CALIBRATION = Path(__file__).parent / "calibration.json"

# The share of the peak that a Pallas (Triton) kernel's matmuls reach: the flash-attention
# kernels' (jetrl.aot.flops.FLASH_MATMULS). NOT fitted (no recorded run timed one): an
# assumption, about what Triton's flash attention reaches on Hopper (0.3 of the bf16 peak,
# against cuBLAS's fitted gemm_eff_bf16 0.81).
PALLAS_GEMM_EFF = 0.3


@dataclasses.dataclass(frozen=True)
class CostParams:
  """The model's free constants (fitted; see the module doc)."""

  launch_us: float = 3.0  # a kernel or custom call launched on its own
  graph_us: float = 5.0  # a command buffer (CUDA graph) launched
  in_graph_us: float = 1.0  # a kernel inside a command buffer
  iteration_us: float = 10.0
  bw_eff: float = 0.8
  gemm_eff_bf16: float = 0.7
  gemm_eff_fp8: float = 0.6
  # Measured, not fitted: the least time a GEMM kernel (any kernel with FLOPs) took. In a
  # decode step on an H200 (docs/device/2026-12-04-h200-1, the profile) cuBLAS's bf16 GEMMs
  # of 5 to 7 MB took 5.4 to 5.6 us each, where their bytes at the fitted bandwidth come to
  # 1.8 to 2.2 us: the latency of their K loop, which a bandwidth model does not see.
  gemm_floor_us: float = 5.5

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def load_params(path: Path = CALIBRATION) -> tuple[CostParams, dict]:
  """The fitted constants and their record (fit and held-out errors, command); defaults and
  an empty record when no calibration file exists."""
  if not path.exists():
    return CostParams(), {}
  rec = json.loads(path.read_text())
  return CostParams(**rec["params"]), rec


def work_seconds(k: Kernel, target: Target, p: CostParams) -> float:
  """Estimated seconds one launch of `k` works, its launch not included (a collective: its
  bytes over the target's device-to-device link, at the published rate)."""
  if k.kind == "collective" and target.link_gbps:  # the larger side crosses the link, serially
    return max(k.bytes_read, k.bytes_written) / (target.link_gbps * 1e9)
  t_mem = k.bytes / (target.hbm_gbps * 1e9 * p.bw_eff)
  t_flop = 0.0
  if k.flops:
    fp8 = k.fp8 and target.peak_fp8_tflops is not None
    if fp8:
      peak, eff = target.peak_fp8_tflops, p.gemm_eff_fp8
    elif k.kind == "pallas":
      peak, eff = target.peak_bf16_tflops, PALLAS_GEMM_EFF
    elif k.gemm_dtype == "f32":
      peak, eff = target.peak_f32_tflops, p.gemm_eff_bf16
    else:
      peak, eff = target.peak_bf16_tflops, p.gemm_eff_bf16
    t_flop = k.flops / (peak * 1e12 * eff)
  t = max(t_mem, t_flop) / occupancy(k, target)
  if k.flops and target.platform == "gpu":  # a GEMM kernel, a library's or a Pallas one
    t = max(t, p.gemm_floor_us * 1e-6)
  return t


def occupancy(k: Kernel, target: Target) -> float:
  """The share of the device a kernel's thread blocks can use: min(1, programs / SMs), 1 where
  either is unknown."""
  if not k.programs or not target.sms:
    return 1.0
  return min(1.0, k.programs / target.sms)


def kernel_seconds(k: Kernel, target: Target, p: CostParams) -> float:
  """Estimated seconds of one launch of `k`, launched on its own."""
  return work_seconds(k, target, p) + p.launch_us * 1e-6


def launch_seconds(launches: Launches, p: CostParams) -> float:
  """The launch cost of one call: from XLA's thunk sequence where it was read (kernels on
  their own, command buffers, kernels inside them), else every kernel on its own."""
  t = launches.thunks
  if t is None:
    n = sum(k.count for k in launches.kernels)
    return n * p.launch_us * 1e-6
  return (
    t["alone"] * p.launch_us + t["graphs"] * p.graph_us + t["in_graph"] * p.in_graph_us
  ) * 1e-6


def program_seconds(
  launches: Launches, target: Target, p: CostParams, kernels: Optional[Iterable[Kernel]] = None
) -> float:
  """Estimated seconds of one call: every kernel's work times its count, the launches and the
  loop iterations (`kernels`: a subset to sum instead, each launched on its own)."""
  if kernels is not None:
    return sum(kernel_seconds(k, target, p) * k.count for k in kernels)
  t = sum(work_seconds(k, target, p) * k.count for k in launches.kernels)
  return t + launch_seconds(launches, p) + launches.iterations * p.iteration_us * 1e-6
