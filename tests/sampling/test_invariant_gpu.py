"""`jet_exact` on a real GPU (Hopper): the invariant kernels compiled through Triton, the
sampler's log-probs against the training forward's bit for bit on a 1.5B-shaped model (random
weights, 2 layers) at 64 rows, and the FP8 GEMM's rows against the same rows among others.

Skipped without an FP8-capable NVIDIA GPU; the same checks run in interpret mode on the CPU
(tests/sampling/test_invariant_rollout.py, tests/precision/test_invariant_gemm.py,
tests/models/test_invariant_attention.py). Part of experiments/gpu_check.py's tests.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.kernels import backend, invariant_gemm
from jetrl.models import get_config, init_params
from jetrl.precision import Fp8Gemm, get_recipe
from jetrl.precision.weights import quantize_2d
from jetrl.rl import make_train_batch, policy_logprobs
from jetrl.sampling import SamplingConfig, sample

pytestmark = pytest.mark.skipif(
  not backend.fp8_gpu_available(), reason="needs an FP8-capable NVIDIA GPU"
)
EXACT = get_recipe("jet_exact")


def test_fp8_gemm_rows_are_batch_invariant_on_the_gpu():
  g = Fp8Gemm(scaling="block")
  rng = np.random.default_rng(0)
  w = quantize_2d(jnp.asarray(rng.standard_normal((1536, 8960)) * 0.02, jnp.bfloat16), g, True)
  x = jnp.asarray(rng.standard_normal((512, 1536)), jnp.bfloat16)
  f = jax.jit(lambda a: invariant_gemm.fp8_fprop(a, w, g, jnp.bfloat16, interpret=False))
  whole = np.asarray(f(x).astype(jnp.float32))
  for m in (1, 7, 64, 256):
    part = np.asarray(f(x[-m:]).astype(jnp.float32))
    np.testing.assert_array_equal(part, whole[-m:], err_msg=f"last {m} rows")


def test_rollout_logprobs_equal_the_training_forward_bitwise_on_the_gpu():
  cfg = dataclasses.replace(get_config("qwen2.5-1.5b"), n_layers=2)
  params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(10, 1000, int(n))) for n in rng.integers(20, 120, 32)]
  sc = SamplingConfig(max_new_tokens=64, temperature=1.0, n=2, prompt_len=128)
  out = jax.tree_util.tree_map(
    np.asarray, sample(params, cfg, prompts, jax.random.PRNGKey(1), sc, EXACT.rollout)
  )
  assert len(out.tokens) == 64
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, np.zeros(64)
  )
  for rows in (slice(0, 64), slice(0, 8), slice(5, 6)):  # the batch, a part, one row
    part = jax.tree_util.tree_map(lambda a: a[rows], batch)
    lp, _ = policy_logprobs(
      params, model_config=cfg, batch=part, precision=EXACT.train, temperature=1.0,
      chunk_size=128,
    )  # fmt: skip
    d = np.abs(np.asarray(lp) - out.logprobs[rows])[out.mask[rows]]
    print(f"jet_exact on the GPU, rows {rows}: max |dlogp| {d.max():.3g} over {d.size} tokens")
    assert d.max() == 0.0
