"""experiments/gpu_check.py without a GPU: its reading of a pytest log, its summary tables over
a committed GPU run's JSON (docs/device/2026-11-30-h200-1), and its refusal of an unknown part
before anything runs. The script defines absl flags, so it is loaded in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import importlib.util, json, pathlib, sys
PROFILED = dict(rollout=[dict(recipe="jet", batch=64, prompt_len=256, new_tokens=256, profile=dict(
  kernels=1280, kernels_per_step=5.0, mean_kernel_us=2.5, busy_share=0.25,
  top=[dict(name="fusion.12", share=0.4)]))], update=[dict(recipe="bf16", rows=16, seq=1024,
  profile=dict(kernels=0, note="profiling failed: X"))])
root = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("gpu_check", root / "experiments" / "gpu_check.py")
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
run = root / "docs" / "device" / "2026-11-30-h200-1"
log = pathlib.Path(sys.argv[2])
print(json.dumps(dict(
  tests=gc.pytest_summary(log),
  summary=gc.summary(
    json.loads((run / "bench_device.json").read_text()),
    json.loads((run / "peers.json").read_text()),
    gc.pytest_summary(log),
  ),
  profiled=gc.summary(PROFILED, None, None),
)))
"""

# A pytest -v log of an xdist run: a progress line, xdist's form, the short summary.
LOG = """\
tests/a_test.py::test_one PASSED                                      [ 10%]
tests/a_test.py::test_two FAILED                                      [ 20%]
[gw3] [ 30%] FAILED tests/b_test.py::test_three[bf16]
[gw1] [ 40%] ERROR tests/c_test.py::test_four
=========================== short test summary info ============================
FAILED tests/a_test.py::test_two - AssertionError: 1 != 2
========== 2 failed, 1 passed, 1 error in 12.34s ==========
"""


def _probe(root, tmp_path, log_text):
  log = tmp_path / "tests.log"
  log.write_text(log_text)
  env = dict(os.environ, PYTHONPATH=str(root / "src"))
  out = subprocess.run(
    [sys.executable, "-c", PROBE, str(root), str(log)],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout)


def test_summary_tables_and_failed_tests(root, tmp_path):
  res = _probe(root, tmp_path, LOG)
  assert res["tests"] == dict(
    counts="2 failed, 1 passed, 1 error in 12.34s",
    failed=[
      "tests/a_test.py::test_two",
      "tests/b_test.py::test_three[bf16]",
      "tests/c_test.py::test_four",
    ],
  )
  lines = res["summary"].splitlines()
  # The q projection at M = 4096 (docs/device/2026-11-30-h200-1: bench_device.json's XLA bf16
  # 640.9 TFLOP/s; peers.json's torch bf16 352.1 and cuBLAS blockwise FP8 351.5): jetrl's
  # numbers and the peers' share a row.
  row = next(ln for ln in lines if ln.startswith("| qwen2.5-1.5b | q | 4096x1536x1536 |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[3] == "641" and cells[-2:] == ["352", "351"]
  # The rollout table: the measured bf16 row, and the row the time budget skipped says so.
  assert any(ln.startswith("| bf16 | 64 | 256 | 256 | 1.72e+04 | 3.71 |") for ln in lines)
  assert any(ln.startswith("| jet | 64 | 256 | 256 |") and "time budget" in ln for ln in lines)
  assert "- FAILED tests/b_test.py::test_three[bf16]" in lines
  assert not any(ln.startswith("## Kernels") for ln in lines)  # run 1 profiled nothing


def test_a_run_stopped_before_its_summary_still_names_its_failures(root, tmp_path):
  res = _probe(root, tmp_path, LOG.split("=====")[0])
  assert res["tests"]["counts"] == ""
  assert res["tests"]["failed"][1:] == [
    "tests/b_test.py::test_three[bf16]",
    "tests/c_test.py::test_four",
  ]


def test_an_unknown_part_is_refused_before_anything_runs(root, tmp_path):
  out = subprocess.run(
    [sys.executable, str(root / "experiments" / "gpu_check.py"), f"--out={tmp_path / 'o'}"]
    + ["--parts=tests,bench,gemm"],
    capture_output=True,
    text=True,
    cwd=root,
    env=dict(os.environ, PYTHONPATH=str(root / "src")),
    timeout=120,
  )
  assert out.returncode != 0
  assert "--parts: unknown ['gemm']; accepted: bench, bench2, peers, tests" in out.stderr
  assert not (tmp_path / "o").exists()


def test_the_kernel_table_of_profiled_runs(root, tmp_path):
  lines = _probe(root, tmp_path, LOG)["profiled"].splitlines()
  assert lines[
    lines.index(
      "| part | recipe | setting | kernels | mean kernel (us) | busy | top kernel (share) |"
    )
    + 2 :
  ][:2] == [
    "| rollout | jet | 64x256+256 | 5 a decode step | 2.5 | 25% | `fusion.12` (40%) |",
    "| update | bf16 | 16x1024 | profiling failed: X | | | |",
  ]
