"""The run loops' hooks: each fires on the steps it should (every n, the last step, after a
resume at step k) and does what it says, driven by the loops' own step loop
(`driver.run_steps`) with stub writers, checkpointers and evaluations (no model)."""

import json

import pytest

from jetrl.train import CheckpointConfig, EvalConfig, LoggingConfig, TrainConfig, driver
from jetrl.train.hooks import (
  CheckpointHook,
  EvalHook,
  Hook,
  LoopState,
  MetricsHook,
  PlotHook,
  SamplesHook,
  SkipHook,
  run_hooks,
)
from jetrl.train.skips import SkippedUpdatesError, SkipTracker


class Writer:
  def __init__(self, events=None, name="writer"):
    self.rows, self.many, self.events, self.name = [], [], events, name

  def write(self, step, record):
    self.rows.append((step, dict(record)))
    if self.events is not None:
      self.events.append((self.name, step))

  def write_many(self, records):
    self.many.append(list(records))


class Progress:
  def __init__(self):
    self.lines = []

  def update(self, step, fields, extra=None):
    self.lines.append((step, fields, extra))


class Checkpointer:
  def __init__(self, events=None):
    self.saved, self.closed, self.events = [], False, events

  def save(self, step, tree, meta):
    self.saved.append((step, tree, meta))
    if self.events is not None:
      self.events.append(("checkpoint", step))

  def close(self):
    self.closed = True


class Out:
  """The part of `driver.Outputs` that `run_steps` uses."""

  closed = False

  def close(self):
    self.closed = True


class Counter(Hook):
  def __init__(self, every, at_end=True):
    self.every, self.at_end, self.steps, self.closed = every, at_end, [], False

  def __call__(self, step, loop):
    self.steps.append(step)

  def close(self):
    self.closed = True


def drive(hooks, steps, start=0, step=None):
  """Steps start+1 .. steps through `driver.run_steps`, each setting its record."""

  def default(i, loop):
    loop.record = {"loss": float(i + 1), "skipped_updates": 0}

  cfg = TrainConfig(steps=steps)
  loop = LoopState(state={"w": 0})
  out = Out()
  driver.run_steps(cfg, out, driver.Hooks(hooks, None, None), loop, start, step or default)
  return loop, out


@pytest.mark.parametrize(
  "every, at_end, start, fired",
  [
    (3, True, 0, [3, 6, 7]),  # every 3 steps and the last
    (3, False, 0, [3, 6]),
    (None, True, 0, [7]),  # only at the end
    (1, True, 0, [1, 2, 3, 4, 5, 6, 7]),
    (7, True, 0, [7]),  # the last step is also a multiple: once
    (3, True, 4, [6, 7]),  # resumed at step 4: steps 5..7 run
    (2, True, 6, [7]),  # resumed one step before the end
    (2, True, 7, []),  # resumed at the end: no step, no hook
  ],
)
def test_hooks_fire_every_n_steps_at_the_end_and_after_a_resume(every, at_end, start, fired):
  hook = Counter(every, at_end)
  _, out = drive([hook], 7, start)
  assert hook.steps == fired
  assert hook.closed and out.closed


def test_hooks_are_closed_when_a_step_fails():
  hook = Counter(1)

  def step(i, loop):
    if i == 2:
      raise RuntimeError("boom")
    loop.record = {}

  with pytest.raises(RuntimeError, match="boom"):
    drive([hook], 5, step=step)
  assert hook.steps == [1, 2] and hook.closed


def test_metrics_hook_writes_the_record_and_the_console_line():
  writer, progress = Writer(), Progress()
  hook = MetricsHook(writer, progress, 2, lambda r: ({"loss": r["loss"]}, f"extra {r['loss']:g}"))
  drive([hook], 5)
  assert writer.rows == [
    (2, {"loss": 2.0, "skipped_updates": 0}),
    (4, {"loss": 4.0, "skipped_updates": 0}),
    (5, {"loss": 5.0, "skipped_updates": 0}),
  ]
  assert progress.lines == [
    (2, {"loss": 2.0}, "extra 2"),
    (4, {"loss": 4.0}, "extra 4"),
    (5, {"loss": 5.0}, "extra 5"),
  ]


def test_samples_hook_writes_only_the_steps_that_sampled():
  writer = Writer()

  def step(i, loop):
    loop.samples = [{"step": i + 1, "text": f"s{i + 1}"}] if (i + 1) % 2 == 0 else None

  drive([SamplesHook(writer)], 5, step=step)
  assert writer.many == [[{"step": 2, "text": "s2"}], [{"step": 4, "text": "s4"}]]
  assert writer.rows == []


def test_skip_hook_stops_after_the_limit_of_fully_skipped_steps():
  # 2 updates a step; step 2 skips one of them (not a fully skipped step), 3..5 skip both.
  skipped = {1: 2, 2: 1, 3: 2, 4: 2, 5: 2, 6: 0}

  def step(i, loop):
    loop.skipped = skipped[i + 1]

  with pytest.raises(SkippedUpdatesError, match=r"stopped at step 5: .* last 3 steps \(3\.\.5\)"):
    drive([SkipHook(SkipTracker(3, "Check the lr."), 2)], 6, step=step)
  # Fewer in a row than the limit: the run goes on.
  drive([SkipHook(SkipTracker(4), 2)], 6, step=step)


def test_eval_hook_writes_logs_and_keeps_the_last_result():
  writer, lines, seen = Writer(), [], []

  def evaluate(loop):
    seen.append(loop.record["loss"])
    return {"eval_accuracy": 0.25 * len(seen), "eval_accuracy_bf16": 0.5}

  hook = EvalHook(evaluate, writer, 2, 16, lines.append, "accuracy at temperature 0.7 (x4)")
  loop, _ = drive([hook], 3)
  assert seen == [2.0, 3.0]  # evaluated after steps 2 and 3 (the last)
  assert [(s, r["eval_accuracy"]) for s, r in writer.rows] == [(2, 0.25), (3, 0.5)]
  assert hook.last == {"eval_accuracy": 0.5, "eval_accuracy_bf16": 0.5}
  # The first evaluation says it compiles first.
  assert lines[0] == "  eval @ step 2: compiling the evaluation (first evaluation only)..."
  assert lines[1].startswith(
    "  eval @ step 2: accuracy at temperature 0.7 (x4) 0.250 (bf16 rollout: 0.500) on 16 "
    "held-out problems ("
  )
  assert len(lines) == 3 and "compiling" not in lines[2]
  hook(0, loop)  # the loop's own evaluation before the first step
  assert writer.rows[-1][0] == 0


def test_checkpoint_and_plot_hooks():
  ckpt, drawn = Checkpointer(), []

  def draw():
    drawn.append(len(drawn) + 1)
    return [f"plot{len(drawn)}.png"]

  plot = PlotHook(draw, None)
  hooks = [
    CheckpointHook(ckpt, 2, lambda loop: dict(loop.state), lambda s, loop: {"step": s, "n": 1}),
    plot,
  ]
  drive(hooks, 5, start=1)
  assert [(s, m) for s, _, m in ckpt.saved] == [
    (2, {"step": 2, "n": 1}),
    (4, {"step": 4, "n": 1}),
    (5, {"step": 5, "n": 1}),
  ]
  assert ckpt.saved[0][1] == {"w": 0} and ckpt.closed
  assert drawn == [1] and plot.paths == ["plot1.png"]  # every=None: once, at the end


def test_hooks_run_in_list_order_at_each_step():
  events = []
  hooks = [
    MetricsHook(Writer(events, "metrics"), Progress(), 1, lambda r: ({}, None)),
    EvalHook(lambda loop: {"eval_accuracy": 1.0}, Writer(events, "eval"), 2, 1, lambda _: None),
    CheckpointHook(Checkpointer(events), 2, lambda loop: {}, lambda s, loop: {}),
  ]
  drive(hooks, 3)
  assert events == [
    ("metrics", 1),
    ("metrics", 2),
    ("eval", 2),
    ("checkpoint", 2),
    ("metrics", 3),
    ("eval", 3),
    ("checkpoint", 3),
  ]


def _wired(tmp_path, start, plots=True, primary=True, plot_every=4):
  """`driver.make_hooks` of a 7-step run (records every 2, evaluation every 3, checkpoints
  every 2, plots every `plot_every`) driven from `start`."""
  cfg = TrainConfig(
    workdir=str(tmp_path),
    steps=7,
    seed=3,
    eval=EvalConfig(every=3, size=8, temperature=0.5, samples=2),
    checkpoint=CheckpointConfig(every=2),
    logging=LoggingConfig(every=2, tensorboard=False, plots=plots, plot_every=plot_every),
  )
  out = driver.Outputs(str(tmp_path), driver.RL, primary, None)
  ckpt, drawn, lines = Checkpointer(), [], []
  samples = Writer()
  spec = driver.HookSpec(
    evaluate=lambda loop: {"eval_accuracy": loop.data_pos / 10},
    console=lambda r: ({"loss": r["loss"]}, None),
    skip_hint="",
    updates_per_step=1,
    tree=lambda loop: {"state": loop.state},
    meta=lambda loop: {"data_pos": loop.data_pos},
    draw=lambda workdir: drawn.append(workdir) or [f"{workdir}/plots/p.png"],
    extra=(SamplesHook(samples),),
  )
  hooks = driver.make_hooks(cfg, out, ckpt, start, lines.append, spec)

  def step(i, loop):
    loop.record = {"loss": float(i + 1), "skipped_updates": 0}
    loop.data_pos = 4 * (i + 1)
    loop.samples = [{"step": i + 1}]

  driver.run_steps(cfg, out, hooks, LoopState(state="s", data_pos=4 * start), start, step)
  return cfg, hooks, ckpt, drawn, lines, samples


def read_steps(path):
  with open(path) as f:
    return [json.loads(line)["step"] for line in f]


@pytest.mark.parametrize("start", [0, 3])
def test_the_loops_hooks_fire_on_their_steps(tmp_path, start):
  cfg, hooks, ckpt, drawn, lines, samples = _wired(tmp_path, start)
  after = lambda steps: [s for s in steps if s > start]
  assert read_steps(tmp_path / "metrics.jsonl") == after([2, 4, 6, 7])
  assert read_steps(tmp_path / "eval.jsonl") == after([3, 6, 7])
  assert [s for s, _, _ in ckpt.saved] == after([2, 4, 6, 7])
  assert drawn == [str(tmp_path)] * len(after([4, 7]))
  assert [r[0]["step"] for r in samples.many] == after(range(1, 8))
  # A checkpoint holds the state and its metadata: the step, the loop's own, the kind, the
  # whole configuration.
  step, tree, meta = ckpt.saved[-1]
  assert tree == {"state": "s"}
  assert meta == {"step": 7, "data_pos": 28, "kind": "rl", "config": cfg.to_dict()}
  assert list(meta) == ["step", "data_pos", "kind", "config"]
  assert hooks.evaluation.last == {"eval_accuracy": 2.8}
  assert hooks.plot.paths == [f"{tmp_path}/plots/p.png"]
  assert any("eval @ step 7: accuracy at temperature 0.5 (x2) 2.800" in line for line in lines)
  # The console line counts from the run's first step.
  assert any("step 7/7 loss 7" in line for line in lines)


def test_plots_only_where_asked_and_on_the_primary(tmp_path):
  *_, drawn, _, _ = _wired(tmp_path / "a", 0, plot_every=None)
  assert drawn == [str(tmp_path / "a")]  # only at the end
  *_, drawn, _, _ = _wired(tmp_path / "b", 0, plots=False)
  assert drawn == []
  *_, drawn, lines, _ = _wired(tmp_path / "c", 0, primary=False)
  assert drawn == []  # another process than the primary draws nothing, writes no record
  assert not (tmp_path / "c" / "metrics.jsonl").exists()
  assert not any("step 7/7" in line for line in lines)


def test_run_hooks_checks_due_for_each_hook():
  a, b = Counter(2), Counter(None, at_end=False)
  for step in range(1, 5):
    run_hooks([a, b], step, step == 4, LoopState(state=None))
  assert a.steps == [2, 4] and b.steps == []


def test_a_long_evaluation_says_how_far_it_is(monkeypatch):
  from types import SimpleNamespace

  import numpy as np

  from jetrl.data import char_tokenizer, get_task
  from jetrl.precision import get_recipe
  from jetrl.train import EvalConfig, evaluation, pieces

  tok, task = char_tokenizer(), get_task("addition", difficulty=1, length=1)
  rows = iter([([0.25, 0.25, 0.25, 0.25], [1, 0, 1, 1]), ([0.25, 0.25], [0, 0])])

  def score(task, tok, chunk, out, n):  # the sampler's rows, scored by hand
    rewards, correct = next(rows)
    assert len(chunk) == len(rewards) and n == 1
    return np.asarray(rewards), np.asarray(correct, bool), np.full(len(chunk), 3), None

  monkeypatch.setattr(evaluation, "sample", lambda *a, **k: SimpleNamespace())
  monkeypatch.setattr(evaluation, "score_rollout", score)
  p = pieces.Pieces(get_recipe("fp32"), tok, lambda text: tok.encode(text), task, 0, None)
  lines = []
  res = evaluation.evaluate(
    None, p, None, EvalConfig(size=6, batch=4), max_new_tokens=8, log=lines.append
  )
  assert res == {"eval_accuracy": 0.5, "eval_reward": 0.25, "eval_length": 3.0}
  assert [line.split(" (")[0] for line in lines] == ["  eval: 4/6 problems", "  eval: 6/6 problems"]
