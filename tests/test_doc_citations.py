"""Every `docs/X.md` a source file cites exists, and every section or invariant it names is there.

Citation forms checked (comment and docstring line breaks inside a citation are allowed):
  docs/X.md                          the file exists
  docs/X.md, "Section" / ("Section") a heading of docs/X.md starts with `Section`
  docs/X.md, invariant "Name"        docs/X.md has the invariant `**Name.**`
  docs/X.md#anchor                   a heading of docs/X.md has that GitHub anchor
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("src", "experiments", "tests")
SUFFIXES = {".py", ".cc", ".h", ".cu", ".ipynb"}
CITATION = re.compile(
  r"docs/(?P<file>[\w/.-]+?\.md)(?P<anchor>#[\w-]+)?"
  r'(?:,\s*(?P<inv>invariant\s+)?"(?P<section>[^"]+)"|\s*\("(?P<paren>[^"]+)"\))?'
)


def _flat(text: str) -> str:
  """The text with each line break, and the comment marker that continues a line, as a space."""
  return re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", text)


def _headings(path: pathlib.Path) -> list[str]:
  lines, fenced = [], False
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"#{1,6} ", line):
      lines.append(line.lstrip("#").strip())
  return lines


def _anchor(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def citations():
  found = []
  for top in SOURCES:
    for path in sorted((ROOT / top).rglob("*")):
      if (
        path.suffix not in SUFFIXES
        or not path.is_file()
        or path.name == pathlib.Path(__file__).name
      ):
        continue
      for m in CITATION.finditer(_flat(path.read_text(encoding="utf-8", errors="replace"))):
        found.append((str(path.relative_to(ROOT)), m))
  return found


def test_the_scan_finds_citations_of_every_form():
  forms = {
    "file": lambda m: True,
    "section": lambda m: m["section"] and not m["inv"],
    "paren": lambda m: m["paren"],
    "invariant": lambda m: m["inv"],
  }
  found = citations()
  for name, matches in forms.items():
    assert any(matches(m) for _, m in found), f"no {name} citation found: the scan is broken"


def test_the_checker_reads_line_broken_citations():
  m = CITATION.search(_flat('x (docs/design.md, invariant "Same source\n  # values").'))
  assert m["file"] == "design.md" and m["inv"] and m["section"] == "Same source values"
  assert _anchor("GPU: FP8 GEMMs, rollout and training on one H200") == (
    "gpu-fp8-gemms-rollout-and-training-on-one-h200"
  )


@pytest.mark.parametrize(
  "where,m", [pytest.param(where, m, id=f"{where}:{m[0]}") for where, m in citations()]
)
def test_citation_resolves(where, m):
  doc = ROOT / "docs" / m["file"]
  assert doc.is_file(), f"{where} cites docs/{m['file']}, which does not exist"
  text = doc.read_text(encoding="utf-8")
  headings = _headings(doc)
  if m["inv"]:
    name = m["section"]
    assert f"**{name}.**" in text, f"{where} cites invariant {name!r}, not in docs/{m['file']}"
  elif m["section"] or m["paren"]:
    name = m["section"] or m["paren"]
    assert any(h.startswith(name) for h in headings), (
      f"{where} cites section {name!r} of docs/{m['file']}; its headings: {headings}"
    )
  if m["anchor"]:
    assert m["anchor"][1:] in {_anchor(h) for h in headings}, (
      f"{where} cites docs/{m['file']}{m['anchor']}; no heading has that anchor"
    )
