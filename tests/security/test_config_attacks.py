"""Flags whose value changes meaning in float32, the precision a run computes in: a learning
rate of 1e-320 is 0 there (the run once trained with lr 0 and ended "done"), an eps of 1e-300
failed only after compiling with a message naming no flag."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.config import ConfigError
from jetrl.train import TrainConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  return TrainConfig(workdir=str(tmp_path_factory.mktemp("w") / "run"))


@pytest.mark.parametrize(
  "path, value, shown",
  [
    ("optimizer.lr", 1e-320, "0.0"),
    ("optimizer.eps", 1e-300, "0.0"),
    ("optimizer.max_grad_norm", 1e-300, "0.0"),
    ("optimizer.lr", 1e-40, "9.99994610111476e-41"),  # a subnormal float32, flushed on devices
    ("optimizer.eps", 1e-45, "1.401298464324817e-45"),
  ],
)
def test_values_zero_or_subnormal_in_float32_are_refused(base, path, value, shown):
  with pytest.raises(ConfigError, match=rf"^{path}: must be in \(0, .*in float32.*\({shown} in"):
    base.replace(**{path: value})


def test_normal_small_values_are_accepted(base):
  cfg = base.replace(**{"optimizer.lr": 1e-30, "optimizer.eps": 2e-38})
  assert cfg.optimizer.lr == 1e-30 and cfg.optimizer.eps == 2e-38


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.floats(min_value=1e-330, max_value=1e-30, allow_subnormal=True))
def test_a_tiny_lr_is_accepted_exactly_when_float32_holds_it_as_a_normal_number(base, lr):
  normal = np.float32(lr) >= np.finfo(np.float32).tiny  # the reference: numpy's own cast
  try:
    cfg = base.replace(**{"optimizer.lr": lr})
    accepted = True
    assert cfg.optimizer.lr == lr
  except ConfigError as e:
    accepted = False
    assert str(e).startswith("optimizer.lr:")
  assert accepted == bool(normal), (lr, float(np.float32(lr)))
  assert not math.isnan(lr)
