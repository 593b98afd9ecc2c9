"""Where the shared reference data lives (`../shared/data` from the repo root), for tests."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = ROOT / ".." / "shared" / "data"
GSM8K_DIR = SHARED / "gsm8k"
MATH500_FILE = SHARED / "math500" / "test.jsonl"

needs_shared = pytest.mark.skipif(
  not (GSM8K_DIR / "train.jsonl").is_file() or not MATH500_FILE.is_file(),
  reason="shared reference data (../shared/data) not present",
)


def read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
