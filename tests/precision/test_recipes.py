"""Recipes: public names, unified flow by construction, hashability, clear errors."""

import dataclasses

import jax
import numpy as np
import pytest

from jetrl.precision import RECIPES, Fp8Gemm, Precision, get_recipe, linear


def test_public_names():
  assert RECIPES == ("fp32", "bf16", "fp8_rollout", "jet", "fp8_tensor", "jet_exact")
  for name in RECIPES:
    r = get_recipe(name)
    assert r.name == name
    hash(r.train), hash(r.rollout)


def test_unknown_recipe_lists_known_ones():
  with pytest.raises(ValueError) as e:
    get_recipe("fp8")
  for name in RECIPES:
    assert name in str(e.value)
  with pytest.raises(ValueError, match="e4m3"):
    get_recipe("jet", grad_fmt="e3m4")


def test_unknown_fields_are_errors_not_defaults():
  with pytest.raises(ValueError, match="scaling"):
    Fp8Gemm(scaling="channel")
  with pytest.raises(ValueError, match="format"):
    Fp8Gemm(fmt="int8")
  with pytest.raises(ValueError, match="compute dtype"):
    Precision("float16")


def test_frozen():
  r = get_recipe("jet")
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.train.fprop.block = 64


def test_jet_rollout_is_the_training_forward():
  r = get_recipe("jet")
  assert r.unified
  assert r.rollout.fprop is r.train.fprop, "same quantizer object, not a copy"
  assert r.rollout.compute_dtype == r.train.compute_dtype
  assert r.rollout.dgrad is None and r.rollout.wgrad is None
  rng = np.random.default_rng(0)
  x = rng.standard_normal((9, 256)).astype(np.float32)
  w = rng.standard_normal((256, 384)).astype(np.float32)
  y_roll = np.asarray(jax.jit(lambda a, b: linear(a, b, r.rollout))(x, w))
  y_train, _ = jax.vjp(lambda a, b: linear(a, b, r.train), x, w)
  np.testing.assert_array_equal(y_roll.view(np.uint16), np.asarray(y_train).view(np.uint16))


def test_recipe_shapes():
  assert not get_recipe("bf16").train.is_fp8 and get_recipe("bf16").unified
  assert get_recipe("fp32").train.compute_dtype == "float32"
  fr = get_recipe("fp8_rollout")
  assert not fr.train.is_fp8 and fr.rollout.fprop is not None and not fr.unified
  ft = get_recipe("fp8_tensor")
  assert ft.train.fprop.scaling == "tensor" and ft.unified
  assert get_recipe("jet", grad_fmt="e5m2").train.dgrad.grad_fmt == "e5m2"


def test_dtype_from_name_maps_compute_dtype_names():
  import jax.numpy as jnp

  from jetrl.precision.formats import dtype_from_name

  assert dtype_from_name("float32") == jnp.float32
  assert dtype_from_name("bfloat16") == jnp.bfloat16
  with pytest.raises(ValueError, match=r"'float16'.*\['bfloat16', 'float32'\]"):
    dtype_from_name("float16")
