"""One RL step with LoRA against the same step training every weight, measured in full runs.

  python experiments/bench_lora.py                     # SmolLM2-135M-Instruct (make smollm2)
  python experiments/bench_lora.py --model=tiny --new_tokens=32 --rank=8

Each configuration is a real `jetrl.train.run` (GSM8K chat prompts from data/gsm8k, or
addition for a preset with its character tokenizer; the recipe's rollout, rewards, the update) of --steps steps in a process of its own. Step 1
compiles, so the later steps are timed. The columns are each step's rollout and update seconds
(the median over the timed steps), the process's peak resident memory, and the train state's
bytes (what is trained and its optimizer state, plus the frozen base). The ratios are against
the full-parameter run of the same recipe, measured in the same invocation.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Model preset or HF folder (default: SmolLM2-135M-Instruct).")
flags.DEFINE_list("recipes", ["jet"], "Recipes; each runs full-parameter and LoRA.")
flags.DEFINE_integer("rank", 16, "--lora.rank of the LoRA runs.", lower_bound=1)
flags.DEFINE_integer("prompts", 2, "--prompts_per_step.", lower_bound=1)
flags.DEFINE_integer("n", 2, "--sampling.n (samples per prompt).", lower_bound=2)
flags.DEFINE_integer("new_tokens", 128, "--sampling.max_new_tokens.", lower_bound=1)
flags.DEFINE_integer(
  "steps", 2, "RL steps per run (step 1 compiles and is not timed).", lower_bound=2
)
flags.DEFINE_string("json_out", "", "Write the rows as JSON here.")
flags.DEFINE_string("child", "", "(internal) run one configuration: recipe:rank")


def _state_bytes(state) -> int:
  import jax

  return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(state))


def _task(model: str) -> dict:
  """GSM8K chat prompts for a model folder; a preset (character tokenizer) gets addition."""
  from jetrl.models import PRESETS

  if model in PRESETS:
    return {"name": "addition"}
  return {
    "name": "gsm8k",
    "data_path": os.path.join(ROOT, "data", "gsm8k"),
    "prompt_format": "chat",
  }


def _child(spec: str) -> dict:
  """One run; returns its timings and memory (printed as JSON by the child process)."""
  import jax

  from jetrl.train import CheckpointConfig, EvalConfig, LoggingConfig, TrainConfig, run
  from jetrl.train import loop as _loop

  recipe, rank = spec.split(":")
  model = FLAGS.model
  if model is None:
    from jetrl.models.io.smollm2 import smollm2_folder

    model = smollm2_folder()
  states = []
  real = _loop._initial_state

  def initial_state(*a, **kw):  # the train state's bytes, as built
    state = real(*a, **kw)
    states.append(_state_bytes(state))
    return state

  _loop._initial_state = initial_state
  with tempfile.TemporaryDirectory(prefix="jetrl-bench-lora-") as workdir:
    cfg = TrainConfig(
      workdir=workdir,
      recipe=recipe,
      steps=FLAGS.steps,
      prompts_per_step=FLAGS.prompts,
      eval=EvalConfig(every=None, size=1),
      checkpoint=CheckpointConfig(every=10**6),
      logging=LoggingConfig(tensorboard=False, plots=False),
    ).replace(
      model={"name": model},
      task=_task(model),
      sampling={"n": FLAGS.n, "max_new_tokens": FLAGS.new_tokens, "temperature": 1.0},
      lora={"rank": int(rank)},
    )
    run(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f if line.strip()][1:]
  med = lambda key: statistics.median(r[key] for r in records)
  return dict(
    recipe=recipe,
    rank=int(rank),
    rollout_s=med("time/rollout"),
    update_s=med("time/update"),
    step_s=med("time/rollout") + med("time/reward") + med("time/update"),
    peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    state_gib=states[0] / 2**30,
    devices=jax.device_count(),
  )


def main(argv):
  del argv
  if FLAGS.child:
    print("RESULT " + json.dumps(_child(FLAGS.child)), flush=True)
    return 0
  rows = []
  for recipe in FLAGS.recipes:
    for rank in (0, FLAGS.rank):
      args = [a for a in sys.argv[1:] if not a.startswith("--child")]
      cmd = [sys.executable, os.path.abspath(__file__), *args, f"--child={recipe}:{rank}"]
      print(f"running {recipe} {'LoRA rank ' + str(rank) if rank else 'full'} ...", flush=True)
      out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
      rows.append(json.loads(next(s for s in out.splitlines() if s.startswith("RESULT "))[7:]))
  print()
  head = "| recipe | trained | rollout s | update s | step s | step vs full | update vs full | train state GiB | peak RSS GiB |"
  print(head)
  print("|" + "---|" * 9)
  for r in rows:
    full = next(f for f in rows if f["recipe"] == r["recipe"] and f["rank"] == 0)
    what = f"LoRA r={r['rank']}" if r["rank"] else "every weight"
    print(
      f"| {r['recipe']} | {what} | {r['rollout_s']:.3g} | {r['update_s']:.3g} | "
      f"{r['step_s']:.3g} | {full['step_s'] / r['step_s']:.2f}x | "
      f"{full['update_s'] / r['update_s']:.2f}x | {r['state_gib']:.3f} | {r['peak_rss_gib']:.2f} |"
    )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  app.run(main)
