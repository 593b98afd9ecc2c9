"""The precision-flow study at >= 1024 generated tokens, sized for one GPU and a few minutes.

  PYTHONPATH=src python3 experiments/gpu_study.py --out=$OUT           # the GPU design
  PYTHONPATH=src python3 experiments/gpu_study.py --out=/tmp/toy --toy # seconds, on a CPU

The design of docs/precision_study.md (`jetrl.train.study`) at a length whose generation budget
is at least --min_tokens: 1-digit-carry addition with `length` digits per addend (the
scratchpad grows with it), the `tiny` preset with --n_layers layers, the recipes bf16,
fp8_rollout (old log-probs recomputed, no correction), fp8_rollout+tis and jet, --seeds seeds,
every run's accuracy measured on --eval_size held-out problems x --eval_samples samples at the
RL temperature, in its own rollout precision and in bf16. The RL settings are the CPU study's (GRPO, 16
prompts x 8 samples, temperature 0.5, lr 5e-5, old log-probs recomputed) with --steps steps,
and so is the warm start's answer noise (half of its gold solutions misreport the final
answer's last digit, so RL has a clear signal to learn from); the length, the model's depth and
the warm start's length differ, so the two studies are not one length sweep.

1. The warm start, shared by every run: bf16 SFT at a constant learning rate in chunks of
   --sft_chunk steps, each ending with an evaluation, until the accuracy reaches
   --sft_target (or --sft_max_steps, or --sft_budget_s).
2. The runs: one worker process per recipe (--workers), each going through its seeds in order;
   with --workers=1, `jetrl.train.study.run_study` runs them all in this process. A worker starts no run after --start_by_s seconds
   from the script's start, so that the report is written within the time the GPU is lent;
   the report says what was not run (paired statistics use the seeds both recipes finished).
3. The report: <out>/study/report.md (tables, verdicts, figures) and <out>/gpu_study.json
   (device, configuration, the warm start's accuracies, per-run summaries without their step
   series, aggregates with their intervals, verdicts, timings, what was not run); everything
   printed also goes to <out>/gpu_study.log, each worker's own lines to <out>/worker<i>.log.

--toy shrinks everything (a 1-layer model, length 1, two steps of two prompts, four problems)
so that the whole path runs on a CPU in seconds; the test suite runs it that way.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several worker processes

import dataclasses
import json
import multiprocessing
import platform
import sys
import time
import traceback

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory (report, JSON, logs).", required=True)
flags.DEFINE_bool("toy", False, "A toy size that runs on a CPU in seconds (for the tests).")
flags.DEFINE_integer("workers", 4, "Worker processes (1: everything in this process).")
flags.DEFINE_float("start_by_s", 400.0, "Start no run after this many seconds.")
flags.DEFINE_integer("min_tokens", 1024, "Smallest generation budget: sets the task length.")
flags.DEFINE_integer("length", 0, "Task length knob (0: the smallest reaching --min_tokens).")
flags.DEFINE_integer("n_layers", 4, "Layers of the tiny preset.")
flags.DEFINE_list("recipes", ["bf16", "fp8_rollout", "fp8_rollout+tis", "jet"], "Recipe specs.")
flags.DEFINE_list("seeds", [], "RL seeds (empty: 0-4, or 0-1 with --toy).")
flags.DEFINE_integer("steps", 24, "RL steps per run.")
flags.DEFINE_integer("prompts_per_step", 16, "Prompts per RL step.")
flags.DEFINE_integer("group_size", 8, "Samples per prompt.")
flags.DEFINE_float("temperature", 0.5, "Sampling temperature of RL and of the evaluation.")
flags.DEFINE_float("lr", 5e-5, "RL learning rate.")
flags.DEFINE_integer("warmup_steps", 0, "RL warmup steps.")
flags.DEFINE_integer("eval_size", 256, "Held-out problems per evaluation.")
flags.DEFINE_integer("eval_samples", 4, "Samples per problem in the evaluation.")
flags.DEFINE_float("sft_lr", 1e-3, "Warm start learning rate (constant after a warmup).")
flags.DEFINE_float("answer_noise", 0.5, "Warm start: fraction of misreported final answers.")
flags.DEFINE_integer("sft_batch", 32, "Warm start problems per step.")
flags.DEFINE_integer("sft_chunk", 100, "Warm start steps between evaluations.")
flags.DEFINE_integer("sft_max_steps", 3000, "Most warm start steps.")
flags.DEFINE_float("sft_target", 0.3, "Warm start accuracy to reach.")
flags.DEFINE_float("sft_budget_s", 150.0, "Start no warm start chunk after this many seconds.")


@dataclasses.dataclass
class Options:
  """The flags above as a value (`run(Options(out=..., toy=True))` from Python)."""

  out: str
  toy: bool = False
  workers: int = 4
  start_by_s: float = 400.0
  min_tokens: int = 1024
  length: int = 0
  n_layers: int = 4
  recipes: tuple = ("bf16", "fp8_rollout", "fp8_rollout+tis", "jet")
  seeds: tuple = ()
  steps: int = 24
  prompts_per_step: int = 16
  group_size: int = 8
  temperature: float = 0.5
  lr: float = 5e-5
  warmup_steps: int = 0
  eval_size: int = 256
  eval_samples: int = 4
  sft_lr: float = 1e-3
  answer_noise: float = 0.5
  sft_batch: int = 32
  sft_chunk: int = 100
  sft_max_steps: int = 3000
  sft_target: float = 0.3
  sft_budget_s: float = 150.0

  @classmethod
  def from_flags(cls) -> "Options":
    values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(cls)}
    values["recipes"] = tuple(values["recipes"])
    values["seeds"] = tuple(int(x) for x in values["seeds"])
    return cls(**values)


_T0 = [time.time()]


def elapsed() -> float:
  return time.time() - _T0[0]


class Log:
  """Prints and appends to a file."""

  def __init__(self, path: str):
    self.path = path

  def __call__(self, *parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def task_length(min_tokens: int, margin: int) -> int:
  """The smallest addition length whose generation budget reaches `min_tokens`."""
  from jetrl.data import get_task  # pylint: disable=import-outside-toplevel

  for length in range(1, 301):
    task = get_task("addition", difficulty=1, length=length, seed=0)
    if task.max_completion_chars + 1 + margin >= min_tokens:
      return length
  raise ValueError(f"no addition length reaches {min_tokens} tokens")


def design(o: Options):
  """The StudyConfig of this run (the options, or the toy sizes)."""
  from jetrl.rl import OptimizerConfig, UpdateConfig  # pylint: disable=import-outside-toplevel
  from jetrl.sampling import SamplingConfig  # pylint: disable=import-outside-toplevel
  from jetrl.train import EvalConfig, ModelSpec, TaskConfig  # pylint: disable=import-outside-toplevel
  from jetrl.train.study import StudyConfig, WarmStartConfig  # pylint: disable=import-outside-toplevel

  toy = o.toy
  margin = 2 if toy else 8
  length = 1 if toy else (o.length or task_length(o.min_tokens, margin))
  return StudyConfig(
    report_dir=os.path.join(o.out, "study"),
    recipes=tuple(o.recipes),
    lengths=(length,),
    seeds=tuple(o.seeds) or ((0, 1) if toy else (0, 1, 2, 3, 4)),
    steps=2 if toy else o.steps,
    prompts_per_step=2 if toy else o.prompts_per_step,
    token_margin=margin,
    quiet_runs=True,
    model=ModelSpec(n_layers=1 if toy else o.n_layers),
    task=TaskConfig(name="addition", difficulty=1, length=length),
    sampling=SamplingConfig(n=2 if toy else o.group_size, temperature=o.temperature),
    optimizer=OptimizerConfig(lr=o.lr, warmup_steps=0 if toy else o.warmup_steps),
    update=UpdateConfig(),
    eval=EvalConfig(
      every=None,
      size=4 if toy else o.eval_size,
      temperature=o.temperature,
      samples=2 if toy else o.eval_samples,
      batch=4 if toy else o.eval_size,
    ),
    sft=WarmStartConfig(
      steps=4 if toy else o.sft_chunk,
      batch_size=4 if toy else o.sft_batch,
      length=length,
      answer_noise=o.answer_noise,
      optimizer=OptimizerConfig(lr=o.sft_lr, warmup_steps=0 if toy else 20),
    ),
  )


def warm_start(o: Options, cfg, log) -> dict:
  """SFT in chunks until the accuracy reaches the target; the shared warm start."""
  from jetrl.train.sft import run_sft  # pylint: disable=import-outside-toplevel
  from jetrl.train.study import sft_config  # pylint: disable=import-outside-toplevel

  length = cfg.lengths[0]
  chunk = cfg.sft.steps
  most = chunk if o.toy else o.sft_max_steps
  history, steps = [], 0
  while True:
    steps += chunk
    t0 = time.time()
    res = run_sft(sft_config(cfg, length).replace(steps=steps), log=lambda *a, **k: None)
    history.append(dict(steps=steps, accuracy=res["eval_accuracy"], s=time.time() - t0))
    log(
      f"warm start: {steps} steps, {cfg.eval.label} {res['eval_accuracy']:.3f} "
      f"({time.time() - t0:.0f}s)"
    )
    if res["eval_accuracy"] >= o.sft_target or steps >= most or elapsed() > o.sft_budget_s:
      break
  return dict(length=length, steps=steps, accuracy=history[-1]["accuracy"], history=history)


def worker(cfg, combos, deadline: float, log_path: str, t0: float) -> dict:
  """Runs `combos` in order, none started after `deadline`; {tag: wall seconds}, not run."""
  from jetrl.train.loop import run  # pylint: disable=import-outside-toplevel
  from jetrl.train.study import is_done, train_config  # pylint: disable=import-outside-toplevel

  log = Log(log_path)
  timing, not_run = {}, []
  for length, spec, seed in combos:
    tag = f"L{length}/{spec}/seed{seed}"
    if is_done(cfg, length, spec, seed):
      continue
    if time.time() > deadline:
      not_run.append(tag)
      log(f"{tag}: not started (past --start_by_s)")
      continue
    start = time.time()
    try:
      summary = run(train_config(cfg, length, spec, seed), log=lambda *a, **k: None)
    except Exception:  # pylint: disable=broad-except
      log(f"{tag}: failed\n{traceback.format_exc()}")
      not_run.append(tag + " (failed)")
      continue
    timing[tag] = time.time() - start
    log(
      f"{tag}: {cfg.eval.label} {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} "
      f"({timing[tag]:.0f}s, {time.time() - t0:.0f}s since the start)"
    )
  return dict(timing=timing, not_run=not_run)


def _worker_main(cfg, combos, deadline, log_path, result_path, t0):
  try:
    res = worker(cfg, combos, deadline, log_path, t0)
  except Exception:  # pylint: disable=broad-except
    res = dict(
      timing={},
      not_run=[f"L{c[0]}/{c[1]}/seed{c[2]} (worker failed)" for c in combos],
      error=traceback.format_exc(),
    )
  with open(result_path, "w") as f:
    json.dump(res, f)


def split_combos(cfg, workers: int) -> list[list]:
  """Each recipe's runs to one worker (round-robin over recipes), seeds in order."""
  from jetrl.train.study import combinations  # pylint: disable=import-outside-toplevel

  groups = [[] for _ in range(min(workers, len(cfg.recipes)))]
  for i, spec in enumerate(cfg.recipes):
    groups[i % len(groups)] += [c for c in combinations(cfg) if c[1] == spec]
  for g in groups:
    g.sort(key=lambda c: (c[2], cfg.recipes.index(c[1])))  # seed-major: seeds finish together
  return groups


def _strip(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.endswith("_series")}


def run(o: Options, command: str = "(from Python)") -> dict:
  """The whole study; returns what gpu_study.json holds."""
  _T0[0] = time.time()
  os.makedirs(o.out, exist_ok=True)
  log = Log(os.path.join(o.out, "gpu_study.log"))
  import jax  # pylint: disable=import-outside-toplevel

  from jetrl.train.study import (  # pylint: disable=import-outside-toplevel
    aggregate,
    collect,
    max_new_tokens_for,
    run_study,
    verdicts,
    write_report,
  )
  from jetrl.train.study.runner import read_timing, timing_path  # pylint: disable=import-outside-toplevel

  device = dict(
    platform=jax.devices()[0].platform,
    devices=[str(d) for d in jax.devices()],
    jax=jax.__version__,
    python=platform.python_version(),
  )
  log(f"gpu_study: {device}")
  cfg = design(o).replace(command=command, time_budget_s=o.start_by_s)
  os.makedirs(cfg.report_dir, exist_ok=True)
  with open(os.path.join(cfg.report_dir, "study_config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
  log(
    f"length {cfg.lengths[0]} (max_new_tokens {max_new_tokens_for(cfg, cfg.lengths[0])}), "
    f"recipes {list(cfg.recipes)}, seeds {list(cfg.seeds)}, {cfg.steps} steps of "
    f"{cfg.prompts_per_step} x {cfg.sampling.n}"
  )
  ws = warm_start(o, cfg, log)
  deadline = _T0[0] + o.start_by_s
  if o.workers <= 1:  # the library's runner, in this process
    timing = read_timing(cfg)
    timing[f"sft/L{ws['length']}"] = sum(h["s"] for h in ws["history"])
    with open(timing_path(cfg), "w") as f:
      json.dump(timing, f, indent=1)
    res = run_study(cfg.replace(time_budget_s=max(0.0, deadline - time.time())), log=log)
    rows, not_run, report = res["rows"], res["not_run"], res["report"]
    timing = read_timing(cfg)
  else:
    results = []
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for i, combos in enumerate(split_combos(cfg, o.workers)):
      path = os.path.join(o.out, f"worker{i}.json")
      p = ctx.Process(
        target=_worker_main,
        args=(cfg, combos, deadline, os.path.join(o.out, f"worker{i}.log"), path, _T0[0]),
      )
      p.start()
      procs.append((p, path))
    for p, path in procs:
      p.join()
      if os.path.exists(path):
        with open(path) as f:
          results.append(json.load(f))
      else:
        results.append(dict(timing={}, not_run=[f"worker exit code {p.exitcode}"]))
    timing = read_timing(cfg)
    timing[f"sft/L{ws['length']}"] = sum(h["s"] for h in ws["history"])
    not_run = []
    for r in results:
      timing.update(r["timing"])
      not_run += r["not_run"]
      if r.get("error"):
        log(r["error"])
    with open(timing_path(cfg), "w") as f:
      json.dump(timing, f, indent=1)
    rows = collect(cfg, timing)
    report = write_report(
      cfg, rows, timing, not_run=not_run, budget_hit=bool(not_run), study_wall_s=elapsed()
    )
  agg = aggregate(rows)
  v = {str(L): verdicts(rows, agg, int(L)) for L in cfg.lengths}
  out = dict(
    device=device,
    command=command,
    config=cfg.to_dict(),
    warm_start=ws,
    rows=[_strip(r) for r in rows],
    aggregates=agg,
    verdicts=v,
    timing=timing,
    not_run=not_run,
    wall_s=elapsed(),
  )
  with open(os.path.join(o.out, "gpu_study.json"), "w") as f:
    json.dump(out, f, indent=1)
  for L, x in v.items():
    log(f"length {L}: {x['valid']}; mechanism {x['mechanism']}; central effect {x['central']}")
    for k, w in x["why"].items():
      log(f"  {k}: {w}")
  log(f"report: {report}; {len(rows)} runs, {len(not_run)} not run; {elapsed():.0f}s")
  return out


def main(argv):
  del argv
  run(Options.from_flags(), " ".join(["python3", "experiments/gpu_study.py"] + sys.argv[1:]))


if __name__ == "__main__":
  app.run(main)
