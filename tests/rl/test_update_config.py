"""The update's configuration: what the advantage and correction fields accept and refuse."""

import pytest

from jetrl.config import ConfigError
from jetrl.rl import ADVANTAGES, IS_METHODS, LOSSES, UpdateConfig
from jetrl.rl.correction import MASK_METHODS


def test_every_loss_takes_every_advantage_but_dr_grpo_a_group_std():
  for loss in LOSSES:
    for kind in ADVANTAGES:
      if (loss, kind) == ("dr_grpo", "grpo"):
        with pytest.raises(ConfigError, match=r"^advantage: 'grpo' divides .*loss='dr_grpo'"):
          UpdateConfig(loss=loss, advantage=kind)
      else:
        assert UpdateConfig(loss=loss, advantage=kind).resolved_advantage == kind
  assert UpdateConfig(loss="dr_grpo").resolved_advantage == "dr_grpo"
  assert UpdateConfig().resolved_advantage == "grpo"
  with pytest.raises(ConfigError, match="advantage: 'ppo' is not accepted"):
    UpdateConfig(advantage="ppo")
  help_ = UpdateConfig.__dataclass_fields__["advantage"].metadata["help"]
  assert all(kind in help_ for kind in ADVANTAGES)


def test_is_cap_low_only_for_the_masking_corrections():
  for method in IS_METHODS:
    if method in MASK_METHODS:
      assert UpdateConfig(is_method=method, is_cap=5.0, is_cap_low=0.5).is_cap_low == 0.5
    else:
      with pytest.raises(ConfigError, match=rf"^is_cap_low: .*is_method='{method}' has no band"):
        UpdateConfig(is_method=method, is_cap_low=0.5)
  for bad in (0.0, 1.5):
    with pytest.raises(ConfigError, match="is_cap_low"):
      UpdateConfig(is_method="icepop", is_cap_low=bad)
