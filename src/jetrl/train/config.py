"""The RL run's configuration: one frozen dataclass of plain data, validated up front.

Every field is a command-line flag of `experiments/train.py` (same name), and every field is
read by the loop. `validate()` runs before anything is compiled and names the flag at fault:
every float is checked finite and in range, every int in range, and the synthetic task's knobs,
the workdir and `--init_from` are checked too (`jetrl.train.validation`, docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jetrl.precision import RECIPES
from jetrl.precision.formats import FORMATS
from jetrl.rl.correction import IS_METHODS
from jetrl.rl.update import LOSSES, MASTER_DTYPES, OLD_LOGP_SOURCES, SCHEDULES
from jetrl.train.validation import (SEED_MAX, FlagError, check_float, check_init_from,
                                    check_int, check_task_knobs, check_workdir)


def _f(default, help_text: str, **kw):
  return dataclasses.field(default=default, metadata={"help": help_text, **kw})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  # Precision and model.
  recipe: str = _f("jet", f"Precision recipe: one of {list(RECIPES)}.")
  grad_fmt: str = _f("e4m3", "FP8 gradient format for jet / fp8_tensor: e4m3 or e5m2.")
  model: str = _f("tiny", "A model preset name (see jetrl.models.PRESETS) or an HF checkpoint directory.")
  n_layers: int = _f(0, "Override the preset's number of layers (0: keep the preset's).")
  init_from: str = _f("", "Warm-start params from this checkpoint directory (e.g. an SFT run's workdir).")
  # Task.
  task: str = _f("addition", "Task name (see jetrl.data.TASKS).")
  difficulty: int = _f(2, "Synthetic task difficulty knob (ignored by dataset tasks).")
  length: int = _f(1, "Synthetic task length knob (ignored by dataset tasks).")
  data_path: str = _f("", "Local JSON-lines file or directory for dataset tasks (gsm8k, math500).")
  # Rollout.
  steps: int = _f(50, "RL steps (rollout + update).")
  prompts_per_step: int = _f(16, "Prompts per RL step.")
  group_size: int = _f(8, "Samples per prompt (the GRPO group).")
  max_new_tokens: int = _f(64, "Generation budget per sample.")
  temperature: float = _f(1.0, "Sampling temperature for rollouts (> 0).")
  # Loss and correction.
  loss: str = _f("grpo", f"Policy loss: one of {list(LOSSES)}.")
  is_correction: str = _f("none", f"Rollout/training mismatch correction: one of {list(IS_METHODS)}.")
  is_cap: float = _f(2.0, "Cap C of the importance-sampling correction.")
  old_logp: str = _f("rollout", f"Source of the PPO ratio's old log-probs: {list(OLD_LOGP_SOURCES)}.")
  clip_low: float = _f(0.2, "PPO lower clip range.")
  clip_high: float = _f(-1.0, "PPO upper clip range (-1: the loss's default, 0.28 for dapo).")
  kl_coef: float = _f(0.0, "Coefficient of the KL penalty to the initial policy (0: off).")
  entropy_coef: float = _f(0.0, "Coefficient of the entropy bonus (0: off).")
  dynamic_sampling: bool = _f(False, "Mask out groups whose rewards are all equal (DAPO).")
  overlong_buffer: int = _f(0, "DAPO soft overlong penalty buffer in tokens (0: off).")
  mask_truncated: bool = _f(False, "Drop completions that hit the length limit from the loss.")
  # Optimisation.
  lr: float = _f(1e-4, "Peak learning rate.")
  schedule: str = _f("constant", f"Learning-rate schedule: {list(SCHEDULES)}.")
  warmup_steps: int = _f(0, "Warmup optimizer steps.")
  weight_decay: float = _f(0.0, "AdamW weight decay.")
  max_grad_norm: float = _f(1.0, "Global-norm gradient clipping.")
  ppo_epochs: int = _f(1, "Passes over each rollout batch.")
  minibatches: int = _f(1, "Optimizer steps per epoch.")
  micro_batches: int = _f(1, "Gradient-accumulation micro-batches per minibatch.")
  master_dtype: str = _f("float32", f"Master weights dtype: {list(MASTER_DTYPES)}.")
  # Devices.
  mesh: str = _f("", "Device mesh, e.g. 'data:2,fsdp:2,tensor:2' (axes data, fsdp, tensor; "
                 "empty: every device on data). See docs/scaling.md.")
  # Run.
  seed: int = _f(0, "Random seed (sampling, shuffling, synthetic problems).")
  workdir: str = _f("", "Output directory: metrics.jsonl, checkpoints, plots, TensorBoard.", required=True)
  eval_every: int = _f(10, "Greedy evaluation on held-out problems every N steps (0: only at start and end).")
  eval_size: int = _f(64, "Held-out problems per evaluation.")
  ckpt_every: int = _f(10, "Checkpoint every N steps (and at the end).")
  keep_ckpts: int = _f(2, "Checkpoints kept.")
  tensorboard: bool = _f(True, "Write TensorBoard event files under workdir/tb.")
  plots: bool = _f(True, "Write PNG plots at the end.")
  max_skipped_steps: int = _f(5, "Stop with an error when every update of this many steps in a "
                              "row was skipped for non-finite values.")
  overwrite: bool = _f(False, "Start afresh in a workdir that holds metrics but no checkpoint; "
                       "the old files are moved to workdir/previous/<time>/, never deleted.")
  allow_schedule_change: bool = _f(False, "Resume although a changed flag (e.g. --steps under "
                                   "a cosine schedule) changes the learning-rate schedule; the "
                                   "change is recorded in workdir/config_changes.jsonl.")

  def replace(self, **kw) -> "TrainConfig":
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def validate(self) -> "TrainConfig":
    """Raise FlagError (a ValueError) naming the flag for any invalid value or combination."""
    from jetrl.data import TASKS
    from jetrl.models import PRESETS

    def bad(flag, msg):
      raise FlagError(flag, msg)

    def one_of(flag, accepted):
      if getattr(self, flag) not in accepted:
        bad(flag, f"{getattr(self, flag)!r} is not accepted; choose one of {list(accepted)}")

    one_of("recipe", RECIPES)
    one_of("grad_fmt", FORMATS)
    one_of("task", TASKS)
    one_of("loss", LOSSES)
    one_of("is_correction", IS_METHODS)
    one_of("old_logp", OLD_LOGP_SOURCES)
    one_of("schedule", SCHEDULES)
    one_of("master_dtype", MASTER_DTYPES)
    if self.model not in PRESETS and not os.path.isdir(self.model):
      bad("model", f"{self.model!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    check_workdir(self.workdir)
    check_init_from(self.init_from)
    for flag in ("steps", "prompts_per_step", "max_new_tokens", "ppo_epochs", "minibatches",
                 "micro_batches", "eval_size", "ckpt_every", "keep_ckpts", "max_skipped_steps"):
      check_int(flag, getattr(self, flag), 1)
    for flag in ("n_layers", "eval_every", "warmup_steps", "overlong_buffer", "difficulty",
                 "length"):
      check_int(flag, getattr(self, flag), 0)
    check_int("seed", self.seed, 0, SEED_MAX)
    if self.group_size < 2:
      bad("group_size", f"must be >= 2 for group-relative advantages, got {self.group_size}")
    check_int("group_size", self.group_size, 2)
    check_task_knobs(self.task, self.difficulty, self.length)
    # Floats: finite and in range (NaN fails every comparison, so `x < 0` alone lets it in).
    if isinstance(self.temperature, (int, float)) and self.temperature == 0:
      bad("temperature", "must be > 0 for RL sampling, got 0")
    check_float("temperature", self.temperature, 0.01, 100.0)
    check_float("lr", self.lr, 0.0, 1.0, lo_open=True)
    check_float("weight_decay", self.weight_decay, 0.0, 10.0)
    check_float("max_grad_norm", self.max_grad_norm, 0.0, 1e6, lo_open=True)
    check_float("is_cap", self.is_cap, 1.0, 1e6)
    check_float("clip_low", self.clip_low, 0.0, 1.0)
    if self.clip_low == 1.0:
      bad("clip_low", "must be < 1 (a ratio clipped at 0 has no gradient), got 1.0")
    check_float("clip_high", self.clip_high, 0.0, 10.0, also=(-1.0,))
    check_float("kl_coef", self.kl_coef, 0.0, 100.0)
    check_float("entropy_coef", self.entropy_coef, 0.0, 100.0)
    rows = self.prompts_per_step * self.group_size
    if rows % (self.minibatches * self.micro_batches):
      bad("minibatches", f"prompts_per_step x group_size = {rows} rows do not split into "
          f"minibatches={self.minibatches} x micro_batches={self.micro_batches}")
    from jetrl.parallel.mesh import parse_mesh
    try:
      parse_mesh(self.mesh)  # axis names and sizes; the device count is checked at start-up
    except ValueError as e:
      bad("mesh", str(e))
    if self.overlong_buffer >= self.max_new_tokens:
      bad("overlong_buffer", f"must be < --max_new_tokens ({self.max_new_tokens})")
    return self


# Fields that may change when a run resumes; all others must match the checkpoint. A change
# of `steps` that changes the learning-rate schedule is refused separately (schedule_key).
RESUMABLE_FIELDS = ("steps", "workdir", "eval_every", "ckpt_every", "keep_ckpts", "tensorboard",
                    "plots", "mesh", "max_skipped_steps", "overwrite", "allow_schedule_change")


def incompatible_fields(saved: dict, current, resumable=RESUMABLE_FIELDS) -> list[str]:
  """Fields whose values differ between a checkpoint's config and the current one (a field the
  checkpoint does not record counts as its default, so older checkpoints stay usable)."""
  now = dataclasses.asdict(current)
  defaults = {f.name: f.default for f in dataclasses.fields(current)}
  return [f"--{k}: checkpoint has {saved.get(k, defaults[k])!r}, this run has {now[k]!r}"
          for k in now if k not in resumable and saved.get(k, defaults[k]) != now[k]]


def schedule_key(cfg: TrainConfig) -> tuple:
  """What the learning-rate schedule depends on (jetrl.rl.update.make_optimizer): two configs
  with the same key follow the same schedule, step for step."""
  total = cfg.steps * cfg.ppo_epochs * cfg.minibatches
  warm = min(cfg.warmup_steps, total)
  return (cfg.schedule, cfg.lr, warm, total if cfg.schedule == "cosine" else None)
