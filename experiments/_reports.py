"""What the memory reports (experiments/model_memory.py, scaling_memory.py) share: the check
of --presets and the JSON lines they write into --workdir."""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from absl import app

from jetrl.models import PRESETS


def check_presets(names: Sequence[str]) -> None:
  unknown = [p for p in names if p not in PRESETS]
  if unknown:
    raise app.UsageError(f"unknown presets {unknown}; known: {list(PRESETS)}")


def write_jsonl(workdir: Optional[str], name: str, rows: Sequence[dict]) -> None:
  """rows as <workdir>/<name>, one JSON line each (nothing without a workdir)."""
  if not workdir:
    return
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, name), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
