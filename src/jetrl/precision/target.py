"""The platform the program being traced now is compiled for.

Trace-time choices (which GEMM kernel, whether a Pallas kernel runs interpreted, whether the
CPU's bit-level FP8 cast is used) follow the platform a program will run on. That is JAX's
default backend, except while `jetrl.aot` compiles for a device this process does not have
(an H200 or a TPU, from a CPU machine): then it is the compile target's, set here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax


@dataclasses.dataclass(frozen=True)
class CompileTarget:
  """A device compiled for without being present: JAX's platform name ("gpu", "tpu") and,
  for an NVIDIA GPU, its compute capability ("9.0")."""

  platform: str
  compute_capability: Optional[str] = None
  # Trace the target's program but run it here: its Pallas kernels in interpret mode and its
  # FP8 GEMMs on XLA (tests of the GPU-only paths on a CPU; `interpreting`).
  interpret: bool = False
  # The device's memory in bytes (0: unknown), for trace-time choices that depend on it (the
  # update's rematerialisation, `jetrl.rl.remat`).
  memory_bytes: int = 0


_current: list[CompileTarget] = []


def compile_target() -> Optional[CompileTarget]:
  """The compile-only target set by `jetrl.aot` (None: programs run where they are traced)."""
  return _current[-1] if _current else None


def platform() -> str:
  """ "cpu", "gpu" or "tpu": the compile target's platform, else JAX's default backend."""
  t = compile_target()
  return t.platform if t is not None else jax.default_backend()


def interpreting() -> bool:
  """Whether the GPU-only paths being traced run here, interpreted (`CompileTarget.interpret`)."""
  t = compile_target()
  return t is not None and t.interpret


def push(target: CompileTarget) -> None:
  _current.append(target)


def pop() -> None:
  _current.pop()
