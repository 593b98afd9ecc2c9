"""The configuration trees of an RL run (`TrainConfig`) and of a supervised warm start
(`SFTConfig`), and the run-level fields they share (`RunConfig`, `WorkdirRun`).

Both are trees of frozen dataclasses (`jetrl.config`): a few run-level fields, then one node
per concern, shared between the two where the concern is the same:

  model       ModelSpec          which weights: a preset or a checkpoint directory
  task        TaskConfig         prompts and reward
  sampling    SamplingConfig     rollouts (jetrl.sampling; RL only)
  optimizer   OptimizerConfig    AdamW and its schedule (jetrl.rl.optimizer; both runs)
  update      UpdateConfig       the policy-gradient update (jetrl.rl.update; RL only)
  lora        LoraConfig         LoRA adapters on a frozen base (jetrl.models.lora; RL only)
  eval        EvalConfig         greedy evaluation on held-out problems
  checkpoint  CheckpointConfig   how often, how many kept
  logging     LoggingConfig      metric records, TensorBoard, plots
  kernels     KernelConfig       which kernels compute the numbers (jetrl.kernels.device)

(the nodes of this package are `jetrl.train.nodes`). Every leaf is a flag of
`experiments/train.py` / `experiments/sft.py` named by its path (`--optimizer.lr`). Each node
checks its own values when built, and the top-level class checks what involves several nodes
(rows that must split into minibatches, a temperature RL can sample at); paths on disk are
checked when a run starts (`check_paths`), before anything is compiled or written
(docs/reliability.md). What a field's value means for a resumed run is on the field
(`resumable=True`: it may change; `jetrl.train.resume`), as are the flag names it had before
the trees had nodes (`former=`: refused with the new name, `jetrl.train.cli`).

The recipe is resolved once, when the config is built: `cfg.precision_recipe` is the
`jetrl.precision.Recipe` (with the run's gradient format and KV cache) every part of the run
reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jetrl.config import (
  SEED_MAX,
  ConfigError,
  check_fields,
  field,
  flatten,
  node,
  replace,
  to_dict,
)
from jetrl.kernels import KernelConfig
from jetrl.models.lora import LoraConfig
from jetrl.parallel.mesh import parse_mesh
from jetrl.precision import RECIPES, Recipe, get_recipe
from jetrl.precision.recipes import KV_CACHE_RECIPES, KV_CACHES
from jetrl.precision.formats import FORMATS
from jetrl.rl.optimizer import OptimizerConfig
from jetrl.rl.update_config import UpdateConfig
from jetrl.sampling import GenerationConfig, SamplingConfig
from jetrl.train import validation
from jetrl.train.nodes import (
  CheckpointConfig,
  EvalConfig,
  LoggingConfig,
  ModelSpec,
  TaskConfig,
  given_task_config,
)

__all__ = [
  "CheckpointConfig",
  "EvalConfig",
  "LoggingConfig",
  "ModelSpec",
  "RunConfig",
  "SFTConfig",
  "SFT_OPTIMIZER",
  "TaskConfig",
  "TrainConfig",
  "Tree",
  "WorkdirRun",
  "KERNELS_HELP",
  "given_task_config",
]


class Tree:
  """What the top-level configs share: `replace` (a field, a node's fields as a dict, or a
  dotted path: `cfg.replace(steps=5, sampling={"n": 4}, **{"optimizer.lr": 1e-3})`) and
  `to_dict`."""

  def replace(self, **changes):
    flat = {}
    for key, value in changes.items():
      if isinstance(value, dict):
        flat.update({f"{key}.{k}": v for k, v in flatten(value).items()})
      else:
        flat[key] = value
    return replace(self, flat)

  def to_dict(self) -> dict[str, Any]:
    return to_dict(self)


KERNELS_HELP = (
  "Which kernels compute the numbers where several compute the same ones (the float32 sums "
  "may run in another order; may change on resume). Each default comes from its JETRL_* "
  "variable where set (jetrl.kernels.device)."
)


def recipe_field(default: str, what: str = "Precision recipe.") -> Any:
  return field(default, what, choices=RECIPES)


def seed_field(what: str = "Random seed.") -> Any:
  return field(0, what, lo=0, hi=SEED_MAX)


@dataclasses.dataclass(frozen=True)
class RunConfig(Tree):
  """What every run is given: a precision recipe and a seed. `precision_recipe` is the
  recipe as an object, resolved once when the config is built (an unknown combination is a
  ConfigError naming the flag)."""

  recipe: str = recipe_field("jet")
  seed: int = seed_field()
  kv_cache: str = field(
    "compute",
    "The rollout's KV cache: compute (keys and values in the recipe's compute dtype) or fp8 "
    "(E4M3, per token and kv head in 1x128 groups along the head dimension, float32 scales: "
    "half the bytes; recipes " + ", ".join(KV_CACHE_RECIPES) + "). Under jet and jet_exact "
    "the training forward's attention reads the same rounded keys and values (the gradient "
    "straight through the rounding); under fp8_rollout only the rollout does.",
    choices=KV_CACHES,
  )

  def __post_init__(self):
    check_fields(self)
    self._resolve_recipe()

  def _resolve_recipe(self) -> Recipe:
    try:
      recipe = get_recipe(self.recipe, grad_fmt=self.gradient_format, kv_cache=self.kv_cache)
    except ValueError as e:
      if self.recipe not in RECIPES:
        raise ConfigError("recipe", str(e)) from None
      raise ConfigError("kv_cache" if "kv_cache" in str(e) else "grad_fmt", str(e)) from None
    object.__setattr__(self, "_recipe", recipe)
    return recipe

  @property
  def gradient_format(self) -> str:
    """The FP8 format of the backward's incoming gradients (a run that trains sets it)."""
    return "e4m3"

  @property
  def precision_recipe(self) -> Recipe:
    """The `jetrl.precision.Recipe` of `recipe` (and the gradient format)."""
    recipe = self.__dict__.get("_recipe")
    return recipe if recipe is not None else self._resolve_recipe()


@dataclasses.dataclass(frozen=True)
class WorkdirRun(RunConfig):
  """The run-level fields of a run that trains and writes a workdir (RL and SFT); those that
  may change when it resumes are marked resumable."""

  workdir: Optional[str] = field(
    None,
    "Output directory: metrics, checkpoints, plots, TensorBoard (required).",
    resumable=True,
  )
  grad_fmt: str = field(
    "e4m3",
    "FP8 format of the incoming gradients of the recipe's FP8 backward GEMMs (jet, jet_exact, "
    "fp8_tensor); a recipe with no FP8 backward accepts only e4m3.",
    choices=FORMATS,
  )
  steps: int = field(
    50, "Steps (RL: rollout + update; SFT: optimizer steps).", lo=1, resumable=True
  )
  mesh: Optional[str] = field(
    None,
    "Device mesh, e.g. data:2,fsdp:2,tensor:2 (none: every device on data). See docs/scaling.md.",
    resumable=True,
  )
  max_skipped_steps: int = field(
    5,
    "Stop with an error when every update of this many steps in a row was skipped for "
    "non-finite values.",
    lo=1,
    resumable=True,
  )
  overwrite: bool = field(
    False,
    "Start afresh in a workdir that holds metrics but no checkpoint; the old files are moved "
    "to <workdir>/previous/<time>/.",
    resumable=True,
  )
  allow_schedule_change: bool = field(
    False,
    "Resume although a changed --steps changes the learning-rate schedule; the change is "
    "recorded in <workdir>/config_changes.jsonl.",
    resumable=True,
  )

  def __post_init__(self):
    super().__post_init__()
    try:
      parse_mesh(self.mesh or "")  # the device count is checked at start-up
    except ValueError as e:
      raise ConfigError("mesh", str(e)) from None

  @property
  def gradient_format(self) -> str:
    return self.grad_fmt


@dataclasses.dataclass(frozen=True)
class TrainConfig(WorkdirRun):
  """An RL run: `experiments/train.py`, `jetrl.train.run`."""

  prompts_per_step: int = field(16, "Prompts per RL step; each is sampled sampling.n times.", lo=1)
  init_from: Optional[str] = field(
    None,
    "Warm-start the params from the newest checkpoint of an SFT or RL run's workdir, or from "
    "a Hugging Face folder (its weights; the model is still --model.name's).",
  )
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(TaskConfig, "Prompts and reward.")
  sampling: SamplingConfig = node(
    SamplingConfig(max_new_tokens=64, n=8), "Rollouts under the recipe's rollout precision."
  )
  optimizer: OptimizerConfig = node(OptimizerConfig, "AdamW and its learning-rate schedule.")
  update: UpdateConfig = node(UpdateConfig, "The policy-gradient update.")
  lora: LoraConfig = node(LoraConfig, "LoRA adapters on a frozen base (rank 0: full fine-tuning).")
  eval: EvalConfig = node(EvalConfig, "Greedy evaluation on held-out problems.")
  checkpoint: CheckpointConfig = node(
    CheckpointConfig, "Checkpoints (a rerun resumes).", resumable=True
  )
  logging: LoggingConfig = node(LoggingConfig, "Metrics, TensorBoard, plots.", resumable=True)
  kernels: KernelConfig = node(KernelConfig, KERNELS_HELP, resumable=True)

  def __post_init__(self):
    super().__post_init__()
    if self.sampling.temperature == 0:
      raise ConfigError("sampling.temperature", "must be > 0 for RL sampling, got 0")
    if self.sampling.n < 2:
      raise ConfigError(
        "sampling.n", f"must be >= 2 for group-relative advantages, got {self.sampling.n}"
      )
    u = self.update
    if self.rows % (u.minibatches * u.micro_batches):
      raise ConfigError(
        "update.minibatches",
        f"prompts_per_step x sampling.n = {self.rows} "
        f"rows do not split into update.minibatches={u.minibatches} x "
        f"update.micro_batches={u.micro_batches}",
      )
    if u.overlong_buffer >= self.sampling.max_new_tokens:
      raise ConfigError(
        "update.overlong_buffer",
        "must be < sampling.max_new_tokens "
        f"({self.sampling.max_new_tokens}), got {u.overlong_buffer}",
      )

  @property
  def rows(self) -> int:
    """Rows of an RL step's batch."""
    return self.prompts_per_step * self.sampling.n

  def schedule_steps(self, steps: int) -> int:
    """Optimizer steps of a run of `steps` RL steps (what its learning-rate schedule spans)."""
    return self.update.optimizer_steps(steps)

  @property
  def optimizer_steps(self) -> int:
    return self.schedule_steps(self.steps)

  def check_paths(self) -> None:
    """FlagError for the workdir, --init_from, --model.name / --model.tokenizer or
    --task.reward (checked when a run starts)."""
    validation.check_workdir(self.workdir)
    validation.check_init_from(self.init_from)
    validation.check_model(self.model.name, self.model.tokenizer)
    validation.check_reward(self.task.reward)


# The warm start's optimizer: a short warmup, then a cosine decay to 5% of the peak.
SFT_OPTIMIZER = OptimizerConfig(lr=1e-3, schedule="cosine", warmup_steps=20, end_lr_ratio=0.05)


@dataclasses.dataclass(frozen=True)
class SFTConfig(WorkdirRun):
  """A supervised warm start on a task's gold solutions: `experiments/sft.py`,
  `jetrl.train.run_sft`."""

  recipe: str = recipe_field("bf16", "Precision recipe of the SFT step.")
  steps: int = field(300, "Optimizer steps.", lo=1, resumable=True)
  batch_size: int = field(32, "Problems per step.", lo=1)
  answer_noise: float = field(
    0.0,
    "Fraction of the gold solutions whose final answer is misreported (its last digit replaced "
    "by the next one; synthetic tasks only): a warm start that works a problem out but reports "
    "the result unreliably, which RL can then learn to report.",
    lo=0.0,
    hi=1.0,
  )
  mix_lengths: tuple[int, ...] = field(
    (),
    "Train on problems of these task lengths in turn (step i: the (i mod n)-th; synthetic "
    "tasks only), so that one warm start serves RL runs at each of them (empty: --task.length "
    "alone). The evaluation stays at --task.length.",
    lo=0,
  )
  model: ModelSpec = node(ModelSpec, "The model.")
  task: TaskConfig = node(TaskConfig, "The task whose gold solutions are the targets.")
  optimizer: OptimizerConfig = node(SFT_OPTIMIZER, "AdamW and its learning-rate schedule.")
  sampling: GenerationConfig = node(
    GenerationConfig(max_new_tokens=64),
    "The greedy evaluation's generation budget; a longer gold solution is an error.",
  )
  eval: EvalConfig = node(
    EvalConfig(every=None),
    "Greedy evaluation on held-out problems (always at the end).",
    resumable=True,
  )
  checkpoint: CheckpointConfig = node(
    CheckpointConfig(every=50), "Checkpoints (a rerun resumes).", resumable=True
  )
  logging: LoggingConfig = node(
    LoggingConfig(every=10), "Metrics, TensorBoard, plots.", resumable=True
  )
  kernels: KernelConfig = node(KernelConfig, KERNELS_HELP, resumable=True)

  def __post_init__(self):
    super().__post_init__()
    if self.answer_noise > 0 and not self.task.synthetic:
      raise ConfigError(
        "answer_noise",
        f"{self.answer_noise} needs a synthetic task (addition, multiplication, sorting), "
        f"whose answers are digits; got --task.name={self.task.name}",
      )
    if self.mix_lengths and not self.task.synthetic:
      raise ConfigError(
        "mix_lengths",
        f"needs a synthetic task (addition, multiplication, sorting); got --task.name="
        f"{self.task.name}",
      )
    self.task.check_lengths("mix_lengths", self.mix_lengths)

  def schedule_steps(self, steps: int) -> int:
    """Optimizer steps of a run of `steps` steps: one each."""
    return steps

  @property
  def optimizer_steps(self) -> int:
    return self.steps

  def check_paths(self) -> None:
    validation.check_workdir(self.workdir)
    validation.check_model(self.model.name, self.model.tokenizer)
    validation.check_reward(self.task.reward)
