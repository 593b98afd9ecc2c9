"""Start a jetrl script as several JAX processes: on this machine, or as one process of many.

  python -m jetrl.launch --processes=2 --local_devices=2 -- experiments/train.py --mesh=data:4 ...
  python -m jetrl.launch --processes=2 --process_id=0 --coordinator=10.0.0.1:12345 -- \\
      experiments/train.py ...        # on host 0; the same with --process_id=1 on host 1

Local mode (no --process_id): starts all N processes here, with a coordinator on a free port of
127.0.0.1. Each child gets the variables `jetrl.parallel.maybe_initialize_distributed` reads
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); with --local_devices=K it runs on
the CPU backend with K host devices (XLA_FLAGS=--xla_force_host_platform_device_count=K), so
N x K CPU devices form one global mesh, with gloo collectives between the processes.

One of many (--process_id=I with --coordinator=HOST:PORT): starts process I of N here; run the
same command with each I on its host. Under Slurm, Open MPI or on a TPU pod slice no launcher
is needed: JAX reads the cluster's own variables (docs/scaling.md).

Every line a child prints is printed here prefixed with `[pI] ` (and, with --log_dir, also
written to <log_dir>/process_I.log), but for gloo's "[Gloo] Rank I is connected to ..." lines,
which only the log files get unless --gloo_lines. The children know they were launched
(JETRL_LAUNCHED=1): jetrl's runs then leave the prefix of the other processes' lines to the
launcher. When a child fails (a non-zero exit, or killed by a
signal), the others are stopped (SIGTERM, then SIGKILL after --grace seconds, with everything
they started) and the launcher exits with that child's code (128 + the signal number for a
signal), naming it. A SIGINT or SIGTERM to the launcher is passed on the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

PROG = "python -m jetrl.launch"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG, ...)
LAUNCHED_VAR = "JETRL_LAUNCHED"  # in each child's environment
GLOO_LINE = re.compile(rb"^\[Gloo\] Rank \d+ is connected to ")


class LaunchError(ValueError):
  """A bad launcher flag or environment."""


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """(launcher options, the command) from `argv` (without the program name).

  The command is everything after `--`; a first word ending in `.py` runs with this Python
  (as do `-m module` and `-c code`). LaunchError for a bad value."""
  argv = list(argv)
  if "--" not in argv:
    raise LaunchError(
      "missing `--` before the command, e.g. "
      f"{PROG} --processes=2 -- experiments/train.py --workdir=runs/x"
    )
  split = argv.index("--")
  own, command = argv[:split], argv[split + 1 :]
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--processes", type=int, required=True, help="Processes in the run (N).")
  parser.add_argument(
    "--local_devices",
    type=int,
    default=None,
    help="CPU devices per process (the CPU backend; none: the backend's own devices).",
  )
  parser.add_argument(
    "--process_id",
    type=int,
    default=None,
    help="Start only this process of N here (needs --coordinator); none: all N here.",
  )
  parser.add_argument(
    "--coordinator",
    default=None,
    help="HOST:PORT of process 0's coordinator (default here: 127.0.0.1 and a free port).",
  )
  parser.add_argument(
    "--log_dir", default=None, help="Also write each process's output to LOG_DIR/process_I.log."
  )
  parser.add_argument(
    "--gloo_lines",
    action="store_true",
    help="Also print gloo's '[Gloo] Rank I is connected to ...' lines (default: log files only).",
  )
  parser.add_argument(
    "--grace",
    type=float,
    default=5.0,
    help="Seconds between SIGTERM and SIGKILL when stopping processes.",
  )
  parser.add_argument(
    "--heartbeat_timeout",
    type=int,
    default=None,
    help="Seconds after which JAX declares a silent process dead (JAX's default: 100).",
  )
  try:
    args = parser.parse_args(own)
  except SystemExit as e:  # argparse printed the usage and the error
    raise LaunchError("bad launcher flags (see above)") from e
  if not command:
    raise LaunchError("no command after `--`")
  if args.processes < 1:
    raise LaunchError(f"--processes must be >= 1, got {args.processes}")
  if args.local_devices is not None and args.local_devices < 1:
    raise LaunchError(f"--local_devices must be >= 1, got {args.local_devices}")
  if args.local_devices is not None:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and platforms.split(",")[0].strip().lower() != "cpu":
      raise LaunchError(
        f"--local_devices sets the number of CPU (host) devices, but JAX_PLATFORMS={platforms} "
        "selects another backend; on GPUs or TPUs each process uses its own accelerators "
        "(leave --local_devices out), or unset JAX_PLATFORMS to run on CPU devices"
      )
  if args.process_id is not None:
    if not 0 <= args.process_id < args.processes:
      raise LaunchError(
        f"--process_id must be in [0, {args.processes - 1}] for --processes={args.processes}, "
        f"got {args.process_id}"
      )
    if not args.coordinator:
      raise LaunchError("--process_id needs --coordinator=HOST:PORT (process 0's host)")
  if args.coordinator is not None and not re.fullmatch(r"\S+:\d+", args.coordinator):
    raise LaunchError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
  if args.grace < 0:
    raise LaunchError(f"--grace must be >= 0, got {args.grace}")
  if args.heartbeat_timeout is not None and args.heartbeat_timeout < 1:
    raise LaunchError(f"--heartbeat_timeout must be >= 1, got {args.heartbeat_timeout}")
  if command[0].endswith(".py") or command[0] in ("-m", "-c"):
    command = [sys.executable] + command
  return args, command


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def child_env(
  base: dict, *, process_id: int, processes: int, coordinator: str, local_devices, heartbeat
) -> dict:
  """The environment of process `process_id`."""
  env = dict(base)
  env["JAX_NUM_PROCESSES"] = str(processes)
  env["JAX_PROCESS_ID"] = str(process_id)
  env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
  if processes > 1:
    env["JAX_COORDINATOR_ADDRESS"] = coordinator
    if coordinator.startswith("127.0.0.1:"):  # local: listen on the loopback interface only
      env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
  else:
    env.pop("JAX_COORDINATOR_ADDRESS", None)
  if local_devices is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
  if heartbeat is not None:
    env["JETRL_HEARTBEAT_TIMEOUT"] = str(heartbeat)
  env["PYTHONUNBUFFERED"] = "1"
  env[LAUNCHED_VAR] = "1"
  return env


def _die_with_parent() -> None:
  """In a child before exec: its own process group, and SIGKILL when the launcher dies."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel

    ctypes.CDLL(None, use_errno=True).prctl(_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: the launcher's own handlers remain
    pass


def describe(code: int) -> str:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"was killed by {name}"
  return f"exited with code {code}"


def failure_line(failed: int, code: int, processes: int, procs: dict) -> str:
  """What the launcher says when process `failed` ended with `code`: which peers it stops, and
  which had already ended on their own (e.g. a collective failing on the dead peer's closed
  connection) before the launcher looked."""
  others = [i for i in procs if i != failed and procs[i].poll() is None]
  gone = [i for i in procs if i != failed and procs[i].poll() is not None]
  line = f"process {failed} of {processes} (pid {procs[failed].pid}) {describe(code)}"
  if others:
    line += f"; stopping process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))}"
  for i in gone:
    line += f"; process {i} had already " + describe(procs[i].poll()).replace(
      "was killed", "been killed"
    )
  return line


def exit_code(code: int) -> int:
  return 128 - code if code < 0 else code


class Launch:
  """The children of one launch, their output, and stopping them."""

  def __init__(
    self,
    ids: Sequence[int],
    processes: int,
    command: Sequence[str],
    env_of,
    log_dir,
    gloo_lines: bool = False,
  ):
    self.ids, self.processes, self.command = list(ids), processes, list(command)
    self.gloo_lines = gloo_lines
    self.procs: dict[int, subprocess.Popen] = {}
    self.out_lock = threading.Lock()
    self.threads: list[threading.Thread] = []
    self.logs = {}
    if log_dir:
      os.makedirs(log_dir, exist_ok=True)
    # Every child is started before any reader thread (preexec_fn is unsafe with threads).
    for i in self.ids:
      try:
        self.procs[i] = subprocess.Popen(
          self.command,
          env=env_of(i),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL,
          start_new_session=True,
          preexec_fn=_die_with_parent,
        )
      except OSError as e:
        self.stop(0.0)
        raise LaunchError(f"cannot start {shlex.join(self.command)}: {e}") from None
      if log_dir:
        self.logs[i] = open(os.path.join(log_dir, f"process_{i}.log"), "wb")
    for i in self.ids:
      t = threading.Thread(target=self._pump, args=(i,), daemon=True)
      t.start()
      self.threads.append(t)

  def _pump(self, i: int) -> None:
    prefix = f"[p{i}] ".encode()
    stream = self.procs[i].stdout
    for line in iter(stream.readline, b""):
      if not line.endswith(b"\n"):
        line += b"\n"
      with self.out_lock:
        if self.gloo_lines or not GLOO_LINE.match(line):
          sys.stdout.buffer.write(prefix + line)
          sys.stdout.buffer.flush()
        if i in self.logs:
          self.logs[i].write(line)
          self.logs[i].flush()

  def say(self, message: str) -> None:
    with self.out_lock:
      print(f"{PROG}: {message}", file=sys.stderr, flush=True)

  def wait(self, poll: float = 0.1) -> tuple[Optional[int], int]:
    """Waits until every child has exited 0, or one has failed: (failed id or None, code).

    When several have failed by the same poll, one killed by a signal is named first: the
    others' errors are then its consequence (a peer that lost its collectives exits 1, and on
    a loaded machine it may do so before this loop sees the killed one)."""
    while True:
      codes = {i: self.procs[i].poll() for i in self.ids}
      failed = [(i, c) for i, c in codes.items() if c not in (None, 0)]
      if failed:
        return ([f for f in failed if f[1] < 0] or failed)[0]
      if all(c is not None for c in codes.values()):
        return None, 0
      time.sleep(poll)

  def stop(self, grace: float) -> None:
    """SIGTERM to every running child's process group, SIGKILL to what is left after
    `grace` seconds (a JAX process with the preemption service catches SIGTERM)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
      alive = [p for p in self.procs.values() if p.poll() is None]
      for p in alive:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
      deadline = time.monotonic() + wait
      while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.poll() is None]
        time.sleep(0.05)
    for p in self.procs.values():  # what the children started, in their groups
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass

  def close(self) -> None:
    for t in self.threads:
      t.join(timeout=2.0)
    for f in self.logs.values():
      f.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
  except LaunchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
    return 2
  if args.process_id is None:
    ids = list(range(args.processes))
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
  else:
    ids, coordinator = [args.process_id], args.coordinator

  def env_of(i):
    return child_env(
      os.environ,
      process_id=i,
      processes=args.processes,
      coordinator=coordinator,
      local_devices=args.local_devices,
      heartbeat=args.heartbeat_timeout,
    )

  try:
    launch = Launch(ids, args.processes, command, env_of, args.log_dir, args.gloo_lines)
  except LaunchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
    return 2
  pids = ", ".join(f"p{i} pid {launch.procs[i].pid}" for i in ids)
  where = f", coordinator {coordinator}" if args.processes > 1 else ""
  launch.say(
    f"{len(ids)} of {args.processes} processes started ({pids}{where}): {shlex.join(command)}"
  )

  stopping = {}

  def forward(signum, _frame):
    stopping.setdefault("signal", signum)
    raise KeyboardInterrupt

  signal.signal(signal.SIGTERM, forward)
  try:
    failed, code = launch.wait()
  except KeyboardInterrupt:
    signum = stopping.get("signal", signal.SIGINT)
    launch.say(f"{signal.Signals(signum).name} received: stopping every process")
    launch.stop(args.grace)
    launch.close()
    return 128 + signum
  if failed is None:
    launch.close()
    return 0
  launch.say(failure_line(failed, code, args.processes, launch.procs))
  launch.stop(args.grace)
  launch.close()
  launch.say(f"failed: process {failed} {describe(code)}")
  return exit_code(code)


if __name__ == "__main__":
  sys.exit(main())
