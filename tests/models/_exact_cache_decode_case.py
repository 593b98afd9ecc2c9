"""A case of tests/models/test_exact_cache.py run in a process of its own (python this_file):
jet_exact's cached decode over a gridded cache, a plain cache and a view of its filled slots
against the full-sequence forward, bit for bit. Compiled after some other tests of the suite in
one process, this program's XLA:CPU compile crashed (a segmentation fault inside
backend_compile, with the suite's fast-compile XLA flags); alone it compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import models as M
from jetrl.precision import get_recipe

EXACT = get_recipe("jet_exact")


def main():
  """Prefill then one token at a time, left padding: the gridded cache, the plain cache
  (gridded whole at every step) and the full-sequence forward give the same logits."""
  cfg = dataclasses.replace(M.get_config("tiny"), vocab_size=300, max_seq_len=64)
  params = jax.tree_util.tree_map(
    lambda a: a * 3.0 if a.ndim >= 2 else a, M.init_params(cfg, jax.random.PRNGKey(0))
  )
  prec = EXACT.rollout
  p, t = 8, 6
  toks = np.random.default_rng(0).integers(1, 300, (3, p + t)).astype(np.int32)
  mask = np.ones((3, p + t), bool)
  mask[0, :3] = False
  mask[2, :5] = False
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
  full = np.asarray(
    M.forward(params, cfg, toks, precision=prec, positions=pos, attention_mask=mask)
  )
  step = jax.jit(
    lambda w, tk, c, ps, m, slots=None: M.forward_cached(
      w, cfg, tk, c, positions=ps, token_mask=m, precision=prec, attend_slots=slots
    ),
    static_argnums=5,
  )

  def decode(weights, cache, views=(None, None)):
    # views: attend_slots of the prefill and of the decode steps (None: the whole cache).
    out = []
    for lo, hi in [(0, p)] + [(i, i + 1) for i in range(p, p + t)]:
      logits, cache = step(
        weights, toks[:, lo:hi], cache, pos[:, lo:hi], mask[:, lo:hi], views[lo > 0]
      )
      out.append(np.asarray(logits))
    return np.concatenate(out, 1)

  gridded = decode(
    M.rollout_weights(params, prec), M.init_cache(cfg, 3, 20, jnp.bfloat16, precision=prec)
  )
  plain = decode(params, M.init_cache(cfg, 3, 20, jnp.bfloat16))
  # Attention over the filled slots only: the prompt's own p, then 16 of the 20.
  viewed = decode(
    M.rollout_weights(params, prec),
    M.init_cache(cfg, 3, 20, jnp.bfloat16, precision=prec),
    views=(p, 16),
  )
  assert np.abs(gridded - full)[mask].max() == 0.0
  assert np.abs(plain - full)[mask].max() == 0.0
  assert np.abs(viewed - full)[mask].max() == 0.0
  print("ok")


if __name__ == "__main__":
  main()
