"""Milliseconds per decode step of the cached forward, and per draw of the token sampler.

  python experiments/bench_decode_step.py
  python experiments/bench_decode_step.py --precision=jet --slots_extra=512

Times `forward_cached` for one new token per row against a cache of prompt_len + new_tokens
slots, run `new_tokens` times inside one jitted `fori_loop` (greedy feedback, cache donated),
and, separately, drawing one token per row with `jax.random.categorical` (Gumbel-max) and
with jetrl's two-level inverse-CDF `sample_categorical`. Uses only public entry points, so
the same script can time an older checkout of the decoder.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import models as M
from jetrl.precision import get_recipe

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Model preset (random weights).")
flags.DEFINE_integer("vocab", 2048, "Vocabulary size.")
flags.DEFINE_integer("batch", 32, "Rows.")
flags.DEFINE_integer("prompt_len", 64, "Filled slots before the first step.")
flags.DEFINE_integer("new_tokens", 128, "Decode steps per timed call.")
flags.DEFINE_integer("slots_extra", 0, "Extra empty cache slots (a longer max_len).")
flags.DEFINE_enum(
  "precision", "float32", ["float32", "bf16", "jet", "jet_exact"], "Rollout precision."
)
flags.DEFINE_integer("repeats", 5, "Timed calls (the median is reported).")


def _median_ms(fn, *args):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)) * 1e3


def main(argv):
  del argv
  b, p, n = FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens
  slots = p + n + FLAGS.slots_extra
  cfg = dataclasses.replace(M.get_config(FLAGS.model), vocab_size=FLAGS.vocab, max_seq_len=slots)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  prec = None if FLAGS.precision == "float32" else get_recipe(FLAGS.precision).rollout
  cache_dtype = jnp.float32 if prec is None else jnp.dtype(prec.compute_dtype)

  def rollout_params(params):
    # The sampler's rollout weights without fused projections (prequantized, layers sliced,
    # and jet_exact's gridded LM head); older checkouts lack some of these.
    if hasattr(M, "rollout_weights"):
      return M.rollout_weights(params, prec, fuse=False)
    params = M.prequantize_linear_weights(params, prec)
    unstack = getattr(M, "unstack_layers", None)
    return unstack(params) if unstack else params

  @jax.jit
  def decode(params, cache):
    params = rollout_params(params)

    def body(i, carry):
      cache, tok = carry
      logits, cache = M.forward_cached(
        params,
        cfg,
        tok,
        cache,
        positions=jnp.full((b, 1), p, jnp.int32) + i,
        token_mask=jnp.ones((b, 1), bool),
        precision=prec,
        last_only=True,
      )
      return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]

    return jax.lax.fori_loop(0, n, body, (cache, jnp.zeros((b, 1), jnp.int32)))[1]

  def fresh_cache():
    # The sampler's cache (jet_exact: keys and values kept on their grids) where supported.
    kw = {"precision": prec} if "precision" in inspect.signature(M.init_cache).parameters else {}
    cache = M.init_cache(cfg, b, slots, cache_dtype, **kw)
    return cache._replace(
      index=jnp.int32(p), mask=jnp.broadcast_to(jnp.arange(slots) < p, (b, slots))
    )

  decode(params, fresh_cache())
  step_ms = []
  for _ in range(FLAGS.repeats):
    cache = fresh_cache()
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    jax.block_until_ready(decode(params, cache))
    step_ms.append((time.perf_counter() - t0) * 1e3 / n)

  def draws(fn):
    @jax.jit
    def loop(key, logits):
      def body(i, carry):
        key, acc = carry
        key, sub = jax.random.split(key)
        return key, acc + fn(sub, logits + acc[:, None].astype(jnp.float32) * 1e-9)

      return jax.lax.fori_loop(0, n, body, (key, jnp.zeros((b,), jnp.int32)))[1]

    return _median_ms(loop, jax.random.PRNGKey(0), jnp.zeros((b, FLAGS.vocab))) / n

  rows = [
    ("decode step: forward_cached, greedy", float(np.median(step_ms))),
    (
      "token draw: jax.random.categorical",
      draws(lambda k, x: jax.random.categorical(k, x, axis=-1).astype(jnp.int32)),
    ),
  ]
  try:
    from jetrl.sampling.categorical import sample_categorical

    rows.append(("token draw: jetrl sample_categorical", draws(sample_categorical)))
  except ImportError:
    pass
  print(
    f"\n{FLAGS.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {FLAGS.vocab}), "
    f"{b} rows, {slots} slots, {FLAGS.precision}; jax {jax.__version__}\n"
  )
  print("| what | ms per step |\n|---|---:|")
  for name, ms in rows:
    print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
  app.run(main)
