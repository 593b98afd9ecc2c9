"""The limits a confined worker sets on itself, shared by every worker jetrl starts to handle
hostile text: the sympy worker (`sympy_worker.py`) and the chat-template worker
(`jetrl/models/io/template_worker.py`). The parent's side (starting one in an isolated
interpreter, reading its replies within a time limit, killing it) is `pipes.py`.

The workers run in isolated interpreters (`python -I -B`) that do not import jetrl, so this
file uses the standard library only and a worker loads it by its path."""


def set_limit(which, soft: int, hard=None) -> None:
  """Lowers resource limit `which` to (soft, hard), never above the limit already in force
  (an unprivileged process cannot raise its hard limit)."""
  import resource  # pylint: disable=import-outside-toplevel

  hard = soft if hard is None else hard
  _, current_hard = resource.getrlimit(which)
  if current_hard != resource.RLIM_INFINITY:
    soft, hard = min(soft, current_hard), min(hard, current_hard)
  resource.setrlimit(which, (soft, hard))


def limit_memory_cpu_files(memory_bytes: int, cpu_seconds: int, cpu_hard_seconds=None) -> None:
  """Address space (`memory_bytes`), CPU time (soft `cpu_seconds`, hard `cpu_hard_seconds`,
  past which the kernel ends the process), no core files, no file writes."""
  import resource  # pylint: disable=import-outside-toplevel

  set_limit(resource.RLIMIT_AS, memory_bytes)
  set_limit(resource.RLIMIT_CPU, cpu_seconds, cpu_hard_seconds)
  set_limit(resource.RLIMIT_CORE, 0)
  set_limit(resource.RLIMIT_FSIZE, 0)


def limit_descriptors_and_processes(max_open_files=None, *, required: bool = True) -> None:
  """At most `max_open_files` descriptors (None: as they are) and no child processes. The
  kernel does not apply RLIMIT_NPROC to root; with `required=False` a refusal to set it is
  ignored (the other limits still hold)."""
  import resource  # pylint: disable=import-outside-toplevel

  if max_open_files is not None:
    set_limit(resource.RLIMIT_NOFILE, max_open_files)
  try:
    set_limit(resource.RLIMIT_NPROC, 0)
  except (ValueError, OSError):
    if required:
      raise
