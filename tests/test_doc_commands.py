"""Every experiments/ command shown in README.md, docs/ and the experiments' docstrings names a
script that exists and flags that script accepts, with values it accepts; a command shown with
its error gives that error. Nothing runs: each script's flags are parsed (and, for a configuration tree, its
configuration built) in a subprocess (tests/_doc_command_flags.py).

What a command line is, here: `python[3] [-m] experiments/NAME.py` and what follows on its line
and the lines its trailing backslashes join, up to a comment, a pipe, `&&`, `;` or the end of
inline code. Shell variables set earlier in the same file (`TASK="..."`) are substituted;
`$OUT` and others not set there stand for a path. A value spelled as a placeholder in capitals
(`--seed=S`, `--workdir=W`) only has its flag name checked. The `--bench_flags` and
`--bench2_flags` of a gpu_check.py command are checked against experiments/bench_device.py too.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

COMMAND = re.compile(r"python3?\s+(?:-m\s+)?(experiments/[A-Za-z0-9_]+\.py)")
ASSIGN = re.compile(r"^\s*([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)\s*(?:#.*)?$")
PLACEHOLDER = re.compile(r"^--[\w.]+=[A-Z][A-Z_]*$")
# A command shown with the error it gives: `$ python experiments/x.py ...` then `x.py: error: ...`.
SHOWN_ERROR = re.compile(r"^([A-Za-z0-9_]+\.py): error: (.*)$")


def _doc_files(root):
  """README.md, docs/, and the experiments' own docstrings (what --help prints)."""
  return [
    root / "README.md",
    *sorted((root / "docs").rglob("*.md")),
    *sorted((root / "experiments").glob("*.py")),
  ]


def _command_text(lines, i, start):
  """The rest of line i from `start`, with the lines its trailing backslashes join."""
  rest, j = lines[i][start:], i
  while rest.rstrip().endswith("\\") and j + 1 < len(lines):
    j += 1
    rest = rest.rstrip()[:-1] + " " + lines[j]
  return rest, j


def _expand(text: str, variables: dict) -> str:
  """$NAME / ${NAME} replaced by the variables' values; any other variable by a path."""
  for name, value in variables.items():
    text = re.sub(r"\$\{?" + name + r"\b\}?", lambda _: value, text)
  return re.sub(r"\$\{?[A-Za-z_]\w*\}?", "/tmp/x", text)


def _argv(rest: str, variables: dict):
  """The flags of a command's text (see the module docstring)."""
  rest = rest.split("`")[0]
  rest = _expand(re.split(r"\s(?:#|\||&&|;|>|2>)", " " + rest)[0], variables)
  try:
    words = shlex.split(rest)
  except ValueError:  # a command inside another's quotes: its closing quote is the outer one
    words = shlex.split(rest.rstrip().rstrip("\"'"))
  return [w for w in words if w.startswith("-")]


def doc_commands(root):
  """[(where, script, argv, shown error or None)] for every command shown (`_doc_files`)."""
  found = []
  for path in _doc_files(root):
    lines = path.read_text(encoding="utf-8").splitlines()
    variables = {}
    for i, line in enumerate(lines):
      m = ASSIGN.match(line)
      if m:
        variables[m.group(1)] = _expand(m.group(2).strip("\"'"), variables)
      for c in COMMAND.finditer(line):
        rest, end = _command_text(lines, i, c.end())
        after = lines[end + 1] if end + 1 < len(lines) else ""
        shown = SHOWN_ERROR.match(after) if line.lstrip().startswith("$ ") else None
        where = f"{path.relative_to(root)}:{i + 1}"
        found.append((where, c.group(1), _argv(rest, variables), shown and shown.group(2)))
  return found


def test_the_scan_reads_continued_lines_variables_and_inline_code(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "README.md").write_text(
    "Y=--b\n"
    'X="--a=1 $Y"\n'
    "```\n"
    "python experiments/t.py $X --c=$OUT \\\n"
    "    --d=2   # comment --e\n"
    "```\n"
    "Run `python3 experiments/u.py --f=S` and see.\n"
    "$ python experiments/t.py --g=3\n"
    "t.py: error: --g: bad\n"
  )
  assert doc_commands(tmp_path) == [
    ("README.md:4", "experiments/t.py", ["--a=1", "--b", "--c=/tmp/x", "--d=2"], None),
    ("README.md:7", "experiments/u.py", ["--f=S"], None),
    ("README.md:8", "experiments/t.py", ["--g=3"], "--g: bad"),
  ]


def _check(root, script, argvs):
  env = dict(os.environ, PYTHONPATH=str(root / "src"), JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, str(root / "tests" / "_doc_command_flags.py"), str(root), script]
    + [json.dumps(argvs)],
    capture_output=True,
    text=True,
    cwd=root,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0, f"{script}: {out.stderr[-3000:]}"
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checked(root):
  """[(where, script, argv, shown error, the error the script gives or None)]."""
  by_script = collections.defaultdict(list)
  for where, script, argv, shown in doc_commands(root):
    assert (root / script).exists(), f"{where}: {script} is not in the repository"
    names = [a.split("=")[0] for a in argv if PLACEHOLDER.match(a)]
    by_script[script].append((where, [a for a in argv if not PLACEHOLDER.match(a)], shown, names))
    if script.endswith("gpu_check.py"):
      for flag in ("--bench_flags=", "--bench2_flags="):
        bench = next((a.split("=", 1)[1] for a in argv if a.startswith(flag)), None)
        if bench is not None:
          by_script["experiments/bench_device.py"].append(
            (f"{where} ({flag[:-1]})", shlex.split(bench), None, [])
          )
  results = []
  for script, items in sorted(by_script.items()):
    # A placeholder's flag name alone: the flag given with a value of its own kind.
    names = sorted({n for *_, ns in items for n in ns})
    errors = _check(root, script, [argv for _, argv, _, _ in items] + [[n] for n in names])
    unknown = {n: e for n, e in zip(names, errors[len(items) :]) if e and "Unknown" in e}
    for (where, argv, shown, ns), err in zip(items, errors):
      bad = [f"{n}: {unknown[n]}" for n in ns if n in unknown]
      results.append((where, script, argv, shown, "; ".join(filter(None, [err, *bad])) or None))
  return results


def test_documented_commands_are_accepted(checked):
  bad = [f"{w}: {s} {' '.join(a)}\n  -> {e}" for w, s, a, shown, e in checked if e and not shown]
  assert not bad, "\n".join(bad)
  assert len(checked) > 60  # the scan found the commands (~55 in README.md and docs/)


def test_documented_errors_are_the_errors_given(checked):
  shown = [(w, s, want, got) for w, s, _, want, got in checked if want]
  assert shown, "README.md shows the error of a bad --recipe"
  for where, script, want, got in shown:
    assert got and want in got, f"{where}: {script} should fail with {want!r}, gave {got!r}"
