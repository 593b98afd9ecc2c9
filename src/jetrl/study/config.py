"""The precision study's configuration: the template of its runs and of its warm starts, and its
grid.

`StudyConfig` is a `TrainConfig`: its RL fields (`--steps`, `--prompts_per_step`, `--model.*`,
`--task.*`, `--sampling.*`, `--optimizer.*`, `--update.*`, `--eval.*`, ...) are the template of
every run, and its `sft` node (`WarmStartConfig`, an `SFTConfig`) is the template of every warm
start. The study adds its grid: the arms (each of `recipes`, and those of them that also run
with the importance-sampling correction `correction`: `corrected`), the rollout lengths and the
seeds. A combination's config is its template with what the study sets applied
(`run_settings`, `sft_settings`): the recipe and `update.is_method` of its arm, `task.length`,
the generation budget that length needs, the seed, the workdir, the warm start to begin from,
`eval.also_bf16` (every run's evaluations are scored in its own rollout precision and in bf16)
and the checkpoint interval. Those fields are therefore not flags of the study
(`set_by_study`), and a value a combination refuses is reported under the study's field that
set it, or else under its own path in the template (`--sft.` for a warm start's).

The warm start: with `sft.mix`, one warm start trained on every length of the grid in turn
serves every length (so that the lengths differ in the RL rollouts alone, and each starts from
a model that has seen it; `sft.lengths` names them when the warm start should see lengths that
get no runs); with `sft.length` set, one warm start at that length serves every
length; with neither, each length trains its own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Optional

from jetrl.config import SEED_MAX, ConfigError, FlagError, check_fields, field, node, replace
from jetrl.data import get_task
from jetrl.precision import RECIPES
from jetrl.rl.correction import IS_METHODS
from jetrl.rl.optimizer import OptimizerConfig
from jetrl.rl.update import UpdateConfig
from jetrl.sampling import SamplingConfig
from jetrl.train.config import (
  CheckpointConfig,
  EvalConfig,
  LoggingConfig,
  SFTConfig,
  TaskConfig,
  TrainConfig,
)

CORRECTIONS = tuple(m for m in IS_METHODS if m != "none")

# What the study sets in a template: (the study's field that sets it, {template path: value}).
Settings = Sequence[tuple[str, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm of the study: a precision recipe and the importance-sampling correction of its
  runs (`update.is_method`)."""

  recipe: str
  is_method: str = "none"
  old_logp: Optional[str] = None  # the PPO ratio's old log-probs; None: the template's

  @property
  def label(self) -> str:
    """The arm's name in run directories, results and the report: its recipe, followed by `+`
    and its correction when it has one (fp8_rollout+tis), and by `@` and the source of its old
    log-probs when the arm sets one (bf16@recompute)."""
    out = self.recipe if self.is_method == "none" else f"{self.recipe}+{self.is_method}"
    return out if self.old_logp is None else f"{out}@{self.old_logp}"

  def __str__(self) -> str:
    return self.label


@dataclasses.dataclass(frozen=True)
class WarmStartConfig(SFTConfig):
  """The template of the supervised warm start shared by the runs of a length (or of every
  length), and how it relates to the study's lengths."""

  steps: int = field(200, "SFT steps per warm start.", lo=1)
  answer_noise: float = field(
    0.5, "Fraction of the gold solutions whose final answer is misreported.", lo=0.0, hi=1.0
  )
  logging: LoggingConfig = node(
    LoggingConfig(every=10, tensorboard=False, plots=False), "Metrics of the warm start."
  )
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
  lengths: tuple[int, ...] = field(
    (),
    "With --sft.mix: the lengths the warm start trains on in turn (empty: the study's "
    "--lengths); it must include every length of --lengths, and may add lengths that get no "
    "RL runs (--lengths=9 --sft.lengths=3,9: the runs of length 9 from the warm start of 3 and 9).",
    lo=0,
  )

  def __post_init__(self):
    super().__post_init__()
    if self.mix and self.length is not None:
      raise ConfigError(
        "mix", "trains on every length of the study; leave --sft.length none with it"
      )
    if self.lengths and not self.mix:
      raise ConfigError("lengths", "names the lengths of a mixed warm start; set --sft.mix with it")


@dataclasses.dataclass(frozen=True)
class StudyConfig(TrainConfig):
  """The same RL experiment under several recipes, rollout lengths and seeds: the template of
  its runs (the fields of `TrainConfig`), of its warm starts (`sft`), and its grid."""

  # The RL template's defaults: the design of docs/precision_study.md.
  steps: int = field(30, "RL steps per combination.", lo=1)
  task: TaskConfig = node(TaskConfig(difficulty=1), "A synthetic task (its length: --lengths).")
  sampling: SamplingConfig = node(
    SamplingConfig(n=8, temperature=0.5), "Rollouts (the budget follows from each length)."
  )
  optimizer: OptimizerConfig = node(OptimizerConfig(lr=5e-5), "The RL optimizer.")
  # The studies ran with the old log-probs recomputed (the update's default until 2026-12-06):
  # their commands keep it.
  update: UpdateConfig = node(
    UpdateConfig(old_logp="recompute"),
    "The policy-gradient update (its correction: from each arm).",
  )
  eval: EvalConfig = node(
    EvalConfig(every=None, size=256, temperature=0.5, samples=4, batch=256),
    "Evaluation on held-out problems (sampled at the RL temperature by default).",
  )
  checkpoint: CheckpointConfig = node(
    CheckpointConfig(keep=1), "Checkpoints of each run (one every half of its steps)."
  )
  logging: LoggingConfig = node(
    LoggingConfig(tensorboard=False, plots=False), "Metrics of each run."
  )
  # The study's own fields.
  report_dir: Optional[str] = field(
    None, "Output directory of the study: runs, warm starts, report (required)."
  )
  # BF16 training and rollout; the BF16-train / FP8-rollout baseline as the paper's trainer runs
  # it (old log-probs recomputed, no correction), and the same with truncated IS; the unified
  # flow; the unified flow with bitwise-equal rollout and training log-probs.
  recipes: tuple[str, ...] = field(
    ("bf16", "fp8_rollout", "jet", "jet_exact"), "Precision recipes: one arm each."
  )
  corrected: tuple[str, ...] = field(
    ("fp8_rollout",),
    "Those of --recipes that also run with --correction, as one more arm right after the "
    "recipe's own (labelled fp8_rollout+tis); a recipe --recipes does not list adds nothing.",
    choices=RECIPES,
  )
  correction: str = field(
    "tis",
    "The importance-sampling correction (update.is_method) of the --corrected arms.",
    choices=CORRECTIONS,
  )
  recomputed: tuple[str, ...] = field(
    (),
    "Those of --recipes that also run with the PPO ratio's old log-probs recomputed by a "
    "pre-update forward (update.old_logp=recompute), as one more arm after the recipe's own "
    "(labelled bf16@recompute); for a template whose --update.old_logp is another source.",
    choices=RECIPES,
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
  sft: WarmStartConfig = node(WarmStartConfig, "The warm start of each length.")

  def __post_init__(self):
    # The fields' own checks; a run's checks across fields (TrainConfig's) hold for each
    # combination, once the grid has set its fields (`check_combinations`).
    check_fields(self)
    for name in ("recipes", "lengths", "seeds"):
      if not getattr(self, name):
        raise ConfigError(name, "must not be empty")
    for name in self.recipes:
      if name not in RECIPES:
        raise ConfigError(
          "recipes",
          f"{name!r}: unknown recipe; choose one of {list(RECIPES)} (an importance-sampling "
          "correction is an arm of its own: --corrected, --correction)",
        )
    for arm in self.arms:
      if arm.is_method != "none" and self.update.old_logp == "rollout":
        raise ConfigError(
          "update.old_logp",
          f"'rollout' cannot be combined with the correction of {arm.label!r}: the PPO ratio "
          "pi_theta/pi_rollout already carries the mismatch and the IS weight would apply it "
          "a second time; use 'recompute' (the default)",
        )
    if self.recomputed and self.update.old_logp == "recompute":
      raise ConfigError(
        "recomputed",
        "adds arms whose old log-probs are recomputed, but --update.old_logp is 'recompute' "
        "already; set --update.old_logp=same_forward (or auto) for the recipes' own arms",
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
    if self.sft.lengths:
      self.task.check_lengths("sft.lengths", self.sft.lengths)
      missing = [int(L) for L in self.lengths if int(L) not in self.sft.lengths]
      if missing:
        raise ConfigError(
          "sft.lengths",
          f"must include every length of --lengths (the runs start from it); "
          f"{', '.join(map(str, missing))} missing from {','.join(map(str, self.sft.lengths))}",
        )

  @property
  def arms(self) -> tuple[Arm, ...]:
    """Each recipe's arm, followed by its corrected one when `corrected` lists it."""
    out = []
    for name in self.recipes:
      out.append(Arm(name))
      if name in self.corrected:
        out.append(Arm(name, self.correction))
      if name in self.recomputed:
        out.append(Arm(name, old_logp="recompute"))
    return tuple(out)


def max_new_tokens_for(cfg: StudyConfig, length: int) -> int:
  """Generation budget at a length setting: longest gold completion + eos + margin (tokens of
  the character tokenizer are characters)."""
  task = get_task(cfg.task.name, difficulty=cfg.task.difficulty, length=int(length), seed=0)
  return int(task.max_completion_chars) + 1 + cfg.token_margin


def mix_lengths(cfg: StudyConfig) -> tuple[int, ...]:
  """The lengths a mixed warm start trains on, in turn: `sft.lengths`, else the study's."""
  return tuple(int(L) for L in (cfg.sft.lengths or cfg.lengths))


def sft_length(cfg: StudyConfig, length: int) -> int:
  """The task length of the warm start that the runs of `length` start from (with
  `sft.mix`, the length its evaluation runs at: the first it mixes)."""
  if cfg.sft.mix:
    return mix_lengths(cfg)[0]
  return int(length) if cfg.sft.length is None else int(cfg.sft.length)


def sft_name(cfg: StudyConfig, length: int) -> str:
  """The warm start's name: L<length>, or mix<lengths> for one trained on every length."""
  if cfg.sft.mix:
    return "mix" + "_".join(map(str, mix_lengths(cfg)))
  return f"L{sft_length(cfg, length)}"


def sft_lengths_text(cfg: StudyConfig, length: int) -> str:
  """What the warm start of `length`'s runs trained on, for the report."""
  if cfg.sft.mix:
    return "lengths " + ", ".join(map(str, mix_lengths(cfg))) + " in turn"
  return f"length {sft_length(cfg, length)}"


def sft_dir(cfg: StudyConfig, length: int) -> str:
  return os.path.join(cfg.report_dir, "sft", sft_name(cfg, length))


def run_dir(cfg: StudyConfig, length: int, arm: Arm, seed: int) -> str:
  return os.path.join(cfg.report_dir, "runs", f"L{length}", arm.label, f"seed{seed}")


def is_done(cfg: StudyConfig, length: int, arm: Arm, seed: int) -> bool:
  """A combination is done when its run wrote summary.json."""
  return os.path.exists(os.path.join(run_dir(cfg, length, arm, seed), "summary.json"))


def tag(length: int, arm: Arm, seed: int) -> str:
  """A combination's name in the logs, timing.json and the report: L<length>/<arm>/seed<seed>."""
  return f"L{length}/{arm.label}/seed{seed}"


def combinations(cfg: StudyConfig) -> list[tuple[int, Arm, int]]:
  """Run order: seed, then arm, then length, so that a study cut short by its time budget has
  every length of its first arms (the length comparison is the study's point)."""
  return [(int(L), arm, int(s)) for s in cfg.seeds for arm in cfg.arms for L in cfg.lengths]


def run_settings(cfg: StudyConfig, length: int, arm: Arm, seed: int) -> Settings:
  """What the study sets in its RL template for the run (length, arm, seed)."""
  old_logp = () if arm.old_logp is None else (("recomputed", {"update.old_logp": arm.old_logp}),)
  return (
    ("recipes", {"recipe": arm.recipe}),
    ("correction", {"update.is_method": arm.is_method}),
    *old_logp,
    ("seeds", {"seed": int(seed)}),
    ("lengths", {"task.length": int(length)}),
    ("token_margin", {"sampling.max_new_tokens": max_new_tokens_for(cfg, length)}),
    ("report_dir", {"workdir": run_dir(cfg, length, arm, seed), "init_from": sft_dir(cfg, length)}),
    ("steps", {"checkpoint.every": max(cfg.steps // 2, 1)}),
    ("eval", {"eval.also_bf16": True}),
  )


def sft_settings(cfg: StudyConfig, length: int) -> Settings:
  """What the study sets in its warm-start template for the warm start of `length`'s runs."""
  budget_at = mix_lengths(cfg) if cfg.sft.mix else [sft_length(cfg, length)]
  return (
    ("report_dir", {"workdir": sft_dir(cfg, length)}),
    ("model", {"model": cfg.model}),
    ("task", {"task": cfg.task}),
    (
      "sft.length" if cfg.sft.length is not None else "lengths",
      {"task.length": sft_length(cfg, length)},
    ),
    (
      "token_margin",
      {"sampling.max_new_tokens": max(max_new_tokens_for(cfg, L) for L in budget_at)},
    ),
    (
      "sft.lengths" if cfg.sft.lengths else "lengths",
      {"mix_lengths": mix_lengths(cfg) if cfg.sft.mix else ()},
    ),
    ("eval", {"eval": dataclasses.replace(cfg.eval, every=None, also_bf16=False)}),
  )


def _build(cls: type, template: Any, settings: Settings) -> Any:
  """A `cls` of `template`'s fields of that class with `settings` applied, checked once (as a
  `cls`, its checks across fields included)."""
  values = {f.name: getattr(template, f.name) for f in dataclasses.fields(cls)}
  nested: dict[str, dict] = {}
  for _, sets in settings:
    for path, value in sets.items():
      head, _, rest = path.partition(".")
      if rest:
        nested.setdefault(head, {})[rest] = value
      else:
        values[head] = value
  for head, changes in nested.items():
    values[head] = replace(values[head], changes, prefix=head + ".")
  return cls(**values)


def train_config(cfg: StudyConfig, length: int, arm: Arm, seed: int) -> TrainConfig:
  """The RL run of one combination."""
  return _build(TrainConfig, cfg, run_settings(cfg, length, arm, seed))


def sft_config(cfg: StudyConfig, length: int) -> SFTConfig:
  """The warm start that the runs of `length` start from."""
  return _build(SFTConfig, cfg.sft, sft_settings(cfg, length))


def set_by_study(cfg: StudyConfig) -> tuple[str, ...]:
  """The templates' fields that the study sets for every combination, so not flags of the
  study: the runs' at their paths, the warm starts' under `sft.` (what a setting sets does not
  depend on the values, so those of `cfg`'s first combination tell)."""
  probe = dataclasses.replace(cfg, report_dir=cfg.report_dir or "")
  length, arm, seed = combinations(probe)[0]
  run = [p for _, sets in run_settings(probe, length, arm, seed) for p in sets]
  return tuple(run + ["sft." + p for _, sets in sft_settings(probe, length) for p in sets])


def flag_error(e: ConfigError, settings: Settings, prefix: str, where: str) -> FlagError:
  """`e`, raised by a combination's config, as a FlagError naming the study's flag: the field
  that set the failing one (or the node holding it), else the failing field's own path in the
  template (under `prefix`)."""
  path = e.path
  if path is not None:
    hits = [
      (key, source)
      for source, sets in settings
      for key in sets
      if path == key or path.startswith(key + ".")
    ]
    key, source = max(hits, key=lambda h: len(h[0])) if hits else ("", prefix)
    path = source + path[len(key) :]
  return FlagError(path, f"{e.detail} ({where})")


def _check(cls: type, template: Any, settings: Settings, prefix: str, where: str) -> None:
  try:
    _build(cls, template, settings)
  except ConfigError as e:
    raise flag_error(e, settings, prefix, where) from None


def check_combinations(cfg: StudyConfig) -> None:
  """Builds the config of every warm start and of every (length, arm, seed) run, so that a
  value the study accepts but a run refuses (`--sampling.temperature=1e-30`, a batch that does
  not split into minibatches) is a FlagError naming the study's flag before any warm start
  trains, not after it."""
  for length in sorted({int(L) for L in cfg.lengths}):
    settings = sft_settings(cfg, length)
    _check(SFTConfig, cfg.sft, settings, "sft.", f"the warm start of length {length}")
  for length, arm, seed in combinations(cfg):
    settings = run_settings(cfg, length, arm, seed)
    _check(TrainConfig, cfg, settings, "", f"the run {tag(length, arm, seed)}")
