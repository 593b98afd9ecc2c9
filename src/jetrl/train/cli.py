"""The command line of the entry points under experiments/: flags generated from a config tree,
`--help` grouped by sub-config, a quiet console, and errors as one-line messages.

  main(TrainConfig(), run_fn, doc=__doc__)

defines one flag per field of the tree (`--optimizer.lr`, ...) plus `--config=FILE`, builds the
config from them and calls `run_fn(config)`.

* `--help` (or `-h`) prints the program's docstring and its flags, one block per sub-config,
  each with its default; `--helpfull` is absl's listing of every flag of every library.
* stdout is line-buffered, also into a pipe or a file, so a run's lines show as they come.
* Other libraries' INFO logs (Orbax, JAX) are off unless `--verbosity` (absl's `-v`) is
  given: `--verbosity=0` brings them back.
* A flag that does not exist or whose value does not parse, a bad flag value, a bad config
  file (a key that is no field: the closest field names), and what a run refuses at start-up
  (a workdir in use, a checkpoint written with other settings, a step that cannot fit in
  memory) print `error: --flag: message` and exit with code 2; a run stopped by non-finite updates, with
  no intact checkpoint, or by a `--task.reward` function that cannot be used (a result of the
  wrong length, failures batch after batch: `jetrl.data.RewardError`) prints its message and
  exits with code 1. No traceback.
* Ctrl-C during a run's steps lets the step finish, writes its checkpoint and prints one line
  (the step saved, the command that resumes) with exit code 130; a second Ctrl-C stops at
  once (`jetrl.train.interrupt`). Before the steps, Ctrl-C stops at once with one line too.
* A flag name from before the configuration had sub-configs is refused with its new name
  (the field says which names it had: `field(..., former=...)`).
* The kernel settings (`--kernels.*`, `jetrl.kernels.KernelConfig`) take their defaults from
  the JETRL_* variables where they are set (`jetrl.kernels.device.kernel_defaults`, the one
  place a run reads them): `--help` shows those defaults, a line says which variable set what, and a flag or a
  `--config` file still overrides them.
* In a run of several processes, any other error (a collective that lost a process) prints its
  traceback and ends the process at once with code 1, without waiting for the others at JAX's
  shutdown (docs/scaling.md).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import app, flags
from absl import logging as absl_logging

from jetrl.config import ConfigError, FlagError, former_names
from jetrl.config.flags import CONFIG_FLAG, config_from_flags, define_flags, grouped_help
from jetrl.config.tree import closest
from jetrl.kernels.device import kernel_defaults
from jetrl.train.interrupt import EXIT_CODE as INTERRUPT_EXIT_CODE
from jetrl.train.interrupt import RunInterrupted

FLAGS = flags.FLAGS
HELP_ARGS = ("-h", "--help", "-help", "--helpshort", "-helpshort", "-?")


def program() -> str:
  return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "jetrl"


def usage(default: Any, doc: str, exclude: Sequence[str] = ()) -> str:
  return "\n".join(
    [
      (doc or "").strip(),
      "",
      "Flags (--name=value; none sets an optional field to None; lists are comma-separated):",
      "",
      grouped_help(default, exclude=exclude),
      "",
      "Every flag of every library: --helpfull. Their INFO logs: --verbosity=0 (or -v=0).",
    ]
  )


def fail(message: str, code: int = 2) -> None:
  """Print `error: message` to stderr and exit (no traceback)."""
  print(f"{program()}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(code)


def quiet_third_party_logs() -> None:
  """Other libraries' INFO logs off, unless --verbosity / -v was given (absl would otherwise
  turn INFO on once the flags are parsed)."""
  if "verbosity" in FLAGS and FLAGS["verbosity"].present:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger().setLevel(logging.WARNING)


def check_renamed(argv: Sequence[str], renamed: Mapping[str, str]) -> None:
  """Refuse flag names that were renamed, naming the new one."""
  for arg in argv[1:]:
    if not arg.startswith("-"):
      continue
    name = arg.lstrip("-").split("=", 1)[0]
    if name in FLAGS:
      continue
    base = name[2:] if name.startswith("no") and name[2:] in renamed else name
    if base in renamed:
      fail(
        f"--{base} is now --{renamed[base]} (flags are named by their place in the "
        f"configuration; {program()} --help lists them)"
      )


def parse_argv(argv: Sequence[str], flag_values, names: Sequence[str]) -> list[str]:
  """`flag_values(argv)` (absl's parse), its errors as FlagErrors in this module's style: an
  unknown flag with the closest of `names` (the program's flags), a value that does not parse
  with what was expected."""
  try:
    return flag_values(list(argv))
  except flags.UnrecognizedFlagError as e:
    close = closest(e.flagname, names)
    hint = f"did you mean {' or '.join('--' + c for c in close)}? " if close else ""
    raise FlagError(e.flagname, f"no such flag; {hint}{program()} --help lists them") from None
  except flags.Error as e:
    text = str(e)
    found = re.match(r"flag --([^=\s]+)=", text)
    if found is None:
      raise FlagError(None, text) from None
    name = found.group(1)
    for arg in argv[1:]:
      key, sep, value = arg.lstrip("-").partition("=")
      if sep and key == name and text.startswith(f"flag --{name}={value}: "):
        text = text[len(f"flag --{name}={value}: ") :]
        if isinstance(flag_values[name], flags.BooleanFlag):
          text = f"expected true or false, got {value!r}"
        break
    raise FlagError(name, text) from None
  except ValueError as e:  # absl's own: '--noflag=3 does not take an argument'
    raise FlagError(None, str(e)) from None


def main(
  default: Any,
  run_fn: Callable[[Any], None],
  *,
  doc: str,
  exclude: Sequence[str] = (),
  renamed: Optional[Mapping[str, str]] = None,
  errors: tuple[type, ...] = (),
) -> None:
  """Run an entry point: flags from `default`'s tree, then `run_fn(config)`.

  renamed: a script's own former flag names that are no field's (`--toy`), beside those the
    tree's fields name (`field(..., former=...)`).
  errors: exception types a run raises for a failed run (not a usage error): their message is
  printed and the exit code is 1."""
  line_buffered()
  try:
    default, kernel_notes = kernel_defaults(default)
  except ValueError as e:  # a JETRL_* kernel variable with a bad value
    fail(str(e))
  names = define_flags(default, FLAGS, exclude=exclude, module_name=sys.argv[0])
  if any(a in HELP_ARGS for a in sys.argv[1:]):
    print(usage(default, doc, exclude))
    sys.exit(0)
  tree = {old: path for old, path in former_names(type(default)).items() if path not in exclude}
  check_renamed(sys.argv, {**tree, **(renamed or {})})

  def _main(argv):
    if len(argv) > 1:
      fail(f"unexpected arguments: {argv[1:]}")
    quiet_third_party_logs()
    for note in kernel_notes:
      print(f"{program()}: {note}", flush=True)
    try:
      config = config_from_flags(default, FLAGS, exclude=exclude)
      run_fn(config)
    except ConfigError as e:  # a bad value, or refused at start-up
      fail(str(e))
    except KeyboardInterrupt as e:  # Ctrl-C: jetrl.train.interrupt
      interrupted(e)
    except errors as e:  # pylint: disable=catching-non-exception
      fail(str(e), code=1)
    except Exception:  # pylint: disable=broad-except
      if not several_processes():
        raise
      exit_now()

  def _parse(argv):
    try:
      return parse_argv(argv, FLAGS, [CONFIG_FLAG, *names])
    except FlagError as e:
      fail(str(e))

  app.run(_main, flags_parser=_parse)


def line_buffered() -> None:
  """stdout written line by line even into a pipe or a file (`| tee run.log`), so progress
  and the compile clocks show as they happen, not in blocks at exit."""
  try:
    sys.stdout.reconfigure(line_buffering=True)
  except (AttributeError, ValueError):  # replaced by something else (a notebook, a test)
    pass


def resume_command() -> str:
  """The command line that started this process, as a shell would rerun it."""
  return shlex.join([os.path.basename(sys.executable) or "python", *sys.argv])


def interrupted(e: KeyboardInterrupt) -> None:
  """One line for a run stopped by Ctrl-C, and exit code 130: what was saved and the command
  that resumes it (`RunInterrupted`), or that the run stopped before its steps."""
  if isinstance(e, RunInterrupted):
    what = f"saved the checkpoint of step {e.step} in {e.directory}"
  else:
    what = "stopped before a step finished; nothing new saved"
  print(
    f"{program()}: interrupted: {what}; resume with: {resume_command()}",
    file=sys.stderr,
    flush=True,
  )
  sys.exit(INTERRUPT_EXIT_CODE)


def several_processes() -> bool:
  """True in a run of several JAX processes (jax.distributed initialized)."""
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def exit_now(code: int = 1) -> None:
  """An unexpected error in one process of several (often: another process died and a
  collective failed): print it and exit at once. A normal exit would wait at JAX's shutdown
  barrier for every other process, up to the heartbeat timeout (100 s by default)."""
  traceback.print_exc()
  print(
    f"{program()}: error: this process failed; exiting without waiting for the others",
    file=sys.stderr,
    flush=True,
  )
  sys.stdout.flush()
  os._exit(code)
