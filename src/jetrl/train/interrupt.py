"""Ctrl-C during a run's steps: the first interrupt lets the current step finish, then the run
writes a checkpoint of it and stops (`RunInterrupted`); a second one stops the process at once.

`Interrupts` is installed by `jetrl.train.driver.run_steps` around the steps of a run in one
process, from the main thread, when SIGINT has Python's default handler (a terminal, a
notebook's kernel). The signal's C handler writes to a socket (`signal.set_wakeup_fd`), so a
thread of its own hears each interrupt as it comes, even while the main thread waits on a
compile or a device: the first is acknowledged on the console at once and sets `requested`,
which the loop reads after the step; the second ends the process with code 130 there and
then (the workdir's lock is released by the kernel; steps since the last checkpoint are lost,
and rerunning the command resumes from it). Before the steps start, and in a run of several
processes (whose processes could hear it at different steps), Ctrl-C is Python's
KeyboardInterrupt as usual.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


class RunInterrupted(KeyboardInterrupt):
  """A run stopped by an interrupt after the checkpoint of `step` was written in
  `directory`; rerunning it (the same config and workdir) resumes from there."""

  def __init__(self, step: int, directory: str):
    self.step, self.directory = step, directory
    super().__init__(
      f"interrupted: saved the checkpoint of step {step} in {directory}; rerun with the same "
      "config and workdir to resume from it"
    )


class Interrupts:
  """The SIGINT handling of a run's steps (see the module's doc); a context manager. `step`:
  the step running now (1-based), for the acknowledging line."""

  def __init__(self, log: Callable[[str], None] = print, enabled: bool = True):
    self.log = log
    self.requested = False
    self.step = 0
    self.count = 0
    self.enabled = (
      enabled
      and threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    self._sockets: Optional[tuple[socket.socket, socket.socket]] = None
    self._old_fd = -1
    self._thread: Optional[threading.Thread] = None

  def __enter__(self) -> "Interrupts":
    if not self.enabled:
      return self
    r, w = socket.socketpair()
    w.setblocking(False)
    self._sockets = (r, w)
    self._old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, self._handler)  # the wakeup socket's thread says so at once
    self._thread = threading.Thread(target=self._watch, name="jetrl-interrupts", daemon=True)
    self._thread.start()
    return self

  def _watch(self) -> None:
    r = self._sockets[0]
    while True:
      try:
        data = r.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum == signal.SIGINT:
          self.heard()

  def _handler(self, signum, frame) -> None:  # pylint: disable=unused-argument
    self.requested = True  # in the main thread, before the loop's next look

  def heard(self) -> None:
    """One interrupt: the first asks the loop to stop after its step, the second exits."""
    self.count += 1
    if self.count == 1:
      self.requested = True
      self.log(
        f"interrupt: finishing step {self.step}, then saving a checkpoint and stopping "
        "(Ctrl-C again to stop at once, losing the steps since the last checkpoint)"
      )
      return
    self.log(
      "second interrupt: stopped at once; rerun the same command to resume from the last checkpoint"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)

  def __exit__(self, *exc) -> None:
    if self._sockets is None:
      return
    signal.set_wakeup_fd(self._old_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    r, w = self._sockets
    w.close()
    r.shutdown(socket.SHUT_RDWR)
    r.close()
    self._sockets = None
