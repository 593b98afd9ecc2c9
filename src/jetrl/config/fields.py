"""Configuration as a tree of frozen dataclasses whose fields describe and check themselves.

A run's configuration is one tree: a top-level dataclass (`TrainConfig`, `SFTConfig`,
`StudyConfig`) whose fields are plain values or nested dataclasses (the model, the task,
sampling, the optimizer, the update, evaluation, checkpoints, logging). Every field is made with
`field(...)`, which records its help text and what it accepts (a set of choices, an integer or
float range); `node(...)` nests a sub-config. Each class calls `check_fields(self)` from its
`__post_init__`, so a config is checked once, when it is built, and a bad value is a
`ConfigError` naming the field, what was wrong and what is accepted. The command-line flags
(`jetrl.config.flags`) are generated from the same fields, with dotted names equal to the
fields' paths (`--optimizer.lr`), so every knob is a flag and every flag is a knob.

Types understood: bool, int, float, str, `Optional[X]` (None is a value, never a sentinel),
`tuple[X, ...]`, and nested config dataclasses. Floats are always checked finite: NaN fails
every comparison, so a range check alone would let it in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import types
import typing
from collections.abc import Mapping
from typing import Any, Optional

INT_MAX = 2**31 - 1  # counts are int32 inside jitted code
SEED_MAX = 2**32 - 1  # a JAX key holds 32 bits of seed: larger seeds would collide


class ConfigError(ValueError):
  """An invalid configuration value. `path` is the field's dotted path, relative to the config
  that raised it (None: the message names the fields itself); `detail` is the message alone."""

  prefix = ""

  def __init__(self, path: Optional[str], message: str):
    self.path = path
    self.detail = message
    super().__init__(message if path is None else f"{self.prefix}{path}: {message}")

  @property
  def flag(self) -> Optional[str]:
    return self.path

  def under(self, parent: str, kind: Optional[type] = None) -> ConfigError:
    """The same error for the field at `parent.path` (as a `kind`, default: this class)."""
    kind = kind or type(self)
    if self.path is None:
      return kind(None, self.detail)
    return kind(f"{parent}.{self.path}" if parent else self.path, self.detail)


class FlagError(ConfigError):
  """An invalid flag value, or one this machine cannot run: `--path: message`."""

  prefix = "--"


# --- declaring fields ---------------------------------------------------------------------


def field(
  default: Any = dataclasses.MISSING,
  help: str = "",
  *,
  choices: Optional[tuple] = None,
  lo: Optional[float] = None,
  hi: Optional[float] = None,
  lo_open: bool = False,
  also: tuple = (),
  flag: bool = True,
  legacy: tuple = (),
  resumable: bool = False,
  former: tuple = (),
) -> Any:
  """A config field: its default, help text and accepted values.

  choices: the accepted values (listed in the help and in the error).
  lo, hi: an inclusive range for an int or float (lo_open: exclude lo).
  also: values accepted outside that range (a temperature of 0, greedy, beside [0.01, 100]).
  flag: False for fields a run fills in itself (never set from the command line).
  legacy: (old, new) pairs: a value an older version stored for this field (`old`, no longer
    accepted) and what it meant (`new`). A stored tree (a config file, a checkpoint's config)
    is read with `old` as `new` (`upgrade`); a flag or a constructor given `old` is an error.
  resumable: the field may change when a run resumes from a checkpoint written with another
    value (jetrl.train.resume); every other field must match the checkpoint's.
  former: flag names this field had before the configuration had nodes (`lr` for
    `--optimizer.lr`): a command line using one is refused with the new name.
  """
  metadata = {
    "help": help,
    "choices": tuple(choices) if choices is not None else None,
    "lo": lo,
    "hi": hi,
    "lo_open": lo_open,
    "also": tuple(also),
    "flag": flag,
    "legacy": tuple(legacy),
    "resumable": resumable,
    "former": tuple(former),
  }
  return dataclasses.field(default=default, metadata=metadata)


def node(default: Any, help: str = "", *, resumable: bool = False) -> Any:
  """A nested sub-config; `default` is an instance (frozen, so it can be shared) or a class.
  resumable: every field below may change when a run resumes (see `field`)."""
  factory = default if isinstance(default, type) else (lambda: default)
  metadata = {"help": help, "flag": True, "resumable": resumable}
  return dataclasses.field(default_factory=factory, metadata=metadata)


# --- types ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
  """What a field holds: `base` (bool, int, float, str or a config class), optionally a tuple
  of them, optionally None."""

  base: type
  optional: bool = False
  is_tuple: bool = False

  @property
  def is_node(self) -> bool:
    return dataclasses.is_dataclass(self.base)

  def describe(self) -> str:
    name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
      self.base, self.base.__name__
    )
    if self.is_tuple:
      name = f"a comma-separated list of {name.split(' ', 1)[-1]}s"
    return f"{name} or none" if self.optional else name


@functools.cache
def kinds(cls: type) -> dict[str, Kind]:
  """{field name: Kind} of a config class (its annotations resolved once)."""
  hints = typing.get_type_hints(cls)
  return {f.name: _kind(hints[f.name], f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)}


def _kind(t: Any, where: str) -> Kind:
  optional = False
  args = typing.get_args(t)
  if typing.get_origin(t) in (typing.Union, types.UnionType):
    rest = [a for a in args if a is not type(None)]
    if len(rest) != 1 or len(args) != 2:
      raise TypeError(f"{where}: only Optional[X] unions are supported, got {t}")
    optional, t = True, rest[0]
    args = typing.get_args(t)
  if typing.get_origin(t) is tuple:
    if len(args) != 2 or args[1] is not Ellipsis:
      raise TypeError(f"{where}: tuples must be tuple[X, ...], got {t}")
    return Kind(args[0], optional, True)
  if t in (bool, int, float, str) or dataclasses.is_dataclass(t):
    return Kind(t, optional, False)
  raise TypeError(f"{where}: unsupported field type {t}")


# --- checks ---------------------------------------------------------------------------------


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def check_int(name: str, value: Any, lo: int, hi: int = INT_MAX) -> int:
  """`value` if it is an int in [lo, hi]; ConfigError naming `name` otherwise."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(name, f"must be an integer in [{lo}, {hi}], got {value!r}")
  if not lo <= value <= hi:
    raise ConfigError(name, f"must be in [{lo}, {hi}], got {value}")
  return value


def check_float(
  name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False
) -> float:
  """`value` if it is a finite number in [lo, hi] (or (lo, hi])."""
  bounded = math.isfinite(lo) or math.isfinite(hi)
  interval = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if bounded else ""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(name, f"must be a finite number{interval}, got {value!r}")
  if not ((lo < value) if lo_open else (lo <= value)) or value > hi:
    raise ConfigError(name, f"must be{interval}, got {value!r}")
  # The run computes in float32: the value must still be in range, and not subnormal, there.
  # The bounds are compared in float32 too: 0.01 is below 0.01 once both are rounded.
  x32, lo32, hi32 = as_float32(value), as_float32(lo), as_float32(hi)
  if (
    not math.isfinite(x32)
    or not ((lo32 < x32) if lo_open else (lo32 <= x32))
    or x32 > hi32
    or 0 < abs(x32) < FLOAT32_TINY
  ):
    raise ConfigError(
      name,
      f"must be{interval} in float32, the precision the run computes in (normal values from "
      f"{FLOAT32_TINY:.2g} to {FLOAT32_MAX:.3g} in magnitude, or 0), got {value!r} "
      f"({x32!r} in float32)",
    )
  return value


def as_float32(value: float) -> float:
  """`value` rounded to float32 (to +-inf past its range, to 0 or a subnormal below it)."""
  try:
    return struct.unpack("<f", struct.pack("<f", value))[0]
  except OverflowError:
    return math.copysign(math.inf, value)


def check_choice(name: str, value: Any, choices: tuple) -> Any:
  if value not in choices:
    raise ConfigError(name, f"{value!r} is not accepted; choose one of {list(choices)}")
  return value


def _check_value(name: str, value: Any, kind: Kind, md: Mapping) -> None:
  base = kind.base
  if dataclasses.is_dataclass(base):
    if not isinstance(value, base):
      raise ConfigError(name, f"must be a {base.__name__}, got {type(value).__name__}")
    return
  if md.get("choices") is not None:
    check_choice(name, value, md["choices"])
    return
  if not isinstance(value, bool) and value in md.get("also", ()):
    return
  if base is bool:
    if not isinstance(value, bool):
      raise ConfigError(name, f"must be true or false, got {value!r}")
  elif base is int:
    lo = md.get("lo")
    check_int(
      name,
      value,
      -INT_MAX - 1 if lo is None else int(lo),
      INT_MAX if md.get("hi") is None else int(md["hi"]),
    )
  elif base is float:
    try:
      check_float(
        name,
        value,
        -math.inf if md.get("lo") is None else md["lo"],
        math.inf if md.get("hi") is None else md["hi"],
        lo_open=md.get("lo_open", False),
      )
    except ConfigError as e:
      if not md.get("also"):
        raise
      also = " or ".join(f"{v:g}" for v in md["also"])
      raise ConfigError(name, f"{e.detail.replace('must be', f'must be {also} or', 1)}") from None
  elif base is str and not isinstance(value, str):
    raise ConfigError(name, f"must be a string, got {value!r}")


def check_fields(config: Any) -> None:
  """Check every field of a config dataclass against its declaration (call it from
  `__post_init__`). Lists given for tuple fields are stored as tuples."""
  for f in dataclasses.fields(config):
    kind = kinds(type(config))[f.name]
    value = getattr(config, f.name)
    if value is None:
      if not kind.optional:
        raise ConfigError(f.name, f"must be {kind.describe()}, got None")
      continue
    if kind.is_tuple:
      if isinstance(value, list):
        value = tuple(value)
        object.__setattr__(config, f.name, value)
      if not isinstance(value, tuple):
        raise ConfigError(f.name, f"must be {kind.describe()}, got {value!r}")
      for item in value:
        _check_value(f.name, item, kind, f.metadata)
    else:
      _check_value(f.name, value, kind, f.metadata)
