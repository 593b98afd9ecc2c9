"""The nodes a run's configuration is made of, besides those that live with the code that reads
them (`jetrl.sampling.SamplingConfig`, `jetrl.rl.OptimizerConfig`, `jetrl.rl.UpdateConfig`):

  model       ModelSpec          which weights: a preset or a checkpoint directory
  task        TaskConfig         prompts and reward
  eval        EvalConfig         greedy (or sampled) evaluation on held-out problems
  checkpoint  CheckpointConfig   how often, how many kept
  logging     LoggingConfig      metric records, TensorBoard, plots

Each checks its own values when built (`jetrl.config`); a field that may change when a run
resumes says so (`resumable=True`), and a flag name it had before the configuration had nodes
is on the field (`former=`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Iterator, Optional

from jetrl.config import ConfigError, FlagError, check_fields, check_int, field
from jetrl.data import Task
from jetrl.data.custom_jsonl import CHECKERS
from jetrl.data.registry import DATASET_TASKS, SYNTHETIC_TASKS, task_class, task_names
from jetrl.data.user_reward import DEFAULT_TIMEOUT as DEFAULT_REWARD_TIMEOUT
from jetrl.data.user_reward import check_spec_form
from jetrl.models.config import PRESETS
from jetrl.sampling.config import temperature_field


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which model: a preset (random init, sized to the tokenizer), a Hugging Face folder or a
  hub id, and the tokenizer that goes with it."""

  name: str = field(
    "tiny",
    f"A model preset: {', '.join(PRESETS)} (RANDOM weights in that model's shape, not the "
    "trained model); a Hugging Face folder (config.json, safetensors weights, "
    "tokenizer, chat template, generation config); or a hub id such as "
    "Qwen/Qwen2.5-0.5B-Instruct (its snapshot in the local hub cache, HF_HUB_CACHE / HF_HOME, "
    "or downloaded there where the network allows).",
    former=("model",),
  )
  n_layers: Optional[int] = field(
    None,
    "Number of layers: the first N of a checkpoint's, or a preset's changed (none: unchanged).",
    lo=1,
    former=("n_layers",),
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
WANDB_MODES = ("offline", "online")
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
    f"Task: {', '.join(SYNTHETIC_TASKS)} (synthetic: --task.difficulty, --task.length); "
    f"{', '.join(t for t in DATASET_TASKS if t != 'jsonl')} (datasets: --task.data_path, or "
    "the hub); jsonl (a JSON-lines file of your own: --task.data_path, --task.prompt_field, "
    "--task.answer_field, --task.checker); or a name registered with "
    "jetrl.data.register_task.",
    former=("task",),
  )
  difficulty: int = field(
    2, "Synthetic task difficulty knob (ignored by dataset tasks).", lo=0, former=("difficulty",)
  )
  length: int = field(
    1,
    "Synthetic task length knob: rollout length grows with it (ignored by dataset tasks).",
    lo=0,
    former=("length",),
  )
  data_path: Optional[str] = field(
    None,
    "Local JSON-lines file or directory of a dataset task (none: the hub; required by jsonl).",
    former=("data_path",),
  )
  prompt_field: str = field(
    "question",
    "--task.name=jsonl: the field of each row that holds the question (the prompt).",
  )
  answer_field: str = field(
    "answer",
    "--task.name=jsonl: the field of each row that holds the reference answer (a string or a "
    "number).",
  )
  solution_field: Optional[str] = field(
    None,
    "--task.name=jsonl: the field of each row that holds a worked solution ending in the "
    "answer, for a supervised warm start (none: no solutions).",
  )
  checker: str = field(
    "number",
    "--task.name=jsonl: how a completion is scored against the answer. number: its final "
    "number (#### 42, \\boxed{42} or the last number) equals the answer as a number; math: its "
    "\\boxed{} answer equals the answer as MATH answers are compared (normalised, then sympy); "
    "exact: its \\boxed{} answer (else what follows ####, else its last line) is the answer "
    "string.",
    choices=CHECKERS,
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
    resumable=True,
  )

  def __post_init__(self):
    check_fields(self)
    if self.name not in task_names() and self.name not in _GIVEN_TASKS.get():
      raise ConfigError(
        "name",
        f"{self.name!r} is not accepted; choose one of {list(task_names())} (a task of your "
        "own: register it with jetrl.data.register_task, or pass it to run(config, task=...))",
      )
    if self.name == "jsonl" and self.data_path is None:
      raise ConfigError(
        "data_path",
        "--task.name=jsonl reads your own JSON-lines file: pass --task.data_path=FILE.jsonl "
        "(with --task.prompt_field, --task.answer_field and --task.checker naming its fields "
        "and how answers are checked; docs/tasks.md)",
      )
    if self.name != "jsonl":
      for name in ("prompt_field", "answer_field", "solution_field", "checker"):
        if getattr(self, name) != getattr(TaskConfig, name):
          raise ConfigError(name, "is only for --task.name=jsonl (your own JSON-lines file)")
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
    10,
    "Evaluate every N steps (none: only at the start and the end).",
    lo=1,
    resumable=True,
    former=("eval_every",),
  )
  size: int = field(64, "Held-out problems per evaluation.", lo=1, former=("eval_size",))
  temperature: float = temperature_field(
    0.0,
    "0: greedy accuracy; > 0: the mean accuracy of `samples` completions per problem drawn at "
    "this temperature (from a fixed key, the same for every run).",
  )
  samples: int = field(1, "Completions per problem when temperature > 0.", lo=1)
  batch: int = field(
    64,
    "Problems per sampling call (each distinct batch shape compiles once: "
    "--eval.batch=--eval.size compiles one).",
    lo=1,
    resumable=True,
  )
  also_bf16: bool = field(
    False,
    "RL: also score each evaluation with the bf16 rollout precision (eval_accuracy_bf16), so "
    "that recipes are compared on one scale as well as in their own rollout precision.",
  )
  k: tuple[int, ...] = field(
    (),
    "Also report pass@k and maj@k for each k (eval_pass_at_K, eval_maj_at_K): pass@k the "
    "unbiased estimate from the --eval.samples completions per problem, maj@k a majority vote "
    "of the task's extracted answers over the first k (needs --eval.temperature > 0 and "
    "--eval.samples >= max k; empty: neither).",
    lo=1,
  )

  def __post_init__(self):
    check_fields(self)
    if self.k and not self.temperature > 0:
      raise ConfigError(
        None,
        f"--eval.k={','.join(map(str, self.k))} needs sampled completions: set "
        "--eval.temperature > 0 (and --eval.samples >= max k)",
      )
    if self.k and self.samples < max(self.k):
      raise ConfigError(
        None,
        f"--eval.k={','.join(map(str, self.k))} needs --eval.samples >= {max(self.k)} "
        f"completions per problem (got --eval.samples={self.samples})",
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

  every: int = field(10, "Checkpoint every N steps (and at the end).", lo=1, former=("ckpt_every",))
  keep: int = field(2, "Checkpoints kept.", lo=1, former=("keep_ckpts",))

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Metric records (JSON lines, the source of truth), TensorBoard, Weights & Biases, MLflow,
  PNG plots and the completions table."""

  every: int = field(1, "Write a metrics record and a console line every N steps.", lo=1)
  tensorboard: bool = field(
    True, "Also write TensorBoard events under <workdir>/tb.", former=("tensorboard",)
  )
  plots: bool = field(True, "Draw PNG plots under <workdir>/plots at the end.", former=("plots",))
  plot_every: Optional[int] = field(
    None, "Also redraw the plots every N steps (none: only at the end).", lo=1
  )
  samples_every: Optional[int] = field(
    10,
    "Write the completions table of every N-th RL step to <workdir>/samples.jsonl (one row per "
    "distinct prompt: prompt, completion, answer, reward, correct, length, |dlogp|, tokens), "
    "and to TensorBoard's text tab, Weights & Biases and MLflow (none: never).",
    lo=1,
  )
  samples_rows: Optional[int] = field(
    4,
    "How many rows the completions table of --logging.samples_every has: one completion "
    "(the first) of each of the step's first N prompts (none: one of every prompt).",
    lo=1,
  )
  wandb: bool = field(
    False,
    "Also log the metrics, the configuration and the samples to Weights & Biases (files under "
    "<workdir>/wandb; needs the wandb package: pip install 'jetrl[wandb]').",
  )
  wandb_project: str = field("jetrl", "The Weights & Biases project of --logging.wandb.")
  wandb_name: Optional[str] = field(
    None, "The Weights & Biases run name (none: the workdir's base name)."
  )
  wandb_mode: str = field(
    "offline",
    "offline: write the run under <workdir>/wandb only, no network (upload it later with "
    "`wandb sync <workdir>/wandb/offline-run-*`); online: stream it to the W&B server.",
    choices=WANDB_MODES,
  )
  mlflow: bool = field(
    False,
    "Also log the metrics (eval.jsonl's as eval/*), the configuration (params and "
    "config.json), the completions table and the plots to MLflow (needs the mlflow package: "
    "pip install 'jetrl[mlflow]'); a resumed run continues the same MLflow run.",
  )
  mlflow_uri: Optional[str] = field(
    None,
    "The MLflow tracking URI of --logging.mlflow: a server (http://...) or a store (none: a "
    "file store under <workdir>/mlruns; look with `mlflow ui --backend-store-uri URI`).",
  )
  mlflow_experiment: str = field("jetrl", "The MLflow experiment of --logging.mlflow.")
  mlflow_run_name: Optional[str] = field(
    None, "The MLflow run name (none: the workdir's base name)."
  )

  def __post_init__(self):
    check_fields(self)
