"""Recipes: public names, unified flow by construction, hashability, clear errors."""

import dataclasses

import jax
import numpy as np
import pytest

from jetrl.precision import RECIPES, Fp8Gemm, Precision, get_recipe, linear


def test_public_names():
  assert RECIPES == (
    "fp32",
    "bf16",
    "fp8_rollout",
    "jet",
    "fp8_tensor",
    "jet_exact",
    "fp8_rollout_tensor",
    "fp8_rollout_e5m2",
    "jet_exact_rollout",
    "jet_exact_train",
    "jet_exact_train_bf16_rollout",
    "jet_exact_train_e5m2_rollout",
  )
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


def test_dose_response_rollouts_train_in_bf16_and_round_more():
  """The rollout-only recipes share bf16 training; E5M2 (2 mantissa bits) and one scale per
  tensor round a linear's output further from float64 than the 1x128 / 128x128 E4M3 rollout.
  One scale per tensor costs precision only where the tensor's range outgrows E4M3's normal
  range (2^-6 .. 448): here four tokens of 1e5 times the others' size (LLMs' massive
  activations), which push the other tokens' values into E4M3's subnormals."""
  base = get_recipe("fp8_rollout")
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 256)).astype(np.float32)
  x[:4] *= 1e5
  w = rng.standard_normal((256, 256)).astype(np.float32) / 16
  ref = x[4:].astype(np.float64) @ w.astype(np.float64)

  def err(recipe):
    y = np.asarray(jax.jit(lambda a, b: linear(a, b, recipe.rollout))(x, w), np.float64)[4:]
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)

  for name in ("fp8_rollout_tensor", "fp8_rollout_e5m2"):
    r = get_recipe(name)
    assert r.train == base.train == get_recipe("bf16").train
    assert not r.unified and r.rollout.dgrad is None
    assert err(r) > 1.5 * err(base), name
  assert get_recipe("fp8_rollout_tensor").rollout.fprop.scaling == "tensor"
  assert get_recipe("fp8_rollout_e5m2").rollout.fprop.fmt == "e5m2"


def test_crossover_recipes_compose_the_two_halves():
  jet, exact = get_recipe("jet"), get_recipe("jet_exact")
  a, b = get_recipe("jet_exact_rollout"), get_recipe("jet_exact_train")
  assert a.train == jet.train and a.rollout == exact.rollout
  assert b.train == exact.train and b.rollout == jet.rollout
  assert not a.unified and not b.unified
  assert a.rollout.batch_invariant and not a.train.batch_invariant
  assert b.train.batch_invariant and not b.rollout.batch_invariant


def test_exact_trainer_arms_vary_only_the_rollout():
  # The fourth round's crossover holds the trainer (jet_exact's training step) and varies the
  # rollout. fp8_rollout's rollout is jet's (the same Precision, so the same sampler program),
  # which is why that crossover needs no arm of its own for it.
  exact = get_recipe("jet_exact")
  arms = [get_recipe(n) for n in ("jet_exact_train", "jet_exact_train_bf16_rollout")]
  arms.append(get_recipe("jet_exact_train_e5m2_rollout"))
  for r in arms:
    assert r.train == exact.train and not r.unified
  assert get_recipe("fp8_rollout").rollout == get_recipe("jet").rollout
  assert arms[1].rollout == Precision("bfloat16") and not arms[1].rollout.is_fp8
  assert arms[2].rollout.fprop.fmt == "e5m2" and arms[2].rollout.fprop.scaling == "block"
  assert arms[2].train.fprop.fmt == "e4m3"
