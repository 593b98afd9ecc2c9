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
from jetrl.aot import kernels as _kn
from jetrl.aot import thunks as _thunks
from jetrl.aot.targets import Target, compiling_for

GPU_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"


DUMP_ENV = "JETRL_AOT_DUMP_DIR"


def setup_environment(extra_xla_flags: str = GPU_XLA_FLAGS) -> None:
  """Before JAX starts: the CPU as the only runtime platform (compile-only devices need no
  runtime), the GPU benchmark's XLA flags unless XLA_FLAGS already sets them, and a dump
  folder for XLA's thunk sequences (how a GPU program launches its kernels: jetrl.aot.thunks),
  emptied after each compile."""
  import tempfile  # pylint: disable=import-outside-toplevel

  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compiling processes
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_dump_to" not in flags:
    os.environ[DUMP_ENV] = tempfile.mkdtemp(prefix="jetrl_aot_dump_")
    extra_xla_flags += f" --xla_dump_to={os.environ[DUMP_ENV]}"
  for f in extra_xla_flags.split():
    if f.split("=")[0] not in flags:
      flags = f"{flags} {f}".strip()
  os.environ["XLA_FLAGS"] = flags


@dataclasses.dataclass
class Compiled:
  """A compiled program's facts: its launches, memory plan (bytes) and compile seconds."""

  name: str
  launches: _kn.Launches
  memory: dict
  compile_s: float
  steps: tuple[int, ...] = ()
  tokens: int = 0
  hlo_text: Optional[str] = None
  xla_cost: Optional[dict] = None  # XLA's own cost analysis where it gives one (TPU)

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
      trips=self.launches.trips,
      xla_cost=self.xla_cost,
      thunks=self.launches.thunks,
      kernels=aggregate(self.launches.kernels),
    )

  @classmethod
  def from_json(cls, d: dict) -> "Compiled":
    ks = [_kn.Kernel(**k) for k in d["kernels"]]
    return cls(
      d["name"],
      _kn.Launches(ks, d["iterations"], d.get("trips", []), d.get("thunks")),
      d["memory"],
      d["compile_s"],
      tuple(d.get("steps", ())),
      d.get("tokens", 0),
      xla_cost=d.get("xla_cost"),
    )


def aggregate(kernels: list[_kn.Kernel]) -> list[dict]:
  """Kernels with the same kind, traffic, FLOPs, thread blocks and loop merged (counts added),
  as dicts."""
  acc: dict = collections.OrderedDict()
  for k in kernels:
    key = (
      k.kind,
      k.bytes_read,
      k.bytes_written,
      k.flops,
      k.gemm_dtype,
      k.loop,
      k.computation,
      k.programs,
    )
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


def _dumped_files() -> set:
  d = os.environ.get(DUMP_ENV)
  return set(os.listdir(d)) if d and os.path.isdir(d) else set()


def _thunks_of_compile(before: set, launches: _kn.Launches) -> Optional[dict]:
  """The launch counts from the thunk sequence XLA dumped for this compile (GPU), the dump
  files removed; None where there is none (TPU, or no dump folder)."""
  d = os.environ.get(DUMP_ENV)
  new = sorted(_dumped_files() - before)
  found = [f for f in new if f.endswith(".thunk_sequence_after_thunk_passes.txt")]
  out = None
  if found:
    text = open(os.path.join(d, found[-1])).read()
    out = dataclasses.asdict(_thunks.launch_counts(text, launches.trips))
  for f in new:
    try:
      os.remove(os.path.join(d, f))
    except OSError:
      pass
  return out


def compile_program(program, target: Target, keep_text: bool = False) -> Compiled:
  """Lower and compile `program` for `target`; its kernels and memory plan."""
  before = _dumped_files()
  t0 = time.perf_counter()
  graphs = program.device is None or program.device.kernels.cublaslt_graphs
  with compiling_for(target, graphs):
    compiled = program.compile()
  dt = time.perf_counter() - t0
  text = compiled.as_text()
  launches = _kn.kernels(text, program.steps)
  launches.thunks = _thunks_of_compile(before, launches)
  return Compiled(
    program.name,
    launches,
    memory_stats(compiled),
    dt,
    tuple(program.steps),
    program.tokens,
    text if keep_text else None,
    _xla_cost(compiled),
  )


def _xla_cost(compiled) -> Optional[dict]:
  """XLA's own FLOPs and bytes accessed of one call (loops counted once), where the backend
  gives them (TPU does; the GPU compiler without a device does not)."""
  try:
    ca = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else None
  if not ca:
    return None
  return {k: float(ca[k]) for k in ("flops", "bytes accessed") if k in ca}


def estimate_seconds(c: Compiled, target: Target, params: Optional[_cost.CostParams] = None):
  """The cost model's estimate of one call of `c` (seconds)."""
  params = params or _cost.load_params()[0]
  return _cost.program_seconds(c.launches, target, params)
