"""The precision study's configuration, and the RL and SFT configs of each combination.

`StudyConfig` holds the grid (recipe specs x rollout lengths x seeds) and the same sub-configs
an RL run has (`--model.*`, `--task.*`, `--sampling.*`, `--optimizer.*`, `--update.*`,
`--eval.*`), plus the warm start's (`--sft.*`). Each combination's `TrainConfig` is made of
those nodes, with what the grid sets: the recipe, `update.is_method` from a spec such as
`fp8_rollout+tis`, `task.length`, the generation budget that length needs, the seed, the
workdir, the warm start to begin from and `eval.also_bf16` (every run's evaluations are scored
in its own rollout precision and in bf16). Those fields are therefore not flags of the study.

The warm start: with `sft.mix`, one warm start trained on every length of the grid in turn
serves every length (so that the lengths differ in the RL rollouts alone, and each starts from
a model that has seen it); with `sft.length` set, one warm start at that length serves every
length; with neither, each length trains its own.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jetrl.config import SEED_MAX, ConfigError, FlagError, check_fields, field, node
from jetrl.precision import RECIPES
from jetrl.rl.correction import IS_METHODS
from jetrl.rl.optimizer import OptimizerConfig
from jetrl.rl.update import UpdateConfig
from jetrl.sampling import SamplingConfig
from jetrl.train.config import (
  SFT_OPTIMIZER,
  CheckpointConfig,
  EvalConfig,
  LoggingConfig,
  ModelSpec,
  SFTConfig,
  TaskConfig,
  TrainConfig,
  Tree,
)

# BF16 training and rollout; the BF16-train / FP8-rollout baseline as the paper's trainer runs
# it (old log-probs recomputed, no correction); the same with truncated IS; the unified flow;
# the unified flow with bitwise-equal rollout and training log-probs.
DEFAULT_RECIPES = ("bf16", "fp8_rollout", "fp8_rollout+tis", "jet", "jet_exact")
# Set by the grid for each combination, so not flags of the study.
GRID_FIELDS = (
  "task.length",
  "task.data_path",
  "sampling.max_new_tokens",
  "update.is_method",
  "eval.also_bf16",
  "command",
)


def parse_recipe(spec: str) -> tuple[str, str]:
  """'fp8_rollout+tis' -> ('fp8_rollout', 'tis'); 'jet' -> ('jet', 'none')."""
  name, _, corr = str(spec).partition("+")
  corr = corr or "none"
  if name not in RECIPES:
    raise ConfigError(
      "recipes", f"{spec!r}: unknown recipe {name!r}; choose one of {list(RECIPES)}"
    )
  if corr not in IS_METHODS:
    raise ConfigError(
      "recipes", f"{spec!r}: unknown correction {corr!r}; choose one of {list(IS_METHODS)}"
    )
  return name, corr


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """The supervised warm start shared by the runs of a length (or of every length)."""

  steps: int = field(200, "SFT steps per warm start.", lo=1)
  length: Optional[int] = field(
    None,
    "Task length of one warm start shared by every length of the study (none: one warm start "
    "per length, at that length).",
    lo=0,
  )
  mix: bool = field(
    False,
    "One warm start trained on every length of the study in turn (SFTConfig.mix_lengths), "
    "shared by every length, so that the lengths differ in the RL runs alone and each starts "
    "from a model that has seen it.",
  )
  batch_size: int = field(32, "Problems per SFT step.", lo=1)
  seed: int = field(0, "Seed of the warm start.", lo=0, hi=SEED_MAX)
  answer_noise: float = field(
    0.5,
    "Fraction of the warm start's gold solutions whose final answer is misreported "
    "(SFTConfig.answer_noise).",
    lo=0.0,
    hi=1.0,
  )
  recipe: str = field("bf16", "Precision recipe of the warm start.", choices=RECIPES)
  optimizer: OptimizerConfig = node(SFT_OPTIMIZER, "The warm start's optimizer.")

  def __post_init__(self):
    check_fields(self)
    if self.mix and self.length is not None:
      raise ConfigError(
        "mix", "trains on every length of the study; leave --sft.length none with it"
      )


@dataclasses.dataclass(frozen=True)
class StudyConfig(Tree):
  """The same RL experiment under several recipes, rollout lengths and seeds."""

  report_dir: Optional[str] = field(
    None, "Output directory of the study: runs, warm starts, report (required)."
  )
  recipes: tuple[str, ...] = field(
    DEFAULT_RECIPES,
    "Recipe specs: a recipe name, optionally "
    "'+' and an importance-sampling correction (fp8_rollout+tis).",
  )
  lengths: tuple[int, ...] = field(
    (3,), "Values of the task's length knob (the rollout length grows with it).", lo=0
  )
  seeds: tuple[int, ...] = field(
    (0, 1, 2, 3, 4),
    "RL seeds (one warm start per length serves them all).",
    lo=0,
    hi=SEED_MAX,
  )
  steps: int = field(30, "RL steps per combination.", lo=1)
  prompts_per_step: int = field(16, "Prompts per RL step.", lo=1)
  token_margin: int = field(
    8, "Generation budget = the task's longest gold completion + eos + this margin.", lo=0
  )
  target_accuracy: float = field(
    0.5, "Accuracy whose first crossing is reported (steps to target).", lo=0.0, hi=1.0
  )
  collapse_ratio: float = field(
    0.1,
    "A run whose final accuracy is below this fraction "
    "of its best (best >= 0.1) counts as collapsed.",
    lo=0.0,
    hi=1.0,
  )
  time_budget_s: Optional[float] = field(
    None, "Stop starting new combinations after this many seconds (none: no limit).", lo=0.0
  )
  quiet_runs: bool = field(False, "Hide the per-step lines of the individual runs.")
  command: str = field("", "The command line that produced the study (in report.md).", flag=False)
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(TaskConfig(difficulty=1), "A synthetic task (its length: --lengths).")
  sampling: SamplingConfig = node(
    SamplingConfig(n=8, temperature=0.5), "Rollouts (the budget follows from each length)."
  )
  optimizer: OptimizerConfig = node(OptimizerConfig(lr=5e-5), "The RL optimizer.")
  update: UpdateConfig = node(
    UpdateConfig, "The policy-gradient update (the correction: from each recipe spec)."
  )
  eval: EvalConfig = node(
    EvalConfig(every=None, size=256, temperature=0.5, samples=4, batch=256),
    "Evaluation on held-out problems (sampled at the RL temperature by default).",
  )
  sft: WarmStartConfig = node(WarmStartConfig, "The warm start of each length.")

  def __post_init__(self):
    check_fields(self)
    for name in ("recipes", "lengths", "seeds"):
      if not getattr(self, name):
        raise ConfigError(name, "must not be empty")
    for spec in self.recipes:
      _, corr = parse_recipe(spec)
      if corr != "none" and self.update.old_logp == "rollout":
        raise ConfigError(
          "update.old_logp",
          f"'rollout' cannot be combined with the correction of {spec!r}: the PPO ratio "
          "pi_theta/pi_rollout already carries the mismatch and the IS weight would apply it "
          "a second time; use 'recompute' (the default)",
        )
    if not self.task.synthetic:
      raise ConfigError(
        "task.name",
        f"{self.task.name!r} is not a synthetic task; the study "
        "varies the length knob of addition, multiplication or sorting",
      )
    self.task.check_lengths("lengths", self.lengths)
    if self.sft.length is not None:
      self.task.check_lengths("sft.length", [self.sft.length])


def max_new_tokens_for(cfg: StudyConfig, length: int) -> int:
  """Generation budget at a length setting: longest gold completion + eos + margin (tokens of
  the character tokenizer are characters)."""
  from jetrl.data import get_task  # pylint: disable=import-outside-toplevel

  task = get_task(cfg.task.name, difficulty=cfg.task.difficulty, length=int(length), seed=0)
  return int(task.max_completion_chars) + 1 + cfg.token_margin


def sft_length(cfg: StudyConfig, length: int) -> int:
  """The task length of the warm start that the runs of `length` start from (with
  `sft.mix`, the length its evaluation runs at: the study's first)."""
  if cfg.sft.mix:
    return int(cfg.lengths[0])
  return int(length) if cfg.sft.length is None else int(cfg.sft.length)


def sft_name(cfg: StudyConfig, length: int) -> str:
  """The warm start's name: L<length>, or mix<lengths> for one trained on every length."""
  if cfg.sft.mix:
    return "mix" + "_".join(str(int(L)) for L in cfg.lengths)
  return f"L{sft_length(cfg, length)}"


def sft_lengths_text(cfg: StudyConfig, length: int) -> str:
  """What the warm start of `length`'s runs trained on, for the report."""
  if cfg.sft.mix:
    return "lengths " + ", ".join(str(int(L)) for L in cfg.lengths) + " in turn"
  return f"length {sft_length(cfg, length)}"


def sft_dir(cfg: StudyConfig, length: int) -> str:
  return os.path.join(cfg.report_dir, "sft", sft_name(cfg, length))


def run_dir(cfg: StudyConfig, length: int, spec: str, seed: int) -> str:
  return os.path.join(cfg.report_dir, "runs", f"L{length}", spec, f"seed{seed}")


def is_done(cfg: StudyConfig, length: int, spec: str, seed: int) -> bool:
  """A combination is done when its run wrote summary.json."""
  return os.path.exists(os.path.join(run_dir(cfg, length, spec, seed), "summary.json"))


def train_config(cfg: StudyConfig, length: int, spec: str, seed: int) -> TrainConfig:
  """The RL run of one combination."""
  name, corr = parse_recipe(spec)
  return TrainConfig(
    workdir=run_dir(cfg, length, spec, seed),
    recipe=name,
    steps=cfg.steps,
    prompts_per_step=cfg.prompts_per_step,
    seed=int(seed),
    init_from=sft_dir(cfg, length),
    model=cfg.model,
    task=dataclasses.replace(cfg.task, length=int(length)),
    sampling=dataclasses.replace(cfg.sampling, max_new_tokens=max_new_tokens_for(cfg, length)),
    optimizer=cfg.optimizer,
    update=dataclasses.replace(cfg.update, is_method=corr),
    eval=dataclasses.replace(cfg.eval, also_bf16=True),
    checkpoint=CheckpointConfig(every=max(cfg.steps // 2, 1), keep=1),
    logging=LoggingConfig(tensorboard=False, plots=False),
  )


def sft_config(cfg: StudyConfig, length: int) -> SFTConfig:
  """The warm start that the runs of `length` start from."""
  w = cfg.sft
  at = sft_length(cfg, length)
  return SFTConfig(
    workdir=sft_dir(cfg, length),
    recipe=w.recipe,
    steps=w.steps,
    batch_size=w.batch_size,
    max_new_tokens=max(max_new_tokens_for(cfg, L) for L in (cfg.lengths if w.mix else [at])),
    seed=w.seed,
    answer_noise=w.answer_noise,
    mix_lengths=tuple(int(L) for L in cfg.lengths) if w.mix else (),
    model=cfg.model,
    task=dataclasses.replace(cfg.task, length=at),
    optimizer=w.optimizer,
    eval=dataclasses.replace(cfg.eval, every=None, also_bf16=False),
    logging=LoggingConfig(every=10, tensorboard=False, plots=False),
  )


def combinations(cfg: StudyConfig) -> list[tuple[int, str, int]]:
  """Run order: seed, then recipe, then length, so that a study cut short by its time budget
  has every length of its first recipes (the length comparison is the study's point)."""
  return [(int(L), spec, int(s)) for s in cfg.seeds for spec in cfg.recipes for L in cfg.lengths]


# Fields of a combination's TrainConfig / SFTConfig that the study sets from one of its own
# flags of another name; every other field has the same path in both.
_TRAIN_FLAGS = {
  "recipe": "recipes",
  "update.is_method": "recipes",
  "seed": "seeds",
  "task.length": "lengths",
  "sampling.max_new_tokens": "token_margin",
}
_SFT_FLAGS = {
  "recipe": "sft.recipe",
  "steps": "sft.steps",
  "batch_size": "sft.batch_size",
  "seed": "sft.seed",
  "answer_noise": "sft.answer_noise",
  "mix_lengths": "lengths",
  "task.length": "sft.length",
  "max_new_tokens": "token_margin",
}


def _flag_error(e: ConfigError, flags: dict, where: str) -> FlagError:
  path = flags.get(e.path, e.path)
  if flags is _SFT_FLAGS and path is not None and path.startswith("optimizer."):
    path = "sft." + path  # the warm start's optimizer is --sft.optimizer.*
  return FlagError(path, f"{e.detail} ({where})")


def check_combinations(cfg: StudyConfig) -> None:
  """Builds the config of every warm start and of every (length, recipe, seed) run, so that a
  value the study accepts but a run refuses (`--sampling.temperature=1e-30`, a batch that does
  not split into minibatches) is a FlagError naming the study's flag before any warm start
  trains, not after it."""
  for length in sorted({int(L) for L in cfg.lengths}):
    try:
      sft_config(cfg, length)
    except ConfigError as e:
      raise _flag_error(e, _SFT_FLAGS, f"the warm start of length {length}") from None
  for length, spec, seed in combinations(cfg):
    try:
      train_config(cfg, length, spec, seed)
    except ConfigError as e:
      raise _flag_error(e, _TRAIN_FLAGS, f"the run L{length}/{spec}/seed{seed}") from None
