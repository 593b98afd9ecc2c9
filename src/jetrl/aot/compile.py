"""Compiling a `Program` for a compile-only target and summarising what it would run.

`GPU_XLA_FLAGS` are the flags jetrl's GPU benchmark runs set (experiments/bench_device.py), so
that what is compiled here is what the recorded H200 runs ran: set them in XLA_FLAGS before
JAX starts (`setup_environment`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Optional

from jetrl.aot import cost as _cost
from jetrl.aot import hlo as _hlo
from jetrl.aot.targets import Target, compiling_for

GPU_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"


def setup_environment(extra_xla_flags: str = GPU_XLA_FLAGS) -> None:
  """Before JAX starts: the CPU as the only runtime platform (compile-only devices need no
  runtime), and the GPU benchmark's XLA flags unless XLA_FLAGS already sets them."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compiling processes
  flags = os.environ.get("XLA_FLAGS", "")
  for f in extra_xla_flags.split():
    if f.split("=")[0] not in flags:
      flags = f"{flags} {f}".strip()
  os.environ["XLA_FLAGS"] = flags


@dataclasses.dataclass
class Compiled:
  """A compiled program's facts: its launches, memory plan (bytes) and compile seconds."""

  name: str
  launches: _hlo.Launches
  memory: dict
  compile_s: float
  steps: tuple[int, ...] = ()
  tokens: int = 0
  hlo_text: Optional[str] = None

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs - aliased + temporaries: what the program holds at its peak."""
    m = self.memory
    return int(m["argument"] + m["output"] - m["alias"] + m["temp"])

  def to_json(self) -> dict:
    return dict(
      name=self.name,
      memory=self.memory,
      compile_s=self.compile_s,
      steps=list(self.steps),
      tokens=self.tokens,
      iterations=self.launches.iterations,
      kernels=aggregate(self.launches.kernels),
    )

  @classmethod
  def from_json(cls, d: dict) -> "Compiled":
    ks = [_hlo.Kernel(**k) for k in d["kernels"]]
    return cls(
      d["name"],
      _hlo.Launches(ks, d["iterations"]),
      d["memory"],
      d["compile_s"],
      tuple(d.get("steps", ())),
      d.get("tokens", 0),
    )


def aggregate(kernels: list[_hlo.Kernel]) -> list[dict]:
  """Kernels with the same kind, traffic, FLOPs and loop merged (counts added), as dicts."""
  acc: dict = collections.OrderedDict()
  for k in kernels:
    key = (k.kind, k.bytes_read, k.bytes_written, k.flops, k.gemm_dtype, k.loop, k.computation)
    if key in acc:
      acc[key]["count"] += k.count
    else:
      acc[key] = dataclasses.asdict(k)
  return list(acc.values())


def memory_stats(compiled) -> dict:
  m = compiled.memory_analysis()
  return dict(
    argument=int(m.argument_size_in_bytes),
    output=int(m.output_size_in_bytes),
    alias=int(m.alias_size_in_bytes),
    temp=int(m.temp_size_in_bytes),
    code=int(m.generated_code_size_in_bytes),
  )


def compile_program(program, target: Target, keep_text: bool = False) -> Compiled:
  """Lower and compile `program` for `target`; its kernels and memory plan."""
  t0 = time.perf_counter()
  with compiling_for(target):
    compiled = program.compile()
  dt = time.perf_counter() - t0
  text = compiled.as_text()
  launches = _hlo.kernels(text, program.steps)
  return Compiled(
    program.name,
    launches,
    memory_stats(compiled),
    dt,
    tuple(program.steps),
    program.tokens,
    text if keep_text else None,
  )


def estimate_seconds(c: Compiled, target: Target, params: Optional[_cost.CostParams] = None):
  """The cost model's estimate of one call of `c` (seconds)."""
  params = params or _cost.load_params()[0]
  return _cost.program_seconds(c.launches, target, params)
