"""Symbolic equivalence of two normalised LaTeX answers, run in a separate process.

`jetrl.data.math_equivalence` starts this file as a script (`python -P sympy_worker.py`) and
talks to it over pipes, one JSON object per line:

  request  {"id": 7, "a": "\\frac{1}{\\sqrt{2}}", "b": "\\frac{\\sqrt{2}}{2}"}
  reply    {"id": 7, "eq": true}

It imports nothing from jetrl (only the standard library and sympy), so starting it is cheap and
it cannot pick up modules from its own folder. The parent kills it when a reply takes longer
than its time limit, so nothing here needs a timeout of its own. Address space is capped so that
a huge power fails with MemoryError instead of taking the machine's memory.

The LaTeX is translated to a restricted Python expression (a fixed set of commands; no quotes,
no attribute access, no double underscores, no builtins) and parsed with
`sympy.parsing.sympy_parser.parse_expr`.
"""

import json
import re
import sys

MAX_CHARS = 400
MEMORY_LIMIT = 4 << 30

FUNCS = {
    "sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "log": "log", "ln": "log", "exp": "exp",
}
CONSTANTS = {"pi": "pi", "infty": "oo", "infinity": "oo", "e": "E", "i": "I"}
GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon",
    "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi",
    "Sigma", "Phi", "Psi", "Omega",
}
TIMES = {"cdot", "times", "ast"}
IGNORED = {"displaystyle", "left", "right", "mathrm", "mathbf", "text"}
ALLOWED = re.compile(r"[0-9A-Za-z+\-*/().!, _]*")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Unsupported(Exception):
  pass


def _group(s, i):
  """(contents, next index) of the argument at s[i]: a {group} or one character/command."""
  while i < len(s) and s[i] == " ":
    i += 1
  if i >= len(s):
    raise Unsupported("missing argument")
  if s[i] == "{":
    depth = 0
    k = i
    while k < len(s):
      if s[k] == "\\":
        k += 2
        continue
      if s[k] == "{":
        depth += 1
      elif s[k] == "}":
        depth -= 1
        if depth == 0:
          return s[i + 1:k], k + 1
      k += 1
    raise Unsupported("unbalanced braces")
  if s[i] == "\\":
    m = re.match(r"\\[A-Za-z]+", s[i:])
    if m:
      return m.group(), i + len(m.group())
  return s[i], i + 1


def to_python(s):
  """A Python expression string for LaTeX `s` (raises Unsupported)."""
  out = []
  i = 0
  n = len(s)
  while i < n:
    c = s[i]
    if c == "\\":
      m = re.match(r"\\([A-Za-z]+|.)", s[i:])
      name = m.group(1)
      i += len(m.group())
      if name in ("frac", "dfrac", "tfrac"):
        a, i = _group(s, i)
        b, i = _group(s, i)
        out.append(f"(({to_python(a)})/({to_python(b)}))")
      elif name == "binom":
        a, i = _group(s, i)
        b, i = _group(s, i)
        out.append(f"binomial({to_python(a)},{to_python(b)})")
      elif name == "sqrt":
        root = None
        if i < n and s[i] == "[":
          close = s.find("]", i)
          if close < 0:
            raise Unsupported("unclosed root index")
          root, i = s[i + 1:close], close + 1
        a, i = _group(s, i)
        if root is None:
          out.append(f"sqrt({to_python(a)})")
        else:
          out.append(f"(({to_python(a)})**(1/({to_python(root)})))")
      elif name in FUNCS:
        out.append(f" {FUNCS[name]} ")
      elif name in CONSTANTS:
        out.append(f" {CONSTANTS[name]} ")
      elif name in GREEK:
        out.append(f" {'lamda' if name == 'lambda' else name} ")
      elif name in TIMES:
        out.append("*")
      elif name == "div":
        out.append("/")
      elif name in IGNORED or name == " ":
        pass
      else:
        raise Unsupported(f"command \\{name}")
    elif c == "{":
      a, i = _group(s, i)
      out.append(f"({to_python(a)})")
    elif c == "}":
      raise Unsupported("unbalanced braces")
    elif c == "^":
      a, i = _group(s, i + 1)
      out.append(f"**({to_python(a)})")
    elif c == "_":
      a, i = _group(s, i + 1)
      if not re.fullmatch(r"[A-Za-z0-9]+", a) or not out or not re.search(r"[A-Za-z]$", out[-1]):
        raise Unsupported("subscript")
      out.append("_" + a)
    elif c in "[]":
      out.append("(" if c == "[" else ")")
    else:
      out.append(c)
      i += 1
  return "".join(out)


def _parse(s):
  from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                          parse_expr, standard_transformations)
  if len(s) > MAX_CHARS:
    raise Unsupported("too long")
  expr = to_python(s)
  if not ALLOWED.fullmatch(expr) or "__" in expr:
    raise Unsupported("characters")
  for name in IDENT.findall(expr):
    if name.startswith("_") or len(name) > 12:
      raise Unsupported(f"name {name}")
  transformations = standard_transformations + (implicit_multiplication_application,
                                                convert_xor)
  return parse_expr(expr, local_dict=dict(_LOCALS), global_dict=dict(_GLOBALS),
                    transformations=transformations, evaluate=True)


def _expr_equal(a, b):
  import sympy
  if a == b:
    return True
  if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
    return False
  if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo,
                                                              sympy.nan):
    return False
  diff = a - b
  if diff.is_number:
    value = complex(sympy.N(diff, 50))
    scale = max(1.0, abs(complex(sympy.N(b, 50))))
    return abs(value) <= 1e-9 * scale
  return sympy.simplify(diff) == 0


def equivalent(a, b):
  """Whether normalised LaTeX answers `a` and `b` have the same value (False if unsure)."""
  try:
    if a.count("=") == 1 and b.count("=") == 1:
      la, ra = (_parse(x) for x in a.split("="))
      lb, rb = (_parse(x) for x in b.split("="))
      return _expr_equal(la - ra, lb - rb) or _expr_equal(la - ra, rb - lb)
    if "=" in a or "=" in b or "<" in a or ">" in a or "<" in b or ">" in b:
      return False
    return _expr_equal(_parse(a), _parse(b))
  except Exception:  # anything unparsable or unsupported is "not shown equal"
    return False


def _namespaces():
  import sympy
  names = ["Symbol", "Integer", "Float", "Rational", "Function", "Number", "factorial",
           "binomial", "sqrt", "pi", "oo", "E", "I", "Mul", "Add", "Pow"]
  names += list(set(FUNCS.values()))
  glob = {name: getattr(sympy, name) for name in names}
  glob["__builtins__"] = {}
  local = {"e": sympy.E, "i": sympy.I}
  for g in GREEK:
    g = "lamda" if g == "lambda" else g
    local[g] = sympy.Symbol(g)
  return glob, local


def main():
  try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
  except Exception:
    pass
  global _GLOBALS, _LOCALS
  _GLOBALS, _LOCALS = _namespaces()
  sys.setrecursionlimit(10_000)
  out = sys.stdout
  out.write('{"ready": true}\n')
  out.flush()
  for line in sys.stdin:
    try:
      req = json.loads(line)
      eq = bool(equivalent(str(req["a"]), str(req["b"])))
      rid = req.get("id")
    except Exception:
      eq, rid = False, None
    out.write(json.dumps({"id": rid, "eq": eq}) + "\n")
    out.flush()


if __name__ == "__main__":
  main()
