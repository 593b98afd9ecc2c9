"""The limits a confined worker sets on itself (jetrl/data/confine.py), each checked in a fresh
child process against what the kernel then reports or refuses."""

import os
import subprocess
import sys

import pytest

from jetrl.data import confine

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="resource limits as on Linux")


def _child(code: str) -> subprocess.CompletedProcess:
  """`code` run by a fresh, isolated interpreter that loads confine.py by its path, as the
  workers do."""
  prelude = (
    "import importlib.util, resource, sys\n"
    f"spec = importlib.util.spec_from_file_location('c', {confine.__file__!r})\n"
    "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
  )
  return subprocess.run(
    [sys.executable, "-I", "-B", "-c", prelude + code],
    capture_output=True,
    text=True,
    timeout=60,
    cwd="/",
  )


def test_a_limit_is_never_raised_past_the_hard_limit_in_force():
  # Open files, not core size: a shell's `ulimit -c 0` leaves a hard core limit of 0 that no
  # child may raise to the test's starting point, while every system allows 200 open files.
  out = _child(
    "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))\n"
    "c.set_limit(resource.RLIMIT_NOFILE, 5000)\n"
    "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    "c.set_limit(resource.RLIMIT_NOFILE, 64, 100)\n"
    "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split("\n")[:2] == ["(200, 200)", "(64, 100)"]


def test_a_confined_process_writes_no_file_and_allocates_no_more_than_its_memory(tmp_path):
  target = tmp_path / "out.txt"
  out = _child(
    "c.limit_memory_cpu_files(512 << 20, 60)\n"
    "try:\n"
    "  bytearray(1 << 30)\n"
    "  print('allocated')\n"
    "except MemoryError:\n"
    "  print('memory refused')\n"
    f"with open({str(target)!r}, 'w') as f:\n"
    "  f.write('x' * 10)\n"
  )
  assert "memory refused" in out.stdout
  assert out.returncode != 0  # SIGXFSZ or OSError on the write
  assert not target.exists() or os.path.getsize(target) == 0


def test_no_child_process_once_unprivileged():
  code = "import os, subprocess\n"
  if os.geteuid() == 0:  # the kernel does not apply RLIMIT_NPROC to root
    code += "os.setresuid(65534, 65534, 65534)\n"
  out = _child(
    code + "c.limit_descriptors_and_processes(8)\n"
    "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    "try:\n"
    "  subprocess.run(['/bin/true'])\n"
    "  print('started')\n"
    "except OSError:\n"
    "  print('refused')\n"
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["(8,", "8)", "refused"]
