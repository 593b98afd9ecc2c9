"""In a run of several processes the run's own lines are process 0's alone; the others say
their warnings and errors, prefixed by their index unless the launcher prefixes every line."""

import jax

from jetrl import parallel


def _as_process(monkeypatch, index):
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: index)


LINES = [
  "jetrl RL: recipe=jet ...",
  "  eval @ step 0: greedy accuracy 0.500 on 4 held-out problems (1.0s)",
  "warning: step 3 has no learning signal: ...",
  "error: something",
]


def test_one_process_and_process_0_say_everything(monkeypatch):
  log = [].append
  assert parallel.primary_log(log) is log  # not distributed
  _as_process(monkeypatch, 0)
  assert parallel.primary_log(log) is log


def test_the_other_processes_say_warnings_and_errors_prefixed(monkeypatch):
  _as_process(monkeypatch, 1)
  said = []
  monkeypatch.delenv("JETRL_LAUNCHED", raising=False)
  log = parallel.primary_log(said.append)
  for line in LINES:
    log(line)
  assert said == ["[p1] warning: step 3 has no learning signal: ...", "[p1] error: something"]
  said.clear()
  monkeypatch.setenv("JETRL_LAUNCHED", "1")  # the launcher prefixes every line itself
  log = parallel.primary_log(said.append)
  for line in LINES:
    log(line)
  assert said == LINES[2:]
