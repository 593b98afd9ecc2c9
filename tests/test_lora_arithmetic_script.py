"""experiments/lora_arithmetic.py: the train.py command it runs for each seed is one train.py
accepts (parsed and its configuration built, nothing run), and a finished run is read back
from its summary and evaluations."""

import functools
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _script():
  spec = importlib.util.spec_from_file_location(
    "lora_arithmetic", os.path.join(ROOT, "experiments", "lora_arithmetic.py")
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  mod.FLAGS(["lora_arithmetic.py", "--steps=24"])
  return mod


def test_the_seed_command_is_one_train_py_accepts(tmp_path):
  mod = _script()
  cmd = mod.train_command(3, str(tmp_path / "seed3"), str(tmp_path))
  assert cmd[1].endswith(os.path.join("experiments", "train.py"))
  flags = cmd[2:]
  assert "--seed=3" in flags and "--lora.rank=16" in flags and "--recipe=jet" in flags
  assert "--task.name=chat_arithmetic" in flags and "--task.prompt_format=chat" in flags
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.path.join(ROOT, "src"))
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "tests", "_doc_command_flags.py"),
      ROOT,
      "experiments/train.py",
      json.dumps([flags]),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout) == [None]


def test_a_finished_run_is_read_and_an_unfinished_one_is_not(tmp_path):
  mod = _script()
  run = tmp_path / "seed0"
  assert mod.read_run(str(run)) is None
  run.mkdir()
  evals = [(0, 0.25), (12, 0.5), (24, 0.625)]
  (run / "eval.jsonl").write_text(
    "".join(json.dumps({"step": s, "eval_accuracy": a}) + "\n" for s, a in evals)
  )
  (run / "summary.json").write_text(json.dumps({"steps": 12, "eval_before": 0.25}))
  assert mod.read_run(str(run)) is None  # stopped short of --steps
  (run / "summary.json").write_text(
    json.dumps({"steps": 24, "eval_before": 0.25, "eval_after": 0.625})
  )
  assert mod.read_run(str(run)) == dict(before=0.25, after=0.625, curve=evals)


def test_a_seeds_console_is_shown_prefixed_and_kept_in_its_log(tmp_path):
  """Each line the seed's run prints reaches the console as it comes, prefixed by the seed,
  and its log file; the run's exit code is returned."""
  import io

  mod = _script()
  out = io.StringIO()
  prog = (
    "import os, sys; print('step 1/2 | 3s elapsed'); "
    "print('step 2/2, unbuffered:', os.environ.get('PYTHONUNBUFFERED')); sys.exit(3)"
  )
  code = mod.run_seed([sys.executable, "-c", prog], str(tmp_path / "seed0.log"), "seed 0 | ", out)
  assert code == 3
  lines = ["step 1/2 | 3s elapsed\n", "step 2/2, unbuffered: 1\n"]  # lines as they come
  assert out.getvalue() == "".join("seed 0 | " + line for line in lines)
  assert (tmp_path / "seed0.log").read_text() == "".join(lines)
