"""A rollout's prefill traced for a GPU and run here (a plan for `Device("gpu", interpret=True)`): with
gate / up fused and the weights quantized once, SwiGLU's kernel writes h's FP8 groups for the
down GEMM (`layers._quantized_swiglu_applies`). Against the unfused path, which writes h in
bf16 and quantizes it in a pass of its own (`KernelConfig(fused_mlp=False)`): the same FP8 values, so the
same outputs bit for bit, for one MLP and for a whole prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.models import layers
from jetrl.precision import get_recipe
from jetrl.kernels import Device, KernelConfig, resolve_plan
from model_helpers import perturbed, tiny_config

BF16 = jnp.bfloat16
# Head size 128 and widths of whole groups; 2 rows x 192 prompt tokens = 384 rows, more than a
# decode step's 256 and whole 128-row tiles.
CFG = tiny_config("qwen2", vocab=96, d_model=256, heads=(4, 2, 128), d_ff=384, max_seq_len=256)
ROWS, PROMPT = 2, 192
KERNEL = "name=fp8_swiglu_gate_up"


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


@pytest.fixture(scope="module")
def weights():
  params = perturbed(M.init_params(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.05)
  return M.rollout_weights(params, get_recipe("jet").rollout)


def _traced_for_a_gpu(fn, *args, fused: bool):
  """(jaxpr text, outputs) of fn(plan, *args) traced for a GPU and run here, with the plan of
  jet's rollout there, the fused MLP on or off."""
  gpu = Device("gpu", interpret=True, kernels=KernelConfig(fused_mlp=fused))
  plan = resolve_plan(get_recipe("jet").rollout, gpu)
  fresh = lambda: lambda *a: fn(plan, *a)  # a new function each time: JAX caches a trace
  return str(jax.make_jaxpr(fresh())(*args)), jax.jit(fresh())(*args)


def test_the_mlp_of_a_prefill_quantizes_h_in_swiglus_kernel(weights):
  layer = weights["layers"][0]  # a rollout holds its layers unstacked
  assert "w_gate_up" in layer  # the rollout's fused weight
  x = jnp.asarray(np.random.default_rng(0).normal(size=(ROWS, PROMPT, CFG.d_model)), BF16)
  mlp = lambda plan, x, layer: layers.swiglu(x, layer, plan, BF16)
  jaxpr, got = _traced_for_a_gpu(mlp, x, layer, fused=True)
  plain_jaxpr, want = _traced_for_a_gpu(mlp, x, layer, fused=False)
  assert jaxpr.count(KERNEL) == 1 and KERNEL not in plain_jaxpr
  assert got.shape == (ROWS, PROMPT, CFG.d_model) and got.dtype == BF16
  np.testing.assert_array_equal(_bits(got), _bits(want))
  # A decode step's rows (<= 256) keep the unfused path here (the decode step has its own).
  jaxpr, _ = _traced_for_a_gpu(mlp, x[:1, :128], layer, fused=True)
  assert KERNEL not in jaxpr


def test_a_prefill_gives_the_unfused_programs_logits_and_cache(weights):
  prec = get_recipe("jet").rollout
  tokens = jax.random.randint(jax.random.PRNGKey(2), (ROWS, PROMPT), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(PROMPT), (ROWS, PROMPT))

  def prefill(plan, w, t):
    cache = M.init_cache(CFG, ROWS, CFG.max_seq_len)
    mask = jnp.ones((ROWS, PROMPT), bool)
    return M.forward_cached(
      w, CFG, t, cache, positions=pos, token_mask=mask, precision=prec, plan=plan
    )

  jaxpr, (logits, cache) = _traced_for_a_gpu(prefill, weights, tokens, fused=True)
  assert jaxpr.count(KERNEL) >= 1  # inside the layers' loop
  _, (want_logits, want_cache) = _traced_for_a_gpu(prefill, weights, tokens, fused=False)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
  for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v):
    np.testing.assert_array_equal(_bits(a), _bits(b))
