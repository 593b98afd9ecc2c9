"""Several processes (hosts): start-up, who writes what, agreeing, and rows across processes.

Start-up (`maybe_initialize_distributed`) reads the environment and nothing else, so every way
of starting a run ends in the same place: `python -m jetrl.launch` (its flags become these
variables), variables set by hand, or a cluster JAX detects itself:

  JAX_COORDINATOR_ADDRESS   HOST:PORT of process 0's coordinator
  JAX_NUM_PROCESSES         number of processes (> 1: a multi-process run)
  JAX_PROCESS_ID            this process, 0 .. JAX_NUM_PROCESSES - 1
  JAX_LOCAL_DEVICE_IDS      optional, read by JAX: the local GPUs this process uses
  JETRL_HEARTBEAT_TIMEOUT   optional: seconds before a silent process is declared dead (100)

or, without them, a Slurm job step with several tasks, Open MPI / PMI with several ranks, or a
TPU pod slice. On the CPU backend the processes' collectives use gloo (JAX's default).

One process, "the primary" (process 0), writes the run's files: metrics, plots, TensorBoard,
the summary; it alone holds the workdir lock. Checkpoints are written by every process (each
its own shards, Orbax). A decision only the primary can make (taking the lock, moving old
files aside) runs there and its outcome, an error included, is sent to every process
(`on_primary`), so all processes stop with the same message instead of some waiting forever
for the others.

Rows: a rollout's rows are sharded over the processes. `owned_rows` says which rows this
process scores (each row exactly once over all processes, also when rows are replicated),
`rows_to_host` reads them from its own shards (never a non-addressable array), and
`gather_rows` puts per-row results (rewards) together on every process.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jetrl.config.fields import ConfigError, FlagError

T = TypeVar("T")

HEARTBEAT_VAR = "JETRL_HEARTBEAT_TIMEOUT"
_MESSAGE_BYTES = 8192


def _env_int(name: str, default: Optional[int] = None, lo: int = 0) -> Optional[int]:
  """An integer environment variable (`default` when unset or empty); ConfigError naming the
  variable when it is not an integer >= lo."""
  text = os.environ.get(name, "").strip()
  if not text:
    return default
  try:
    value = int(text)
  except ValueError:
    raise ConfigError(None, f"environment: {name}={text!r} is not an integer") from None
  if value < lo:
    raise ConfigError(None, f"environment: {name}={value} must be >= {lo}")
  return value


def _loose_int(name: str) -> int:
  try:
    return int(os.environ.get(name, "1") or "1")
  except ValueError:
    return 1


def multi_process_env() -> bool:
  """True when the environment says this run spans several processes.

  Explicit: JAX_NUM_PROCESSES > 1. Auto-detected clusters: a Slurm job step with several
  tasks, Open MPI / PMI with several ranks, or a TPU pod slice (several TPU worker hostnames).
  """
  if _loose_int("JAX_NUM_PROCESSES") > 1:
    return True
  if "JAX_NUM_PROCESSES" in os.environ:  # set to 1 (e.g. by the launcher): one process
    return False
  if os.environ.get("SLURM_JOB_ID") and _loose_int("SLURM_NTASKS") > 1:
    return True
  if _loose_int("OMPI_COMM_WORLD_SIZE") > 1 or _loose_int("PMI_SIZE") > 1:
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h.strip()]) > 1


def distributed_kwargs() -> dict:
  """The arguments of `jax.distributed.initialize` the environment gives explicitly (the rest
  JAX detects from the cluster); ConfigError for a variable that is set wrong."""
  n = _env_int("JAX_NUM_PROCESSES", lo=1)
  pid = _env_int("JAX_PROCESS_ID", lo=0)
  address = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
  kwargs: dict[str, Any] = {}
  if n is not None and n > 1:
    kwargs["num_processes"] = n
    if pid is None:
      raise ConfigError(
        None, f"environment: JAX_NUM_PROCESSES={n} but JAX_PROCESS_ID is not set (0 .. {n - 1})"
      )
    if pid >= n:
      raise ConfigError(
        None, f"environment: JAX_PROCESS_ID={pid} is not below JAX_NUM_PROCESSES={n}"
      )
    kwargs["process_id"] = pid
  if address:
    if ":" not in address:
      raise ConfigError(None, f"environment: JAX_COORDINATOR_ADDRESS={address!r} is not HOST:PORT")
    kwargs["coordinator_address"] = address
  heartbeat = _env_int(HEARTBEAT_VAR, lo=1)
  if heartbeat is not None:
    kwargs["heartbeat_timeout_seconds"] = heartbeat
  return kwargs


def maybe_initialize_distributed(log: Callable[[str], None] = print) -> bool:
  """Call `jax.distributed.initialize()` when the environment says there are several
  processes (see the module docstring); a no-op otherwise and when already initialized.

  Must run before any JAX computation. JAX's preemption service is turned off, so SIGTERM
  ends a process as it would any other program (a run resumes from its last checkpoint).
  Returns True if it initialized; ConfigError for a wrong variable or a cluster it cannot
  start."""
  if not multi_process_env() or jax.distributed.is_initialized():
    return False
  kwargs = distributed_kwargs()
  jax.config.update("jax_enable_preemption_service", False)
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError as e:
    raise ConfigError(
      None,
      f"cannot start several processes ({e}); set JAX_COORDINATOR_ADDRESS, "
      "JAX_NUM_PROCESSES and JAX_PROCESS_ID, start with `python -m jetrl.launch`, or run "
      "in a cluster JAX detects (Slurm, Open MPI, a TPU pod) -- docs/scaling.md",
    ) from None
  n = kwargs.get("num_processes")
  if n is not None and jax.process_count() != n:
    raise ConfigError(
      None, f"JAX_NUM_PROCESSES={n}, but JAX formed {jax.process_count()} processes"
    )
  log(
    f"jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
    f"{jax.local_device_count()} local / {jax.device_count()} global devices"
  )
  return True


def primary_log(log: Callable[[str], None]) -> Callable[[str], None]:
  """`log` as a run's process 0 uses it; on the other processes of a multi-process run, only
  the lines of warnings and errors, prefixed by the process index (`[pI] `, unless
  `jetrl.launch`, which prefixes every line, started it): a run's header, evaluations and
  progress are said once."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1 or is_primary():
    return log
  prefix = "" if os.environ.get("JETRL_LAUNCHED") == "1" else f"[p{jax.process_index()}] "

  def others(line: str) -> None:
    if line.lstrip().lower().startswith(("warning", "error")):
      log(prefix + line)

  return others


def is_primary() -> bool:
  """True in the process that writes the run's files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (nothing with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def all_true(ok: bool) -> bool:
  """True when `ok` holds in every process (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return bool(ok)
  return bool(np.all(multihost_utils.process_allgather(np.int32(bool(ok)))))


def _encode(error: Optional[BaseException]) -> np.ndarray:
  if error is None:
    payload = {}
  elif isinstance(error, ConfigError):
    kind = "FlagError" if isinstance(error, FlagError) else "ConfigError"
    payload = {"kind": kind, "path": error.path, "detail": error.detail}
  else:
    payload = {"kind": type(error).__name__, "detail": str(error)}
  data = json.dumps(payload).encode()
  if len(data) > _MESSAGE_BYTES:  # keep it valid JSON when cut
    payload["detail"] = payload["detail"][: _MESSAGE_BYTES // 2] + " ..."
    data = json.dumps(payload).encode()[:_MESSAGE_BYTES]
  buf = np.zeros(_MESSAGE_BYTES, np.uint8)
  buf[: len(data)] = np.frombuffer(data, np.uint8)
  return buf


def _decode(buf: np.ndarray) -> Optional[Exception]:
  payload = json.loads(bytes(np.asarray(buf, np.uint8)).rstrip(b"\0").decode() or "{}")
  if not payload:
    return None
  if payload["kind"] == "FlagError":
    return FlagError(payload["path"], payload["detail"])
  if payload["kind"] == "ConfigError":
    return ConfigError(payload["path"], payload["detail"])
  return RuntimeError(f"process 0: {payload['kind']}: {payload['detail']}")


def on_primary(fn: Callable[[], T]) -> Optional[T]:
  """`fn()` on the primary only; its result there (None elsewhere). An exception it raises is
  raised in every process (a ConfigError / FlagError as itself, with the same message)."""
  if jax.process_count() == 1:
    return fn()
  result, error = None, None
  if is_primary():
    try:
      result = fn()
    except Exception as e:  # pylint: disable=broad-except
      error = e
  got = _decode(multihost_utils.broadcast_one_to_all(_encode(error)))
  if error is not None:
    raise error
  if got is not None:
    raise got
  return result


# -- rows across processes --------------------------------------------------------------------


def owned_rows(x) -> np.ndarray:
  """The indices of the rows (first axis) of `x` this process is responsible for.

  One process: all rows. Several: the rows one of this process's devices holds, each row
  given to the lowest-numbered process holding it, so that over all processes every row is
  owned exactly once (rows replicated over processes included)."""
  n = x.shape[0]
  if jax.process_count() == 1:
    return np.arange(n)
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    raise ValueError(
      "owned_rows: with several processes the rows must be a global jax.Array placed on the "
      "run's mesh (a host or single-device value is the same in every process)"
    )
  owner = np.full(n, np.iinfo(np.int32).max, np.int64)
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    rows = np.arange(n)[index[0]]
    owner[rows] = np.minimum(owner[rows], device.process_index)
  return np.nonzero(owner == jax.process_index())[0]


def rows_to_host(x, rows: np.ndarray) -> np.ndarray:
  """Rows `rows` of `x` as numpy, read from this process's own shards (which must hold them,
  with the other axes whole: a rollout's arrays are split by rows only)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)[rows]
  n = x.shape[0]
  out = np.empty((len(rows),) + tuple(x.shape[1:]), x.dtype)
  where = {int(r): k for k, r in enumerate(rows)}
  found = np.zeros(len(rows), bool)
  for shard in x.addressable_shards:
    if shard.data.shape[1:] != x.shape[1:]:
      raise ValueError(f"rows_to_host: an array of shape {x.shape} is split along another axis")
    shard_rows = np.arange(n)[shard.index[0]]
    wanted = [(j, where[int(r)]) for j, r in enumerate(shard_rows) if int(r) in where]
    if not wanted:
      continue
    data = np.asarray(shard.data)
    for j, k in wanted:
      if not found[k]:
        out[k], found[k] = data[j], True
  if not found.all():
    missing = np.asarray(rows)[~found][:8].tolist()
    raise ValueError(f"rows_to_host: rows {missing} are not held by this process")
  return out


def gather_rows(values, rows: np.ndarray, n: int) -> np.ndarray:
  """[n, ...] on every process, from each process's values of its `owned_rows` (a collective:
  every process must call it)."""
  values = np.asarray(values)
  full = np.zeros((n,) + values.shape[1:], values.dtype)
  full[rows] = values
  if jax.process_count() == 1:
    return full
  count = np.zeros(n, np.int32)
  count[rows] = 1
  stacked, counts = multihost_utils.process_allgather((full, count))
  if not np.all(np.asarray(counts).sum(0) == 1):
    raise RuntimeError("gather_rows: the processes' rows do not cover every row exactly once")
  owner = np.argmax(np.asarray(counts), axis=0)
  return np.asarray(stacked)[owner, np.arange(n)]
