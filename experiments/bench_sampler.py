"""Tokens per second of jetrl's sampler against `transformers` generate on the same weights.

  python experiments/bench_sampler.py                  # 32 prompts x 64 tokens, 128 new tokens
  python experiments/bench_sampler.py --batch=8 --new_tokens=64 --repeats=3

Both sides sample (temperature 1) the full budget with no stop token, from one random model
built by jetrl and exported with `save_pretrained` (so transformers runs the same weights).
jetrl runs in float32 (plain matmuls: the same arithmetic as torch's float32), and under the
bf16, jet and jet_exact recipes. The first jetrl call of each setting compiles and is not timed.
"first token" times the same call generating one token: the prefill's share of a call (and one
decode step); the rest of "s / call" is the decode loop.

On a CPU, one XLA device runs a decode step's small GEMMs on one core, while torch spreads
its ops over all cores. `--host_devices=N` (default 2, this machine's core count) also runs
each setting with the rows split over N host devices (`--xla_force_host_platform_device_count`,
a `data:N` mesh through `sample(..., layout=...)`): the same multi-device path a GPU run uses,
one device per core. Both kinds of rows are printed. Needs the test extra (torch,
transformers).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import time

from absl import app, flags

import jax
import numpy as np

from jetrl.models import get_config, init_params, save_pretrained
from jetrl.parallel import make_layout, make_mesh
from jetrl.precision import RECIPES, get_recipe
from jetrl.sampling import SamplingConfig, sample

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Model preset (random weights).")
flags.DEFINE_integer("vocab", 2048, "Vocabulary size of the random model.")
flags.DEFINE_integer("batch", 32, "Prompts per call.")
flags.DEFINE_integer("prompt_len", 64, "Tokens per prompt.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("repeats", 3, "Timed calls per setting.")
flags.DEFINE_enum(
  "statistic",
  "median",
  ["median", "min"],
  "Reported time of the timed calls "
  "(min: the least disturbed call, on a machine shared with other jobs).",
)
flags.DEFINE_list(
  "recipes",
  ["float32", "bf16", "jet", "jet_exact"],
  "jetrl precisions to time (float32: no recipe).",
)
flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0: torch's default).")
flags.DEFINE_integer(
  "host_devices",
  2,
  "CPU only: also run jetrl over a data:N mesh of N host "
  "devices (one per core); 1 skips those rows.",
)
flags.DEFINE_string("json_out", None, "Optional path for the results as JSON.")


def _timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.min(times) if FLAGS.statistic == "min" else np.median(times))


def main(argv):
  del argv
  for name in ("batch", "prompt_len", "new_tokens", "repeats", "vocab", "host_devices"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1")
  known = ["float32", *RECIPES]
  unknown = [r for r in FLAGS.recipes if r not in known]
  if unknown or not FLAGS.recipes:
    raise app.UsageError(f"--recipes: {unknown or 'none given'}; choose from {known}")
  if FLAGS.batch % FLAGS.host_devices:
    raise app.UsageError(
      f"--batch={FLAGS.batch} must be divisible by --host_devices={FLAGS.host_devices}"
    )
  if FLAGS.host_devices > 1:
    # Read when the CPU client starts, i.e. at the first jax call below, not at import.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
      f"device_count={FLAGS.host_devices}"
    )
  import torch
  import transformers

  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)

  cfg = dataclasses.replace(
    get_config(FLAGS.model), vocab_size=FLAGS.vocab, max_seq_len=FLAGS.prompt_len + FLAGS.new_tokens
  )
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
      out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=FLAGS.new_tokens,
        min_new_tokens=FLAGS.new_tokens,
        pad_token_id=0,
        eos_token_id=None,
      )
    assert out.shape[1] == FLAGS.prompt_len + FLAGS.new_tokens

  hf_call()  # warm up
  t = _timed(hf_call, FLAGS.repeats)
  rows.append(
    dict(
      engine="transformers generate",
      precision="float32",
      seconds=t,
      tokens_per_s=n_tokens / t,
      first_token_seconds=None,
    )
  )
  print(f"  transformers float32: {n_tokens / t:9.1f} tok/s", flush=True)

  sc = SamplingConfig(max_new_tokens=FLAGS.new_tokens, temperature=1.0, prompt_len=FLAGS.prompt_len)
  plist = [list(p) for p in prompts]
  settings = [("jetrl sample", None)]
  if FLAGS.host_devices > 1 and jax.default_backend() == "cpu":
    mesh = make_mesh(f"data:{FLAGS.host_devices}")
    settings.append((f"jetrl sample, data:{FLAGS.host_devices} host devices", mesh))
  for engine, mesh in settings:
    for label in FLAGS.recipes:
      recipe = None if label == "float32" else label
      prec = get_recipe(recipe).rollout if recipe else None
      layout, p = None, params
      if mesh is not None:
        layout = make_layout(
          mesh, cfg, mode="sample", recipe=get_recipe(recipe) if recipe else None
        )
        p = layout.shard_params(params)
      key = iter(range(1000))

      def jet_call(config=sc):
        out = sample(p, cfg, plist, jax.random.PRNGKey(next(key)), config, prec, layout=layout)
        jax.block_until_ready(out.tokens)
        assert int(out.lengths.min()) == config.max_new_tokens

      jet_call()  # compile
      t = _timed(jet_call, FLAGS.repeats)
      # The prefill's share: a call that generates one token (the prefill, one step).
      first = functools.partial(jet_call, dataclasses.replace(sc, max_new_tokens=1))
      first()
      t1 = _timed(first, FLAGS.repeats)
      rows.append(
        dict(
          engine=engine,
          precision=label,
          seconds=t,
          tokens_per_s=n_tokens / t,
          first_token_seconds=t1,
        )
      )
      print(f"  {engine}, {label}: {n_tokens / t:9.1f} tok/s", flush=True)

  base = rows[0]["tokens_per_s"]
  print(
    f"\nmodel {FLAGS.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}),"
    f" {FLAGS.batch} prompts x {FLAGS.prompt_len} tokens, {FLAGS.new_tokens} new tokens, "
    f"sampling on, {FLAGS.statistic} of {FLAGS.repeats} calls; jax {jax.__version__}, "
    f"torch {torch.__version__}\n"
  )
  print("| engine | precision | s / call | first token, s | tokens/s | vs transformers |")
  print("|---|---|---:|---:|---:|---:|")
  for r in rows:
    r["vs_transformers"] = r["tokens_per_s"] / base
    first = "-" if r["first_token_seconds"] is None else f"{r['first_token_seconds']:.3f}"
    print(
      f"| {r['engine']} | {r['precision']} | {r['seconds']:.2f} | {first} | "
      f"{r['tokens_per_s']:.0f} | {r['vs_transformers']:.2f}x |"
    )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
