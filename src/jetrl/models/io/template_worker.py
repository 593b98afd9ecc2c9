"""Renders a model folder's chat template in a separate process with time and memory limits.

A chat template is a jinja2 program from a downloaded folder. jinja2's sandbox stops escapes
(no attribute of a Python object it should not reach), not CPU or memory bombs: three nested
`range(100000)` loops ran for minutes, `{{ 'x' * 2000000000 }}` exhausted memory. So
`jetrl.models.io.hf_tokenizer` renders through this file, started as a script
(`python -I -B template_worker.py`), one JSON object per line:

  first line  {"template": "..."}          reply {"ready": true} or {"ready": false, "error"}
  request     {"id": 3, "kwargs": {...}}   reply {"id": 3, "text": "..."}, or with "type"
                                           and "error" (an exception's class name, message)

Before it parses the template the process limits its address space (MEMORY_LIMIT), its CPU
time (CPU_SECONDS over its life), core files and file writes (none) and child processes
(none once unprivileged). It compiles the template when the first render asks, inside that
render's time: jinja2's code generator evaluates constant expressions while compiling (even
unoptimized, to inline constant output), so `{{ 9 ** 30000000 }}` once cost the worker's
60 s start-up allowance instead of the 10 s render limit. The parent kills it when a reply is
late (`RENDER_TIMEOUT`) and starts a new one for the next render. A rendered text longer than MAX_TEXT_CHARS is an error.
The parent only parses the template (`check_syntax`), which evaluates nothing.
"""

import datetime
import importlib.util
import json
import os
import sys

MEMORY_LIMIT = 1 << 30  # bytes of address space
CPU_SECONDS = 3600
MAX_TEXT_CHARS = 10_000_000


def environment():
  """The sandboxed jinja2 environment `transformers` renders chat templates in, without the
  constant folding of jinja2's optimizer (which would evaluate `'x' * 2000000000` while
  compiling, outside any limit)."""
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols], optimized=False
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env


def check_syntax(template: str) -> None:
  """jinja2's TemplateSyntaxError when the template does not parse (parsing runs nothing)."""
  environment().parse(template)


def compile_template(template: str):
  """The template compiled as `transformers` compiles chat templates (sandboxed jinja2)."""
  return environment().from_string(template)


def confine() -> None:
  """The limits of the module doc, set by jetrl/data/confine.py (loaded from its file: this
  process does not import jetrl)."""
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.path.join(os.path.dirname(os.path.dirname(here)), "data", "confine.py")
  spec = importlib.util.spec_from_file_location("jetrl_confine", path)
  limits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(limits)
  limits.limit_memory_cpu_files(MEMORY_LIMIT, CPU_SECONDS)
  limits.limit_descriptors_and_processes(required=False)  # NPROC: not applied to root


def main() -> int:
  out = sys.stdout
  try:
    import jinja2  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    first = json.loads(sys.stdin.readline())
    confine()
    template = first["template"]
    check_syntax(template)  # parsing evaluates nothing; compiling may (see `main`)
  except Exception as e:  # pylint: disable=broad-except
    out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    out.flush()
    return 1
  out.write('{"ready": true}\n')
  out.flush()
  compiled = None
  for line in sys.stdin:
    rid = None
    try:
      req = json.loads(line)
      rid = req.get("id")
      if compiled is None:  # inside the render the parent times
        compiled = compile_template(template)
      text = compiled.render(**req["kwargs"])
      if len(text) > MAX_TEXT_CHARS:
        raise MemoryError(f"the rendered text has {len(text)} characters")
      reply = {"id": rid, "text": text}
    except MemoryError as e:
      reply = {"id": rid, "type": "MemoryError", "error": str(e)[:500]}
    except Exception as e:  # pylint: disable=broad-except
      reply = {"id": rid, "type": type(e).__name__, "error": str(e)[:500]}
    out.write(json.dumps(reply) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
