"""A reward plugin is code the user chose to run, and what it returns is untrusted data: a
result of the wrong type is refused, a value that is Inf once cast to float32 scores 0, and
the processes it starts die with its worker."""

from __future__ import annotations

import os
import textwrap
import time
import warnings

import numpy as np
import pytest

from jetrl.data import RewardError, load_reward
from jetrl.train.scoring import checked_rewards

PLUGIN = """
import os, subprocess, sys, time

def as_dict(prompts, completions, answers, **kwargs):
  return {1.0: "a", 0.0: "b"}

def as_str(prompts, completions, answers, **kwargs):
  return "11"

def as_generator(prompts, completions, answers, **kwargs):
  return (1.0 for _ in completions)

def as_tuple(prompts, completions, answers, **kwargs):
  return tuple(0.5 for _ in completions)

def huge(prompts, completions, answers, **kwargs):
  return [1e300, -1e39, 3.4e38, 1.0]

def forks_and_hangs(prompts, completions, answers, **kwargs):
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  with open(os.environ["PID_FILE"], "w") as f:
    f.write(str(child.pid))
  time.sleep(600)
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
  d = tmp_path_factory.mktemp("plugins")
  (d / "plugin.py").write_text(textwrap.dedent(PLUGIN))
  return str(d / "plugin.py")


@pytest.mark.parametrize("name", ["as_dict", "as_str", "as_generator"])
def test_a_result_that_is_not_a_list_is_a_reward_error(plugin, name):
  with load_reward(f"{plugin}:{name}") as fn:
    with pytest.raises(RewardError, match="not a list"):
      fn(None, ["x", "y"], ["1", "0"])


def test_a_tuple_is_taken(plugin):
  with load_reward(f"{plugin}:as_tuple") as fn:
    assert fn(None, ["x", "y"], ["1", "0"]) == [0.5, 0.5]


def test_values_beyond_float32_score_zero(plugin):
  with load_reward(f"{plugin}:huge") as fn:
    with pytest.warns(RuntimeWarning, match="float32"):
      out = fn(None, list("abcd"), list("abcd"))
    assert out == [0.0, 0.0, 3.4e38, 1.0]
    assert fn.stats["non_finite"] == 2


class _Task:
  name = "t"


def test_a_task_reward_beyond_float32_is_a_reward_error():
  with pytest.raises(RewardError, match="not finite in float32.*1e\\+300 at position 1"):
    checked_rewards(_Task(), [0.0, 1e300])
  with pytest.raises(RewardError, match="position 0"):
    checked_rewards(_Task(), [float("nan")])
  out = checked_rewards(_Task(), [1.0, 3.0e38])
  assert out.dtype == np.float32 and out.tolist() == [1.0, np.float32(3.0e38)]


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
  except FileNotFoundError:
    return False


def test_processes_a_plugin_starts_are_killed_with_it(plugin, tmp_path, monkeypatch):
  pid_file = tmp_path / "child.pid"
  monkeypatch.setenv("PID_FILE", str(pid_file))
  fn = load_reward(f"{plugin}:forks_and_hangs", timeout=3.0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert fn(None, ["x"], ["1"]) == [0.0]  # timed out
  child = int(pid_file.read_text())
  deadline = time.monotonic() + 5
  while _alive(child) and time.monotonic() < deadline:
    time.sleep(0.05)
  alive = _alive(child)
  if alive:
    os.kill(child, 9)
  fn.close()
  assert not alive, "the plugin's child outlived its worker"
