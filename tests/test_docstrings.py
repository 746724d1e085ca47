"""Every module of mk/ says in its docstring what is here and what is not, in at most
`MAX_LINES` lines; the design prose lives in docs/design/<module>.md, and every page a
docstring links there exists.

`WAITING` names the modules whose docstring is still longer, each with why; the list only
shrinks (a listed module that fits fails, so it is taken off).
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 20
# Modules whose docstring is still longer, each with why (none now).
WAITING: dict[str, str] = {}
MODULES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "mk").rglob("*.py"))


def _docstring(path: str) -> str:
    return ast.get_docstring(ast.parse((ROOT / path).read_text(encoding="utf-8")),
                             clean=False) or ""


def _lines(doc: str) -> int:
    return len(doc.strip("\n").splitlines())


@pytest.mark.parametrize("path", MODULES)
def test_module_docstring_says_what_is_here_in_at_most_20_lines(path):
    doc = _docstring(path)
    assert doc.strip(), f"{path} has no module docstring"
    lines = _lines(doc)
    if path in WAITING:
        assert lines > MAX_LINES, f"{path} fits now ({lines} lines): take it off WAITING"
    else:
        assert lines <= MAX_LINES, (f"{path}: its docstring has {lines} lines; move the "
                                    f"design prose to docs/design/ and link it")


def test_every_design_page_a_docstring_names_exists_and_its_links_resolve():
    named = {(path, page) for path in MODULES
             for page in re.findall(r"docs/design/[\w.]+\.md", _docstring(path))}
    assert len(named) > 20, named
    missing = [f"{path}: {page}" for path, page in sorted(named) if not (ROOT / page).exists()]
    assert not missing, missing
    pages = sorted((ROOT / "docs" / "design").glob("*.md"))
    broken = [f"{page.name}: {target}" for page in pages
              for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
              if not target.startswith(("http://", "https://", "#"))
              and not (page.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def test_a_docstring_one_line_too_long_is_counted_so():
    doc = ast.get_docstring(ast.parse('"""' + "line\n" * (MAX_LINES + 1) + '"""\n'),
                            clean=False)
    assert _lines(doc) == MAX_LINES + 1
