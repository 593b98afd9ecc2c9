"""The precision study's fourth round (docs/study/round4/prereg.md): run it, keep it, judge it.

  python experiments/round4.py --root=runs/round4                 # run (resumes; several may share --root)
  python experiments/round4.py --root=runs/round4 --plan          # every job, in order, and its state
  python experiments/round4.py --root=runs/round4 --keep=docs/study/round4/data
  python experiments/round4.py --judge=docs/study/round4/data --report=docs/study/round4

Running refuses to start while the pre-registration (docs/study/round4/prereg.md, the design
`jetrl.study.round4_design` and the analysis `jetrl.study.prereg4`) is uncommitted, or once it
has changed since the first run in --root. Jobs run in the pre-registered order; several
workers (processes with distinct --worker names) may share one --root and each takes the next
job nobody holds. --keep copies what the judge reads of every finished run (summaries, metric
records, configs, the commit that ran it, timings) to a folder meant to be committed; --judge
computes the verdicts from such a folder alone, checking that the pre-registration's commit
precedes every run's. --report (with --judge) writes the verdicts, results.md (the summary
table, every comparison, the machines) and the figures (learning curves by arm with 95%
intervals, the effects against the margin, the crossover's effect against its dose) there.
Each job's first line, and --plan's last, says how many jobs are left and about how much of one
worker's time they need at the pace so far (each part's median timed run).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "src"))

from jetrl.study import prereg4, round4  # noqa: E402
from jetrl.study import round4_design as design  # noqa: E402
from jetrl.study import round4_report as report  # noqa: E402
from jetrl.study.config import sft_dir  # noqa: E402
from jetrl.study.provenance import PreregError, precedes  # noqa: E402
from jetrl.study.summary import summarize_run  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("root", "runs/round4", "Folder of the round's runs.")
flags.DEFINE_string("worker", "w1", "This worker's name (timings are kept per worker).")
flags.DEFINE_list("parts", list(design.PARTS), f"Parts to run, of {list(design.PARTS)}.")
flags.DEFINE_bool("plan", False, "Print every job in order with its state, then stop.")
flags.DEFINE_integer("max_jobs", None, "Stop after this many jobs (none: run until done).")
flags.DEFINE_string("keep", None, "Copy the finished runs' kept files to this folder.")
flags.DEFINE_string("judge", None, "Judge the kept runs in this folder.")
flags.DEFINE_string("json_out", None, "With --judge: write the verdicts here.")
flags.DEFINE_string(
  "report",
  None,
  "With --judge: write verdicts.json, results.md and the figures to this folder "
  "(docs/study/round4 for the committed report).",
)

RUN_FILES = (
  "summary.json",
  "metrics.jsonl",
  "eval.jsonl",
  "config.json",
  "commit.txt",
  "machine.json",
)
SFT_FILES = ("sft_summary.json", "sft_config.json", "sft_eval.jsonl", "machine.json")


def _copy(src_dir: str, dst_dir: str, names) -> int:
  n = 0
  for name in names:
    src = os.path.join(src_dir, name)
    if os.path.isfile(src) and not os.path.islink(src):
      os.makedirs(dst_dir, exist_ok=True)
      shutil.copyfile(src, os.path.join(dst_dir, name))
      n += 1
  return n


def _keep_checkpoint(src_sft: str, dst_sft: str) -> None:
  """The warm start's newest checkpoint, whole: a later sitting starts its runs from these
  params instead of retraining them (a retrained warm start differs on another kind of CPU)."""
  ckpts = os.path.join(src_sft, "checkpoints")
  if not os.path.isdir(ckpts):
    return
  steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
  if not steps:
    return
  last = str(steps[-1])
  dst = os.path.join(dst_sft, "checkpoints", last)
  if not os.path.exists(dst):
    shutil.copytree(os.path.join(ckpts, last), dst, symlinks=False)


def keep(root: str, dest: str) -> None:
  """Copies each finished job's kept files, the warm starts' summaries and the timings (and the
  newest checkpoint of each warm start but those the gate left out)."""
  done = 0
  for job in round4.jobs(root, left_out=True):
    if not round4.job_done(root, job):
      continue
    src = round4.job_dir(root, job)
    dst = round4.job_dir(dest, job)
    _copy(src, dst, RUN_FILES)
    if job["part"] == "smollm2":
      _copy(os.path.dirname(src), os.path.dirname(dst), [os.path.basename(src) + ".json"])
    else:
      cfg = round4.study_config(job["part"], job["warm"], root)
      out = round4.study_config(job["part"], job["warm"], dest)
      src_sft, dst_sft = sft_dir(cfg, job["length"]), sft_dir(out, job["length"])
      _copy(src_sft, dst_sft, SFT_FILES)
      if not (job["part"] == "primary" and round4.warm_start_feasible(root, job["warm"]) is False):
        _keep_checkpoint(src_sft, dst_sft)  # one the gate left out never serves again
    done += 1
  # The gate's evidence for each warm start it left out, from a run that may not have finished
  # (an unfinished run is not kept otherwise): the kept folder decides the gate as the runs did.
  for warm in round4.primary_warm_starts(root)[1]:
    path, _ = round4.gate_evidence(root, warm)
    rel = os.path.relpath(os.path.dirname(path), root)
    _copy(os.path.dirname(path), os.path.join(dest, rel), ["eval.jsonl"])
  # The length part's warm start once it has finished: the gate's evidence, whether or not any
  # length run follows it (a warm start the gate stopped keeps no checkpoint).
  passed = round4.length_gate(root)
  if passed is not None:
    src_sft = round4.length_warm_start_dir(root)
    dst_sft = os.path.join(dest, os.path.relpath(src_sft, root))
    _copy(src_sft, dst_sft, SFT_FILES + ("sft_metrics.jsonl",))
    if passed:
      _keep_checkpoint(src_sft, dst_sft)
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    if name.startswith("timing_") or name == "prereg.json":
      _copy(root, dest, [name])
  print(f"kept {done} finished runs: {root} -> {dest}")


def rows(root: str) -> tuple[list[dict], list[dict]]:
  """(tiny-model rows with their warm start, SmolLM2 rows) of the finished jobs under root."""
  tiny, smol = [], []
  for job in round4.jobs(root):
    if not round4.job_done(root, job):
      continue
    folder = round4.job_dir(root, job)
    with open(os.path.join(folder, "commit.txt")) as f:
      commit = f.read().strip()
    machine = _machine_kind(folder)
    if job["part"] == "smollm2":
      with open(folder + ".json") as f:
        row = json.load(f)["rows"][0]
      # the runner's recipe, seed, commit and machine over the script's own record of the run
      smol.append(row | dict(recipe=job["arm"], seed=job["seed"], commit=commit, machine=machine))
      continue
    cfg = round4.study_config(job["part"], job["warm"], root)
    tiny.append(
      dict(
        part=job["part"],
        warm=job["warm"],
        length=job["length"],
        recipe=job["arm"].label,
        seed=job["seed"],
        commit=commit,
        machine=machine,
        **summarize_run(cfg, folder),
      )
    )
  return tiny, smol


def _machine_kind(folder: str) -> str:
  """The kind of CPU a run ran on ("vendor family/model flags-hash"), or "unrecorded"."""
  path = os.path.join(folder, "machine.json")
  if not os.path.exists(path):
    return "unrecorded"
  with open(path) as f:
    m = json.load(f)
  return (
    f"{m.get('vendor_id', '?')} {m.get('cpu_family', '?')}/{m.get('model', '?')} "
    f"{m.get('flags_sha256', '?')}"
  )


def machines(tiny: list[dict]) -> dict:
  """Per part: the kinds of CPU its runs ran on, and the units whose arms ran on several."""
  out = {}
  for part in sorted({r["part"] for r in tiny}):
    units: dict = {}
    for r in tiny:
      if r["part"] == part:
        units.setdefault((r["warm"], r["length"], r["seed"]), set()).add(r["machine"])
    out[part] = dict(
      kinds=sorted({m for ms in units.values() for m in ms}),
      mixed_units=[list(u) for u, ms in sorted(units.items()) if len(ms) > 1],
    )
  return out


def judge(folder: str, tiny: list[dict], smol: list[dict]) -> dict:
  """The verdicts of the kept runs in `folder` (`rows(folder)`: tiny, smol)."""
  with open(os.path.join(folder, "prereg.json")) as f:
    registered = json.load(f)["commit"]
  late = [
    f"{r.get('part', 'smollm2')}/{r['recipe']}/seed{r['seed']}"
    for r in tiny + smol
    if not precedes(REPO, registered, r["commit"])
  ]
  if late:
    raise PreregError(f"runs made before the pre-registration's commit {registered[:12]}: {late}")
  part = lambda p: [r for r in tiny if r["part"] == p]
  kinds = machines(tiny)
  mixed = {tuple(u) for u in kinds.get("primary", {}).get("mixed_units", [])}
  one_kind = [r for r in part("primary") if (r["warm"], r["length"], r["seed"]) not in mixed]
  chosen, left_out = round4.primary_warm_starts(folder)
  out = dict(
    prereg_commit=registered,
    primary_warm_starts=dict(used=list(chosen), left_out_by_the_gate=list(left_out)),
    machines=kinds,
    progress=progress(folder),
    primary={o: prereg4.judge_primary(part("primary"), 9, o) for o in prereg4.OUTCOMES},
    primary_one_machine_kind=prereg4.judge_primary(one_kind, 9, "primary"),
    primary_rl_effect=report.rl_effect(part("primary")),
    crossover={o: prereg4.judge_crossover(part("crossover"), 9, o) for o in prereg4.OUTCOMES},
    length={o: prereg4.judge_length(part("length"), 20, o) for o in prereg4.OUTCOMES},
    smollm2=prereg4.judge_smollm2(smol),
    smollm2_runs=[
      {k: r[k] for k in ("recipe", "seed", "before", "after", "commit", "machine")} for r in smol
    ],
    runs=[
      {
        k: r[k]
        for k in ("part", "warm", "length", "recipe", "seed", "commit", "machine", "abs_diff_mean")
      }
      | {o: prereg4.OUTCOMES[o](r) for o in prereg4.OUTCOMES if _has_outcome(r, o)}
      for r in tiny
    ],
  )
  return out


def progress(folder: str) -> dict:
  """Per part: its runs done and planned, and why the length part did not run if its gate
  failed."""
  out: dict = {}
  for job in round4.jobs(folder):
    p = out.setdefault(job["part"], dict(done=0, planned=0))
    p["planned"] += 1
    p["done"] += int(round4.job_done(folder, job))
  note = round4.length_gate_note(folder)
  if "length" in out and note:
    out["length"]["note"] = note
  return out


def _has_outcome(row: dict, outcome: str) -> bool:
  try:
    prereg4.OUTCOMES[outcome](row)
  except ValueError:
    return False
  return True


def write_report(folder: str, out_dir: str, tiny, smol, verdicts: dict, text: str) -> None:
  """verdicts.json, results.md and the figures (jetrl.study.round4_report) under out_dir."""
  os.makedirs(out_dir, exist_ok=True)
  figures = report.write_figures(tiny, smol, verdicts, out_dir)
  command = f"python experiments/round4.py --judge={folder} --report={out_dir}"
  md = report.results_markdown(verdicts, figures, command, round4.head_commit(REPO))
  for name, body in (("verdicts.json", text + "\n"), ("results.md", md + "\n")):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(body)
    os.replace(tmp, os.path.join(out_dir, name))
  print(f"report: {out_dir}/results.md, verdicts.json and {len(figures)} figures")


def plan(root: str) -> None:
  todo, gated = [], 0
  gate_note = round4.length_gate_note(root)
  for i, job in enumerate(round4.jobs(root)):
    if round4.job_done(root, job):
      state = "done"
    elif job["part"] == "length" and gate_note:
      state, gated = "not run (its warm start failed the gate)", gated + 1
    else:
      state = "to run"
      todo.append(job)
    print(f"{i + 1:4d} {round4.job_name(job):55s} {state}")
  print(f"{len(todo)} jobs to run: {round4.time_left(root, todo)}")
  if gated:
    print(f"the length part's {gated} jobs: {gate_note}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = [p for p in FLAGS.parts if p not in design.PARTS]
  if unknown:
    raise app.UsageError(f"--parts: {unknown} unknown; choose from {list(design.PARTS)}")
  if FLAGS.report and not FLAGS.judge:
    raise app.UsageError("--report writes the judge's report: give --judge=<kept runs> with it")
  if FLAGS.judge:
    tiny, smol = rows(FLAGS.judge)
    verdicts = judge(FLAGS.judge, tiny, smol)
    text = json.dumps(verdicts, indent=1, default=float)
    if FLAGS.report:
      write_report(FLAGS.judge, FLAGS.report, tiny, smol, verdicts, text)
    if FLAGS.json_out:
      with open(FLAGS.json_out, "w") as f:
        f.write(text + "\n")
      print(f"verdicts: {FLAGS.json_out}")
    elif not FLAGS.report:
      print(text)
    return 0
  if FLAGS.plan:
    plan(FLAGS.root)
    return 0
  if FLAGS.keep:
    keep(FLAGS.root, FLAGS.keep)
    return 0
  try:
    round4.work(
      FLAGS.root,
      repo=REPO,
      worker=FLAGS.worker,
      parts=tuple(FLAGS.parts),
      log=lambda *a: print(*a, flush=True),
      max_jobs=FLAGS.max_jobs,
    )
  except PreregError as e:
    print(f"round4.py: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  app.run(main)
