"""Runs started from a Hugging Face folder written by `transformers` itself: a random 2-layer
Llama (float32 safetensors, a generation config with two eos ids) and a byte-level BPE
tokenizer trained here, with a ChatML chat template, saved by `PreTrainedTokenizerFast`.

Checked against `transformers` loading the same folder: the prompt ids of `run()` with chat
prompts and a system prompt are `apply_chat_template`'s, the params the run starts from give
the folder model's float32 logits, greedy evaluation gives `generate`'s tokens (which stop on
either eos id), and sampled rows stop on each of the folder's eos ids. Also `--init_from`
on a Hugging Face folder inside `run()`, and `run_sft` given a Task object (its prompts and
gold solutions as the chat template and the tokenizer give them, its first loss the folder
model's negative log-likelihood of them)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import one_torch_thread, quiet, tiny_llama_config
from jetrl.data import Problem, Task, get_task
from jetrl.models import forward
from jetrl.train import evaluation, rl_step, run, run_sft, sft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]  # ids 0, 1, 2, 3
ENDOFTEXT, IM_END, PAD = 0, 2, 3
STOP = {IM_END, ENDOFTEXT}
CHATML = (
  "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
  "{{ '<|im_start|>system\\nYou are a calculator.<|im_end|>\\n' }}{% endif %}"
  "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "Add the numbers."
MAX_NEW = 24  # tiny_train_config's sampling.max_new_tokens


def write_tokenizer(path):
  """A byte-level BPE trained on addition text, saved by transformers (320 ids)."""
  from tokenizers import decoders, models, pre_tokenizers, trainers

  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  corpus = [
    f"{a}+{b}\n{a}+{b}+0={a + b} {(a + b) % 10}\nanswer: {a + b}"
    for a in range(10)
    for b in range(10)
  ] + ["You are a calculator. Add the numbers. system user assistant say echo"]
  backend.train_from_iterator(
    corpus,
    trainers.BpeTrainer(
      vocab_size=320,
      special_tokens=SPECIAL,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    ),
  )
  tok = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|pad|>"
  )
  tok.chat_template = CHATML
  tok.save_pretrained(path)
  assert tok.convert_ids_to_tokens(list(range(4))) == SPECIAL
  return len(tok)


def write_model(path, vocab_size, seed):
  """A random 2-layer Llama in float32 whose samples end on either eos id, often early: the
  lm_head rows of <|endoftext|> and <|im_end|> are scaled by -2 and 3."""
  torch.manual_seed(seed)
  config = tiny_llama_config(
    vocab_size,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=IM_END,
    pad_token_id=PAD,
  )
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
    model.lm_head.weight[ENDOFTEXT] *= -2.0
    model.lm_head.weight[IM_END] *= 3.0
  model.generation_config = transformers.GenerationConfig(
    bos_token_id=1, eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=PAD
  )
  model.save_pretrained(path)


def load(path):
  with one_torch_thread():
    model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
  return model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """Two folders of the same shape and tokenizer, different weights: (path, model, tokenizer)."""
  out = []
  for seed in (0, 1):
    path = tmp_path_factory.mktemp(f"hf{seed}")
    write_model(path, write_tokenizer(path), seed)
    out.append((str(path), *load(path)))
  assert list(out[0][1].generation_config.eos_token_id) == [IM_END, ENDOFTEXT]
  return out


def chat_ids(hf_tok, text, system=SYSTEM):
  messages = [{"role": "system", "content": system}] if system is not None else []
  ids = hf_tok.apply_chat_template(
    messages + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
  )
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_logits(model, ids):
  with one_torch_thread(), torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


class Calls:
  """`jetrl.sampling.sample` as the RL step and the evaluation call it, recorded: the prompts,
  the sampling config, the params (copied to numpy before an update can donate them), the
  model config and the rollout."""

  def __init__(self, monkeypatch):
    self.train, self.eval = [], []
    for module, calls in ((rl_step, self.train), (evaluation, self.eval)):
      monkeypatch.setattr(module, "sample", self._wrap(module.sample, calls))

  @staticmethod
  def _wrap(real, calls):
    def sample(params, model_config, prompts, key, config, precision=None, **kw):
      record = dict(
        prompts=[list(map(int, p)) for p in prompts],
        config=config,
        model_config=model_config,
        params=jax.tree_util.tree_map(lambda a: np.array(a, np.float32), params),
      )
      out = real(params, model_config, prompts, key, config, precision, **kw)
      record["tokens"], record["lengths"] = np.asarray(out.tokens), np.asarray(out.lengths)
      calls.append(record)
      return out

    return sample


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def rows(call):
  """Each row's completion ids, up to its length."""
  return [list(map(int, t[:n])) for t, n in zip(call["tokens"], call["lengths"])]


def chat_run(tiny_train_config, workdir, path, **changes):
  """tiny_train_config's 2-step run on the folder `path` in float32, with chat prompts and a
  system prompt (the same shapes in every test, so the compiled steps are reused)."""
  return tiny_train_config(
    workdir,
    recipe="fp32",
    model={"name": path, "n_layers": None},
    task={"prompt_format": "chat", "system_prompt": SYSTEM},
    **changes,
  )


def test_run_from_a_hf_folder_with_chat_prompts(folders, tiny_train_config, tmp_path, monkeypatch):
  path, model, hf_tok = folders[0]
  calls = Calls(monkeypatch)
  cfg = chat_run(tiny_train_config, tmp_path / "run", path, logging={"samples_every": 1})
  run(cfg, log=quiet)
  assert len(calls.train) == 2 and len(calls.eval) == 2  # 2 steps; evaluation before and after

  # The prompt ids of every rollout are transformers' chat template around the problem.
  samples = read(tmp_path / "run" / "samples.jsonl")  # one row per prompt
  for step, call in enumerate(calls.train, 1):
    texts = [s["prompt"] for s in samples if s["step"] == step]
    assert len(texts) == cfg.prompts_per_step
    assert call["prompts"] == [chat_ids(hf_tok, t) for t in texts]
    assert hf_tok.decode(call["prompts"][0]).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")
  test = get_task("addition", difficulty=1, length=1, seed=cfg.seed).batch("test", 0, 4)
  assert calls.eval[0]["prompts"] == [chat_ids(hf_tok, p.prompt) for p in test]

  # Every sampler call stops on both eos ids: the tokenizer's and the generation config's.
  for call in calls.train + calls.eval:
    assert set(call["config"].stop_ids) == STOP and call["config"].stop_ids[0] == IM_END
    assert call["config"].pad_id == PAD

  # The params the run starts from are the folder's weights: transformers' float32 logits.
  first = calls.train[0]
  assert first["model_config"].n_layers == 2 and first["model_config"].vocab_size == 320
  ids = first["prompts"][0]
  got = np.asarray(forward(first["params"], first["model_config"], np.asarray([ids])))[0]
  assert rel_err(got, hf_logits(model, ids)) <= 1e-5

  # Greedy evaluation before training: transformers' greedy tokens, stopping where generate
  # stops (on either eos id of the generation config).
  want = []
  with one_torch_thread():
    for p in calls.eval[0]["prompts"]:
      out = model.generate(
        torch.tensor([p]),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
      )
      want.append(out[0, len(p) :].tolist())
  assert rows(calls.eval[0]) == want
  assert {r[-1] for r in want} >= STOP  # generate's rows end on each eos id

  # Sampled rows end at their first eos id, whichever it is; rows end on each of them.
  ends = set()
  for call in calls.train + calls.eval:
    for row in rows(call):
      assert not STOP & set(row[:-1]), row
      assert len(row) == MAX_NEW or row[-1] in STOP, row
      ends.add(row[-1])
    for t, length in zip(call["tokens"], call["lengths"]):
      assert set(t[length:].tolist()) <= {PAD}
  assert STOP <= ends, ends
  # samples.jsonl holds the rows' ids, and their text without the eos id.
  for s in samples:
    toks = s["tokens"]
    body = toks[:-1] if toks and toks[-1] in STOP else toks
    assert s["completion"] == hf_tok.decode(body)


def test_init_from_a_hf_folder_in_a_run(folders, tiny_train_config, tmp_path, monkeypatch):
  (path_a, model_a, _), (path_b, model_b, _) = folders
  calls = Calls(monkeypatch)
  run(chat_run(tiny_train_config, tmp_path / "run", path_a, init_from=path_b), log=quiet)
  first = calls.train[0]
  ids = first["prompts"][0]
  got = np.asarray(forward(first["params"], first["model_config"], np.asarray([ids])))[0]
  assert rel_err(got, hf_logits(model_b, ids)) <= 1e-5  # the weights of --init_from
  assert rel_err(got, hf_logits(model_a, ids)) > 1e-2  # not those of --model.name


class Echo(Task):
  """Prompts `say N`, gold solutions `echo N`; reward 0.5 for everything."""

  def __init__(self):
    self.name, self.seed = "echo-sft", 0

  def problem(self, split, index):
    n = (index * 7 + (split == "test")) % 10
    return Problem(prompt=f"say {n}", answer=f"echo {n}", solution=f"echo {n}")

  def reward(self, prompts, completions, answers):
    return [0.5] * len(completions)


def test_sft_on_a_given_task_object(folders, tiny_sft_config, tmp_path, monkeypatch):
  path, model, hf_tok = folders[0]
  batches = []
  real = sft.sft_step

  def step(params, opt_state, batch, **kw):
    batches.append(jax.tree_util.tree_map(np.asarray, batch))
    return real(params, opt_state, batch, **kw)

  monkeypatch.setattr(sft, "sft_step", step)
  task = Echo()
  cfg = tiny_sft_config(
    tmp_path / "sft",
    recipe="fp32",
    steps=2,
    model={"name": path, "n_layers": None},
    task={"prompt_format": "chat", "system_prompt": SYSTEM},
    logging={"every": 1},
  )
  summary = run_sft(cfg, task=task, log=quiet)
  assert len(batches) == 2
  saved = json.loads((tmp_path / "sft" / "sft_config.json").read_text())
  assert saved["task"]["name"] == "echo-sft"
  # The evaluation scores with the given task's reward.
  assert summary["eval_reward"] == 0.5 and summary["eval_accuracy"] == 0.0

  # Each row: the chat prompt of the given task's problem, then its gold solution + eos.
  batch = batches[0]
  t = batch.targets.shape[1]
  width = batch.inputs.shape[1] + 1 - t
  problems = task.batch("train", 0, cfg.batch_size)
  nll = []
  for i, p in enumerate(problems):
    prompt = batch.inputs[i, :width][batch.attention_mask[i, :width]].tolist()
    completion = batch.targets[i][batch.mask[i] > 0].tolist()
    assert prompt == chat_ids(hf_tok, p.prompt)
    assert completion == hf_tok(p.solution, add_special_tokens=False)["input_ids"] + [IM_END]
    seq = prompt + completion
    logits = hf_logits(model, seq[:-1])[len(prompt) - 1 :]
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll += [-logp[j, c] for j, c in enumerate(completion)]
  # The first loss: the folder model's mean negative log-likelihood of those tokens.
  first = read(tmp_path / "sft" / "sft_metrics.jsonl")[0]
  assert first["step"] == 1
  assert first["loss"] == pytest.approx(float(np.mean(nll)), rel=1e-4)
