"""absl flags generated from a config tree, a `--config=FILE`, and `--help` grouped by sub-config.

`define_flags(default)` defines one flag per leaf field of the tree, named by the field's
dotted path (`--optimizer.lr`, `--sampling.temperature`, `--model.n_layers`), with the field's
help text, its choices, and the default instance's value as default. Optional fields accept
`none` (or an empty value) for None; tuple fields take comma-separated values.

`config_from_flags(default)` builds the config: the tree of `--config=FILE` if given (else the
default), then every flag that was given on the command line on top of it, like
`ml_collections.config_flags`. A config file is a Python file whose `get_config()` returns the
config (or a nested dict of the fields it changes), or a JSON / YAML file of nested fields (the
`config.json` a run writes in its workdir is one). Values are checked by the config classes
themselves; a bad one is a `FlagError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import textwrap
from typing import Any, Iterator, Optional, Sequence

from absl import flags

from jetrl.config.fields import ConfigError, FlagError, Kind, kinds
from jetrl.config.tree import from_dict, is_config, replace

CONFIG_FLAG = "config"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
  path: str
  kind: Kind
  default: Any
  help: str
  choices: Optional[tuple]
  group: str  # the sub-config's path ("" for the top level)
  group_help: str


def flag_specs(
  default: Any, *, exclude: Sequence[str] = (), prefix: str = "", group_help: str = ""
) -> Iterator[FlagSpec]:
  """The flags of a config tree, top-level fields first, then each sub-config in order.

  `exclude`: paths (fields or whole sub-configs) that are not flags (set by the program)."""
  cls = type(default)
  nodes = []
  for f in dataclasses.fields(cls):
    path = prefix + f.name
    if not f.metadata.get("flag", True) or path in exclude:
      continue
    value = getattr(default, f.name)
    if is_config(value):
      nodes.append((path, value, f.metadata.get("help", "")))
      continue
    yield FlagSpec(
      path,
      kinds(cls)[f.name],
      value,
      f.metadata.get("help", f.name),
      f.metadata.get("choices"),
      prefix.rstrip("."),
      group_help,
    )
  for path, value, help_text in nodes:
    yield from flag_specs(value, exclude=exclude, prefix=path + ".", group_help=help_text)


class _ValueParser(flags.ArgumentParser):
  """Parses one flag value of a `Kind`: scalars, `none` for Optional, lists for tuples."""

  def __init__(self, kind: Kind):
    self.kind = kind

  def _scalar(self, text: str):
    base = self.kind.base
    if base is bool:
      low = text.strip().lower()
      if low in ("true", "t", "1", "yes"):
        return True
      if low in ("false", "f", "0", "no"):
        return False
      raise ValueError(f"expected true or false, got {text!r}")
    try:
      if base is int:
        return int(text, 0) if text.strip().lower().startswith(("0x", "0o", "0b")) else int(text)
      if base is float:
        return float(text)
    except ValueError:
      raise ValueError(f"expected {'an integer' if base is int else 'a number'}, got {text!r}")
    return text

  def parse(self, argument):
    if not isinstance(argument, str):
      return argument  # a default, already typed
    if self.kind.optional and argument.strip().lower() in ("", "none"):
      return None
    if self.kind.is_tuple:
      items = [s.strip() for s in argument.split(",")] if argument.strip() else []
      return tuple(self._scalar(s) for s in items)
    return self._scalar(argument)

  def flag_type(self):
    return self.kind.describe()


class _ValueSerializer(flags.ArgumentSerializer):
  def serialize(self, value):
    if value is None:
      return "none"
    if isinstance(value, tuple):
      return ",".join(str(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def help_line(spec: FlagSpec) -> str:
  text = spec.help
  if spec.choices:
    text += f" One of: {', '.join(str(c) for c in spec.choices)}."
  return text


def define_flags(
  default: Any,
  flag_values: flags.FlagValues = flags.FLAGS,
  *,
  exclude: Sequence[str] = (),
  module_name: Optional[str] = None,
  config_file: bool = True,
) -> list[str]:
  """Defines `--config` and one flag per leaf field of `default`'s tree; returns their names.

  module_name: the module the flags belong to in absl's help (the entry point's, so that
  absl lists them as the program's own flags). config_file: False for a program whose tree
  is only a part of its flags (no `--config`)."""
  names = []
  if config_file and CONFIG_FLAG not in flag_values:
    flags.DEFINE_string(
      CONFIG_FLAG,
      None,
      "A config file: Python (get_config() returns the "
      "config), JSON or YAML (nested fields). Flags given on the command line "
      "override its values.",
      flag_values=flag_values,
      module_name=module_name,
    )
  for spec in flag_specs(default, exclude=exclude):
    if spec.kind.base is bool and not spec.kind.optional and not spec.kind.is_tuple:
      flags.DEFINE_bool(
        spec.path, spec.default, help_line(spec), flag_values=flag_values, module_name=module_name
      )
    else:
      flags.DEFINE(
        _ValueParser(spec.kind),
        spec.path,
        spec.default,
        help_line(spec),
        flag_values,
        _ValueSerializer(),
        module_name=module_name,
      )
    names.append(spec.path)
  return names


MAX_CONFIG_VALUES = 100_000  # a run's whole config is a few hundred


def _check_size(data: Any, path: str) -> None:
  """FlagError (--config) when the file's tree holds more than MAX_CONFIG_VALUES keys and
  values, YAML aliases counted as often as they are used: nine levels of ten aliases (a
  billion strings, a few hundred bytes of YAML) once took 15 GB while an error message
  spelled the value out. Stops counting at the limit."""
  count, todo = 0, [data]
  while todo:
    x = todo.pop()
    count += 1
    if count > MAX_CONFIG_VALUES:
      raise FlagError(
        CONFIG_FLAG,
        f"{path}: holds more than {MAX_CONFIG_VALUES} values once its YAML aliases are "
        "expanded; a config file sets a few hundred fields",
      )
    if isinstance(x, dict):
      todo.extend(x.keys())
      todo.extend(x.values())
    elif isinstance(x, (list, tuple)):
      todo.extend(x)


def load_config_file(path: str, default: Any) -> Any:
  """The config a file describes, on top of `default` (see the module docstring). A Python
  file is executed: it is code the user chose to run, like a reward plugin (docs/reliability.md,
  "Threat model"); JSON and YAML files are read as data."""
  cls = type(default)
  if not os.path.isfile(path):
    raise FlagError(CONFIG_FLAG, f"{path!r} is not a file")
  ext = os.path.splitext(path)[1].lower()
  try:
    if ext == ".py":
      spec = importlib.util.spec_from_file_location("_jetrl_config_file", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      if not hasattr(module, "get_config"):
        raise FlagError(CONFIG_FLAG, f"{path}: defines no get_config()")
      data = module.get_config()
    elif ext == ".json":
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    elif ext in (".yaml", ".yml"):
      import yaml  # pylint: disable=import-outside-toplevel

      with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    else:
      raise FlagError(
        CONFIG_FLAG, f"{path}: unknown kind of file {ext!r}; give a .py, .json, .yaml or .yml file"
      )
  except FlagError:
    raise
  except ConfigError as e:  # raised while get_config() built the config
    raise FlagError(CONFIG_FLAG, f"{path}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except  (a file that does not load or run)
    raise FlagError(CONFIG_FLAG, f"{path}: {type(e).__name__}: {e}") from None
  if isinstance(data, cls):
    return data
  _check_size(data, path)
  if is_config(data):
    raise FlagError(
      CONFIG_FLAG,
      f"{path}: get_config() returned a {type(data).__name__}; this program takes a {cls.__name__}",
    )
  try:
    return from_dict(cls, data, base=default)
  except ConfigError as e:
    raise FlagError(CONFIG_FLAG, f"{path}: {e}") from None


def config_from_flags(
  default: Any, flag_values: flags.FlagValues = flags.FLAGS, *, exclude: Sequence[str] = ()
) -> Any:
  """The config: `--config`'s tree (or `default`), with the flags given on the command line
  applied on top; FlagError naming the flag for a bad value."""
  path = flag_values[CONFIG_FLAG].value if CONFIG_FLAG in flag_values else None
  base = load_config_file(path, default) if path else default
  given = {
    spec.path: flag_values[spec.path].value
    for spec in flag_specs(default, exclude=exclude)
    if flag_values[spec.path].present
  }
  return replace(base, given, error=FlagError)


def grouped_help(default: Any, *, exclude: Sequence[str] = (), width: int = 100) -> str:
  """The flags of a config tree as text, one block per sub-config, each flag with its help
  text and default."""
  lines = [f"  --{CONFIG_FLAG}=FILE"]
  lines += textwrap.wrap(
    "A config file: Python (get_config() returns the config), JSON or YAML; "
    "flags given on the command line override its values.",
    width,
    initial_indent=" " * 6,
    subsequent_indent=" " * 6,
  )
  group = None
  for spec in flag_specs(default, exclude=exclude):
    if spec.group != group:
      group = spec.group
      title = f"--{group}.*" if group else "run"
      lines += ["", f"{title}" + (f": {spec.group_help}" if spec.group_help else "")]
    shown = _ValueSerializer().serialize(spec.default)
    lines.append(f"  --{spec.path}={shown!s}" if shown != "" else f"  --{spec.path}=")
    lines += textwrap.wrap(
      help_line(spec), width, initial_indent=" " * 6, subsequent_indent=" " * 6
    )
  return "\n".join(lines)
