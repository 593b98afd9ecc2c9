"""A pre-registered design's provenance: its files are committed, and unchanged since its first run.

A pre-registration is a set of files (the document and the design it fixes) that must be in
git, committed and clean, before the first run it judges, and must not change afterwards.
`check` enforces both: on the first call for a report folder it records each file's committed
blob id and the commit that holds them in `<report_dir>/prereg.json`; every later call refuses
to go on if a file is uncommitted, edited, or differs from what was recorded. `precedes` tells
whether the pre-registration's commit is an ancestor of the commit a run was made from (git
order), for the judge.

Git is the only source of truth here: a checkout without git, or files outside a repository,
cannot hold a pre-registration and is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence

RECORD = "prereg.json"


class PreregError(RuntimeError):
  """The pre-registration is missing, uncommitted, or changed since the first run."""


def _git(repo: str, *args: str) -> str:
  try:
    out = subprocess.run(
      ["git", "-C", repo, *args], capture_output=True, text=True, timeout=60, check=False
    )
  except FileNotFoundError as e:
    raise PreregError("git is not installed: a pre-registration is checked against git") from e
  if out.returncode != 0:
    raise PreregError(f"git {' '.join(args)}: {out.stderr.strip() or 'failed'}")
  return out.stdout.strip()


def repo_root(path: str) -> str:
  """The top of the git work tree holding `path`."""
  where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) or "."
  return _git(where, "rev-parse", "--show-toplevel")


def committed_state(files: Sequence[str]) -> dict:
  """{"commit": the newest commit touching any of `files`, "head": HEAD, "blobs": {file: blob id
  at HEAD}} for files that are tracked and have no uncommitted change; else PreregError naming
  the file and what is wrong."""
  if not files:
    raise PreregError("a pre-registration names at least one file")
  root = repo_root(files[0])
  blobs = {}
  for f in files:
    if not os.path.isfile(f):
      raise PreregError(f"{f}: no such file (the pre-registration must be committed first)")
    rel = os.path.relpath(os.path.abspath(f), root)
    if not _git(root, "ls-files", "--", rel):
      raise PreregError(f"{f}: not committed; commit the pre-registration before its first run")
    if _git(root, "status", "--porcelain", "--", rel):
      raise PreregError(f"{f}: has uncommitted changes; a pre-registration runs only as committed")
    blobs[rel] = _git(root, "rev-parse", f"HEAD:{rel}")
  commit = _git(root, "log", "-1", "--format=%H", "--", *blobs)
  return {"commit": commit, "head": _git(root, "rev-parse", "HEAD"), "blobs": blobs}


def check(report_dir: str, files: Sequence[str]) -> dict:
  """Refuses (PreregError) unless `files` are committed and clean, and, when `report_dir` holds
  the record of an earlier run, identical to what that run recorded. Writes the record on the
  first call. Returns the current state (committed_state) with "first_head": the HEAD of the
  first run."""
  state = committed_state(files)
  path = os.path.join(report_dir, RECORD)
  if os.path.exists(path):
    with open(path) as f:
      first = json.load(f)
    if first.get("blobs") != state["blobs"]:
      changed = sorted(
        k
        for k in set(first.get("blobs", {})) | set(state["blobs"])
        if first.get("blobs", {}).get(k) != state["blobs"].get(k)
      )
      raise PreregError(
        f"the pre-registration changed since its first run (commit {first.get('commit', '?')[:12]}"
        f"): {', '.join(changed)}; report a change as an amendment in a file of its own, "
        "never by editing the registered design"
      )
    return dict(state, first_head=first["head"])
  os.makedirs(report_dir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(state, f, indent=1)
  os.replace(tmp, path)
  return dict(state, first_head=state["head"])


def precedes(repo: str, prereg_commit: str, run_commit: str) -> bool:
  """True when `prereg_commit` is `run_commit` or one of its ancestors."""
  out = subprocess.run(
    ["git", "-C", repo, "merge-base", "--is-ancestor", prereg_commit, run_commit],
    capture_output=True,
    timeout=60,
    check=False,
  )
  if out.returncode not in (0, 1):
    raise PreregError(f"git merge-base: {out.stderr.decode().strip() or 'failed'}")
  return out.returncode == 0
