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
transformers). The model is a field of the configuration named by its path, as in
experiments/train.py (--model.name).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from typing import Optional

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared fields

from _fields import PRESET_ONLY, json_out_field, preset_model, recipes_field  # noqa: E402
from jetrl.config import ConfigError, check_fields, field  # noqa: E402
from jetrl.models import get_config, init_params, save_pretrained  # noqa: E402
from jetrl.parallel import make_layout, make_mesh  # noqa: E402
from jetrl.precision import get_recipe  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.train import ModelSpec  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

RENAMED = {"model": "model.name"}


@dataclasses.dataclass(frozen=True)
class BenchSamplerConfig(Tree):
  """experiments/bench_sampler.py's settings."""

  model: ModelSpec = preset_model()
  vocab: int = field(2048, "Vocabulary size of the random model.", lo=1)
  batch: int = field(32, "Prompts per call.", lo=1)
  prompt_len: int = field(64, "Tokens per prompt.", lo=1)
  new_tokens: int = field(128, "Tokens generated per prompt.", lo=1)
  repeats: int = field(3, "Timed calls per setting.", lo=1)
  statistic: str = field(
    "median",
    "Reported time of the timed calls "
    "(min: the least disturbed call, on a machine shared with other jobs).",
    choices=("median", "min"),
  )
  recipes: tuple[str, ...] = recipes_field(
    ("float32", "bf16", "jet", "jet_exact"),
    "jetrl precisions to time (float32: no recipe).",
    extra=("float32",),
  )
  torch_threads: int = field(0, "torch intra-op threads (0: torch's default).", lo=0)
  host_devices: int = field(
    2,
    "CPU only: also run jetrl over a data:N mesh of N host devices (one per core); 1 skips "
    "those rows.",
    lo=1,
  )
  json_out: Optional[str] = json_out_field()

  def __post_init__(self):
    check_fields(self)
    if not self.recipes:
      raise ConfigError("recipes", "give at least one")
    if self.batch % self.host_devices:
      raise ConfigError(
        "batch", f"{self.batch} must be divisible by --host_devices={self.host_devices}"
      )


def _timed(fn, repeats, statistic):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.min(times) if statistic == "min" else np.median(times))


def run(c: BenchSamplerConfig) -> None:
  if c.host_devices > 1:
    # Read when the CPU client starts, i.e. at the first jax call below, not at import.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={c.host_devices}"
    )
  import torch
  import transformers

  if c.torch_threads:
    torch.set_num_threads(c.torch_threads)

  cfg = dataclasses.replace(
    get_config(c.model.name), vocab_size=c.vocab, max_seq_len=c.prompt_len + c.new_tokens
  )
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, c.vocab, size=(c.batch, c.prompt_len))
  n_tokens = c.batch * c.new_tokens
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
        max_new_tokens=c.new_tokens,
        min_new_tokens=c.new_tokens,
        pad_token_id=0,
        eos_token_id=None,
      )
    assert out.shape[1] == c.prompt_len + c.new_tokens

  hf_call()  # warm up
  t = _timed(hf_call, c.repeats, c.statistic)
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

  sc = SamplingConfig(max_new_tokens=c.new_tokens, temperature=1.0, prompt_len=c.prompt_len)
  plist = [list(p) for p in prompts]
  settings = [("jetrl sample", None)]
  if c.host_devices > 1 and jax.default_backend() == "cpu":
    mesh = make_mesh(f"data:{c.host_devices}")
    settings.append((f"jetrl sample, data:{c.host_devices} host devices", mesh))
  for engine, mesh in settings:
    for label in c.recipes:
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
      t = _timed(jet_call, c.repeats, c.statistic)
      # The prefill's share: a call that generates one token (the prefill, one step).
      first = functools.partial(jet_call, dataclasses.replace(sc, max_new_tokens=1))
      first()
      t1 = _timed(first, c.repeats, c.statistic)
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
    f"\nmodel {c.model.name} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}),"
    f" {c.batch} prompts x {c.prompt_len} tokens, {c.new_tokens} new tokens, "
    f"sampling on, {c.statistic} of {c.repeats} calls; jax {jax.__version__}, "
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
  if c.json_out:
    with open(c.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(BenchSamplerConfig(), run, doc=__doc__, exclude=PRESET_ONLY, renamed=RENAMED)
