"""Parses command lines of one experiments/ script the way the script would, without running it.

  python tests/_doc_command_flags.py ROOT SCRIPT ARGV_JSON

ARGV_JSON is a JSON list of argument lists (flags only). Prints a JSON list with one entry per
argument list: null when the script accepts it, else the error it gives. A script that runs
through `jetrl.train.cli.main` (a configuration tree) has its flags defined from its tree and
its configuration built from the parsed flags (so a bad value is an error, as in a run); other
scripts have their absl flags parsed (with their validators). Nothing is run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys


class _Captured(Exception):
  """Raised by the stand-in for `cli.main`, carrying what the script passed it."""

  def __init__(self, default, kwargs):
    super().__init__("captured")
    self.default, self.kwargs = default, kwargs


def _tree_script(root: str, script: str):
  """(default config, main's keyword arguments) of a script that calls `cli.main`."""
  from jetrl.train import cli  # pylint: disable=import-outside-toplevel

  def fake_main(default, run_fn, **kwargs):
    del run_fn
    raise _Captured(default, kwargs)

  cli.main = fake_main
  sys.argv = [script]
  try:
    runpy.run_path(os.path.join(root, script), run_name="__main__")
  except _Captured as c:
    return c.default, c.kwargs
  raise RuntimeError(f"{script} did not call jetrl.train.cli.main")


def _error(e: BaseException, stderr) -> str:
  """The error a script gives: an exception's message, or what it printed before exiting."""
  if isinstance(e, SystemExit):
    return f"exit {e.code}: {stderr.getvalue().strip()[-500:]}"
  return f"{type(e).__name__}: {e}"


def main() -> None:
  import io  # pylint: disable=import-outside-toplevel

  root, script, argvs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
  sys.path.insert(0, os.path.join(root, "experiments"))
  from absl import flags  # pylint: disable=import-outside-toplevel

  source = open(os.path.join(root, script), encoding="utf-8").read()
  tree = None
  if "jetrl.train.cli import" in source:
    from jetrl.train import cli  # pylint: disable=import-outside-toplevel

    real = dict(define=cli.define_flags, build=cli.config_from_flags, renamed=cli.check_renamed)
    default, kw = _tree_script(root, script)
    exclude = kw.get("exclude", ())
    real["define"](default, flags.FLAGS, exclude=exclude, module_name=script)
    tree = (default, exclude, kw.get("renamed") or {})
  else:
    spec = importlib.util.spec_from_file_location("doc_command_script", os.path.join(root, script))
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_command_script"] = module
    spec.loader.exec_module(module)
  results = []
  for argv in argvs:
    stderr = io.StringIO()
    saved, sys.stderr = sys.stderr, stderr
    flags.FLAGS.unparse_flags()
    try:
      if tree is not None and any(a in ("--help", "-h", "--helpfull") for a in argv):
        results.append(None)
        continue
      if tree is not None:
        real["renamed"]([script] + argv, tree[2])
      flags.FLAGS([script] + argv)
      if tree is not None:
        real["build"](tree[0], flags.FLAGS, exclude=tree[1])
      results.append(None)
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except
      results.append(_error(e, stderr))
    finally:
      sys.stderr = saved
  print(json.dumps(results))


if __name__ == "__main__":
  main()
