"""The import arrows between jetrl's packages, read from the source (no import runs).

Packages sit on floors, and a module imports only from its own package or from lower floors;
imports between jetrl modules stand at module level, where a reader sees them, so the module
graph they draw has no circle (docs/design.md, "Modules")."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "jetrl"

# Each package's floor: a package may import from packages on lower floors only.
FLOORS = {
  "config": 0,
  "data": 0,
  "precision": 0,
  "kernels": 1,
  "models": 2,
  "sampling": 3,
  "rl": 3,
  "parallel": 4,
  "train": 5,
  "study": 6,
  "aot": 6,
  "kernel_profile": 6,
  "launch": 6,
}
# Function-local jetrl imports that must stay local, with the reason.
LOCAL_IMPORTS = {
  # read before JAX is imported (the compile report sets JAX's environment first), and
  # jetrl.precision imports JAX
  "aot/targets.py",
}


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(SRC.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _resolve(name: str) -> str:
  """A dotted jetrl name as the module it is (a submodule, else its package)."""
  parts = name.split(".")
  while parts:
    base = SRC.parent.joinpath(*parts)
    if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
      return ".".join(parts)
    parts.pop()
  return name


def _imports(path: pathlib.Path):
  """(module-level jetrl imports, function-local ones) of a file, as module names."""
  tree = ast.parse(path.read_text())
  top, inner = set(), set()

  def names(node):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.startswith("jetrl"):
        return [_resolve(f"{node.module}.{a.name}") for a in node.names]
    if isinstance(node, ast.Import):
      return [_resolve(a.name) for a in node.names if a.name.startswith("jetrl")]
    return []

  for node in tree.body:
    top.update(names(node))
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner_node in ast.walk(node):
        inner.update(names(inner_node))
  return top, inner


def _graph():
  files = {_module_name(p): p for p in SRC.rglob("*.py")}
  return files, {m: _imports(p) for m, p in files.items()}


def _package(module: str) -> str:
  return module.split(".")[1] if "." in module else module


def test_every_package_has_a_floor():
  assert {_package(m) for m in _graph()[0] if m != "jetrl"} == set(FLOORS)


def test_imports_go_down_the_floors():
  _, graph = _graph()
  up = [
    f"{m} imports {t}"
    for m, (top, inner) in graph.items()
    for t in top | inner
    if m != "jetrl"
    and t != "jetrl"
    and _package(t) != _package(m)
    and FLOORS[_package(t)] >= FLOORS[_package(m)]
  ]
  assert not up, up


def test_jetrl_imports_stand_at_module_level():
  files, graph = _graph()
  local = [
    f"{files[m].relative_to(SRC)} imports {sorted(inner)} inside a function"
    for m, (_, inner) in graph.items()
    if inner and str(files[m].relative_to(SRC)) not in LOCAL_IMPORTS
  ]
  assert not local, local


def test_no_import_circle():
  _, graph = _graph()
  edges = {m: {t for t in top if t in graph and t != m} for m, (top, _) in graph.items()}
  # A package's __init__ importing its own submodules is how a package is built, not a circle.
  edges = {
    m: {t for t in ts if not (graph_is_init(m) and t.startswith(m + "."))}
    for m, ts in edges.items()
  }
  state, stack, circles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for t in sorted(edges[m]):
      if state.get(t) == "open":
        circles.append(stack[stack.index(t) :] + [t])
      elif t not in state:
        visit(t)
    stack.pop()
    state[m] = "done"

  for m in sorted(edges):
    if m not in state:
      visit(m)
  assert not circles, circles


def graph_is_init(module: str) -> bool:
  return (SRC.parent.joinpath(*module.split(".")) / "__init__.py").exists()
