"""Runs tests/parallel/_multi_device_cases.py on 8 simulated CPU devices in a subprocess.

The device count is fixed when JAX starts, so the flag goes into the child's environment
before it imports anything; the rest of the suite keeps one device. Compilation dominates
these cases on a CPU, so the child also turns down XLA's backend (LLVM) optimisation: the
one-device references and the sharded runs are compiled alike, so comparisons are unaffected.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests", "parallel", "_multi_device_cases.py")
MOE_CASES = os.path.join(ROOT, "tests", "parallel", "_moe_mesh_cases.py")


def _run_cases(select: str, cases: str = CASES):
  env = dict(os.environ)
  flags = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
  )
  env["XLA_FLAGS"] = (
    flags + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  for var in ("JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS"):
    env.pop(var, None)
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-x",
    "-p",
    "no:cacheprovider",
    "-s",
    "--durations=5",
    cases,
    "-k",
    select,
  ]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  print(proc.stdout[-6000:])
  assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]


def test_multi_device_cases_on_8_cpu_devices():
  """Forward, greedy sampling, one update, checkpoints across meshes, invalid meshes."""
  _run_cases("not runner")


def test_moe_sampler_and_update_on_8_cpu_devices():
  """A mixture of experts: the sampler and one update on data:2,fsdp:2,tensor:2."""
  _run_cases("moe or mesh", MOE_CASES)


@pytest.mark.slow
def test_runner_with_mesh_on_8_cpu_devices():
  """The RL loop with --mesh=data:4,fsdp:2, resumed under --mesh=data:8."""
  _run_cases("runner")
