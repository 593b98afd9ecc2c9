"""A real model that learns on a CPU: LoRA RL of SmolLM2-135M-Instruct under jet, over seeds.

  python experiments/lora_arithmetic.py                    # 3 seeds, about 20 minutes each
                                                           # (17.5-19.8 on 2 cores: docs/lora.md)
  python experiments/lora_arithmetic.py --seeds=0 --steps=4 --root=/tmp/try   # a quick look

Each seed is one `experiments/train.py` run in a process of its own, in <root>/seed<S>:
`chat_arithmetic` questions (one-digit numbers, one operation by default: "What is 7 + 5?";
--length=2 asks two: "What is 8 + 2 - 4?"; chat prompts), LoRA adapters on every projection
of the frozen FP8 base, the `jet` recipe in the rollout and the update, greedy held-out
accuracy on --eval_size test problems at step 0 and every --eval_every steps. The seed sets the adapters' init, the sampling and the task's
problems (train and test alike). A run that exists is resumed (train.py resumes a workdir), a
finished one is only re-read, so rerunning the command after a crash or a Ctrl-C loses nothing.
Each run's console (a line per step with its elapsed time and ETA, the compiles' clocks, the
evaluations) is shown prefixed by its seed, and kept in <root>/seed<S>.log.

The model is SmolLM2-135M-Instruct as `make smollm2` writes it: a Q4_1 GGUF file dequantized
to float32 (4-bit weights, not the original bf16 ones).

The table: each seed's accuracy before (step 0, the base model) and after (the last
evaluation), the gain, and the run's minutes; then the mean gain with its two-sided 95%
Student t interval over the seeds (`jetrl.study.stats.paired_interval`). --json_out writes
the rows and the interval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

FLAGS = flags.FLAGS
flags.DEFINE_string("root", "runs/lora_arithmetic", "Folder of the seeds' workdirs.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds, one run each.")
flags.DEFINE_string(
  "model", None, "HF model folder (default: SmolLM2-135M-Instruct, make smollm2)."
)
flags.DEFINE_string("recipe", "jet", "--recipe of every run.")
flags.DEFINE_integer("steps", 24, "RL steps per run.", lower_bound=1)
flags.DEFINE_integer("rank", 16, "--lora.rank.", lower_bound=1)
flags.DEFINE_float("alpha", 32.0, "--lora.alpha.")
flags.DEFINE_float("lr", 5e-4, "--optimizer.lr.")
flags.DEFINE_integer("difficulty", 1, "--task.difficulty: digits per number.", lower_bound=1)
flags.DEFINE_integer("length", 1, "--task.length: operations per question.", lower_bound=1)
flags.DEFINE_integer("prompts", 2, "--prompts_per_step.", lower_bound=1)
flags.DEFINE_integer("n", 8, "--sampling.n: samples per prompt (the GRPO group).", lower_bound=2)
flags.DEFINE_integer("new_tokens", 48, "--sampling.max_new_tokens.", lower_bound=1)
flags.DEFINE_float("temperature", 0.7, "--sampling.temperature of the rollouts.")
flags.DEFINE_integer("eval_size", 128, "Held-out problems per greedy evaluation.", lower_bound=1)
flags.DEFINE_integer("eval_every", 12, "Evaluate every N steps (and at the start and end).")
flags.DEFINE_string("json_out", "", "Write the rows and the interval as JSON here.")


def train_command(seed: int, workdir: str, model: str) -> list[str]:
  """The train.py command line of one seed."""
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "train.py"),
    f"--workdir={workdir}",
    f"--seed={seed}",
    f"--recipe={FLAGS.recipe}",
    f"--model.name={model}",
    "--task.name=chat_arithmetic",
    f"--task.difficulty={FLAGS.difficulty}",
    f"--task.length={FLAGS.length}",
    "--task.prompt_format=chat",
    f"--lora.rank={FLAGS.rank}",
    f"--lora.alpha={FLAGS.alpha}",
    f"--optimizer.lr={FLAGS.lr}",
    f"--steps={FLAGS.steps}",
    f"--prompts_per_step={FLAGS.prompts}",
    f"--sampling.n={FLAGS.n}",
    f"--sampling.max_new_tokens={FLAGS.new_tokens}",
    f"--sampling.temperature={FLAGS.temperature}",
    f"--eval.size={FLAGS.eval_size}",
    f"--eval.batch={FLAGS.eval_size}",
    f"--eval.every={FLAGS.eval_every}",
    f"--checkpoint.every={FLAGS.eval_every}",
    "--logging.samples_every=6",
    "--nologging.tensorboard",
  ]


def run_seed(cmd: list[str], log_path: str, prefix: str, out=None) -> int:
  """Runs one seed's command: each line it prints goes to `log_path` and, prefixed, to the
  console (its per-step progress, compile clocks, evaluations); its exit code. Ctrl-C reaches
  the run too (it finishes its step and saves a checkpoint): this waits for it to end."""
  out = out or sys.stdout
  with open(log_path, "a") as log:
    proc = subprocess.Popen(
      cmd,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      bufsize=1,
      env=dict(os.environ, PYTHONUNBUFFERED="1"),  # each line as it is printed, not in blocks
    )
    try:
      for line in proc.stdout:
        log.write(line)
        log.flush()
        out.write(prefix + line)
        out.flush()
    except KeyboardInterrupt:
      proc.wait()
      raise
    return proc.wait()


def read_run(workdir: str) -> dict | None:
  """(accuracy before, after, steps, seconds) of a finished run, or None."""
  summary = os.path.join(workdir, "summary.json")
  if not os.path.isfile(summary):
    return None
  with open(summary) as f:
    s = json.load(f)
  if s.get("steps") != FLAGS.steps or s.get("eval_before") is None:
    return None
  with open(os.path.join(workdir, "eval.jsonl")) as f:
    evals = [json.loads(line) for line in f if line.strip()]
  return dict(
    before=s["eval_before"],
    after=s["eval_after"],
    curve=[(e["step"], e["eval_accuracy"]) for e in evals],
  )


def main(argv):
  del argv
  from jetrl.study.stats import paired_interval

  model = FLAGS.model
  if model is None:
    from jetrl.models.io.smollm2 import smollm2_folder

    model = smollm2_folder()
  if not os.path.isdir(model):
    raise app.UsageError(f"--model: {model!r} is not a folder (make smollm2 writes SmolLM2's)")
  seeds = [int(s) for s in FLAGS.seeds]
  if FLAGS.model is None:
    print(
      f"model: {model} (SmolLM2-135M-Instruct from a Q4_1 GGUF file dequantized to float32: "
      "4-bit weights, not the original bf16 ones)",
      flush=True,
    )
  rows = []
  for seed in seeds:
    workdir = os.path.join(FLAGS.root, f"seed{seed}")
    result, minutes = read_run(workdir), None
    if result is None:
      print(f"seed {seed}: training in {workdir} (also logged to {workdir}.log)", flush=True)
      os.makedirs(FLAGS.root, exist_ok=True)
      t0 = time.time()
      code = run_seed(train_command(seed, workdir, model), workdir + ".log", f"seed {seed} | ")
      if code:
        raise SystemExit(f"seed {seed}: train.py exited with code {code}; see {workdir}.log")
      minutes = (time.time() - t0) / 60
      result = read_run(workdir)
      if result is None:
        raise SystemExit(f"seed {seed}: {workdir} has no finished summary; see {workdir}.log")
    rows.append(dict(seed=seed, minutes=minutes, **result))
    curve = ", ".join(f"{a:.3f}@{s}" for s, a in result["curve"])
    print(f"seed {seed}: accuracy {curve}", flush=True)
  ci = paired_interval([r["after"] - r["before"] for r in rows])
  print()
  print("| seed | accuracy before | accuracy after | gain | minutes (this call) |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    mins = "re-read" if r["minutes"] is None else f"{r['minutes']:.1f}"
    print(
      f"| {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
      f"{r['after'] - r['before']:+.3f} | {mins} |"
    )
  print(
    f"\nmean gain {ci['mean']:+.3f} over {ci['n']} seeds, 95% interval "
    f"[{ci['lo']:+.3f}, {ci['hi']:+.3f}] (Student t), p = {ci['p']:.3g}"
  )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(dict(rows=rows, gain=ci, command=sys.argv), f, indent=1)
  return 0


if __name__ == "__main__":
  app.run(main)
