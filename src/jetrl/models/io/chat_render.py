"""A chat template rendered in a confined worker process, with a time limit per render.

`TemplateRenderer(template).render(**kwargs)` is `compile_template(template).render(**kwargs)`
run in `jetrl/models/io/template_worker.py` (memory, CPU and output limits there), so that a
template that loops for minutes or allocates gigabytes costs at most `timeout` seconds and
the worker's memory limit, and ends in a `ChatTemplateError` saying which limit it hit. A
template's own errors (`raise_exception(...)`, an undefined name) are `jinja2`'s
`TemplateError`, as when rendered in-process. The worker starts on the first render and is
restarted after a timeout or a death.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import weakref
from typing import Optional

from jetrl.data.pipes import kill_worker, read_line, spawn_confined
from jetrl.models.io import template_worker

WORKER_PATH = template_worker.__file__
RENDER_TIMEOUT = 10.0  # seconds per render
START_TIMEOUT = 60.0


class ChatTemplateError(ValueError):
  """A chat template that ran past its time or memory limit."""


def _kill(proc, owner: Optional[int] = None) -> None:
  if owner is not None and owner != os.getpid():
    return  # a forked copy never kills the worker of the process it was forked from
  kill_worker(proc)


class TemplateRenderer:
  """Renders one chat template in a worker process (see the module docstring)."""

  def __init__(self, template: str, *, timeout: float = RENDER_TIMEOUT):
    self.template = template
    self.timeout = float(timeout)
    self.proc: Optional[subprocess.Popen] = None
    self.owner = None
    self.buffer = b""
    self.next_id = 0
    self.lock = threading.Lock()
    template_worker.check_syntax(template)  # syntax errors here, as before
    self._finalizer = None

  def _start(self) -> None:
    self.proc = spawn_confined(WORKER_PATH)
    self.owner = os.getpid()
    self.buffer = b""
    self._finalizer = weakref.finalize(self, _kill, self.proc, self.owner)
    self.proc.stdin.write((json.dumps({"template": self.template}) + "\n").encode())
    line = self._read(START_TIMEOUT)
    ready = json.loads(line) if line else {}
    if ready.get("ready") is not True:
      self.close()
      raise ChatTemplateError(
        f"the chat template's renderer did not start: {ready.get('error', 'no reply')}"
      )

  def _read(self, timeout: float) -> Optional[bytes]:
    line, self.buffer, _ = read_line(self.proc.stdout.fileno(), self.buffer, timeout)
    return line

  def render(self, **kwargs) -> str:
    with self.lock:
      if self.proc is not None and (self.owner != os.getpid() or self.proc.poll() is not None):
        self.proc = None  # a forked copy's or a dead worker: start a new one
      if self.proc is None:
        self._start()
      self.next_id += 1
      rid = self.next_id
      try:
        self.proc.stdin.write((json.dumps({"id": rid, "kwargs": kwargs}) + "\n").encode())
      except (BrokenPipeError, OSError):
        self.close()
        raise ChatTemplateError("the chat template's renderer died") from None
      line = self._read(self.timeout)
      if line is None:
        died = self.proc.poll() is not None
        self.close()
        if died:
          raise ChatTemplateError(
            "the chat template's renderer died while rendering (past its memory limit of "
            f"{template_worker.MEMORY_LIMIT >> 20} MiB?)"
          )
        raise ChatTemplateError(
          f"the chat template did not finish rendering within {self.timeout:g} s; a chat "
          "template may not loop for that long"
        )
      reply = json.loads(line)
      if reply.get("id") != rid:
        self.close()
        raise ChatTemplateError("the chat template's renderer answered out of turn")
      if "error" in reply:
        kind, error = str(reply.get("type")), str(reply["error"])
        if kind == "MemoryError":
          raise ChatTemplateError(
            f"the chat template ran past its memory limit of "
            f"{template_worker.MEMORY_LIMIT >> 20} MiB or "
            f"{template_worker.MAX_TEXT_CHARS} characters of text ({error or 'MemoryError'})"
          )
        import jinja2  # pylint: disable=import-outside-toplevel

        jinja_kind = hasattr(jinja2.exceptions, kind)  # the template's own error
        raise jinja2.exceptions.TemplateError(error if jinja_kind else f"{kind}: {error}")
      return reply["text"]

  def close(self) -> None:
    proc, self.proc = self.proc, None
    if proc is not None and self.owner == os.getpid():
      _kill(proc)
    if self._finalizer is not None:
      self._finalizer.detach()
      self._finalizer = None
