"""Decode-step attention scores against the KV cache in two layouts, on this machine.

  python experiments/bench_cache_layout.py --slots=768

jetrl's cache stores k / v as [L, B, S, Hkv, Dh]. A batched dot over (batch, kv head) first
moves the kv-head axis in front of the slot axis, which costs a copy of the layer's cache at
every step; a cache stored as [B, Hkv, S, Dh] needs no such copy. This times one query's
scores (the QK^T of a decode step) for both layouts.
"""

import time

from absl import app, flags

import jax
import jax.numpy as jnp

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 32, "Rows.")
flags.DEFINE_integer("slots", 768, "Cache slots S.")
flags.DEFINE_integer("kv_heads", 2, "KV heads.")
flags.DEFINE_integer("group", 2, "Query heads per kv head.")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("repeats", 50, "Timed calls.")


def main(argv):
  del argv
  b, s, h, g, d = FLAGS.batch, FLAGS.slots, FLAGS.kv_heads, FLAGS.group, FLAGS.head_dim
  q = jnp.ones((b, 1, h, g, d))
  cases = (("[B, S, Hkv, Dh] (current)", "btkgd,bskd->bkgts", jnp.ones((b, s, h, d))),
           ("[B, Hkv, S, Dh]", "btkgd,bksd->bkgts", jnp.ones((b, h, s, d))))
  print("| cache layout | ms per QK^T |\n|---|---:|")
  for name, spec, k in cases:
    f = jax.jit(lambda q_, k_, spec=spec: jnp.einsum(spec, q_, k_,
                                                     preferred_element_type=jnp.float32))
    f(q, k).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(FLAGS.repeats):
      f(q, k).block_until_ready()
    print(f"| {name} | {(time.perf_counter() - t0) * 1e3 / FLAGS.repeats:.2f} |")


if __name__ == "__main__":
  app.run(main)
