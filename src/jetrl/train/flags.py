"""absl flags generated from a config dataclass: one flag per field, same name and help.

Because flags are generated from the fields, every flag is read (the field is the flag) and
every config field can be set from the command line.
"""

from __future__ import annotations

import dataclasses
from typing import Type

from absl import flags


def define_flags(config_cls: Type, flag_values=flags.FLAGS) -> None:
  for f in dataclasses.fields(config_cls):
    help_text = f.metadata.get("help", f.name)
    default = f.default
    kind = type(default)
    if kind is bool:
      flags.DEFINE_bool(f.name, default, help_text, flag_values=flag_values)
    elif kind is int:
      flags.DEFINE_integer(f.name, default, help_text, flag_values=flag_values)
    elif kind is float:
      flags.DEFINE_float(f.name, default, help_text, flag_values=flag_values)
    elif kind is str:
      flags.DEFINE_string(f.name, default, help_text, flag_values=flag_values)
    else:
      raise TypeError(f"config field {f.name} has unsupported type {kind}")


def config_from_flags(config_cls: Type, flag_values=flags.FLAGS, **overrides):
  values = {f.name: flag_values[f.name].value for f in dataclasses.fields(config_cls)}
  values.update(overrides)
  return config_cls(**values)
