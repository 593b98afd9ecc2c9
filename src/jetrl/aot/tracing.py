"""`tracing_for`: trace and compile jetrl's programs for a compile-report target from outside.

  import jax, jetrl.aot
  with jetrl.aot.tracing_for("h200") as t:
    f = jax.jit(lambda p, k: jetrl.sampling.sample(p, cfg, prompts, k, scfg, prec))
    compiled = f.trace(abstract_params_on(t.sharding), key_on(t.sharding)).lower().compile()

Inside the context jetrl traces the program the target runs: the same kernel choices (on a
Hopper GPU the cuBLASLt FP8 GEMM through its FFI registration, the Pallas kernels lowered for
Triton) as `experiments/compile_report.py`, so the decode step compiled this way is the compile
report's. The compile report passes the target's device to the programs it builds
(`jetrl.aot.targets.target_device`); code outside jetrl that calls `sample` passes none, so
inside this context (and only here) a plan resolved without a device is for the target's
(`jetrl.kernels.device.tracing`). `t.device` is that device: passing it (`sample(...,
kernels=t.device)`) gives the same program without relying on the context. Arguments must be placed on the target's compile-only devices: `t.devices`, or
`t.sharding` (the first device, replicated). Programs traced before the context (for this
machine) are not reused inside it, nor the target's after it (JAX's caches are cleared on
entry and exit).

The target's JAX plugin must be installed (`make aot` builds `.venv-aot` with it); compile-only
devices need no runtime, so a CPU-only process (`JAX_PLATFORMS=cpu`) can do this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Union

from jetrl.aot.targets import TARGETS, Target, compiling_for, devices, get_target, target_device


@dataclasses.dataclass(frozen=True)
class Tracing:
  """What `tracing_for` yields: the target, its compile-only devices, a one-device sharding,
  and the `jetrl.kernels.Device` its programs are traced for."""

  target: Target
  devices: tuple
  sharding: Any
  device: Any = None


@contextlib.contextmanager
def tracing_for(target: Union[str, Target], kernels=None):
  """A context under which jetrl traces the program `target` (a compile-report target name such
  as "h200", "h100" or "tpu-v5e", or a `Target`) would run, with the kernel settings `kernels`
  (a `jetrl.kernels.KernelConfig`; None: the environment's); yields a `Tracing`."""
  if isinstance(target, str):
    if target not in TARGETS:
      raise ValueError(f"tracing_for: unknown target {target!r}; accepted: {', '.join(TARGETS)}")
    target = get_target(target)
  elif not isinstance(target, Target):
    raise TypeError(f"tracing_for: target must be a target name or a Target, got {type(target)}")
  # What compile-only devices need, where the caller has not set it (a no-op once JAX started).
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  devs = tuple(devices(target))
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  sharding = NamedSharding(Mesh(devs[:1], ("x",)), P())
  dev = target_device(target, kernels)
  with compiling_for(target, dev.kernels.cublaslt_graphs, default=dev):
    yield Tracing(target, devs, sharding, dev)
