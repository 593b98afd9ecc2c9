"""The configuration trees of an RL run (`TrainConfig`) and of a supervised warm start
(`SFTConfig`). What a checkpoint's configuration must share with the run resuming it is
`jetrl.train.resume`; the flag names from before the trees had nodes are `jetrl.train.cli`'s.

Both are trees of frozen dataclasses (`jetrl.config`): a few run-level fields, then one node
per concern, shared between the two where the concern is the same:

  model       ModelSpec          which weights: a preset or a checkpoint directory
  task        TaskConfig         prompts and reward
  sampling    SamplingConfig     rollouts (jetrl.sampling; RL only)
  optimizer   OptimizerConfig    AdamW and its schedule (jetrl.rl.optimizer; both runs)
  update      UpdateConfig       the policy-gradient update (jetrl.rl.update; RL only)
  eval        EvalConfig         greedy evaluation on held-out problems
  checkpoint  CheckpointConfig   how often, how many kept
  logging     LoggingConfig      metric records, TensorBoard, plots

Every leaf is a flag of `experiments/train.py` / `experiments/sft.py` named by its path
(`--optimizer.lr`). Each node checks its own values when built, and the top-level class checks
what involves several nodes (rows that must split into minibatches, a temperature RL can
sample at); paths on disk are checked when a run starts (`check_paths`), before anything is
compiled or written (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Any, Iterator, Optional

from jetrl.config import (
  SEED_MAX,
  ConfigError,
  FlagError,
  check_fields,
  check_float,
  check_int,
  field,
  flatten,
  node,
  replace,
  to_dict,
)
from jetrl.data.registry import SYNTHETIC_TASKS, task_class, task_names
from jetrl.data.user_reward import DEFAULT_TIMEOUT as DEFAULT_REWARD_TIMEOUT
from jetrl.data.user_reward import check_spec_form
from jetrl.precision import RECIPES
from jetrl.precision.formats import FORMATS
from jetrl.rl.optimizer import OptimizerConfig
from jetrl.rl.update import UpdateConfig
from jetrl.sampling import SamplingConfig
from jetrl.train import validation


# The sampling temperatures a run accepts (--sampling.temperature=1e-30 once led to NaN params
# or every update skipped, docs/reliability.md); an evaluation also accepts 0, greedy.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0


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


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which model: a preset (random init, sized to the tokenizer) or a Hugging Face folder, and
  the tokenizer that goes with it."""

  name: str = field(
    "tiny",
    "A model preset (jetrl.models.PRESETS) or a Hugging Face folder (config.json, safetensors "
    "weights, tokenizer, chat template, generation config).",
  )
  n_layers: Optional[int] = field(
    None,
    "Number of layers: the first N of a checkpoint's, or a preset's changed (none: unchanged).",
    lo=1,
  )
  tokenizer: Optional[str] = field(
    None,
    "A tokenizer folder (tokenizer.json, tokenizer_config.json, chat template) to use instead "
    "of the model folder's; samples still stop on the model folder's eos ids too. With a "
    "preset, the random model is sized to it (none: the model folder's own tokenizer, or the "
    "character tokenizer for a preset).",
  )

  def __post_init__(self):
    check_fields(self)


PROMPT_FORMATS = ("plain", "chat")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Names of tasks a run was handed as objects (`run(cfg, task=...)`): accepted as task names
# while such a run builds its config, though they are not registered.
_GIVEN_TASKS: contextvars.ContextVar[tuple] = contextvars.ContextVar("given_tasks", default=())


@contextlib.contextmanager
def accepting_task_name(name: str) -> Iterator[None]:
  """Within the block, `TaskConfig(name=name)` is accepted without a registered task of that
  name (the run was given the task object itself)."""
  token = _GIVEN_TASKS.set(_GIVEN_TASKS.get() + (name,))
  try:
    yield
  finally:
    _GIVEN_TASKS.reset(token)


def given_task_config(cfg, task):
  """`cfg` for a run given its task object (`run(cfg, task=...)`): task.name becomes the
  object's name (recorded in the run's config and checked on resume like any field), the
  object's name need not be registered. The config must not name another task."""
  from jetrl.data import Task  # pylint: disable=import-outside-toplevel

  if not isinstance(task, Task):
    raise FlagError(None, f"task= must be a jetrl.data.Task, got {type(task).__name__}")
  name = getattr(task, "name", None)
  if not isinstance(name, str) or not _TASK_NAME.match(name):
    raise FlagError(
      None,
      f"the task given to the run needs a name (its .name: letters, digits, '_', '.', '-'), "
      f"got {name!r}",
    )
  if cfg.task.name not in (name, type(cfg.task)().name):
    raise FlagError(
      "task.name",
      f"names task {cfg.task.name!r}, but the run was given the task object {name!r}; leave "
      f"--task.name at its default or set it to {name!r}",
    )
  with accepting_task_name(name):
    return cfg.replace(task={"name": name})


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The task (built in, or registered with `jetrl.data.register_task`), how its prompts reach
  the model, and the reward that scores it."""

  name: str = field(
    "addition",
    "Task: addition, multiplication, sorting, gsm8k, math500, or a name registered with "
    "jetrl.data.register_task.",
  )
  difficulty: int = field(2, "Synthetic task difficulty knob (ignored by dataset tasks).", lo=0)
  length: int = field(
    1, "Synthetic task length knob: rollout length grows with it (ignored by dataset tasks).", lo=0
  )
  data_path: Optional[str] = field(
    None, "Local JSON-lines file or directory of a dataset task (none: the hub)."
  )
  prompt_format: str = field(
    "plain",
    "plain: the prompt text encoded as is (dataset tasks: the plain question + answer-format "
    "template); chat: the prompt as the user's message in the tokenizer's chat template, with "
    "the assistant's turn opened (dataset tasks: the question and the instruction to box the "
    "answer).",
    choices=PROMPT_FORMATS,
  )
  system_prompt: Optional[str] = field(
    None,
    "The system turn of a chat prompt (none: no system turn, so the template's default "
    "applies). Only with --task.prompt_format=chat.",
  )
  reward: Optional[str] = field(
    None,
    "Score completions with your own function instead of the task's reward: "
    "path/to/file.py:fn or module:fn, fn(prompts, completions, answers) -> list[float], run in "
    "a worker process (none: the task's reward).",
  )
  reward_timeout: float = field(
    DEFAULT_REWARD_TIMEOUT,
    "Seconds one batch of --task.reward may take; past it the batch scores 0, with a warning.",
    lo=0.0,
    hi=86400.0,
    lo_open=True,
  )

  def __post_init__(self):
    check_fields(self)
    if self.name not in task_names() and self.name not in _GIVEN_TASKS.get():
      raise ConfigError(
        "name",
        f"{self.name!r} is not accepted; choose one of {list(task_names())} (a task of your "
        "own: register it with jetrl.data.register_task, or pass it to run(config, task=...))",
      )
    if self.name in SYNTHETIC_TASKS:  # each synthetic task's own ranges
      cls = task_class(self.name)
      check_int("difficulty", self.difficulty, *cls.difficulty_range)
      check_int("length", self.length, *cls.length_range)
    if self.system_prompt is not None and self.prompt_format != "chat":
      raise ConfigError(
        "system_prompt",
        "is part of a chat prompt; pass --task.prompt_format=chat with it, or leave it none",
      )
    if self.reward is not None:
      try:
        check_spec_form(self.reward)
      except ValueError as e:
        raise ConfigError("reward", str(e)) from None

  @property
  def synthetic(self) -> bool:
    return self.name in SYNTHETIC_TASKS

  def check_lengths(self, name: str, lengths) -> None:
    """ConfigError naming `name` (a field of the config holding this task) when one of
    `lengths` is not a valid length knob of this task."""
    for length in lengths:
      try:
        dataclasses.replace(self, length=int(length))
      except ConfigError as e:
        raise ConfigError(name, f"{length}: {e.detail}") from None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Evaluation (the recipe's rollout precision) on the task's held-out problems: greedy, or
  sampled at a temperature."""

  every: Optional[int] = field(
    10, "Evaluate every N steps (none: only at the start and the end).", lo=1
  )
  size: int = field(64, "Held-out problems per evaluation.", lo=1)
  temperature: float = field(
    0.0,
    "0: greedy accuracy; > 0: the mean accuracy of `samples` completions per problem drawn at "
    "this temperature (from a fixed key, the same for every run).",
    lo=0.0,
    hi=100.0,
  )
  samples: int = field(1, "Completions per problem when temperature > 0.", lo=1)
  batch: int = field(
    64,
    "Problems per sampling call (each distinct batch shape compiles once: "
    "--eval.batch=--eval.size compiles one).",
    lo=1,
  )
  also_bf16: bool = field(
    False,
    "RL: also score each evaluation with the bf16 rollout precision (eval_accuracy_bf16), so "
    "that recipes are compared on one scale as well as in their own rollout precision.",
  )

  def __post_init__(self):
    check_fields(self)
    t = self.temperature
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
      raise ConfigError(
        "temperature",
        f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (as "
        f"--sampling.temperature), got {t!r}",
      )

  @property
  def rows(self) -> int:
    """Rows of one evaluation sampler call: `batch` problems (at most `size`), times `samples`
    when sampled."""
    return min(self.batch, self.size) * (self.samples if self.temperature > 0 else 1)

  @property
  def label(self) -> str:
    """What the evaluation measures, for log lines."""
    if self.temperature == 0:
      return "greedy accuracy"
    return f"accuracy at temperature {self.temperature:g} (x{self.samples})"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints under <workdir>/checkpoints: written atomically and checksummed."""

  every: int = field(10, "Checkpoint every N steps (and at the end).", lo=1)
  keep: int = field(2, "Checkpoints kept.", lo=1)

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Metric records (JSON lines, the source of truth), TensorBoard and PNG plots."""

  every: int = field(1, "Write a metrics record and a console line every N steps.", lo=1)
  tensorboard: bool = field(True, "Also write TensorBoard events under <workdir>/tb.")
  plots: bool = field(True, "Draw PNG plots under <workdir>/plots at the end.")
  plot_every: Optional[int] = field(
    None, "Also redraw the plots every N steps (none: only at the end).", lo=1
  )
  samples_every: Optional[int] = field(
    None,
    "Write every sampled completion of every N-th RL step to <workdir>/samples.jsonl (prompt, "
    "tokens, text, reward; none: never).",
    lo=1,
  )

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Tree):
  """An RL run: `experiments/train.py`, `jetrl.train.run`."""

  workdir: Optional[str] = field(
    None, "Output directory: metrics, checkpoints, plots, TensorBoard (required)."
  )
  recipe: str = field("jet", "Precision recipe.", choices=RECIPES)
  grad_fmt: str = field("e4m3", "FP8 gradient format of jet / fp8_tensor.", choices=FORMATS)
  steps: int = field(50, "RL steps (rollout + update).", lo=1)
  prompts_per_step: int = field(16, "Prompts per RL step; each is sampled sampling.n times.", lo=1)
  seed: int = field(
    0, "Random seed (sampling, shuffling, synthetic problems, init).", lo=0, hi=SEED_MAX
  )
  init_from: Optional[str] = field(
    None,
    "Warm-start the params from the newest checkpoint of an SFT or RL run's workdir, or from "
    "a Hugging Face folder (its weights; the model is still --model.name's).",
  )
  mesh: Optional[str] = field(
    None,
    "Device mesh, e.g. data:2,fsdp:2,tensor:2 (none: every device on data). See docs/scaling.md.",
  )
  max_skipped_steps: int = field(
    5,
    "Stop with an error when every update of this many steps "
    "in a row was skipped for non-finite values.",
    lo=1,
  )
  overwrite: bool = field(
    False,
    "Start afresh in a workdir that holds metrics but no "
    "checkpoint; the old files are moved to <workdir>/previous/<time>/.",
  )
  allow_schedule_change: bool = field(
    False,
    "Resume although a changed --steps changes the "
    "learning-rate schedule; the change is recorded in "
    "<workdir>/config_changes.jsonl.",
  )
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(TaskConfig, "Prompts and reward.")
  sampling: SamplingConfig = node(
    SamplingConfig(max_new_tokens=64, n=8), "Rollouts under the recipe's rollout precision."
  )
  optimizer: OptimizerConfig = node(OptimizerConfig, "AdamW and its learning-rate schedule.")
  update: UpdateConfig = node(UpdateConfig, "The policy-gradient update.")
  eval: EvalConfig = node(EvalConfig, "Greedy evaluation on held-out problems.")
  checkpoint: CheckpointConfig = node(CheckpointConfig, "Checkpoints (a rerun resumes).")
  logging: LoggingConfig = node(LoggingConfig, "Metrics, TensorBoard, plots.")

  def __post_init__(self):
    check_fields(self)
    t = self.sampling.temperature
    if t == 0:
      raise ConfigError("sampling.temperature", "must be > 0 for RL sampling, got 0")
    check_float("sampling.temperature", t, MIN_TEMPERATURE, MAX_TEMPERATURE)
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
    _check_mesh(self.mesh)

  @property
  def rows(self) -> int:
    """Rows of an RL step's batch."""
    return self.prompts_per_step * self.sampling.n

  @property
  def optimizer_steps(self) -> int:
    return self.update.optimizer_steps(self.steps)

  def check_paths(self) -> None:
    """FlagError for the workdir, --init_from, --model.name / --model.tokenizer or
    --task.reward (checked when a run starts)."""
    validation.check_workdir(self.workdir)
    validation.check_init_from(self.init_from)
    validation.check_model(self.model.name, self.model.tokenizer)
    validation.check_reward(self.task.reward)


def _check_mesh(mesh: Optional[str]) -> None:
  """ConfigError (mesh) for bad axis names or sizes; the device count is checked at start-up."""
  from jetrl.parallel.mesh import parse_mesh  # pylint: disable=import-outside-toplevel

  try:
    parse_mesh(mesh or "")
  except ValueError as e:
    raise ConfigError("mesh", str(e)) from None


# The warm start's optimizer: a short warmup, then a cosine decay to 5% of the peak.
SFT_OPTIMIZER = OptimizerConfig(lr=1e-3, schedule="cosine", warmup_steps=20, end_lr_ratio=0.05)


@dataclasses.dataclass(frozen=True)
class SFTConfig(Tree):
  """A supervised warm start on a task's gold solutions: `experiments/sft.py`,
  `jetrl.train.run_sft`."""

  workdir: Optional[str] = field(None, "Output directory: checkpoints, metrics (required).")
  recipe: str = field("bf16", "Precision recipe of the SFT step.", choices=RECIPES)
  steps: int = field(300, "Optimizer steps.", lo=1)
  batch_size: int = field(32, "Problems per step.", lo=1)
  max_new_tokens: int = field(
    64, "Generation budget of the greedy evaluation; a longer gold solution is an error.", lo=1
  )
  seed: int = field(0, "Random seed.", lo=0, hi=SEED_MAX)
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
  mesh: Optional[str] = field(
    None,
    "Device mesh, e.g. data:2,fsdp:2 (none: every device on data). See docs/scaling.md.",
  )
  max_skipped_steps: int = field(
    5, "Stop with an error after this many non-finite updates in a row.", lo=1
  )
  overwrite: bool = field(
    False,
    "Start afresh in a workdir that holds metrics but no "
    "checkpoint; the old files are moved to <workdir>/previous/<time>/.",
  )
  allow_schedule_change: bool = field(
    False,
    "Resume although --steps changed (it sets the "
    "cosine schedule); the change is recorded in "
    "<workdir>/config_changes.jsonl.",
  )
  model: ModelSpec = node(ModelSpec, "The model.")
  task: TaskConfig = node(TaskConfig, "The task whose gold solutions are the targets.")
  optimizer: OptimizerConfig = node(SFT_OPTIMIZER, "AdamW and its learning-rate schedule.")
  eval: EvalConfig = node(
    EvalConfig(every=None), "Greedy evaluation on held-out problems (always at the end)."
  )
  checkpoint: CheckpointConfig = node(CheckpointConfig(every=50), "Checkpoints (a rerun resumes).")
  logging: LoggingConfig = node(LoggingConfig(every=10), "Metrics, TensorBoard, plots.")

  def __post_init__(self):
    check_fields(self)
    _check_mesh(self.mesh)
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

  @property
  def optimizer_steps(self) -> int:
    return self.steps

  def check_paths(self) -> None:
    validation.check_workdir(self.workdir)
    validation.check_model(self.model.name, self.model.tokenizer)
    validation.check_reward(self.task.reward)
