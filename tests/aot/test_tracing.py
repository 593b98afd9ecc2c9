"""`jetrl.aot.tracing_for`: code outside the project that jits and compiles `sample` inside it
gets the compile report's decode step (the same kernels, kind by kind, in the decode loop)."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest

import jetrl.aot
from jetrl.aot import kernels as _kn
from jetrl.aot import programs
from jetrl.aot.compile import compile_program


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


need_cuda = pytest.mark.skipif(
  not _installed("jax_plugins.xla_cuda12"), reason="the aot extra (CUDA plugin) is missing"
)


def test_unknown_target_lists_the_accepted_ones():
  with pytest.raises(ValueError, match="unknown target 'h2000'; accepted: .*h200"):
    with jetrl.aot.tracing_for("h2000"):
      pass
  with pytest.raises(TypeError, match="target name or a Target"):
    with jetrl.aot.tracing_for(200):
      pass


@need_cuda
def test_sample_jitted_outside_compiles_to_the_reports_decode_step():
  from jetrl.models import get_config, init_params
  from jetrl.precision import get_recipe
  from jetrl.sampling import SamplingConfig, sample

  cfg = dataclasses.replace(get_config("tiny"), n_layers=2, max_seq_len=128)
  recipe = get_recipe("jet")
  prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
  new = 16
  scfg = SamplingConfig(max_new_tokens=new, temperature=1.0, n=1, prompt_len=8)
  with jetrl.aot.tracing_for("h200") as t:
    abstract = jax.eval_shape(
      lambda k: init_params(cfg, k, dtype=jnp.bfloat16), jax.random.PRNGKey(0)
    )
    params = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=t.sharding), abstract
    )
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=t.sharding)
    f = jax.jit(lambda p, k: sample(p, cfg, prompts, k, scfg, recipe.rollout))
    outside = _kn.kernels(f.trace(params, key).lower().compile().as_text(), (new,))
    (_, _, decode) = programs.rollout_programs(
      cfg, recipe, list(t.devices), device=t.device, batch=4, prompt_len=8, new_tokens=new
    )
    report = compile_program(decode, t.target).launches

  def loop(launches):  # the decode loop's kernels (its body runs `new` times, its test new + 1)
    return collections.Counter((k.kind, k.count) for k in launches.kernels if k.count >= new)

  assert loop(outside) == loop(report)
  assert loop(report)[("jetrl_fp8_ffi", new)] == 4 * cfg.n_layers  # q/k/v, o, gate/up, down
  # Outside the context the same call traces for this machine again: nothing is left set.
  f = jax.jit(lambda p, k: sample(p, cfg, prompts, k, scfg, recipe.rollout))
  zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
  text = f.trace(zeros, jax.random.PRNGKey(0))
  assert "jetrl_fp8_blockwise_gemm" not in text.lower().as_text()
