"""Building a run's pieces from its config nodes: tokenizer, task, reward, model, prompts,
device layouts (the held-out evaluation is `jetrl.train.evaluation`).

Every tokenizer is used through `jetrl.data.Tokenizer` (the character tokenizer, a
checkpoint's, or a `transformers` one): a prompt is `encode(text)` as the model expects a
sequence to start (`--task.prompt_format=plain`) or the ids of the tokenizer's chat template
around it (`chat`, `jetrl.data.chat_prompt_ids`); a completion is
`encode(text, add_special_tokens=False)` + eos; a sample stops on any of `stop_token_ids` (the
eos token and every eos id of the model's and the tokenizer's generation config).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, NamedTuple, Optional, Sequence

import jax

from jetrl import parallel
from jetrl.config import FlagError
from jetrl.data import (
  DATASET_TASKS,
  TASKS,
  Task,
  WithReward,
  char_tokenizer,
  chat_prompt_ids,
  get_task,
  load_reward,
  stop_token_ids,
  task_kwargs,
)
from jetrl.data.prompts import has_chat_template
from jetrl.data.registry import task_class
from jetrl.kernels import KernelConfig
from jetrl.data.tokenizer import Tokenizer
from jetrl.parallel.rules import Layout
from jetrl.precision import Recipe
from jetrl.models import (
  ModelConfig,
  check_vocab,
  get_config,
  init_params,
  load_model_tokenizer,
  load_pretrained,
  load_tokenizer,
)
from jetrl.models.config import PRESETS
from jetrl.models.io.hf_io import config_from_hf
from jetrl.models.io.hub import hub_folder, is_hub_id

Encoder = Callable[[str], list]


class TokenIds(NamedTuple):
  bos: Optional[int]
  eos: int
  pad: int
  stop: tuple[int, ...]  # every id that ends a sample (eos among them)


def token_ids(tok: Tokenizer) -> TokenIds:
  """bos / eos / pad / stop ids of a tokenizer (pad: eos when it has none)."""
  eos = tok.eos_token_id
  if eos is None:
    raise ValueError("the tokenizer has no eos token: cannot stop generation")
  pad = tok.pad_token_id if tok.pad_token_id is not None else eos
  return TokenIds(tok.bos_token_id, int(eos), int(pad), stop_token_ids(tok) or (int(eos),))


def layouts(mesh: Optional[str], mcfg, recipe, rows: dict[str, int], log):
  """(training layout, sampling layout) on the device mesh `mesh` (the --mesh flag) over every
  device of every process, or (None, None) for one device and no --mesh. `rows`: {what: the
  rows of a batch}, each of which must split over the batch axes. FlagError (--mesh)."""
  if not mesh and jax.device_count() == 1:
    return None, None
  try:
    m = parallel.make_mesh(mesh or "")
    layout = parallel.make_layout(m, mcfg, "train", recipe)
    sample_layout = parallel.make_layout(m, mcfg, "sample", recipe)
    for what, n in rows.items():
      layout.rows_sharding(n, strict=True, what=what)
  except ValueError as e:
    raise FlagError("mesh", str(e)) from None
  log(
    f"mesh {parallel.mesh_str(m)} over {jax.device_count()} devices "
    f"({jax.process_count()} processes)"
  )
  return layout, sample_layout


def make_task(task, *, seed: int) -> Task:
  """The task of a `TaskConfig`: a synthetic one with its knobs; a dataset with its files (or
  the hub), its prompts plain or as the chat's user message (`--task.prompt_format`); or a
  registered one (its factory given the seed and --task.data_path where it takes them)."""
  if task.synthetic:
    return get_task(task.name, difficulty=task.difficulty, length=task.length, seed=seed)
  if task.name in DATASET_TASKS:
    kw = dict(seed=seed, template="message" if task.prompt_format == "chat" else "base")
    if task.data_path:
      kw["path"] = task.data_path
    if task.name == "jsonl":  # your own file: its fields and checker
      kw.update(
        prompt_field=task.prompt_field,
        answer_field=task.answer_field,
        solution_field=task.solution_field,
        checker=task.checker,
      )
    return get_task(task.name, **kw)
  accepted = task_kwargs(task.name)
  kw = {"seed": seed} if "seed" in accepted else {}
  if task.data_path:
    if "path" not in accepted:
      raise ValueError(
        f"task {task.name!r} takes no path (its arguments: {list(accepted)}); leave "
        "--task.data_path none"
      )
    kw["path"] = task.data_path
  return get_task(task.name, **kw)


def load_user_reward(task, log: Callable[[str], None] = print):
  """The `--task.reward` function (a `jetrl.data.UserReward`, its worker started and the
  function loaded), or None; what is wrong with it is a FlagError naming --task.reward."""
  if task.reward is None:
    return None
  try:
    return load_reward(task.reward, timeout=task.reward_timeout, log=log)
  except ValueError as e:
    raise FlagError("task.reward", str(e)) from None


def prompt_encoder(task, tok: Tokenizer) -> Encoder:
  """prompt text -> ids: `encode(text)` (plain), or the chat template with the text as the
  user's message and `--task.system_prompt` as the system turn (chat; a FlagError when the
  tokenizer has no chat template)."""
  if task.prompt_format == "plain":
    return lambda text: encode_prompt(tok, text)
  if not has_chat_template(tok):
    raise FlagError(
      "task.prompt_format",
      "chat needs a tokenizer with a chat template (in tokenizer_config.json, "
      "chat_template.jinja or chat_template.json); this run's tokenizer "
      f"({type(tok).__name__}) has none: pass --task.prompt_format=plain, or "
      "--model.tokenizer=DIR with a template",
    )

  def chat(text: str) -> list:
    try:
      return chat_prompt_ids(tok, text, system_prompt=task.system_prompt)
    except ValueError:
      raise
    except Exception as e:  # a template that raises (e.g. on a system turn) or fails to render
      raise ValueError(f"the chat template failed on a prompt: {type(e).__name__}: {e}") from None

  return chat


PROBE_ALL = 50_000


def load_task(
  task,
  *,
  seed: int,
  tok: Tokenizer,
  encode: Optional[Encoder] = None,
  given: Optional[Task] = None,
  reward=None,
  max_prompt_tokens: Optional[int] = None,
):
  """(task, prompt width): the task (`given`, or the config's), scored by `reward` when given
  (`WithReward`), its data loaded and checked, and the static prompt width (the longest of its
  train and test prompts as `encode` gives them, rounded up to 16, plus 16: every prompt of a
  dataset split of up to PROBE_ALL problems, so no later step or evaluation meets a longer
  one, else the first 64 of a generated task, whose lengths are fixed by its settings). A
  data error, or a prompt longer than `max_prompt_tokens` (the model's positions), is a
  FlagError naming --task.data_path (or --task.name), with the file and line it found, or
  the split and problem; a chat template that fails names --task.prompt_format (or
  --task.system_prompt)."""
  encode = encode or (lambda text: encode_prompt(tok, text))
  try:
    loaded = given if given is not None else make_task(task, seed=seed)
    if reward is not None:
      loaded = WithReward(loaded, reward)
    problems = {}
    for split in ("train", "test"):
      count = loaded.num_problems(split)
      problems[split] = loaded.batch(split, 0, count if count and count <= PROBE_ALL else 64)
  except ValueError as e:
    raise FlagError("task.data_path" if task.data_path else "task.name", str(e)) from None
  try:
    probes = {split: [encode(p.prompt) for p in ps] for split, ps in problems.items()}
  except ValueError as e:
    flag = "task.name"
    if task.prompt_format == "chat":
      flag = "task.system_prompt" if task.system_prompt is not None else "task.prompt_format"
    raise FlagError(flag, f"a prompt of task {loaded.name!r} cannot be encoded: {e}") from None
  if max_prompt_tokens is not None:
    for split, probe in probes.items():
      for k, ids in enumerate(probe):
        if len(ids) > max_prompt_tokens:
          raise FlagError(
            "task.data_path" if task.data_path else "task.name",
            f"problem {k} of the {split} split of task {loaded.name!r} has a prompt of "
            f"{len(ids)} tokens ({len(problems[split][k].prompt)} characters); the model "
            f"holds {max_prompt_tokens} positions",
          )
  return loaded, prompt_width(probes["train"] + probes["test"]) + 16


def model_folder(model) -> Optional[str]:
  """The folder of `--model.name`: a local folder as is, a hub id (`org/name`) as its
  snapshot in the local hub cache (downloaded there where the network allows:
  `jetrl.models.io.hub`); None for a preset. FlagError (--model.name) for a hub id it cannot
  have."""
  name = model.name
  if os.path.isdir(name):
    return name
  if name.lower() in PRESETS or not is_hub_id(name):
    return None
  try:
    return hub_folder(name)
  except ValueError as e:
    raise FlagError("model.name", str(e)) from None


def describe_model(model) -> str:
  """What `--model.name` is, for a run's first line: a preset says its weights are random."""
  name = model.name
  if name.lower() in PRESETS and not os.path.isdir(name):
    return f"{name} (preset: RANDOM weights, the shape of {name} only; not a trained model)"
  folder = model_folder(model)
  if folder is not None and folder != name:
    return f"{name} (hub cache: {folder})"
  return name


def make_tokenizer(model, task=None) -> Tokenizer:
  """The run's tokenizer: the model folder's (or --model.tokenizer's files instead), with the
  end-of-generation ids of both folders; a tokenizer folder's for a preset; else the
  character tokenizer, which only fits the synthetic tasks and tasks of your own."""
  flag = "model.tokenizer" if model.tokenizer else "model.name"
  folder = model_folder(model)
  try:
    if folder is not None:
      return load_model_tokenizer(folder, model.tokenizer)
    if model.tokenizer:
      return load_tokenizer(model.tokenizer)
  except (OSError, ValueError) as e:
    raise FlagError(flag, str(e)) from None
  if task is not None and task.name in TASKS and task_class(task.name).needs_tokenizer:
    raise FlagError(
      "model.name",
      f"task {task.name!r} needs a tokenizer: a Hugging Face folder as --model.name, or "
      f"--model.tokenizer=DIR; the preset {model.name!r} alone has only the character "
      "tokenizer of the character-level synthetic tasks",
    )
  return char_tokenizer()


def model_config(model, tok: Tokenizer, max_seq_len: int) -> ModelConfig:
  """The model's config without its weights, for sequences up to `max_seq_len`: a preset
  sized to the tokenizer, or a checkpoint's config.json (cheap: memory and tokenizer checks
  run before any weight), checked against the tokenizer (`check_tokenizer`)."""
  folder = model_folder(model)
  if folder is not None:
    path = os.path.join(folder, "config.json")
    try:
      with open(path, encoding="utf-8") as f:
        mcfg = config_from_hf(json.load(f))
    except (OSError, ValueError) as e:  # missing, not JSON, or an unsupported model
      raise FlagError("model.name", f"{path}: {e}") from None
  else:
    mcfg = dataclasses.replace(get_config(model.name), vocab_size=len(tok))
  if model.n_layers is not None:
    if folder is not None and model.n_layers > mcfg.n_layers:
      raise FlagError(
        "model.n_layers", f"{model.n_layers} is more than the checkpoint's {mcfg.n_layers} layers"
      )
    mcfg = dataclasses.replace(mcfg, n_layers=model.n_layers)
  if max_seq_len > mcfg.max_seq_len:
    mcfg = dataclasses.replace(mcfg, max_seq_len=max_seq_len)
  check_tokenizer(mcfg, tok, model)
  return mcfg


def make_params(model, mcfg, seed: int):
  """float32 params for `mcfg` (from model_config): a checkpoint's weights (checked finite and
  of a float dtype at load), or a seeded random init."""
  folder = model_folder(model)
  if folder is None:
    return init_params(mcfg, jax.random.PRNGKey(seed))
  _, params = load_pretrained(folder)
  n_layers = mcfg.n_layers
  return dict(params, layers=jax.tree_util.tree_map(lambda a: a[:n_layers], params["layers"]))


def make_model(model, tok: Tokenizer, seed: int, max_seq_len: int):
  """(model_config, float32 params): a preset sized to the tokenizer, or a checkpoint."""
  mcfg = model_config(model, tok, max_seq_len)
  return mcfg, make_params(model, mcfg, seed)


def check_tokenizer(mcfg, tok: Tokenizer, model=None) -> None:
  """FlagError when the tokenizer can produce, or the run uses, an id the model's embedding
  does not have (`jetrl.models.check_vocab`); it names --model.tokenizer when `model` (the
  run's ModelSpec) takes the tokenizer from there, else --model.name."""
  try:
    check_vocab(mcfg, tok)
  except ValueError as e:
    if model is not None and getattr(model, "tokenizer", None):
      raise FlagError(
        "model.tokenizer", f"{e}; the tokenizer must fit the model of --model.name"
      ) from None
    raise FlagError(
      "model.name", f"{e}; a checkpoint's tokenizer and config.json must agree"
    ) from None


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
  """A prompt's ids as the model expects a sequence to start (bos first where it has one)."""
  return list(tok.encode(text))


def encode_completion(tok: Tokenizer, text: str) -> list[int]:
  """A completion's ids, ended by eos (the training target of a gold solution)."""
  return list(tok.encode(text, add_special_tokens=False)) + [token_ids(tok).eos]


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
  return tok.decode([int(i) for i in ids])


def prompt_width(prompts: Sequence[Sequence[int]]) -> int:
  """Static prompt width: the longest prompt rounded up to a multiple of 16."""
  return -(-max(len(p) for p in prompts) // 16) * 16


@dataclasses.dataclass(frozen=True)
class Pieces:
  """What a run's steps and evaluations are built from."""

  recipe: Recipe  # the run's precision recipe: .train, .rollout
  tok: Tokenizer
  encode: Encoder  # prompt text -> ids (--task.prompt_format)
  task: Task  # the configured (or given) task; its held-out split is evaluated
  width: int  # prompt width of the training batches
  mcfg: ModelConfig
  layout: Optional[Layout] = None  # training layout on the mesh (None: one device, no --mesh)
  sample_layout: Optional[Layout] = None  # sampling layout (the params without FSDP)
  kernels: KernelConfig = KernelConfig()  # the run's --kernels.*: every plan is resolved with it

  def rollout_params(self, params):
    """`params` placed for the sampler (a device-to-device copy when the layouts differ)."""
    if self.layout is None:
      return params
    return parallel.switch_layout(params, self.layout, self.sample_layout)[0]
