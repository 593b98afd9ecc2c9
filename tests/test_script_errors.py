"""The model scripts' missing inputs are one line and exit code 2, before anything loads: a
model folder `make smollm2` has not written yet, or a GSM8K file that is not there."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "script, flags, message",
  [
    (
      "hf_model_report.py",
      ["--model.name=/no/such/folder"],
      "hf_model_report.py: error: --model.name: '/no/such/folder' is not a folder; "
      "`make smollm2` writes",
    ),
    (
      "mismatch_length.py",
      [f"--model.name={ROOT}", "--gsm8k=/no/such/test.jsonl"],
      "mismatch_length.py: error: --gsm8k: '/no/such/test.jsonl' is not a file",
    ),
  ],
)
def test_a_missing_model_folder_or_file_is_one_line(script, flags, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", script), *flags],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().startswith(message), out.stderr[-2000:]
  assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
