"""Write the Colab link and the Colab bootstrap of notebooks/TEMPLATE.md into every notebook.

The title cell's second line is `[Open in Colab](URL)` for that notebook's `.ipynb` at the
release tag that the bootstrap's `MK_SOURCE` installs; the first code cell is the bootstrap
block of TEMPLATE.md, verbatim, tagged `hide-input` (the site shows it collapsed). Each
`notebooks/NN_topic.py` is rewritten, then its `.ipynb` twin is synced from it with
jupytext. Run it after changing the template or the version in pyproject.toml;
tests/test_notebooks.py fails until it has run.

Not here: anything else in a notebook.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = "[0-9][0-9]*_*.py"
# The repository's URL is set once, in pyproject.toml ([project.urls].Source); the release
# tag of version X is vX (git tag vX at a release). Everything here follows them.
_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
REPOSITORY = _PROJECT["urls"]["Source"]  # https://github.com/<owner>/<name>
RELEASE_TAG = f"v{_PROJECT['version']}"
COLAB = REPOSITORY.replace("https://github.com/", "https://colab.research.google.com/github/",
                           1) + "/blob"
BOOTSTRAP_TAG = "hide-input"  # myst-nb collapses the input of a cell with this tag
LINK = re.compile(r"^\[Open in Colab\]\(.*\)$", re.M)


def bootstrap() -> str:
    """The bootstrap block of notebooks/TEMPLATE.md."""
    template = (NOTEBOOKS / "TEMPLATE.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- BEGIN BOOTSTRAP -->\n```python\n(.*?)\n```\n<!-- END BOOTSTRAP -->",
                      template, re.S)
    if not block:
        raise ValueError("notebooks/TEMPLATE.md lost its BEGIN/END BOOTSTRAP block")
    return block[1]


def release_ref(code: str) -> str:
    """The git ref the bootstrap's default MK_SOURCE installs (`...@REF`)."""
    match = re.search(rf'"MK_SOURCE", "git\+{re.escape(REPOSITORY)}@([^"]+)"', code)
    if not match:
        raise ValueError(f"the bootstrap's MK_SOURCE default is not a git URL of "
                         f"{REPOSITORY} at a ref")
    return match[1]


def colab_link(notebook: str, ref: str) -> str:
    """The title cell's Colab line for `notebook` (NN_topic) at `ref`."""
    return f"[Open in Colab]({COLAB}/{ref}/notebooks/{notebook}.ipynb)"


def with_link(title: str, link: str) -> str:
    """`title` (a markdown cell) with `link` as its second line, replacing an older one."""
    if LINK.search(title):
        return LINK.sub(lambda _: link, title, count=1)
    first, _, rest = title.partition("\n")
    return f"{first}\n\n{link}" + (f"\n{rest}" if rest else "")


def rewrite(source: Path, code: str) -> None:
    nb = jupytext.read(source)
    title = nb.cells[0]
    if title.cell_type != "markdown" or not title.source.startswith("# "):
        raise ValueError(f"{source.name}: the first cell must be the markdown title")
    title.source = with_link(title.source, colab_link(source.stem, release_ref(code)))
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    first_code.source = code
    # The site shows the bootstrap collapsed: it is setup, not part of the lesson.
    tags = first_code.metadata.setdefault("tags", [])
    if BOOTSTRAP_TAG not in tags:
        tags.append(BOOTSTRAP_TAG)
    jupytext.write(nb, source, fmt="py:percent")
    subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--sync", str(source)],
                   check=True)


def main() -> int:
    code = bootstrap()
    for source in sorted(NOTEBOOKS.glob(SOURCES)):
        rewrite(source, code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
