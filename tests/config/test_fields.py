"""Config fields check themselves: kinds (Optional, tuple, choices, nested), ranges, finiteness,
errors naming the field's path; replace / from_dict on a tree."""

import dataclasses
from typing import Optional

import pytest

from jetrl.config import (
  ConfigError,
  FlagError,
  check_fields,
  field,
  flatten,
  from_dict,
  leaf_paths,
  node,
  replace,
  to_dict,
  upgrade,
)


@dataclasses.dataclass(frozen=True)
class Leaf:
  rate: float = field(0.5, "a rate", lo=0.0, hi=1.0, lo_open=True)
  count: Optional[int] = field(None, "a count", lo=1)
  kind: str = field("a", "a kind", choices=("a", "b"))
  sizes: tuple[int, ...] = field((1, 2), "sizes", lo=0, hi=9)
  on: bool = field(False, "a switch")

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class Root:
  name: str = field("x", "a name")
  leaf: Leaf = node(Leaf, "the leaf")
  other: Leaf = node(Leaf(rate=1.0, kind="b"), "another leaf")

  def __post_init__(self):
    check_fields(self)
    if self.leaf.kind == self.other.kind == "b":
      raise ConfigError("other.kind", "must differ from leaf.kind")


@pytest.mark.parametrize(
  "kw, message",
  [
    ({"rate": float("nan")}, r"^rate: must be a finite number in \(0, 1\], got nan$"),
    ({"rate": 0.0}, r"^rate: must be in \(0, 1\], got 0.0$"),
    ({"rate": "1"}, r"^rate: must be a finite number in \(0, 1\], got '1'$"),
    ({"count": 0}, r"^count: must be in \[1, 2147483647\], got 0$"),
    ({"count": 1.5}, r"^count: must be an integer in \[1, 2147483647\], got 1.5$"),
    ({"count": True}, r"^count: must be an integer"),
    ({"kind": "c"}, r"^kind: 'c' is not accepted; choose one of \['a', 'b'\]$"),
    ({"sizes": (1, 10)}, r"^sizes: must be in \[0, 9\], got 10$"),
    ({"sizes": 3}, r"^sizes: must be a comma-separated list of integers, got 3$"),
    ({"on": 1}, r"^on: must be true or false, got 1$"),
    ({"kind": None}, r"^kind: must be a string, got None$"),
  ],
)
def test_each_field_checks_its_declaration(kw, message):
  with pytest.raises(ConfigError, match=message):
    Leaf(**kw)


def test_values_none_and_lists():
  assert Leaf(count=None).count is None and Leaf(count=3).count == 3
  assert Leaf(sizes=[3, 4]).sizes == (3, 4)  # a list is stored as a tuple (hashable)
  assert Leaf(rate=1).rate == 1 and Leaf(sizes=()).sizes == ()
  hash(Leaf(sizes=[3, 4]))


def test_tree_replace_and_from_dict_name_the_path():
  root = Root()
  assert replace(root, {"leaf.rate": 0.25, "name": "y"}) == Root(name="y", leaf=Leaf(rate=0.25))
  with pytest.raises(ConfigError, match=r"^leaf.rate: must be in \(0, 1\], got 2$"):
    replace(root, {"leaf.rate": 2})
  with pytest.raises(FlagError, match=r"^--other.rate: must be"):
    replace(root, {"other.rate": -1.0}, error=FlagError)
  with pytest.raises(ConfigError, match=r"^leaf.speed: no such field; Leaf has \['count', "):
    replace(root, {"leaf.speed": 1})
  with pytest.raises(ConfigError, match=r"^other.kind: must differ from leaf.kind$"):
    replace(root, {"leaf.kind": "b"})
  built = from_dict(Root, {"leaf": {"sizes": [5], "on": True}, "name": "z"})
  assert built == Root(name="z", leaf=Leaf(sizes=(5,), on=True))
  assert built.other == Root().other  # fields left out keep their defaults
  with pytest.raises(ConfigError, match=r"^other.size: no such field"):
    from_dict(Root, {"other": {"size": 1}})
  with pytest.raises(ConfigError, match=r"^leaf: must be a mapping of fields, got 3$"):
    from_dict(Leaf, 3, prefix="leaf.")


def test_dicts_and_paths():
  root = Root()
  d = to_dict(root)
  assert d["other"] == {"rate": 1.0, "count": None, "kind": "b", "sizes": (1, 2), "on": False}
  assert flatten(d)["other.kind"] == "b" and flatten(d)["name"] == "x"
  assert leaf_paths(root) == flatten(d)
  assert from_dict(Root, d) == root


@dataclasses.dataclass(frozen=True)
class Renewed:
  limit: Optional[int] = field(None, "a limit (none: no limit)", lo=1, legacy=((0, None),))
  leaf: Leaf = node(Leaf, "a leaf")

  def __post_init__(self):
    check_fields(self)


def test_legacy_values_read_from_stored_trees_only():
  # A stored tree (config file, checkpoint config) reads the old spelling as what it meant.
  assert from_dict(Renewed, {"limit": 0}) == Renewed(limit=None)
  assert from_dict(Renewed, {"limit": 4}).limit == 4
  assert upgrade(Renewed, {"limit": 0, "leaf": {"count": 0}, "gone": 1}) == {
    "limit": None,
    "leaf": {"count": 0},  # a field without legacy values is left alone (and refused later)
    "gone": 1,  # unknown keys are kept for the caller to name
  }
  # Only a value of the old value's type is mapped: False is not 0 here.
  assert upgrade(Renewed, {"limit": False}) == {"limit": False}
  # Given directly, or as a change, the old spelling is an error.
  with pytest.raises(ConfigError, match=r"^limit: must be in \[1, "):
    Renewed(limit=0)
  with pytest.raises(ConfigError, match=r"^limit: must be in \[1, "):
    replace(Renewed(), {"limit": 0})
