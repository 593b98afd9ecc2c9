"""The `Sink` protocol every logging backend implements, the completions table's columns, and
`Backend`: how a run opens one from its flags.

A sink gets what the JSON-lines files (the source of truth) get, as it is written: each
record's finite scalars (`scalars`), the step's completions table (`samples`), and,
optionally, the run's configuration (`config`, once, when the run opens its files), the PNG
plots (`artifacts`, when drawn) and a console line saying where it writes and how to look
(`where`). `jetrl.train.sinks.Sinks` fans every call out to the sinks a run has.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Sink(Protocol):
  """A logging backend. `config`, `artifacts` and `where` are optional: `Sinks` calls them
  only on a sink that has them."""

  def scalars(self, step: int, values: dict[str, float]) -> None:
    """A record's finite scalars at `step` (metrics.jsonl's, or eval.jsonl's as eval/*)."""

  def samples(self, step: int, records: list[dict]) -> None:
    """The step's completions table (samples.jsonl's records; `SAMPLE_COLUMNS`)."""

  def close(self) -> None:
    """Flushes and closes; called once, however the run ends."""


# The columns of the completions table (TensorBoard's text, W&B's and MLflow's tables): a
# samples.jsonl record's fields but its token ids. `correct`: the task's checker's verdict;
# `abs_dlogp`: the row's mean over its tokens of |training - rollout log-prob| (None where the
# update did not compare them).
SAMPLE_COLUMNS = (
  "step",
  "row",
  "prompt",
  "completion",
  "answer",
  "reward",
  "correct",
  "length",
  "abs_dlogp",
)


def sample_rows(records: list[dict]) -> list[list]:
  return [[r.get(c) for c in SAMPLE_COLUMNS] for r in records]


@dataclasses.dataclass(frozen=True)
class Backend:
  """A logging backend as a run opens it: `on(logging)` says whether the run's `LoggingConfig`
  turns it on; `open(cfg, prefix, start)` builds its sink on the primary process (`prefix`:
  the run kind's file prefix, "" or "sft_"; `start`: the restored checkpoint's step, 0 on a
  fresh start); `check()` (optional) raises a one-line FlagError when its package is missing,
  before the run starts."""

  name: str
  on: Callable[[object], bool]
  open: Callable[[object, str, int], Optional[Sink]]
  check: Optional[Callable[[], object]] = None
  files: Sequence[str] = ()  # its files in the workdir, moved aside by --overwrite
