"""Flags whose value changes meaning in float32, the precision a run computes in: a learning
rate of 1e-320 is 0 there (the run once trained with lr 0 and ended "done"), an eps of 1e-300
failed only after compiling with a message naming no flag."""

import json
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


# `--config` files of the wrong types, or with YAML tags that name Python objects: refused with
# a `--config` error naming the file and the field, and never executed.

YAML_TAGS = [
  "!!python/object/apply:os.system ['touch {marker}']",
  "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
  "!!python/name:os.system",
  "!!python/module:os",
]


@pytest.mark.parametrize("tag", YAML_TAGS)
@pytest.mark.parametrize("where", ["top", "steps", "optimizer.lr"])
def test_a_yaml_python_tag_is_refused_never_executed(tmp_path, tag, where):
  from jetrl.config import FlagError
  from jetrl.config.flags import load_config_file

  marker = tmp_path / "marker"
  value = tag.format(marker=marker)
  text = {
    "top": f"{value}\n",
    "steps": f"steps: {value}\n",
    "optimizer.lr": f"optimizer:\n  lr: {value}\n",
  }[where]
  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(
    FlagError,
    match=rf"^--config: {path}: ConstructorError: could not determine a constructor for the tag 'tag:yaml.org,2002:python/",
  ):
    load_config_file(str(path), TrainConfig())
  assert not marker.exists()


@pytest.mark.parametrize(
  "text, says",
  [
    ("steps: ten\n", r"steps: must be an integer in \[1, 2147483647\], got 'ten'"),
    ("steps: true\n", r"steps: must be an integer in \[1, 2147483647\], got True"),
    ("steps: 1.5\n", r"steps: must be an integer in \[1, 2147483647\], got 1.5"),
    ("optimizer: 5\n", r"optimizer: must be a"),
    ("optimizer:\n  lr: [0.1]\n", r"optimizer.lr: must be a"),
    ("seed: 18446744073709551616\n", r"seed: must be in \[0, 4294967295\]"),
    ("- steps\n- 3\n", r"expected a mapping|must be a"),
    ("task:\n  name: {a: 1}\n", r"task.name: must be a"),
  ],
)
def test_a_config_file_of_the_wrong_types_names_the_field(tmp_path, text, says):
  from jetrl.config import FlagError
  from jetrl.config.flags import load_config_file

  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(FlagError, match=rf"^--config: {path}: .*{says}"):
    load_config_file(str(path), TrainConfig())
  json_path = tmp_path / "c.json"
  import yaml

  json_path.write_text(json.dumps(yaml.safe_load(text)))
  with pytest.raises(FlagError, match=rf"^--config: {json_path}: .*{says}"):
    load_config_file(str(json_path), TrainConfig())


def test_a_yaml_alias_bomb_is_refused_in_milliseconds(tmp_path):
  """Nine levels of ten aliases each (10**9 strings if expanded) under a string field: once
  15 GB of memory (the error message spelled the value out) and the process killed."""
  from jetrl.config import FlagError
  from jetrl.config.flags import load_config_file

  lines = ['a0: &a0 "lol"']
  lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 10)]
  path = tmp_path / "c.yaml"
  path.write_text("\n".join(lines) + "\ntask:\n  name: *a9\n")
  import time

  start = time.monotonic()
  with pytest.raises(FlagError, match=rf"^--config: {path}: holds more than 100000 values once"):
    load_config_file(str(path), TrainConfig())
  assert time.monotonic() - start < 5.0
