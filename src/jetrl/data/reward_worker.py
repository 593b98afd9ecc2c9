"""Runs a user's reward function in its own process, for `jetrl.data.user_reward`.

The parent starts this file as a script (`python -B reward_worker.py SPEC`, in the parent's
working directory, with the parent's `sys.path` in JETRL_REWARD_SYS_PATH) and talks to it over
pipes, one JSON object per line:

  ready    {"ready": true}                (or {"ready": false, "error": "..."}, then it exits)
  request  {"id": 3, "prompts": [...], "completions": [...], "answers": [...], "kwargs": {...}}
  reply    {"id": 3, "rewards": [1.0, 0.0, null, ...]}
           {"id": 3, "error": "ZeroDivisionError: ...", "traceback": "..."}

Why a process: a reward function that hangs cannot be stopped inside the process that runs
it; the parent kills this one when a reply is late and starts a new one for the next batch.
Only JSON crosses the pipe (the replies are parsed by `json.loads`, never unpickled). The
function's own prints go to stderr, so they cannot break the protocol on stdout. This file does
not import jetrl, so it starts in the time Python and the user's module take.
"""

import importlib
import importlib.util
import json
import math
import os
import sys
import traceback


def load_function(spec):
  """The callable named by "path/to/file.py:fn" or "package.module:fn"."""
  target, sep, name = spec.rpartition(":")
  if not sep or not target or not name:
    raise ValueError(f"expected 'path/to/file.py:function' or 'module:function', got {spec!r}")
  if target.endswith(".py") or os.sep in target:
    path = os.path.abspath(target)
    if not os.path.isfile(path):
      raise ValueError(f"reward file {target!r} does not exist")
    sys.path.insert(0, os.path.dirname(path))  # so the file can import its neighbours
    module_name = "jetrl_user_reward_" + "".join(
      c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0]
    )
    mspec = importlib.util.spec_from_file_location(module_name, path)
    if mspec is None or mspec.loader is None:
      raise ValueError(f"reward file {target!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[module_name] = module
    where = f"reward file {target!r}"
    try:
      mspec.loader.exec_module(module)
    except Exception as e:
      raise ValueError(f"{where} raised {type(e).__name__} while loading: {e}") from e
  else:
    where = f"module {target!r}"
    try:
      module = importlib.import_module(target)
    except Exception as e:
      raise ValueError(f"{where} could not be imported: {type(e).__name__}: {e}") from e
  fn = getattr(module, name, None)
  if fn is None:
    defined = sorted(
      k
      for k, v in vars(module).items()
      if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
    )
    raise ValueError(f"{where} has no function {name!r}; it defines {defined}")
  if not callable(fn):
    raise ValueError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
  return fn


def to_json_value(value):
  """A reward as JSON: a finite or non-finite float, or None; TypeError otherwise."""
  if value is None:
    return None
  if isinstance(value, bool) or not hasattr(value, "__float__"):
    raise TypeError(f"{type(value).__name__} {value!r:.60}")
  x = float(value)
  return x if math.isfinite(x) else repr(x)  # "nan" / "inf": JSON has no spelling for them


def score(fn, req):
  out = fn(req.get("prompts"), req["completions"], req["answers"], **(req.get("kwargs") or {}))
  if isinstance(out, (list, tuple)):
    values = list(out)
  elif getattr(out, "ndim", None) == 1 and hasattr(out, "tolist"):  # a numpy / JAX vector
    values = out.tolist()
  else:  # a dict (its keys), a str (its characters), a generator, ...: not a list
    return {"bad": f"returned a {type(out).__name__}, not a list of floats"}
  rewards = []
  for k, v in enumerate(values):
    try:
      rewards.append(to_json_value(v))
    except (TypeError, ValueError) as e:
      return {"bad": f"returned a non-number at position {k}: {e}"}
  return {"rewards": rewards}


def main():
  proto = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 now goes to stderr
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  extra = json.loads(os.environ.get("JETRL_REWARD_SYS_PATH", "[]"))
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [os.getcwd()] + [p for p in extra if isinstance(p, str) and p != here]
  try:
    fn = load_function(sys.argv[1])
  except Exception as e:  # pylint: disable=broad-except
    proto.write(json.dumps({"ready": False, "error": str(e)}) + "\n")
    proto.flush()
    return 1
  proto.write('{"ready": true}\n')
  proto.flush()
  for line in sys.stdin:
    rid = None
    try:
      req = json.loads(line)
      rid = req.get("id")
      reply = score(fn, req)
    except Exception as e:  # pylint: disable=broad-except
      reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    reply["id"] = rid
    proto.write(json.dumps(reply) + "\n")
    proto.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
