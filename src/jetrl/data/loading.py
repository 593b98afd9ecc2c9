"""Dataset-backed tasks: loading through `datasets`, splitting, seeded shuffles, resuming.

Rows come from the Hugging Face hub (`path=None`, through `datasets`) or from a local JSON-lines
file or directory (`path=...`, read by `jetrl.data.jsonl`). In a directory every `*.jsonl` /
`*.json` file is one source split named after the file (`train.jsonl` -> "train"); a single
file is one source split named after its stem.

Every row is checked when the task first loads (`DatasetTask.row_errors`: required fields
present, of the right type, a non-empty answer), and the first bad one is a ValueError naming
the file, the line and the field (`train.jsonl:188: field 'answer': missing`), so a bad row
cannot stop a run at the step that reaches it (docs/reliability.md).

The task's "train" and "test" splits map onto source splits by `split`:
  None (default): source "train" and "test" when both exist; with a single source split, that
    split is carved in two (below);
  "name": carve source split "name" in two;
  {"train": "a", "test": "b"}: explicit (they may be the same split, e.g. to evaluate on all
    of MATH-500; then train and test overlap).
Carving holds out `test_size` rows (default 20%) for "test" by a fixed permutation that does not
depend on `seed`, so every run sees the same held-out rows.

`problem(split, index)` reads position index of a seeded shuffle of the split: epoch
index // n uses its own permutation (seed, split, epoch), so the stream wraps around with a
reshuffle, and a run resumes by asking for the next index.
"""

from __future__ import annotations

import abc
import glob
import os
import random
import re
from typing import Any, Callable, Mapping

from jetrl.data.jsonl import read_rows
from jetrl.data.prompts import check_template, render_prompt
from jetrl.data.task import SPLITS, Problem, Task, check_index, check_split

_PERM_CACHE = 8


def load_source_splits(
  path: str | os.PathLike | None,
  hub_name: str,
  hub_config: str | None = None,
  check_row: Callable[[dict], list] | None = None,
) -> dict[str, list[dict]]:
  """{source split: rows as dicts} from a local file/dir, or from the hub when path is None.

  `check_row(row)` returns [(field, problem)] for a bad row; the first one found is a
  ValueError naming the file and line (or the hub split and row).
  """
  if path is None:
    import datasets  # heavy: only when a hub dataset is used

    try:
      loaded = datasets.load_dataset(hub_name, hub_config)
    except Exception as e:
      raise RuntimeError(
        f"could not load {hub_name!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
        "pass path= a local JSON-lines file or a directory of them"
      ) from e
    out = {}
    for name, ds in loaded.items():
      rows = ds.to_list()
      _check_rows(
        [(f"{hub_name} split {name!r} row {k}", r) for k, r in enumerate(rows)], check_row
      )
      out[name] = rows
    return out
  path = os.fspath(path)
  if os.path.isdir(path):
    files = sorted(
      glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json"))
    )
    if not files:
      raise ValueError(f"no *.jsonl or *.json files in directory {path!r}")
  elif os.path.isfile(path):
    files = [path]
  else:
    raise ValueError(
      f"path {path!r} is neither a regular file nor a directory (missing, or a FIFO, a "
      "device or a socket); give a JSON-lines file or a directory of them"
    )
  data_files = {}
  for f in files:
    name = re.sub(r"\W", "_", os.path.basename(f).split(".")[0]) or "data"
    if name in data_files:
      raise ValueError(f"two files give source split {name!r} in {path!r}")
    data_files[name] = f
  out = {}
  for name, f in data_files.items():
    rows = read_rows(f)
    _check_rows(rows, check_row)
    out[name] = [r for _, r in rows]
  return out


def _check_rows(rows: list, check_row) -> None:
  if check_row is None:
    return
  for where, row in rows:
    problems = check_row(row)
    if problems:
      field, problem = problems[0]
      raise ValueError(f"{where}: " + (problem if field is None else f"field {field!r}: {problem}"))


def _check_split_arg(split: Any) -> Any:
  if split is None or isinstance(split, str):
    return split
  if (
    isinstance(split, Mapping)
    and set(split) == set(SPLITS)
    and all(isinstance(v, str) for v in split.values())
  ):
    return dict(split)
  raise ValueError(
    f"split must be None, a source split name, or a dict with keys {list(SPLITS)}"
    f" naming source splits; got {split!r}"
  )


class DatasetTask(Task):
  """A task over rows of a dataset; subclasses say how a row becomes a `Problem`."""

  needs_tokenizer = True
  hub_name = ""
  hub_config: str | None = None
  required_columns: tuple[str, ...] = ()

  def __init__(
    self,
    path: str | os.PathLike | None = None,
    split: Any = None,
    seed: int = 0,
    test_size: int | float | None = None,
    shuffle: bool = True,
    template: str = "base",
    tokenizer: Any = None,
    format_weight: float = 0.0,
  ):
    if path is not None and not os.path.exists(path):
      raise ValueError(f"{self.name}: path {os.fspath(path)!r} does not exist")
    if isinstance(seed, bool) or not isinstance(seed, int):
      raise ValueError(f"seed must be an int, got {seed!r}")
    if test_size is not None and (
      isinstance(test_size, bool) or not isinstance(test_size, (int, float)) or test_size <= 0
    ):
      raise ValueError(
        f"test_size must be a positive int (rows) or a fraction in (0, 1), got {test_size!r}"
      )
    self.path = path
    self.split = _check_split_arg(split)
    self.seed = seed
    self.test_size = test_size
    self.shuffle = bool(shuffle)
    self.template = check_template(template, tokenizer)
    self.tokenizer = tokenizer
    self.format_weight = float(format_weight)
    self._splits: dict[str, list[dict]] | None = None
    self._perms: dict[tuple[str, int], list[int]] = {}

  # ---- subclass hooks ------------------------------------------------------------------

  prompt_kind = ""  # which base template of `jetrl.data.prompts` the questions use

  @abc.abstractmethod
  def row_question(self, row: dict) -> str:
    """The question text of a row."""

  @abc.abstractmethod
  def row_answer(self, row: dict) -> str:
    """The reference final answer of a row."""

  @abc.abstractmethod
  def row_solution(self, row: dict) -> str:
    """The gold worked solution of a row (ending in the final answer), or ''."""

  def row_errors(self, row: dict) -> list[tuple[str | None, str]]:
    """[(field, problem)] for a row the task cannot use (checked for every row at load):
    by default, every required column present and a non-empty string."""
    missing = [c for c in self.required_columns if c not in row]
    if missing:
      return [(None, f"the row lacks columns {missing} (it has {sorted(row)})")]
    out = []
    for c in self.required_columns:
      value = row[c]
      if not isinstance(value, str):
        out.append((c, f"must be a string, got {type(value).__name__} {value!r:.40}"))
      elif not value.strip():
        out.append((c, "is empty"))
    return out

  def make_problem(self, row: dict) -> Problem:
    prompt = render_prompt(self.prompt_kind, self.row_question(row), self.template, self.tokenizer)
    return Problem(prompt, self.row_answer(row), self.row_solution(row))

  # ---- loading and splitting -----------------------------------------------------------

  def _load(self) -> dict[str, list[dict]]:
    if self._splits is None:
      try:
        sources = load_source_splits(
          self.path, self.hub_name, self.hub_config, check_row=self.row_errors
        )
      except ValueError as e:
        raise ValueError(f"{self.name}: {e}") from None
      self._splits = self._assign(sources)
    return self._splits

  def _assign(self, sources: dict[str, list[dict]]) -> dict[str, list[dict]]:
    def get(name):
      if name not in sources:
        raise ValueError(f"{self.name}: no source split {name!r}; available: {sorted(sources)}")
      if not sources[name]:
        raise ValueError(f"{self.name}: source split {name!r} is empty")
      return sources[name]

    if isinstance(self.split, dict):
      return {s: get(self.split[s]) for s in SPLITS}
    if self.split is None and all(s in sources for s in SPLITS):
      return {s: get(s) for s in SPLITS}
    if self.split is None and len(sources) != 1:
      raise ValueError(
        f"{self.name}: cannot tell train from test among source splits "
        f"{sorted(sources)}; pass split="
      )
    name = self.split if self.split is not None else next(iter(sources))
    return self._carve(name, get(name))

  def _carve(self, name: str, rows: list[dict]) -> dict[str, list[dict]]:
    n = len(rows)
    size = self.test_size if self.test_size is not None else 0.2
    k = round(size * n) if isinstance(size, float) and size < 1 else int(size)
    if not 1 <= k < n:
      raise ValueError(
        f"{self.name}: test_size={self.test_size!r} leaves no train or no test "
        f"rows out of {n} in source split {name!r}"
      )
    order = list(range(n))
    random.Random(f"{self.name}|holdout").shuffle(order)
    held = sorted(order[:k])
    kept = sorted(order[k:])
    return {"train": [rows[i] for i in kept], "test": [rows[i] for i in held]}

  def rows(self, split: str) -> list[dict]:
    """The rows of a split, in source order."""
    return self._load()[check_split(split)]

  def num_problems(self, split: str) -> int:
    return len(self.rows(split))

  def _permutation(self, split: str, epoch: int) -> list[int]:
    key = (split, epoch)
    perm = self._perms.get(key)
    if perm is None:
      perm = list(range(self.num_problems(split)))
      if self.shuffle:
        random.Random(f"{self.name}|{self.seed}|{split}|{epoch}").shuffle(perm)
      if len(self._perms) >= _PERM_CACHE:
        self._perms.pop(next(iter(self._perms)))
      self._perms[key] = perm
    return perm

  def row_index(self, split: str, index: int) -> int:
    """Which row (in source order) position `index` of the split's stream reads."""
    index = check_index(index)
    n = self.num_problems(split)
    epoch, pos = divmod(index, n)
    return self._permutation(split, epoch)[pos]

  def problem(self, split: str, index: int) -> Problem:
    return self.make_problem(self.rows(split)[self.row_index(split, index)])

  @property
  def max_completion_chars(self) -> int:
    """The longest gold solution in the train split (chars)."""
    return max(len(self.row_solution(r)) for r in self.rows("train"))
