"""Compile-only devices: an H100 / H200 or a TPU that this machine does not have.

XLA compiles a JAX program for a device it cannot run on ("deviceless" compilation): JAX's
`jax.experimental.topologies` gives device objects for a named topology, and arguments placed
on a mesh of them (`jax.ShapeDtypeStruct(..., sharding=...)`) lower and compile as they would
on the device. Nothing runs. NVIDIA targets need the CUDA plugin (`pip install -e '.[aot]'`,
no CUDA libraries), TPU ones libtpu (the same extra).

Each `Target` carries the published per-device peaks that the cost model (`jetrl.aot.cost`)
divides by; where a chip exposes two devices (TPU v4, TPU7x), each device gets half.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Optional

HERE = Path(__file__).parent / "targets"
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
  """One compile-only device kind and how many of it (`devices`), with its published peaks.

  platform: JAX's name ("gpu", "tpu"); topology: the topology name passed to JAX;
  config: a GpuTargetConfig text proto in jetrl/aot/targets/ (NVIDIA only).
  peak_bf16_tflops / peak_fp8_tflops / peak_f32_tflops: dense peaks per device for GEMMs on
  bf16, FP8 (None: no FP8 MMA) and float32 operands (TF32 tensor cores on a GPU, which XLA
  uses for float32 dots at default precision; the bf16 rate's share on a TPU, whose MXU runs
  float32 at default precision as one bf16 pass);
  hbm_gbps: HBM bandwidth per device in GB/s; hbm_gib: HBM per device; link_gbps: the
  published device-to-device bandwidth one way, for collectives (not fitted on any measurement);
  sms: streaming multiprocessors per device (0: not modelled), what a kernel of fewer programs
  than that leaves idle (jetrl.aot.cost).
  """

  name: str
  platform: str
  topology: str
  devices: int
  device_kind: str
  peak_bf16_tflops: float
  peak_fp8_tflops: Optional[float]
  hbm_gbps: float
  hbm_gib: float
  config: Optional[str] = None
  compute_capability: Optional[str] = None
  source: str = ""
  f32_share: float = 0.5  # float32 GEMM peak / bf16 peak
  link_gbps: float = 0.0  # device-to-device bandwidth per direction (NVLink / ICI), GB/s
  sms: int = 0  # streaming multiprocessors (NVIDIA); 0: occupancy not modelled

  @property
  def peak_f32_tflops(self) -> float:
    return self.peak_bf16_tflops * self.f32_share

  @property
  def hbm_bytes(self) -> int:
    return int(self.hbm_gib * GIB)


_H200 = dict(
  platform="gpu",
  device_kind="NVIDIA H200",
  peak_bf16_tflops=989.0,
  peak_fp8_tflops=1979.0,
  hbm_gbps=4800.0,
  hbm_gib=140.0,  # 141 GB of HBM3e, as the target file's device_memory_size
  config="h200.txtpb",
  compute_capability="9.0",
  link_gbps=450.0,  # NVLink 4: 900 GB/s both directions
  sms=132,  # H100 / H200 SXM (seen by PyTorch on a lent H200)
  source="NVIDIA H200 SXM datasheet (dense peaks, without sparsity)",
)
_H100 = dict(_H200, device_kind="NVIDIA H100", hbm_gbps=3350.0, hbm_gib=79.6, config="h100.txtpb")
_H100["source"] = "NVIDIA H100 SXM datasheet (dense peaks, without sparsity)"
_V5E = dict(
  platform="tpu",
  device_kind="TPU v5 lite",
  peak_bf16_tflops=197.0,
  peak_fp8_tflops=None,
  hbm_gbps=819.0,
  hbm_gib=16.0,
  source="Google Cloud TPU v5e documentation (per chip)",
  link_gbps=200.0,  # ICI 1600 Gbps
  f32_share=1.0,  # XLA's default precision runs a float32 dot as one bf16 pass on the MXU
)
_V5P = dict(
  _V5E,
  device_kind="TPU v5",
  peak_bf16_tflops=459.0,
  hbm_gbps=2765.0,
  hbm_gib=95.0,
  link_gbps=600.0,  # ICI 4800 Gbps
  source="Google Cloud TPU v5p documentation (per chip)",
)
_V6E = dict(
  _V5E,
  device_kind="TPU v6 lite",
  peak_bf16_tflops=918.0,
  hbm_gbps=1640.0,
  hbm_gib=32.0,
  link_gbps=448.0,  # ICI 3584 Gbps
  source="Google Cloud TPU v6e (Trillium) documentation (per chip)",
)
# TPU7x (Ironwood): 2307 bf16 / 4614 FP8 TFLOP/s, 192 GB at 7.37 TB/s per chip, which JAX
# shows as two devices.
_TPU7X = dict(
  _V5E,
  device_kind="TPU7x",
  peak_bf16_tflops=2307.0 / 2,
  peak_fp8_tflops=4614.0 / 2,
  hbm_gbps=7370.0 / 2,
  hbm_gib=192.0 * 1e9 / GIB / 2,
  link_gbps=600.0 / 2,  # ICI 1.2 TB/s both directions per chip
  source="Google Cloud TPU7x (Ironwood) documentation, per chip halved (two devices a chip)",
)
# TPU v4: 275 bf16 TFLOP/s, 32 GiB at 1.2 TB/s per chip; JAX shows two devices a chip here.
_V4 = dict(
  _V5E,
  device_kind="TPU v4",
  peak_bf16_tflops=275.0 / 2,
  hbm_gbps=1200.0 / 2,
  hbm_gib=16.0,
  link_gbps=300.0 / 2,  # ICI 2400 Gbps per chip
  source="Google Cloud TPU v4 documentation, per chip halved (two devices a chip)",
)

TARGETS: dict[str, Target] = {
  t.name: t
  for t in (
    Target("h100", topology="1x1x1", devices=1, **_H100),
    Target("h200", topology="1x1x1", devices=1, **_H200),
    Target("8xh200", topology="1x1x8", devices=8, **_H200),
    Target("tpu-v5e", topology="v5e:2x2", devices=1, **_V5E),
    Target("tpu-v5e-8", topology="v5e:2x4", devices=8, **_V5E),
    Target("tpu-v5p", topology="v5p:2x2x1", devices=1, **_V5P),
    Target("tpu-v6e", topology="v6e:2x2", devices=1, **_V6E),
    Target("tpu-v4", topology="v4:2x2x1", devices=1, **_V4),
    Target("tpu7x", topology="tpu7x:2x2x1", devices=1, **_TPU7X),
    Target("tpu7x-8", topology="tpu7x:2x2x1", devices=8, **_TPU7X),
  )
}


def get_target(name: str) -> Target:
  """The target called `name`; an unknown name is a ValueError listing the known ones."""
  if name not in TARGETS:
    raise ValueError(f"unknown compile target {name!r}; known targets: {', '.join(TARGETS)}")
  return TARGETS[name]


class MissingPlugin(RuntimeError):
  """The JAX plugin a target needs is not installed (`pip install -e '.[aot]'`)."""


def _check_plugin(target: Target) -> None:
  import importlib.util  # pylint: disable=import-outside-toplevel

  module = "jax_plugins.xla_cuda12" if target.platform == "gpu" else "libtpu"
  try:
    found = importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    found = False
  if not found:
    what = "the CUDA plugin (jax-cuda12-plugin)" if target.platform == "gpu" else "libtpu"
    raise MissingPlugin(
      f"compiling for {target.name} needs {what}: make aot (a .venv-aot with the aot extra), "
      "or pip install -e '.[aot]'"
    )


def devices(target: Target) -> list:
  """The target's compile-only devices (the first `target.devices` of its topology)."""
  _check_plugin(target)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  if target.platform == "gpu":
    text = (HERE / target.config).read_text()
    topo = topologies.get_topology_desc(
      platform="cuda", topology=target.topology, target_config=text
    )
  else:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    topo = topologies.get_topology_desc(target.topology, "tpu")
  devs = list(topo.devices)
  if len(devs) < target.devices:
    raise ValueError(f"{target.name}: topology {target.topology} has {len(devs)} devices")
  return devs[: target.devices]


def target_device(target: Target, kernels=None):
  """The `jetrl.kernels.Device` of `target`, a compile-only device, with the kernel settings
  `kernels` (a `KernelConfig`; None: the environment's, `KernelConfig.from_env`): what the
  programs compiled for it resolve their plans with (`jetrl.aot.programs`)."""
  # Local: this module is read before JAX is imported (compile.setup_environment sets JAX's
  # environment first), and jetrl.kernels imports JAX.
  from jetrl.kernels import Device, KernelConfig  # pylint: disable=import-outside-toplevel

  return Device(
    target.platform,
    target.compute_capability,
    memory_bytes=target.hbm_bytes,
    compiling=True,
    kernels=KernelConfig.from_env() if kernels is None else kernels,
  )


@contextlib.contextmanager
def compiling_for(target: Target, graphs: bool = True, default=None):
  """Inside, programs compile for `target`: for a Hopper GPU the cuBLASLt FP8 GEMM's handler
  is registered for compiling only (never run; `graphs`: captured in CUDA graphs,
  `KernelConfig.cublaslt_graphs`), and JAX's caches are cleared on entry and exit (programs
  traced for this machine are not reused, nor the target's after). Which kernels a program
  runs is its plan's, resolved for the target's `Device` (`target_device`), passed to it.
  default: a `Device` that plans resolved without one are for inside (`tracing_for`'s, for
  code outside jetrl that passes none: `jetrl.kernels.device.tracing`); None: this machine's."""
  from jetrl.kernels import cublaslt  # pylint: disable=import-outside-toplevel
  from jetrl.kernels.device import tracing  # pylint: disable=import-outside-toplevel

  if target.platform == "gpu":
    reason = cublaslt.load_for_compile(graphs)
    if reason:
      print(f"note: the cuBLASLt FP8 GEMM cannot be registered ({reason}); Pallas instead")
  import jax  # pylint: disable=import-outside-toplevel

  jax.clear_caches()
  try:
    if default is None:
      yield
    else:
      with tracing(default):
        yield
  finally:
    jax.clear_caches()
