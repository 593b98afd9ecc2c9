"""`get_task(name, **kwargs)`: the tasks by name."""

from __future__ import annotations

import inspect

from jetrl.data.arithmetic import Addition, Multiplication
from jetrl.data.gsm8k import GSM8K
from jetrl.data.math500 import Math500
from jetrl.data.sorting import Sorting
from jetrl.data.task import Task

_CLASSES = {cls.name: cls for cls in (Addition, Multiplication, Sorting, GSM8K, Math500)}
TASKS = tuple(_CLASSES)
SYNTHETIC_TASKS = ("addition", "multiplication", "sorting")


def task_kwargs(name: str) -> tuple[str, ...]:
  """The keyword arguments `get_task(name, ...)` accepts."""
  cls = task_class(name)
  names: list[str] = []
  for klass in cls.__mro__:
    init = klass.__dict__.get("__init__")
    if init is None:
      continue
    for p in inspect.signature(init).parameters.values():
      if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) \
          and p.name not in names:
        names.append(p.name)
  return tuple(names)


def task_class(name: str):
  """The class of task `name` (ValueError listing the accepted names)."""
  if name not in _CLASSES:
    raise ValueError(f"unknown task {name!r}; accepted: {list(TASKS)}")
  return _CLASSES[name]


def get_task(name: str, **kwargs) -> Task:
  """A task by name: "addition", "multiplication", "sorting", "gsm8k" or "math500".

  Synthetic tasks take difficulty, length, seed, format_weight. Dataset tasks take path, split,
  seed, test_size, shuffle, template, tokenizer, format_weight, and order (gsm8k) or timeout,
  batch_timeout, symbolic (math500). An unknown name or argument is a ValueError listing the
  accepted ones.
  """
  cls = task_class(name)
  accepted = task_kwargs(name)
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise ValueError(f"task {name!r}: unknown argument(s) {unknown}; accepted: {list(accepted)}")
  return cls(**kwargs)
