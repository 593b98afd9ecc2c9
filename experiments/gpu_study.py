"""The precision-flow study at >= 1024 generated tokens, sized for one GPU and at most 9 minutes.

  PYTHONPATH=src python3 experiments/gpu_study.py --out=$OUT       # the GPU design
  PYTHONPATH=src python3 experiments/gpu_study.py --out=/tmp/toy \\
      --config=experiments/configs/gpu_study_toy.py                 # minutes, on a CPU

The design of docs/precision_study.md (`jetrl.study`) at a length whose generation budget
is at least --min_tokens: 1-digit-carry addition with --length digits per addend (none: the
smallest length reaching --min_tokens; the scratchpad grows with it), the `tiny` preset with
--model.n_layers=4 layers, the recipes bf16, fp8_rollout (old log-probs recomputed, no
correction), fp8_rollout+tis and jet, --seeds 0-4, every run's accuracy measured on
--eval.size held-out problems x --eval.samples samples at the RL temperature, in its own
rollout precision and in bf16. The RL settings are the CPU study's (GRPO, 16 prompts x 8
samples, temperature 0.5, lr 5e-5, old log-probs recomputed) with --steps=24 steps, and so is
the warm start's answer noise (--sft.answer_noise=0.5: half of its gold solutions misreport the
final answer's last digit, so RL has a clear signal to learn from); the length, the model's
depth and the warm start's length differ, so the two studies are not one length sweep.

1. The warm start, shared by every run: bf16 SFT at a constant learning rate
   (--sft.optimizer.*) in chunks of --sft.steps steps, each ending with an evaluation, until
   the accuracy reaches --sft.target (or --sft.max_steps steps; no chunk starts after
   --sft.budget_s seconds).
2. The runs: one worker process per recipe (--workers), each going through its seeds in order;
   with --workers=1 they all run in this process. No run starts after --start_by_s seconds
   from the script's start, and a run still going at --end_by_s seconds stops after its next
   step (a hook of the run: that step's evaluation and checkpoint, when due, complete first;
   the last step is never cut): it is recorded as cut short, and a rerun resumes it from its
   last checkpoint. So the report is written within the time the GPU is
   lent (--end_by_s, plus one step or evaluation, plus the report); the report says what was
   not run or was cut short (paired statistics use the seeds both recipes finished).
3. The report: <out>/study/report.md (tables, verdicts, figures) and <out>/gpu_study.json
   (device, configuration, the warm start's accuracies, per-run summaries without their step
   series, aggregates with their intervals, verdicts, timings, what was not run and what was
   cut short); everything printed also goes to <out>/gpu_study.log, each worker's own lines to
   <out>/worker<i>.log. Rerunning the command resumes: finished runs are skipped.

Every flag is a field of the configuration, named by its path: the study's own
(experiments/compare_precisions.py's: --recipes, --seeds, --steps, --optimizer.lr,
--sampling.n, --sampling.temperature, --eval.size, --eval.temperature, --sft.*, ...) and this
script's (--out, --workers, --start_by_s, --end_by_s, --min_tokens, --length, --sft.target,
--sft.max_steps, --sft.budget_s). experiments/configs/gpu_study_toy.py shrinks everything (a
1-layer model, length 1, two steps of two prompts, four problems) so that the whole path runs
on a CPU in a minute or two; the test suite runs it that way.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several worker processes

import json
import multiprocessing
import platform
import shlex
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its configuration's module

from _gpu_study_config import (  # noqa: E402
  EXCLUDE,
  RENAMED,
  ChunkedWarmStart,
  GPUStudyConfig,
  study_config,
  task_length,
)
from jetrl.config import FlagError  # noqa: E402
from jetrl.study import StudyConfig  # noqa: E402

__all__ = [
  "EXCLUDE",
  "RENAMED",
  "ChunkedWarmStart",
  "GPUStudyConfig",
  "run",
  "study_config",
  "task_length",
]


def clock() -> float:
  """Seconds since the epoch: every deadline of the script is read from here."""
  return time.time()


class Log:
  """Prints and appends to a file."""

  def __init__(self, path: str):
    self.path = path

  def __call__(self, *parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def warm_start(cfg: GPUStudyConfig, study: StudyConfig, log, t0: float) -> dict:
  """SFT in chunks until the accuracy reaches the target; the shared warm start."""
  from jetrl.train.sft import run_sft  # pylint: disable=import-outside-toplevel
  from jetrl.study import sft_config, sft_name  # pylint: disable=import-outside-toplevel

  length = study.lengths[0]
  w = cfg.sft
  history, steps = [], 0
  while True:
    steps += w.steps
    start = clock()
    res = run_sft(sft_config(study, length).replace(steps=steps), log=lambda *a, **k: None)
    history.append(dict(steps=steps, accuracy=res["eval_accuracy"], s=clock() - start))
    log(
      f"warm start: {steps} steps, {study.eval.label} {res['eval_accuracy']:.3f} "
      f"({clock() - start:.0f}s)"
    )
    if res["eval_accuracy"] >= w.target or steps >= w.max_steps or clock() - t0 > w.budget_s:
      break
  return dict(
    name=sft_name(study, length),
    length=length,
    steps=steps,
    accuracy=history[-1]["accuracy"],
    history=history,
  )


class CutShort(Exception):
  """A run stopped at the overall deadline after `step` of its `steps` steps."""

  def __init__(self, step: int, steps: int):
    super().__init__(f"cut short after step {step} of {steps}")
    self.step, self.steps = step, steps


def stop_at(deadline: float, steps: int):
  """A run's hook (`jetrl.train.Hook`): once the clock is past `deadline`, raises CutShort
  after the next step whose record and checkpoint are written, unless it was the last."""
  from jetrl.train import Hook  # pylint: disable=import-outside-toplevel

  class StopAt(Hook):
    every = 1

    def __call__(self, step, loop):
      if step < steps and clock() > deadline:
        raise CutShort(step, steps)

  return StopAt()


def _quiet(*args, **kwargs) -> None:
  """A run's `log`: its lines are dropped (the worker logs one line per run)."""


def worker(study: StudyConfig, combos, start_by: float, end_by: float, log, t0: float) -> dict:
  """Runs `combos` in order: none started after `start_by`, each stopped at `end_by`.

  Returns {"timing": {tag: wall seconds}, "not_run": [...], "cut_short": [...]}."""
  from jetrl.train.loop import run  # pylint: disable=import-outside-toplevel
  from jetrl.study import is_done, train_config  # pylint: disable=import-outside-toplevel

  timing, not_run, cut_short = {}, [], []
  for i, (length, spec, seed) in enumerate(combos):
    tag = f"L{length}/{spec}/seed{seed}"
    head = f"[{i + 1}/{len(combos)}] {tag}"
    if is_done(study, length, spec, seed):
      log(f"{head}: done already, skipped")
      continue
    if clock() > start_by:
      not_run.append(tag)
      log(f"{head}: not started (past --start_by_s)")
      continue
    log(f"{head}: running ({clock() - t0:.0f}s since the start)")
    start = clock()
    try:
      summary = run(
        train_config(study, length, spec, seed),
        log=_quiet,
        hooks=[stop_at(end_by, study.steps)],
      )
    except CutShort as e:
      cut_short.append(dict(run=tag, steps_done=e.step, steps=e.steps, s=clock() - start))
      not_run.append(f"{tag} (cut short after step {e.step} of {e.steps} at --end_by_s)")
      log(f"{head}: {e} at --end_by_s ({clock() - t0:.0f}s since the start)")
      continue
    except Exception:  # pylint: disable=broad-except
      log(f"{head}: failed\n{traceback.format_exc()}")
      not_run.append(tag + " (failed)")
      continue
    timing[tag] = clock() - start
    log(
      f"{head}: {study.eval.label} {summary['eval_before']:.3f} -> "
      f"{summary['eval_after']:.3f} ({timing[tag]:.0f}s, {clock() - t0:.0f}s since the start)"
    )
  return dict(timing=timing, not_run=not_run, cut_short=cut_short)


def _worker_main(study, combos, start_by, end_by, log_path, result_path, t0):
  try:
    res = worker(study, combos, start_by, end_by, Log(log_path), t0)
  except Exception:  # pylint: disable=broad-except
    res = dict(
      timing={},
      not_run=[f"L{c[0]}/{c[1]}/seed{c[2]} (worker failed)" for c in combos],
      cut_short=[],
      error=traceback.format_exc(),
    )
  with open(result_path, "w") as f:
    json.dump(res, f)


def split_combos(study: StudyConfig, workers: int) -> list[list]:
  """Each recipe's runs to one worker (round-robin over recipes), seeds in order."""
  from jetrl.study import combinations  # pylint: disable=import-outside-toplevel

  groups = [[] for _ in range(min(workers, len(study.arms)))]
  for i, arm in enumerate(study.arms):
    groups[i % len(groups)] += [c for c in combinations(study) if c[1] == arm]
  for g in groups:
    g.sort(key=lambda c: (c[2], study.arms.index(c[1])))  # seed-major: seeds finish together
  return groups


def _strip(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.endswith("_series")}


def _in_processes(study, cfg, start_by, end_by, t0, log) -> list[dict]:
  """One spawned process per group of recipes; their results."""
  ctx = multiprocessing.get_context("spawn")
  procs = []
  for i, combos in enumerate(split_combos(study, cfg.workers)):
    path = os.path.join(cfg.out, f"worker{i}.json")
    if os.path.exists(path):
      os.remove(path)
    log_path = os.path.join(cfg.out, f"worker{i}.log")
    p = ctx.Process(target=_worker_main, args=(study, combos, start_by, end_by, log_path, path, t0))
    p.start()
    procs.append((p, path, combos))
  results = []
  for p, path, combos in procs:
    p.join()
    if os.path.exists(path):
      with open(path) as f:
        results.append(json.load(f))
    else:
      results.append(
        dict(
          timing={},
          not_run=[f"L{c[0]}/{c[1]}/seed{c[2]} (worker exit code {p.exitcode})" for c in combos],
          cut_short=[],
        )
      )
  for r in results:
    if r.get("error"):
      log(r["error"])
  return results


def run(cfg: GPUStudyConfig, command: str = "(from Python)") -> dict:
  """The whole study; returns what gpu_study.json holds."""
  t0 = clock()
  if not cfg.out:
    raise FlagError("out", "is required (where the report, the JSON and the runs go)")
  from jetrl.train.validation import check_local  # pylint: disable=import-outside-toplevel

  check_local("out", cfg.out)
  length = cfg.length if cfg.length is not None else task_length(cfg, cfg.min_tokens)
  cfg = cfg.replace(
    report_dir=os.path.join(cfg.out, "study"),
    lengths=(length,),
    time_budget_s=cfg.start_by_s,
    quiet_runs=True,
    command=command,
  )
  study = study_config(cfg)
  os.makedirs(cfg.out, exist_ok=True)
  log = Log(os.path.join(cfg.out, "gpu_study.log"))
  import jax  # pylint: disable=import-outside-toplevel

  from jetrl.study import (  # pylint: disable=import-outside-toplevel
    aggregate,
    collect,
    max_new_tokens_for,
    sft_name,
    verdicts,
    write_report,
  )
  from jetrl.study.runner import read_timing, timing_path  # pylint: disable=import-outside-toplevel

  device = dict(
    platform=jax.devices()[0].platform,
    devices=[str(d) for d in jax.devices()],
    jax=jax.__version__,
    python=platform.python_version(),
  )
  log(f"gpu_study: {device}")
  os.makedirs(study.report_dir, exist_ok=True)
  with open(os.path.join(study.report_dir, "study_config.json"), "w") as f:
    json.dump(study.to_dict(), f, indent=1)
  log(
    f"length {length} (max_new_tokens {max_new_tokens_for(study, length)}), "
    f"recipes {[arm.label for arm in study.arms]}, seeds {list(study.seeds)}, {study.steps} steps of "
    f"{study.prompts_per_step} x {study.sampling.n}; no run starts after {cfg.start_by_s:.0f}s, "
    f"runs stop at {cfg.end_by_s:.0f}s"
  )
  ws = warm_start(cfg, study, log, t0)
  timing = read_timing(study)
  timing[f"sft/{sft_name(study, length)}"] = sum(h["s"] for h in ws["history"])
  start_by, end_by = t0 + cfg.start_by_s, t0 + cfg.end_by_s
  if cfg.workers <= 1:
    results = [
      worker(study, [c for g in split_combos(study, 1) for c in g], start_by, end_by, log, t0)
    ]
  else:
    results = _in_processes(study, cfg, start_by, end_by, t0, log)
  not_run, cut_short = [], []
  for r in results:
    timing.update(r["timing"])
    not_run += r["not_run"]
    cut_short += r["cut_short"]
  with open(timing_path(study), "w") as f:
    json.dump(timing, f, indent=1)
  rows = collect(study, timing)
  report = write_report(
    study, rows, timing, not_run=not_run, budget_hit=bool(not_run), study_wall_s=clock() - t0
  )
  agg = aggregate(rows)
  v = {str(L): verdicts(rows, agg, int(L)) for L in study.lengths}
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
    cut_short=cut_short,
    wall_s=clock() - t0,
  )
  with open(os.path.join(cfg.out, "gpu_study.json"), "w") as f:
    json.dump(out, f, indent=1)
  for L, x in v.items():
    log(f"length {L}: {x['valid']}; mechanism {x['mechanism']}; central effect {x['central']}")
    for k, w in x["why"].items():
      log(f"  {k}: {w}")
  log(
    f"report: {report}; {len(rows)} runs, {len(not_run)} not run ({len(cut_short)} of them cut "
    f"short); {clock() - t0:.0f}s"
  )
  return out


def _main() -> None:
  from jetrl.train.cli import main  # pylint: disable=import-outside-toplevel

  command = " ".join(shlex.quote(a) for a in ["python3", "experiments/gpu_study.py"] + sys.argv[1:])
  main(
    GPUStudyConfig(),
    lambda cfg: run(cfg, command),
    doc=__doc__,
    exclude=EXCLUDE,
    renamed=RENAMED,
  )


if __name__ == "__main__":
  _main()
