"""Running the fourth round (docs/study/round4/prereg.md): its jobs, in order, by one or more workers.

Every tiny-model run of warm start k lives in one study folder, `<root>/w<k>` (its warm starts
under `sft/`, its runs under `runs/L<length>/<arm>/seed<s>`), so the primary and the crossover
share the first warm start. SmolLM2's runs live in `<root>/smollm2/<recipe>/seed<s>`.

Before anything runs, the pre-registration (its document, `round4_design` and the analysis
code `prereg4`) must be committed and clean, and unchanged since the first run
(`provenance.check`). Each finished run gets `commit.txt`, the commit of the code that ran it,
so that the judge can check that the pre-registration precedes it.

Workers share a root: each job and each warm start is claimed by an exclusive file
(`<folder>.claim`, holding the worker's pid and host); a claim whose process is gone is taken
over. A worker runs the first job in order that is neither done nor claimed, and sleeps when
every remaining job waits for a warm start another worker is training.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Optional

from jetrl.config import replace
from jetrl.study import round4_design as design
from jetrl.study.config import (
  Arm,
  StudyConfig,
  is_done,
  run_dir,
  sft_config,
  sft_dir,
  tag,
  train_config,
)
from jetrl.study.provenance import check as check_prereg
from jetrl.train.evaluate import EvalRunConfig, run_eval
from jetrl.train.loop import run
from jetrl.train.sft import run_sft
from jetrl.train.workdir import pid_alive

PREREG_FILES = (
  "docs/study/round4/prereg.md",
  "src/jetrl/study/round4_design.py",
  "src/jetrl/study/prereg4.py",
)
PART_SETTINGS = {
  "primary": design.PRIMARY,
  "crossover": design.CROSSOVER,
  "length": design.LENGTH,
}


def study_config(part: str, warm: int, root: str) -> StudyConfig:
  """The precision study of `part` on warm start `warm`."""
  changes = dict(PART_SETTINGS[part], **{"sft.seed": int(warm), "report_dir": warm_dir(root, warm)})
  return replace(StudyConfig(), changes)


def warm_dir(root: str, warm: int) -> str:
  return os.path.join(root, f"w{int(warm)}")


# Amendment 2 (docs/study/round4/amendments.md): a primary warm start whose held-out accuracy at
# length 9 before RL (its runs' step-0 evaluation, bf16-scored) is below WARM_GATE gives every
# run a reward of 0 and no gradient, so it cannot show learning; it is left out, and the next SFT
# seed takes its place, until design.WARM_SEEDS' count of warm starts pass (at most MAX_WARM_SEED).
WARM_GATE = 0.05
MAX_WARM_SEED = 20


def warm_start_feasible(root: str, warm: int) -> Optional[bool]:
  """None until a length-9 run of warm start `warm` has evaluated its step 0; then whether its
  bf16-scored held-out accuracy there reaches WARM_GATE (every arm evaluates the same params)."""
  found = gate_evidence(root, warm)
  return None if found is None else found[1] >= WARM_GATE


def gate_evidence(root: str, warm: int) -> Optional[tuple[str, float]]:
  """(the eval.jsonl, finished run or not, whose step-0 evaluation decides warm start `warm`'s
  gate; its bf16-scored accuracy), or None while no length-9 run has evaluated its step 0."""
  base = os.path.join(warm_dir(root, warm), "runs", "L9")
  if not os.path.isdir(base):
    return None
  for arm in sorted(os.listdir(base)):
    if not os.path.isdir(os.path.join(base, arm)):
      continue
    for seed_dir in sorted(os.listdir(os.path.join(base, arm))):
      path = os.path.join(base, arm, seed_dir, "eval.jsonl")
      if not os.path.isfile(path):
        continue
      with open(path) as f:
        line = f.readline()
      try:
        first = json.loads(line)
      except ValueError:
        continue
      if first.get("step") == 0 and "eval_accuracy_bf16" in first:
        return path, float(first["eval_accuracy_bf16"])
  return None


def primary_warm_starts(root: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(the warm starts the primary runs on: those that passed the gate or are not yet known, in
  SFT-seed order; those the gate left out)."""
  chosen, left_out = [], []
  warm = design.WARM_SEEDS[0]
  while len(chosen) < len(design.WARM_SEEDS) and warm <= MAX_WARM_SEED:
    (left_out if warm_start_feasible(root, warm) is False else chosen).append(warm)
    warm += 1
  return tuple(chosen), tuple(left_out)


def jobs(root: str, *, left_out: bool = False) -> list[dict]:
  """Every job of the round, in the pre-registered order (with amendment 2's choice of the
  primary's warm starts); left_out: also the primary jobs of the warm starts the gate left out
  (for keeping what they ran)."""
  out = []
  for part in design.PARTS:
    if part == "smollm2":
      for seed in design.SMOLLM2_SEEDS:
        for recipe in design.SMOLLM2_RECIPES:
          out.append(dict(part=part, warm=None, length=None, arm=recipe, seed=seed))
      continue
    if part == "primary":
      chosen, excluded = primary_warm_starts(root)
      warms = tuple(sorted(chosen + excluded)) if left_out else chosen
    else:
      warms = (0,)
    seeds = dict(
      primary=design.PRIMARY_SEEDS,
      crossover=design.CROSSOVER_SEEDS,
      length=design.LENGTH_SEEDS,
    )[part]
    for seed in seeds:
      for warm in warms:
        cfg = study_config(part, warm, root)
        for arm in cfg.arms:
          for length in cfg.lengths:
            out.append(dict(part=part, warm=warm, length=int(length), arm=arm, seed=seed))
  return out


def job_name(job: dict) -> str:
  if job["part"] == "smollm2":
    return f"smollm2/{job['arm']}/seed{job['seed']}"
  return f"w{job['warm']}/{tag(job['length'], job['arm'], job['seed'])}"


def smollm2_dir(root: str, recipe: str, seed: int) -> str:
  return os.path.join(root, "smollm2", recipe, f"seed{seed}")


def job_dir(root: str, job: dict) -> str:
  if job["part"] == "smollm2":
    return smollm2_dir(root, job["arm"], job["seed"])
  cfg = study_config(job["part"], job["warm"], root)
  return run_dir(cfg, job["length"], job["arm"], job["seed"])


def job_done(root: str, job: dict) -> bool:
  return os.path.exists(os.path.join(job_dir(root, job), "commit.txt"))


# Claims ---------------------------------------------------------------------------------------


def _alive(pid: int, host: str) -> bool:
  if host != socket.gethostname():
    return True  # another machine's worker: trust its claim
  return pid_alive(pid)


def claim(folder: str) -> bool:
  """Claims `folder` for this process (an exclusive `<folder>.claim`); False if a live process
  holds it. A claim whose process is gone is taken over."""
  path = folder.rstrip("/") + ".claim"
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  me = {"pid": os.getpid(), "host": socket.gethostname()}
  for _ in range(2):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      try:
        with open(path) as f:
          held = json.load(f)
      except (OSError, ValueError):
        return False  # being written: someone is claiming it now
      if _alive(int(held.get("pid", -1)), str(held.get("host", ""))):
        return False
      os.unlink(path)  # its worker is gone
      continue
    with os.fdopen(fd, "w") as f:
      json.dump(me, f)
    return True
  return False


def release(folder: str) -> None:
  try:
    os.unlink(folder.rstrip("/") + ".claim")
  except FileNotFoundError:
    pass


# Running --------------------------------------------------------------------------------------


def head_commit(repo: str) -> str:
  """The commit checked out in `repo` (HEAD)."""
  return subprocess.run(
    ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
  ).stdout.strip()


def _record_time(root: str, worker: str, name: str, seconds: float) -> None:
  path = os.path.join(root, f"timing_{worker}.json")
  timing = {}
  if os.path.exists(path):
    with open(path) as f:
      timing = json.load(f)
  timing[name] = timing.get(name, 0.0) + seconds
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(timing, f, indent=1)
  os.replace(tmp, path)


def timings(root: str) -> dict[str, float]:
  """Seconds per finished job (and warm start), from every worker's timing file under root."""
  out: dict[str, float] = {}
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    if name.startswith("timing_") and name.endswith(".json"):
      with open(os.path.join(root, name)) as f:
        out.update(json.load(f))
  return out


def time_left(root: str, todo: list[dict]) -> str:
  """How much one worker's time the jobs in `todo` still need at the pace so far: each part's
  jobs times the median time of its jobs already timed (any worker). Parts with none timed yet,
  and warm starts still to train, are named, not guessed."""
  timed = timings(root)
  pace: dict[str, list[float]] = {}
  for job in jobs(root, left_out=True):
    if job_name(job) in timed:
      pace.setdefault(job["part"], []).append(timed[job_name(job)])
  seconds, untimed = 0.0, []
  for part in design.PARTS:
    n = sum(j["part"] == part for j in todo)
    if not n:
      continue
    if part in pace:
      seconds += n * statistics.median(pace[part])
    else:
      untimed.append(f"{part} {n}")
  text = f"about {seconds / 3600:.1f} h of one worker's time at the pace so far"
  if untimed:
    text += f", not counting jobs with no timed run yet ({', '.join(untimed)})"
  return text


def machine_info() -> dict:
  """The CPU a run ran on: runs are deterministic on one kind of CPU, not across kinds (a warm
  start retrained on another CPU ends elsewhere; docs/study/round4/amendments.md)."""
  info = {"machine": platform.machine(), "cores": os.cpu_count()}
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError:
    return info
  first = text.split("\n\n", 1)[0]
  for line in first.splitlines():
    key, _, value = line.partition(":")
    key, value = key.strip(), value.strip()
    if key in ("model name", "cpu family", "model", "vendor_id"):
      info[key.replace(" ", "_")] = value
    elif key == "flags":
      info["flags_sha256"] = hashlib.sha256(value.encode()).hexdigest()[:16]
      info["avx512_bf16"] = "avx512_bf16" in value.split()
  return info


def _finish(folder: str, commit: str) -> None:
  with open(os.path.join(folder, "machine.json"), "w") as f:
    json.dump(machine_info(), f, indent=1)
  tmp = os.path.join(folder, "commit.txt.tmp")
  with open(tmp, "w") as f:
    f.write(commit + "\n")
  os.replace(tmp, os.path.join(folder, "commit.txt"))


def warm_start_ready(root: str, job: dict) -> bool:
  cfg = study_config(job["part"], job["warm"], root)
  return os.path.exists(os.path.join(sft_dir(cfg, job["length"]), "sft_summary.json"))


def length_warm_start_dir(root: str) -> str:
  """The length part's warm start (its SFT folder) under root."""
  cfg = study_config("length", 0, root)
  return sft_dir(cfg, cfg.lengths[0])


def length_gate_accuracy(root: str) -> Optional[float]:
  """The length part's warm start's held-out accuracy at its length (what the gate reads), or
  None while that warm start has not finished."""
  path = os.path.join(length_warm_start_dir(root), "sft_summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return float(json.load(f)["eval_accuracy"])


def warm_start_eval(sft, length: int) -> dict:
  """A finished warm start's held-out evaluation at task `length`, sampled as its own SFT
  evaluation samples it (the same recipe, seed, problems, budget and temperature): at the SFT's
  length this is its sft_summary.json. {eval_accuracy, eval_reward, eval_length, ...}."""
  cfg = EvalRunConfig(
    recipe=sft.recipe,
    init_from=sft.workdir,
    seed=sft.seed,
    model=sft.model,
    task=replace(sft.task, {"length": int(length)}),
    sampling=sft.sampling,
    eval=replace(sft.eval, {"every": None, "also_bf16": False}),
    kernels=sft.kernels,
  )
  return run_eval(cfg, log=lambda *a, **k: None)


def length_gate(root: str) -> Optional[bool]:
  """None while the length part's warm start is missing; else whether it passed the gate."""
  acc = length_gate_accuracy(root)
  return None if acc is None else acc >= design.LENGTH_GATE


def length_gate_note(root: str) -> Optional[str]:
  """Why the length part is not run (its warm start failed the gate, with the accuracy the gate
  read), or None while that is not so."""
  acc = length_gate_accuracy(root)
  if acc is None or acc >= design.LENGTH_GATE:
    return None
  length = study_config("length", 0, root).lengths[0]
  return (
    f"not run: its warm start's held-out accuracy at length {length} is {acc:.3f}, below the "
    f"gate {design.LENGTH_GATE}"
  )


def train_warm_start(root: str, job: dict, log: Callable, worker: str) -> None:
  cfg = study_config(job["part"], job["warm"], root)
  folder = sft_dir(cfg, job["length"])
  log(f"[{worker}] warm start {folder}: {cfg.sft.steps} SFT steps")
  t0 = time.time()
  res = run_sft(sft_config(cfg, job["length"]), log=lambda *a, **k: None)
  with open(os.path.join(folder, "machine.json"), "w") as f:
    json.dump(machine_info(), f, indent=1)
  _record_time(root, worker, f"sft/{os.path.relpath(folder, root)}", time.time() - t0)
  log(
    f"[{worker}] warm start {folder}: accuracy {res['eval_accuracy']:.3f} ({time.time() - t0:.0f}s)"
  )


def run_job(root: str, job: dict, repo: str, log: Callable, worker: str) -> None:
  folder = job_dir(root, job)
  t0 = time.time()
  if job["part"] == "smollm2":
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    cmd = [
      sys.executable,
      os.path.join(repo, "experiments", "lora_arithmetic.py"),
      f"--seeds={job['seed']}",
      f"--recipe={job['arm']}",
      f"--root={parent}",
      f"--json_out={folder}.json",
    ]
    with open(folder + ".runner.log", "a") as out:
      subprocess.run(cmd, check=True, stdout=out, stderr=out, cwd=repo)
  else:
    cfg = study_config(job["part"], job["warm"], root)
    summary = run(
      train_config(cfg, job["length"], job["arm"], job["seed"]), log=lambda *a, **k: None
    )
    log(
      f"[{worker}] {job_name(job)}: accuracy {summary['eval_before']:.3f} -> "
      f"{summary['eval_after']:.3f}"
    )
    if not is_done(cfg, job["length"], job["arm"], job["seed"]):
      raise RuntimeError(f"{folder}: the run ended without its summary.json")
  _record_time(root, worker, job_name(job), time.time() - t0)
  _finish(folder, head_commit(repo))


def work(
  root: str,
  *,
  repo: str,
  worker: str = "w",
  parts: tuple[str, ...] = design.PARTS,
  log: Callable = print,
  poll_s: float = 30.0,
  max_jobs: Optional[int] = None,
) -> int:
  """Runs the round's jobs of `parts` until none is left; returns how many this worker ran."""
  prereg = check_prereg(root, [os.path.join(repo, f) for f in PREREG_FILES])
  log(
    f"[{worker}] pre-registration {prereg['commit'][:12]} committed and unchanged; code {prereg['head'][:12]}"
  )
  ran = 0
  while True:
    todo = [j for j in jobs(root) if j["part"] in parts and not job_done(root, j)]
    if not todo:
      log(f"[{worker}] nothing left to run")
      return ran
    progressed = False
    for job in todo:
      if job["part"] == "length":
        gate = length_gate(root)
        if gate is False:
          continue  # reported as not run
      if job["part"] != "smollm2" and not warm_start_ready(root, job):
        cfg = study_config(job["part"], job["warm"], root)
        folder = sft_dir(cfg, job["length"])
        if not claim(folder):
          continue
        try:
          if not warm_start_ready(root, job):
            train_warm_start(root, job, log, worker)
        finally:
          release(folder)
        progressed = True
        break  # the order may have changed (a gate): look again
      folder = job_dir(root, job)
      if not claim(folder):
        continue
      try:
        if not job_done(root, job):
          left = len(todo)
          log(f"[{worker}] {job_name(job)}: running ({left} jobs left; {time_left(root, todo)})")
          run_job(root, job, repo, log, worker)
          ran += 1
      finally:
        release(folder)
      progressed = True
      break
    if max_jobs is not None and ran >= max_jobs:
      return ran
    if not progressed:
      if all(j["part"] == "length" and length_gate(root) is False for j in todo):
        log(f"[{worker}] the length part: {length_gate_note(root)}")
        return ran
      time.sleep(poll_s)


__all__ = ["Arm", "jobs", "work", "job_name", "job_dir", "claim", "release", "study_config"]
