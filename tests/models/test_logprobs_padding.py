"""The training forward's tokens padded to whole tiles (`logprobs.pad_tokens`, taken when
compiling for a GPU): the real positions' log-probs and entropies are those of the unpadded
forward, since causal attention never lets them see the pads."""

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import models as M
from jetrl.models import logprobs as lp
from jetrl.kernels import Device, resolve_plan
from jetrl.precision import get_recipe
from model_helpers import tiny_config

CFG = tiny_config(vocab=50, d_model=32, heads=(4, 2, 8), d_ff=64, max_seq_len=64)


def test_pad_tokens_by_hand():
  tokens = jnp.asarray([[5, 6, 7], [8, 9, 1]])
  positions = jnp.asarray([[0, 1, 2], [0, 0, 1]])  # a left-padded row
  mask = jnp.asarray([[1, 1, 1], [0, 1, 1]])
  t, g, p, m = lp.pad_tokens(4, tokens, tokens, positions, mask)
  np.testing.assert_array_equal(np.asarray(t), [[5, 6, 7, 0], [8, 9, 1, 0]])
  np.testing.assert_array_equal(np.asarray(p), [[0, 1, 2, 3], [0, 0, 1, 2]])
  np.testing.assert_array_equal(np.asarray(m), [[1, 1, 1, 0], [0, 1, 1, 0]])
  _, _, p, m = lp.pad_tokens(4, tokens, tokens)  # defaults: arange, all real
  np.testing.assert_array_equal(np.asarray(p), [[0, 1, 2, 3]] * 2)
  np.testing.assert_array_equal(np.asarray(m), [[1, 1, 1, 0]] * 2)


def test_padded_forward_gives_the_real_positions_own_values():
  params = M.init_params(CFG, jax.random.PRNGKey(0))
  key = jax.random.PRNGKey(1)
  tokens = jax.random.randint(key, (2, 21), 0, CFG.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  mask = jnp.ones((2, 21), jnp.int32).at[1, :4].set(0)
  pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  want = lp.token_logprobs(params, CFG, tokens, targets, positions=pos, attention_mask=mask)
  padded = lp.pad_tokens(32, tokens, targets, pos, mask)
  got = lp.token_logprobs(params, CFG, padded[0], padded[1], positions=padded[2],
                          attention_mask=padded[3])  # fmt: skip
  real = np.asarray(mask, bool)  # a pad query sees nothing; its output is ignored
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a[:, :21])[real], np.asarray(b)[real], rtol=1e-5)


def test_a_gpu_program_pads_its_tokens():
  params = M.init_params(CFG, jax.random.PRNGKey(0))
  tokens = jnp.zeros((2, 200), jnp.int32)
  bf16 = get_recipe("bf16").train
  f = lambda dev: (
    lambda p, t: lp.token_logprobs(p, CFG, t, t, precision=bf16, plan=resolve_plan(bf16, dev))
  )
  gpu = str(jax.make_jaxpr(f(Device("gpu", interpret=True)))(params, tokens))
  cpu = str(jax.make_jaxpr(f(Device("cpu")))(params, tokens))
  q = "bf16[2,256,4,8]"  # the queries [B, T, H, Dh] of the padded rows
  assert q in gpu and q not in cpu
