"""The CPU demo behind `make demo`: warm-start a tiny model on a synthetic task, run GRPO under
the unified FP8 flow (`jet`), and print the held-out greedy accuracy before and after RL.

  python experiments/demo.py                       # the default, a few minutes on 2 CPU cores
  python experiments/demo.py --steps=160 --eval.every=40 --workdir=runs/demo_long
  python experiments/demo.py --seed=1 --recipe=bf16 --optimizer.lr=5e-5 --workdir=runs/demo_1

Its flags are experiments/train.py's, named by their path in jetrl.train.TrainConfig (--steps,
--recipe, --seed, --optimizer.lr, --sampling.temperature, --eval.size, --task.length, ...), with
the defaults of experiments/configs/addition_jet.py; they set the RL half. The warm start has
its own --sft.steps, --sft.batch_size and --sft.optimizer.*, and shares the model, the task,
the seed, the mesh, the generation budget (--sampling.max_new_tokens) and the evaluation
(--eval.*, at its end only) with the RL half: with the defaults it is
experiments/configs/addition_sft.py. Both halves are the library calls of experiments/sft.py
and experiments/train.py, written to <workdir>/sft and <workdir>/rl (the RL run starts from
the warm start). An earlier demo's <workdir>/sft and <workdir>/rl are moved to
<workdir>/previous/<time>/ first (never deleted, and said so), unless --keep resumes them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

from jetrl.config import FlagError, check_fields, field, node
from jetrl.config.flags import load_config_file
from jetrl.rl import OptimizerConfig
from jetrl.sampling import GenerationConfig
from jetrl.train import (
  SFTConfig,
  TrainConfig,
  run,
  run_sft,
)
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.config import SFT_OPTIMIZER
from jetrl.train.skips import SkippedUpdatesError
from jetrl.train.workdir import move_aside

# Set by the demo: the RL half starts from the warm start.
EXCLUDE = ("init_from",)
# The demo's own flags from before it took the configuration's (the others it had are the
# fields' former names, `field(..., former=...)`).
RENAMED = {"sft_steps": "sft.steps", "rl_steps": "steps"}


@dataclasses.dataclass(frozen=True)
class DemoWarmStart:
  """What the warm start does not share with the RL run."""

  steps: int = field(150, "Supervised warm-start steps.", lo=1)
  batch_size: int = field(32, "Problems per SFT step.", lo=1)
  answer_noise: float = field(
    0.0,
    "Fraction of the gold solutions whose final answer is misreported (SFTConfig.answer_noise): "
    "a warm start that works a problem out but reports it unreliably, which RL learns to fix.",
    lo=0.0,
    hi=1.0,
  )
  optimizer: OptimizerConfig = node(SFT_OPTIMIZER, "The warm start's optimizer.")

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class DemoConfig(TrainConfig):
  """The RL run's configuration (its workdir: the demo's, holding both halves), whether to keep
  an existing workdir, and the warm start's own fields."""

  workdir: Optional[str] = field(
    "runs/demo",
    "Output directory of both halves: <workdir>/sft (the warm start), <workdir>/rl (the RL run).",
  )
  keep: bool = field(
    False,
    "Resume the runs an existing --workdir holds instead of moving them to "
    "<workdir>/previous/<time>/.",
  )
  sft: DemoWarmStart = node(
    DemoWarmStart,
    "The supervised warm start (it shares --model.*, --task.*, --seed, --mesh, "
    "--sampling.max_new_tokens and --eval.* with the RL run).",
  )


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def get_config() -> DemoConfig:
  """`make demo`: experiments/configs/addition_sft.py, then addition_jet.py from it."""
  rl = load_config_file(os.path.join(CONFIGS, "addition_jet.py"), TrainConfig())
  sft = load_config_file(os.path.join(CONFIGS, "addition_sft.py"), SFTConfig())
  shared = {f.name: getattr(rl, f.name) for f in dataclasses.fields(TrainConfig)}
  shared.pop("workdir")  # the demo's own: both halves under it
  warm = DemoWarmStart(
    steps=sft.steps,
    batch_size=sft.batch_size,
    answer_noise=sft.answer_noise,
    optimizer=sft.optimizer,
  )
  return DemoConfig(**shared, sft=warm)


def sft_config(cfg: DemoConfig) -> SFTConfig:
  """The warm start: its own fields, and those it shares with the RL run."""
  return SFTConfig(
    workdir=os.path.join(cfg.workdir, "sft"),
    steps=cfg.sft.steps,
    batch_size=cfg.sft.batch_size,
    answer_noise=cfg.sft.answer_noise,
    optimizer=cfg.sft.optimizer,
    sampling=GenerationConfig(max_new_tokens=cfg.sampling.max_new_tokens),
    seed=cfg.seed,
    mesh=cfg.mesh,
    model=cfg.model,
    task=cfg.task,
    eval=dataclasses.replace(cfg.eval, every=None, also_bf16=False),
  )


def rl_config(cfg: DemoConfig) -> TrainConfig:
  """The RL run: the TrainConfig fields of `cfg`, in <workdir>/rl, from the warm start."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
  fields.update(workdir=os.path.join(cfg.workdir, "rl"), init_from=os.path.join(cfg.workdir, "sft"))
  return TrainConfig(**fields)


HALVES = ("sft", "rl")


def set_aside(cfg: DemoConfig, log=print) -> Optional[str]:
  """Unless --keep: an earlier demo's halves under --workdir moved to a new
  <workdir>/previous/<time>/ (its path, logged), nothing else touched; None when there are
  none."""
  if cfg.keep or not any(os.path.lexists(os.path.join(cfg.workdir, h)) for h in HALVES):
    return None
  dest = move_aside(cfg.workdir, HALVES)
  log(
    f"an earlier demo run in {cfg.workdir} was moved to {dest} (not deleted; --keep resumes "
    "it instead)"
  )
  return dest


def demo(cfg: DemoConfig) -> None:
  if not cfg.workdir:
    raise FlagError("workdir", "is required (the warm start and the RL run go under it)")
  sft, rl = sft_config(cfg), rl_config(cfg)  # both checked before anything is moved
  set_aside(cfg)
  t0 = time.time()
  print(f"== 1/2 supervised warm start: {sft.steps} steps on {sft.task.name} gold solutions")
  warm = dict(run_sft(sft), recipe=sft.recipe)
  print(f"== 2/2 GRPO under recipe {rl.recipe!r}: {rl.steps} steps")
  summary = run(rl)
  print()
  print(report(rl, warm, summary))
  print(f"total {time.time() - t0:.0f}s")


def report(rl: TrainConfig, warm: dict, summary: dict) -> str:
  """The demo's closing lines: accuracy before and after RL, the metrics, every plot (the
  warm start's first)."""
  before, after = summary["eval_before"], summary["eval_after"]
  plots = warm.get("plots", []) + summary.get("plots", [])
  why = []
  if "eval_accuracy" in warm and warm.get("recipe") not in (None, rl.recipe):
    why = [
      f"(the warm start's own {warm['eval_accuracy']:.3f} is the same weights sampled under "
      f"{warm['recipe']}'s rollout precision; before RL is under {rl.recipe}'s)"
    ]
  return "\n".join(
    [
      f"held-out greedy accuracy ({rl.eval.size} problems): before RL {before:.3f}, "
      f"after RL {after:.3f} ({100 * (after - before):+.1f} points)",
      *why,
      f"metrics: {os.path.join(rl.workdir, 'metrics.jsonl')}",
      "plots:   " + "\n         ".join(plots),
    ]
  )


if __name__ == "__main__":
  main(
    get_config(),
    demo,
    doc=__doc__,
    exclude=EXCLUDE,
    renamed=RENAMED,
    errors=(SkippedUpdatesError, CheckpointError),
  )
