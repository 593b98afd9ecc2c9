"""Reading local data files strictly: every error names the file and the line.

A data file is JSON lines (one object per line; blank lines are skipped) or, for `.json`
files, possibly one JSON array of objects. Bad bytes, bad JSON, a line that is not an object
or an empty file is a ValueError such as

  data/train.jsonl:188: invalid JSON (Expecting ',' delimiter, column 41)
  data/train.jsonl:12: not UTF-8 text (byte 0xff at column 7)

so a broken row is found when the task loads, not when a run reaches it. A path is the user's
to give (any file they can read, through links too: it is only read), but it must be a
regular file: a FIFO, a device such as /dev/zero or a socket is refused before it is opened. Each row comes with
where it was read (`path:line`, or `path item k` in an array), which the tasks' field checks
name too (`jetrl.data.loading`).
"""

from __future__ import annotations

import json
import os
import stat


def _where(path: str, line: int) -> str:
  return f"{path}:{line}"


def read_rows(path: str | os.PathLike) -> list[tuple[str, dict]]:
  """[(where, row)] of a JSON-lines file or a `.json` array file; ValueError naming the file
  and line for undecodable bytes, invalid JSON, a non-object row or no rows."""
  path = os.fspath(path)
  if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: opening a FIFO blocks
    raise ValueError(
      f"{path}: not a regular file (a FIFO, a device or a socket would block or never end); "
      "data files are JSON-lines files"
    )
  with open(path, "rb") as f:
    data = f.read()
  if not data.strip():
    raise ValueError(f"{path}: empty file (no rows)")
  lines = data.split(b"\n")
  text_lines = []
  for n, raw in enumerate(lines, 1):
    try:
      text_lines.append(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise ValueError(
        f"{_where(path, n)}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
      ) from None
  if path.endswith(".json") and data.lstrip()[:1] == b"[":
    return _array_rows(path, "\n".join(text_lines))
  rows = []
  for n, line in enumerate(text_lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{_where(path, n)}: invalid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict):
      raise ValueError(f"{_where(path, n)}: a row must be a JSON object, got {type(row).__name__}")
    rows.append((_where(path, n), row))
  return rows


def _array_rows(path: str, text: str) -> list[tuple[str, dict]]:
  try:
    items = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"{_where(path, e.lineno)}: invalid JSON ({e.msg}, column {e.colno})"
    ) from None
  if not items:
    raise ValueError(f"{path}: empty array (no rows)")
  rows = []
  for k, row in enumerate(items):
    if not isinstance(row, dict):
      raise ValueError(
        f"{path}: item {k} of the array must be a JSON object, got {type(row).__name__}"
      )
    rows.append((f"{path} item {k}", row))
  return rows
