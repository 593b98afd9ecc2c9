"""A configuration tree as a whole: its values as nested dicts and dotted paths, copies with
fields changed (each node rebuilt and checked), a stored tree read back (legacy values
upgraded), and the facts its fields declare about the whole run (`resumable_paths`,
`former_names`). The fields themselves are declared and checked in `jetrl.config.fields`."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from jetrl.config.fields import ConfigError, kinds


def is_config(x: Any) -> bool:
  return dataclasses.is_dataclass(x) and not isinstance(x, type)


def to_dict(config: Any) -> dict:
  """The config as nested dicts of plain values (tuples kept as tuples)."""
  return dataclasses.asdict(config)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of nested mappings."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, path + "."))
    else:
      out[path] = v
  return out


def leaf_paths(config: Any, prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of every leaf field of a config instance."""
  out = {}
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if is_config(value):
      out.update(leaf_paths(value, f"{prefix}{f.name}."))
    else:
      out[f"{prefix}{f.name}"] = value
  return out


def resumable_paths(cls: type, prefix: str = "") -> tuple[str, ...]:
  """The dotted paths of the fields and nodes of a config class marked resumable (`field(...,
  resumable=True)`, `node(..., resumable=True)`): what may change when a run resumes."""
  out = []
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    if f.metadata.get("resumable", False):
      out.append(path)
    elif kinds(cls)[f.name].is_node:
      out.extend(resumable_paths(kinds(cls)[f.name].base, path + "."))
  return tuple(out)


def former_names(cls: type, prefix: str = "") -> dict[str, str]:
  """{old flag name: the field's path} for every field of a config class that names its former
  flags (`field(..., former=...)`). Those were flags of the top level, so where a node class
  sits at several depths (an RL run's `model` and its study's `sft.model`) the shallowest
  field keeps the name."""
  out = {}
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    found = {old: path for old in f.metadata.get("former", ())}
    if kinds(cls)[f.name].is_node:
      found.update(former_names(kinds(cls)[f.name].base, path + "."))
    for old, new in found.items():
      if old not in out or new.count(".") < out[old].count("."):
        out[old] = new
  return out


def settable(cls: type) -> list[str]:
  """The names of the fields of a config class a user sets (the internal ones, `field(...,
  flag=False)`, such as the sampler's pad id, left out), sorted."""
  return sorted(f.name for f in dataclasses.fields(cls) if f.metadata.get("flag", True))


def closest(name: str, names: Sequence[str], n: int = 3) -> list[str]:
  """The dotted `names` most like `name` (a typo's likely meaning): those of its own node
  whose last part is close to its last part, else (a node misspelt) close as a whole."""
  node, _, leaf = name.rpartition(".")
  same = {c.rpartition(".")[2]: c for c in names if c.rpartition(".")[0] == node}
  found = [same[m] for m in difflib.get_close_matches(leaf, list(same), n=n)]
  return found or difflib.get_close_matches(name, list(names), n=n, cutoff=0.8)


def no_such_field(cls: type, key: str) -> str:
  """What is said of `key`, not a field of `cls`: the settable names closest to it, and all
  of them."""
  names = settable(cls)
  close = closest(key, names)
  hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
  return f"no such field; {hint}{cls.__name__} has {names}"


def _build(make: Callable[[], Any], path: str, error: type) -> Any:
  try:
    return make()
  except ConfigError as e:
    raise e.under(path, error) from None


def replace(
  config: Any, changes: Mapping[str, Any], *, error: type = ConfigError, prefix: str = ""
) -> Any:
  """A copy of `config` with `changes` ({dotted path: value}) applied, sub-configs rebuilt
  bottom-up (each checks itself); an error names the full path (as an `error`)."""
  names = {f.name for f in dataclasses.fields(config)}
  direct, nested = {}, {}
  for path, value in changes.items():
    head, _, rest = path.partition(".")
    if head not in names:
      raise error(f"{prefix}{head}", no_such_field(type(config), head))
    if rest:
      nested.setdefault(head, {})[rest] = value
    else:
      direct[head] = value
  for head, sub in nested.items():
    child = getattr(config, head)
    if not is_config(child):
      raise error(f"{prefix}{head}", f"is a value, not a group of fields: cannot set {sub}")
    direct[head] = replace(child, sub, error=error, prefix=f"{prefix}{head}.")
  if not direct:
    return config
  return _build(lambda: dataclasses.replace(config, **direct), prefix.rstrip("."), error)


def _current_value(md: Mapping, value: Any) -> Any:
  """`value` with a legacy value of its field (`field(legacy=...)`) replaced by what it meant."""
  for old, new in md.get("legacy", ()):
    if type(value) is type(old) and value == old:
      return new
  return value


def upgrade(cls: type, data: Mapping) -> dict:
  """A stored tree (nested mappings, as a config file or a checkpoint's config holds it) of a
  `cls`, with every legacy value (`field(legacy=...)`) replaced by what it meant and every
  field stored under a name it had before (`field(..., former=...)`: SFT's top-level
  `max_new_tokens`, now `sampling.max_new_tokens`) moved to its path, unless that path is
  stored too; other keys that are not fields of `cls` are kept as they are (for the caller to
  report)."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  moved = former_names(cls)
  data = dict(data)
  for key in [k for k in data if k not in fields and k in moved]:
    *nodes, leaf = moved[key].split(".")
    target = data
    for name in nodes:
      if not isinstance(target.get(name, {}), Mapping):
        break
      target[name] = dict(target.get(name, {}))
      target = target[name]
    else:
      if leaf not in target:
        target[leaf] = data.pop(key)
  out = {}
  for key, value in data.items():
    f = fields.get(key)
    if f is None:
      out[key] = value
      continue
    kind = kinds(cls)[key]
    if kind.is_node and isinstance(value, Mapping):
      out[key] = upgrade(kind.base, value)
    else:
      out[key] = _current_value(f.metadata, value)
  return out


def from_dict(
  cls: type, data: Mapping, *, error: type = ConfigError, prefix: str = "", base: Any = None
) -> Any:
  """A `cls` built from nested mappings (a config file, a saved config.json); fields left out
  keep their defaults (or `base`'s values); an unknown key is an error naming it; a legacy
  value (`field(legacy=...)`) is read as what it meant."""
  if not isinstance(data, Mapping):
    raise error(prefix.rstrip(".") or None, f"must be a mapping of fields, got {data!r}")
  data = upgrade(cls, data)
  base = cls() if base is None else base
  changes = {}
  for key, value in data.items():
    path = f"{prefix}{key}"
    child = getattr(base, key, None) if key in kinds(cls) else None
    if is_config(child) and isinstance(value, Mapping):
      changes[key] = from_dict(type(child), value, error=error, prefix=path + ".", base=child)
    else:
      changes[key] = tuple(value) if isinstance(value, list) else value
  unknown = sorted(set(changes) - set(kinds(cls)))
  if unknown:
    raise error(f"{prefix}{unknown[0]}", no_such_field(cls, unknown[0]))
  return _build(lambda: dataclasses.replace(base, **changes), prefix.rstrip("."), error)
