"""The CPU demo behind `make demo`: warm-start a tiny model on a synthetic task, run GRPO under
the unified FP8 flow (`jet`), and print the held-out greedy accuracy before and after RL.

  python experiments/demo.py                       # the default, a few minutes on 2 CPU cores
  python experiments/demo.py --rl_steps=80 --workdir=runs/demo_long

It is a thin wrapper over experiments/sft.py and experiments/train.py (same library calls; the
configs are those of experiments/configs/addition_sft.py and addition_jet.py); the workdir is
cleared first unless --keep.
"""

from __future__ import annotations

import os
import shutil
import time

from absl import app, flags

from jetrl.rl import OptimizerConfig
from jetrl.sampling import SamplingConfig
from jetrl.train import (
  CheckpointConfig,
  EvalConfig,
  SFTConfig,
  TaskConfig,
  TrainConfig,
  run,
  run_sft,
)
from jetrl.train.cli import quiet_third_party_logs

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/demo", "Output directory (cleared first unless --keep).")
flags.DEFINE_bool("keep", False, "Keep (resume) an existing workdir instead of clearing it.")
flags.DEFINE_string("recipe", "jet", "Precision recipe of the RL phase.")
flags.DEFINE_string("task", "addition", "Synthetic task.")
flags.DEFINE_integer("difficulty", 1, "Task difficulty knob.")
flags.DEFINE_integer("length", 3, "Task length knob.")
flags.DEFINE_integer("max_new_tokens", 64, "Generation budget.")
flags.DEFINE_integer("sft_steps", 150, "Supervised warm-start steps.")
flags.DEFINE_integer("rl_steps", 100, "RL steps.")
flags.DEFINE_float("lr", 3e-5, "RL learning rate.")
flags.DEFINE_float("temperature", 0.7, "Rollout temperature.")
flags.DEFINE_integer("eval_size", 256, "Held-out problems for the greedy evaluation.")
flags.DEFINE_integer("seed", 0, "Random seed.")


def main(argv):
  del argv
  quiet_third_party_logs()
  if os.path.isdir(FLAGS.workdir) and not FLAGS.keep:
    shutil.rmtree(FLAGS.workdir)
  t0 = time.time()
  sft_dir, rl_dir = os.path.join(FLAGS.workdir, "sft"), os.path.join(FLAGS.workdir, "rl")
  task = TaskConfig(name=FLAGS.task, difficulty=FLAGS.difficulty, length=FLAGS.length)
  print(f"== 1/2 supervised warm start: {FLAGS.sft_steps} steps on {FLAGS.task} gold solutions")
  run_sft(
    SFTConfig(
      task=task,
      steps=FLAGS.sft_steps,
      max_new_tokens=FLAGS.max_new_tokens,
      eval=EvalConfig(every=None, size=FLAGS.eval_size),
      seed=FLAGS.seed,
      workdir=sft_dir,
    )
  )
  print(f"== 2/2 GRPO under recipe {FLAGS.recipe!r}: {FLAGS.rl_steps} steps")
  summary = run(
    TrainConfig(
      task=task,
      recipe=FLAGS.recipe,
      init_from=sft_dir,
      steps=FLAGS.rl_steps,
      seed=FLAGS.seed,
      sampling=SamplingConfig(
        max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, n=8
      ),
      optimizer=OptimizerConfig(lr=FLAGS.lr, warmup_steps=5),
      eval=EvalConfig(every=max(FLAGS.rl_steps // 4, 1), size=FLAGS.eval_size),
      checkpoint=CheckpointConfig(every=max(FLAGS.rl_steps // 2, 1)),
      workdir=rl_dir,
    )
  )
  before, after = summary["eval_before"], summary["eval_after"]
  print()
  print(
    f"held-out greedy accuracy ({FLAGS.eval_size} problems): before RL {before:.3f}, "
    f"after RL {after:.3f} ({100 * (after - before):+.1f} points)"
  )
  print(f"metrics: {os.path.join(rl_dir, 'metrics.jsonl')}")
  print("plots:   " + "\n         ".join(summary.get("plots", [])))
  print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
  app.run(main)
