"""Tokens per second of jetrl's sampler against `transformers` generate on the same weights.

  python experiments/bench_sampler.py                  # 32 prompts x 64 tokens, 128 new tokens
  python experiments/bench_sampler.py --batch=8 --new_tokens=64 --repeats=3

Both sides sample (temperature 1) the full budget with no stop token, from one random model
built by jetrl and exported with `save_pretrained` (so transformers runs the same weights).
jetrl runs in float32 (plain matmuls: the same arithmetic as torch's float32), and under the
bf16 and jet recipes. The first jetrl call of each setting compiles and is not timed.
Needs the test extra (torch, transformers).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time

from absl import app, flags

import jax
import numpy as np

from jetrl.models import get_config, init_params, save_pretrained
from jetrl.precision import get_recipe
from jetrl.sampling import SamplingConfig, sample

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Model preset (random weights).")
flags.DEFINE_integer("vocab", 2048, "Vocabulary size of the random model.")
flags.DEFINE_integer("batch", 32, "Prompts per call.")
flags.DEFINE_integer("prompt_len", 64, "Tokens per prompt.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("repeats", 3, "Timed calls per setting (the median is reported).")
flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0: torch's default).")
flags.DEFINE_string("json_out", None, "Optional path for the results as JSON.")


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv):
  del argv
  for name in ("batch", "prompt_len", "new_tokens", "repeats", "vocab"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1")
  import torch
  import transformers
  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)

  cfg = dataclasses.replace(get_config(FLAGS.model), vocab_size=FLAGS.vocab,
                            max_seq_len=FLAGS.prompt_len + FLAGS.new_tokens)
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, FLAGS.vocab, size=(FLAGS.batch, FLAGS.prompt_len))
  n_tokens = FLAGS.batch * FLAGS.new_tokens
  rows = []

  with tempfile.TemporaryDirectory() as d:
    save_pretrained(params, cfg, d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
  ids = torch.tensor(prompts)

  def hf_call():
    with torch.no_grad():
      out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=FLAGS.new_tokens,
                        min_new_tokens=FLAGS.new_tokens, pad_token_id=0, eos_token_id=None)
    assert out.shape[1] == FLAGS.prompt_len + FLAGS.new_tokens

  hf_call()  # warm up
  t = _median_time(hf_call, FLAGS.repeats)
  rows.append(dict(engine="transformers generate", precision="float32", seconds=t,
                   tokens_per_s=n_tokens / t))
  print(f"  transformers float32: {n_tokens / t:9.1f} tok/s", flush=True)

  sc = SamplingConfig(max_new_tokens=FLAGS.new_tokens, temperature=1.0,
                      prompt_len=FLAGS.prompt_len)
  plist = [list(p) for p in prompts]
  for label, prec in (("float32", None), ("bf16", get_recipe("bf16").rollout),
                      ("jet", get_recipe("jet").rollout)):
    key = iter(range(1000))

    def jet_call():
      out = sample(params, cfg, plist, jax.random.PRNGKey(next(key)), sc, prec)
      jax.block_until_ready(out.tokens)
      assert int(out.lengths.min()) == FLAGS.new_tokens

    jet_call()  # compile
    t = _median_time(jet_call, FLAGS.repeats)
    rows.append(dict(engine="jetrl sample", precision=label, seconds=t, tokens_per_s=n_tokens / t))
    print(f"  jetrl {label:8s}: {n_tokens / t:9.1f} tok/s", flush=True)

  base = rows[0]["tokens_per_s"]
  print(f"\nmodel {FLAGS.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}),"
        f" {FLAGS.batch} prompts x {FLAGS.prompt_len} tokens, {FLAGS.new_tokens} new tokens, "
        f"sampling on; jax {jax.__version__}, torch {torch.__version__}\n")
  print("| engine | precision | s / call | tokens/s | vs transformers |")
  print("|---|---|---:|---:|---:|")
  for r in rows:
    r["vs_transformers"] = r["tokens_per_s"] / base
    print(f"| {r['engine']} | {r['precision']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
          f"{r['vs_transformers']:.2f}x |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
