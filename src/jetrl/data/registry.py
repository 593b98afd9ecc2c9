"""`get_task(name, **kwargs)`: the tasks by name, built-in and registered.

The built-in tasks are in `TASKS`. `register_task(task)` adds a user's own under a new name, so
code that asks for tasks by name (the runner's task option, notebooks) gets it like a built-in:
a `Task` object (returned as is), or a `Task` subclass or factory function (called with the
keyword arguments given to `get_task`, which are checked against its signature).
`task_names()` lists both kinds. See docs/tasks.md ("Your own task").
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Union

from jetrl.data.arithmetic import Addition, Multiplication
from jetrl.data.chat_arithmetic import ChatArithmetic
from jetrl.data.custom_jsonl import JsonlTask
from jetrl.data.gsm8k import GSM8K
from jetrl.data.math500 import Math500
from jetrl.data.sorting import Sorting
from jetrl.data.task import Task

_CLASSES = {
  cls.name: cls
  for cls in (Addition, Multiplication, Sorting, ChatArithmetic, GSM8K, Math500, JsonlTask)
}
TASKS = tuple(_CLASSES)
SYNTHETIC_TASKS = ("addition", "multiplication", "sorting", "chat_arithmetic")
DATASET_TASKS = tuple(t for t in TASKS if t not in SYNTHETIC_TASKS)  # read from files
_USER: dict[str, Any] = {}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def task_names() -> tuple[str, ...]:
  """The built-in task names, then the registered ones (in registration order)."""
  return TASKS + tuple(_USER)


def _signature_names(fn) -> list[str]:
  return [
    p.name
    for p in inspect.signature(fn).parameters.values()
    if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
  ]


def _class_kwargs(cls) -> tuple[str, ...]:
  names: list[str] = []
  for klass in cls.__mro__:
    init = klass.__dict__.get("__init__")
    if init is None or klass is object:
      continue
    names += [n for n in _signature_names(init) if n not in names]
  return tuple(names)


def task_kwargs(name: str) -> tuple[str, ...]:
  """The keyword arguments `get_task(name, ...)` accepts."""
  if name in _USER:
    entry = _USER[name]
    if isinstance(entry, Task):
      return ()
    return _class_kwargs(entry) if inspect.isclass(entry) else tuple(_signature_names(entry))
  return _class_kwargs(task_class(name))


def task_class(name: str):
  """The class of task `name` (ValueError listing the accepted names)."""
  if name in _USER:
    entry = _USER[name]
    return type(entry) if isinstance(entry, Task) else entry
  if name not in _CLASSES:
    raise ValueError(f"unknown task {name!r}; accepted: {list(task_names())}")
  return _CLASSES[name]


def register_task(
  task: Union[Task, type, Callable[..., Task]], name: str | None = None, *, replace: bool = False
) -> str:
  """Make `task` available as `get_task(name)`; returns the name.

  task: a `jetrl.data.Task` object, a `Task` subclass, or a function returning a `Task`.
  name: default `task.name` (the object's or the class's). It may not be a built-in name;
    an already registered name needs `replace=True`.
  """
  is_object = isinstance(task, Task)
  is_class = inspect.isclass(task) and issubclass(task, Task)
  if not (is_object or is_class or (callable(task) and not inspect.isclass(task))):
    raise ValueError(
      f"register_task: expected a jetrl.data.Task object, a Task subclass or a "
      f"function returning a Task, got {type(task).__name__}"
    )
  if name is None:
    name = getattr(task, "name", "") if (is_object or is_class) else getattr(task, "__name__", "")
  if not isinstance(name, str) or not _NAME.match(name):
    raise ValueError(
      f"register_task: the name must be letters, digits, '_', '.' or '-' "
      f"(starting with a letter or digit), got {name!r}; pass name="
    )
  if name in _CLASSES:
    raise ValueError(f"register_task: {name!r} is a built-in task; choose another name")
  if name in _USER and not replace:
    raise ValueError(
      f"register_task: a task {name!r} is already registered; pass replace=True to replace it"
    )
  _USER[name] = task
  return name


def unregister_task(name: str) -> None:
  """Remove a registered task (ValueError for a built-in or unknown name)."""
  if name not in _USER:
    raise ValueError(f"no registered task {name!r}; registered: {list(_USER)}")
  del _USER[name]


def get_task(name: str, **kwargs) -> Task:
  """A task by name: "addition", "multiplication", "sorting", "chat_arithmetic", "gsm8k",
  "math500", "jsonl" (a JSON-lines file of your own: `jetrl.data.custom_jsonl`), or one
  registered with `register_task`.

  Synthetic tasks take difficulty, length, seed, format_weight. Dataset tasks take path, split,
  seed, test_size, shuffle, template, tokenizer, format_weight, and order (gsm8k) or timeout,
  batch_timeout, symbolic (math500). A registered task object takes none; a registered class or
  function takes its own. An unknown name or argument is a ValueError listing the accepted ones.
  """
  entry = _USER.get(name)
  if isinstance(entry, Task):
    if kwargs:
      raise ValueError(
        f"task {name!r} was registered as an object and takes no arguments; got {sorted(kwargs)}"
      )
    return entry
  cls = task_class(name)
  accepted = task_kwargs(name)
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise ValueError(f"task {name!r}: unknown argument(s) {unknown}; accepted: {list(accepted)}")
  task = cls(**kwargs)
  if not isinstance(task, Task):
    raise ValueError(
      f"task {name!r}: its factory returned a {type(task).__name__}, not a jetrl.data.Task"
    )
  return task
