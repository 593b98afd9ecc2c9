"""The runner's model, tokenizer, prompt and reward options: --model.tokenizer, every eos id of
the generation config in rollouts and greedy evaluation, --task.prompt_format /
--task.system_prompt, --task.reward, registered and given Task objects, --init_from on a
Hugging Face folder, and experiments/export_hf.py's export of a run.

Everything runs on the 1-layer `tiny` preset with the character tokenizer, or with that
tokenizer written as a Hugging Face tokenizer folder (its ids are known by hand)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest

from conftest import quiet, parse_flags
from jetrl.config import FlagError
from jetrl.data import Problem, Task, char_tokenizer, register_task, unregister_task
from jetrl.models import forward, get_config, init_params
from jetrl.precision import get_recipe
from jetrl.sampling import GenerationConfig, SamplingConfig, sample
from jetrl.train import (
  EvalConfig,
  ModelSpec,
  TaskConfig,
  evaluation,
  pieces,
  run,
  run_sft,
)

CHAT_TEMPLATE = (
  "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
  "{% if add_generation_prompt %}a:{% endif %}"
)
REWARD_FILE = """
def score(prompts, completions, answers):
  return [0.25] * len(completions)
"""


parse = parse_flags


def tokenizer_folder(path, *, eos_ids=None, template=CHAT_TEMPLATE):
  """The character tokenizer as a Hugging Face tokenizer folder (ids 0 pad, 1 bos, 2 eos)."""
  char_tokenizer().save(path)
  cfg = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "pad_token": "<|pad|>",
  }
  if template is not None:
    cfg["chat_template"] = template
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  if eos_ids is not None:
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
  return str(path)


class Echo(Task):
  """Prompts `say N`, answers `echo N`; its own reward is 0.5 for everything."""

  def __init__(self, name):
    self.name, self.seed = name, 0

  def problem(self, split, index):
    n = index % 10
    return Problem(prompt=f"say {n}\n", answer=f"echo {n}", solution=f"echo {n}")

  def reward(self, prompts, completions, answers):
    return [0.5] * len(completions)


class EchoBelow3(Echo):
  """Echo whose own reward (its checker) marks the problems `say 0` .. `say 2` correct and the
  others wrong, whatever the completion."""

  def reward(self, prompts, completions, answers):
    return [1.0 if int(a.split()[1]) < 3 else 0.0 for a in answers]


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_flags_set_the_new_fields(tmp_path):
  cfg = parse(
    [
      "--model.name=tiny",
      f"--model.tokenizer={tmp_path}",
      "--task.prompt_format=chat",
      "--task.system_prompt=be brief",
      "--task.reward=rewards/mine.py:score",
      "--task.reward_timeout=5",
      "--eval.batch=200",
    ]
  )
  assert cfg.model.tokenizer == str(tmp_path) and cfg.task.prompt_format == "chat"
  assert cfg.task.system_prompt == "be brief" and cfg.task.reward == "rewards/mine.py:score"
  assert cfg.task.reward_timeout == 5.0 and cfg.eval.batch == 200


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      {"task.reward": "{tmp}/none.py:score"},
      "--task.reward: reward '{tmp}/none.py:score': file '{tmp}/none.py' does not exist",
    ),
    ({"task.reward": "{tmp}/reward.py:missing"}, "--task.reward: reward '{tmp}/reward.py:missing'"),
    (
      {"task.prompt_format": "chat"},
      "--task.prompt_format: chat needs a tokenizer with a chat "
      "template (in tokenizer_config.json, chat_template.jinja or chat_template.json); this run's "
      "tokenizer (CharTokenizer) has none",
    ),
    (
      {"task.prompt_format": "chat", "model.tokenizer": "{tmp}/plain_tok"},
      "--task.prompt_format: chat needs a tokenizer with a chat template",
    ),
    ({"model.tokenizer": "{tmp}/nowhere"}, "--model.tokenizer: '{tmp}/nowhere' is not a directory"),
    ({"model.tokenizer": "{tmp}"}, "--model.tokenizer: no tokenizer.json in '{tmp}'"),
    ({"task.name": "gsm8k"}, "--model.name: task 'gsm8k' needs a tokenizer: a Hugging Face folder"),
    (
      {"task.name": "chat_arithmetic"},
      "--model.name: task 'chat_arithmetic' needs a tokenizer: a Hugging Face folder",
    ),
    (
      {"init_from": "{tmp}"},
      "--init_from: no checkpoint under {tmp}/checkpoints and no Hugging Face weights",
    ),
  ],
)
@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_start_up_refusals_name_the_flag(
  tmp_path, tiny_train_config, tiny_sft_config, kind, changes, message
):
  (tmp_path / "reward.py").write_text(REWARD_FILE)
  (tmp_path / "plain_tok").mkdir()
  tokenizer_folder(tmp_path / "plain_tok", template=None)
  changes = {k: v.format(tmp=tmp_path) for k, v in changes.items()}
  if kind == "sft":
    if "init_from" in changes:
      pytest.skip("SFT starts from --model.name")
    cfg, go = tiny_sft_config(tmp_path / "w", **changes), run_sft
  else:
    cfg, go = tiny_train_config(tmp_path / "w", **changes), run
  with pytest.raises(FlagError) as e:
    go(cfg, log=quiet)
  assert str(e.value).startswith(message.format(tmp=tmp_path)), str(e.value)
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_prompt_formats_give_the_templates_ids(tmp_path):
  tok = pieces.make_tokenizer(ModelSpec(tokenizer=tokenizer_folder(tmp_path)))
  chars = char_tokenizer()
  chat = pieces.prompt_encoder(TaskConfig(prompt_format="chat", system_prompt="be brief"), tok)
  want = chars.encode("s:be brief\nu:12+3\na:", add_special_tokens=False)  # no bos on top
  assert chat("12+3") == want
  default_system = pieces.prompt_encoder(TaskConfig(prompt_format="chat"), tok)
  assert default_system("12+3") == chars.encode("u:12+3\na:", add_special_tokens=False)
  plain = pieces.prompt_encoder(TaskConfig(), tok)
  assert plain("12+3") == [1] + chars.encode("12+3", add_special_tokens=False)
  # A dataset task under the chat format hands out the user message, not its plain template.
  data = tmp_path / "gsm"
  data.mkdir()
  row = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
  for split in ("train", "test"):
    (data / f"{split}.jsonl").write_text(row + "\n")
  for fmt, prompt in (
    (
      "chat",
      "What is 2 + 3?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    ),
    (
      "plain",
      "Question: What is 2 + 3?\nSolve the problem step by step. Write the final answer "
      'as a number on the last line, in the form "#### <number>".\nAnswer:\n',
    ),
  ):
    task = pieces.make_task(
      TaskConfig(name="gsm8k", data_path=str(data), prompt_format=fmt), seed=0
    )
    assert task.problem("train", 0).prompt == prompt


def _cut(tokens, lengths, stop, pad):
  """Each row of a rollout cut after its first token in `stop` (by hand)."""
  tokens, lengths = np.array(tokens), np.array(lengths)
  for row in range(len(tokens)):
    hits = [t for t in range(lengths[row]) if tokens[row, t] in stop]
    if hits:
      lengths[row] = hits[0] + 1
      tokens[row, hits[0] + 1 :] = pad
  return tokens, lengths


def test_rollouts_and_greedy_evaluation_stop_on_every_eos_id(tmp_path):
  spec = ModelSpec(n_layers=1, tokenizer=tokenizer_folder(tmp_path / "a"))
  tok = pieces.make_tokenizer(spec)
  mcfg = pieces.model_config(spec, tok, 64)
  assert mcfg.vocab_size == 53
  params = init_params(mcfg, jax.random.PRNGKey(3))
  task = pieces.make_task(TaskConfig(difficulty=1, length=1), seed=0)
  prompts = [pieces.encode_prompt(tok, p.prompt) for p in task.batch("test", 0, 4)]

  def rollout(stop, temperature):
    sc = SamplingConfig(
      max_new_tokens=24, temperature=temperature, n=2, stop_ids=stop, pad_id=0, prompt_len=16
    )
    out = sample(params, mcfg, prompts, jax.random.PRNGKey(1), sc)
    return np.asarray(out.tokens), np.asarray(out.lengths)

  # The rollouts with eos alone; a second eos id that both of them generate, not first.
  ref = {t: rollout((2,), t) for t in (1.0, 0.0)}
  counts = {}
  for tokens, lengths in ref.values():
    seen = {int(v) for r in range(len(tokens)) for v in tokens[r, 1 : lengths[r] - 1]}
    for v in seen - {0, 1, 2}:
      counts[v] = counts.get(v, 0) + 1
  k = max((c, v) for v, c in counts.items() if c == 2)[1]
  tok = pieces.make_tokenizer(
    ModelSpec(n_layers=1, tokenizer=tokenizer_folder(tmp_path / "b", eos_ids=[2, k]))
  )
  ids = pieces.token_ids(tok)
  assert ids.stop == (2, k) and ids.eos == 2
  for temperature, (tokens, lengths) in ref.items():
    want_tokens, want_lengths = _cut(tokens, lengths, {2, k}, 0)
    assert (want_lengths < lengths).any()  # the second id ends some row early
    got_tokens, got_lengths = rollout(ids.stop, temperature)
    np.testing.assert_array_equal(got_lengths, want_lengths)
    np.testing.assert_array_equal(got_tokens, want_tokens)
  # Greedy evaluation (n=1: the greedy rows are duplicated in pairs above).
  _, want = _cut(*ref[0.0], {2, k}, 0)
  run_pieces = pieces.Pieces(
    get_recipe("fp32"), tok, functools.partial(pieces.encode_prompt, tok), task, 0, mcfg
  )
  res = evaluation.evaluate(params, run_pieces, None, EvalConfig(size=4), max_new_tokens=24)
  assert res["eval_length"] == pytest.approx(want[::2].mean())


@pytest.fixture(scope="module")
def registered():
  name = register_task(EchoBelow3("echo-registered"))
  yield name
  unregister_task(name)


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory, tiny_train_config, registered):
  """A finished 2-step run on a registered task, scored by a reward file."""
  root = tmp_path_factory.mktemp("reward_run")
  (root / "reward.py").write_text(REWARD_FILE)
  cfg = tiny_train_config(
    root / "run", task={"name": registered, "reward": f"{root}/reward.py:score"}
  )
  lines = []
  summary = run(cfg, log=lines.append)
  return cfg, summary, lines


def test_a_registered_task_scored_by_a_reward_file(reward_run, registered):
  cfg, summary, lines = reward_run
  # The file's reward is 0.25 for everything; accuracy is the task's checker's: problems 0, 1
  # at step 1 (both below 3), 2, 3 at step 2 (one of two), 0 .. 3 held out (three of four).
  records = read(os.path.join(cfg.workdir, "metrics.jsonl"))
  assert [(r["reward_mean"], r["accuracy"]) for r in records] == [(0.25, 1.0), (0.25, 0.5)]
  # Equal rewards in every group: no learning signal, said at each step.
  assert [r["flat_groups"] for r in records] == [1.0, 1.0]
  for step in (1, 2):
    assert (
      f"warning: step {step} has no learning signal: every group's rewards are equal (reward "
      "mean 0.25), so every advantage is 0"
    ) in lines
  # What compiles is said before it does, once, and the step's compiles how long they took.
  for what in ("the sampler (first step", "the update (first step", "the evaluation (first eval"):
    assert sum(what in line and line.endswith("...") for line in lines) == 1, what
  for what in ("the sampler (first step only)", "the update (first step only)"):
    assert sum(line.startswith(f"  compiling {what}: done in ") for line in lines) == 1, what
  console = [line for line in lines if " step 2/2 " in line]
  assert len(console) == 1 and " trunc " in console[0] and " grad_norm " in console[0]
  evals = read(os.path.join(cfg.workdir, "eval.jsonl"))
  assert [(e["eval_reward"], e["eval_accuracy"]) for e in evals] == [(0.25, 0.75)] * 2
  assert summary["eval_after"] == 0.75
  saved = json.loads(open(os.path.join(cfg.workdir, "config.json")).read())
  assert saved["task"]["name"] == registered and saved["task"]["reward"] == cfg.task.reward
  # experiments/evaluate.py on the run's checkpoint gives the run's last evaluation.
  from jetrl.train.evaluate import EvalRunConfig, run_eval

  res = run_eval(
    EvalRunConfig(
      recipe=cfg.recipe,
      init_from=cfg.workdir,
      sampling=GenerationConfig(max_new_tokens=cfg.sampling.max_new_tokens),
      model=cfg.model,
      task=cfg.task,
      eval=cfg.eval,
    ),
    log=quiet,
  )
  keys = ("eval_accuracy", "eval_reward", "eval_length")
  assert {k: res[k] for k in keys} == {k: evals[-1][k] for k in keys}


def test_a_given_task_object_and_what_a_resume_refuses(tmp_path, tiny_train_config):
  cfg = tiny_train_config(tmp_path / "run")
  run(cfg, task=Echo("echo-given"), log=quiet)
  assert [r["reward_mean"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0.5, 0.5]
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["task"]["name"] == "echo-given"
  (tmp_path / "reward.py").write_text(REWARD_FILE)
  spec = f"{tmp_path}/reward.py:score"
  with pytest.raises(FlagError, match=f"--task.reward: checkpoint has None, this run has '{spec}'"):
    run(cfg.replace(task={"reward": spec}), task=Echo("echo-given"), log=quiet)
  with pytest.raises(
    FlagError, match="--task.name: checkpoint has 'echo-given', this run has 'other'"
  ):
    run(cfg, task=Echo("other"), log=quiet)
  with pytest.raises(
    FlagError,
    match="--task.name: names task 'multiplication', but the run was given the task object 'echo-given'",
  ):
    run(cfg.replace(task={"name": "multiplication"}), task=Echo("echo-given"), log=quiet)


def test_export_loads_in_transformers_with_equal_logits(reward_run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from jetrl.train.checkpoint import load_params_from, read_params
  from jetrl.train.export import ExportConfig, export_run

  cfg = reward_run[0]
  out = export_run(ExportConfig(workdir=cfg.workdir, out=str(tmp_path / "hf")), log=quiet)
  params, meta = read_params(cfg.workdir, log=quiet)
  assert meta["step"] == 2
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert list(model.generation_config.eos_token_id) == [2]
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  text = "say 7\n"
  tokens = char_tokenizer().encode(text)
  assert hf_tok(text)["input_ids"] == tokens
  with torch.no_grad():
    want = model(torch.tensor([tokens])).logits.numpy()
  mcfg = dataclasses.replace(get_config("tiny"), n_layers=1, vocab_size=53)
  got = np.asarray(forward(params, mcfg, np.asarray([tokens])))
  assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
  # --init_from reads the exported folder back: the same params.
  again = load_params_from(out, jax.tree_util.tree_map(np.zeros_like, params), log=quiet)
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
  with pytest.raises(FlagError, match="--out: .* exists and is not empty; pass --overwrite"):
    export_run(ExportConfig(workdir=cfg.workdir, out=out), log=quiet)
  with pytest.raises(FlagError, match=r"--step: no checkpoint 9 under .*; it has \[1, 2\]"):
    export_run(ExportConfig(workdir=cfg.workdir, out=str(tmp_path / "x"), step=9), log=quiet)


class LongLater(Echo):
  """100 train problems; the 91st prompt is much longer than the first 64."""

  def num_problems(self, split):
    return 100

  def problem(self, split, index):
    p = super().problem(split, index)
    return p if index != 90 else Problem(prompt="say " + "9" * 70 + "\n", answer="", solution="")


def test_prompt_width_covers_every_prompt_of_a_finite_split():
  tok = char_tokenizer()
  task, width = pieces.load_task(TaskConfig(), seed=0, tok=tok, given=LongLater("long_later"))
  longest = len(tok.encode(task.problem("train", 90).prompt))  # 1 + 4 + 70 + 1 = 76 ids
  assert longest == 76
  assert width == 80 + 16  # rounded up to 16, plus 16
