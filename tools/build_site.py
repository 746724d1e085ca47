"""Build one run's site with Sphinx: myst-nb reads the executed notebooks of a run folder,
the book theme gives each page its notebook's title, the navigation, prev/next and search.

tools/run_notebooks.py calls `build(run_dir, out, record)` after a run (the execution step
stays there); the configuration is docs/conf.py. It writes `run_dir/index.md` (the run's
table and the table of contents, in run order) and the pages into `run_dir/site/`:
`site/index.html` and one `site/<NN_topic[-label]>.html` per executed notebook.

Not here: executing notebooks (papermill, in run_notebooks), the index of every run
(`OUT/index.html`, run_notebooks), checking the pages in a browser (tools/check_site.py).
"""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "docs"
SITE = "site"  # the built pages, inside the run folder
MATHJAX_JS = "MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"


def page(name: str) -> str:
    """Where the page of run `name` lands, relative to its run folder."""
    return f"{SITE}/{name}.html"


def title(notebook: Path) -> str:
    """The notebook's title: the first line of its first markdown cell, without `# `."""
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.splitlines()[0][2:].strip()
    return notebook.stem


def params_text(parameters: dict) -> str:
    if not parameters:
        return "notebook defaults"
    return ", ".join(f"{k}={v!r}" for k, v in parameters.items())


def table(rows: list[dict], prefix: str) -> str:
    """The HTML table of a run's rows; page links are `prefix` + the row's page."""
    lines = ["<table><tr><th>notebook</th><th>configuration</th><th>parameters</th>"
             "<th>status</th><th>run time</th></tr>"]
    for row in rows:
        name = html.escape(row["notebook"])
        link = (f'<a href="{html.escape(prefix + row["page"])}">{name}</a>'
                if row["page"] else name)
        status = row["status"] + (f": {row['error']}" if row["error"] else "")
        lines.append(f'<tr><td>{link}</td><td>{html.escape(row["label"] or "-")}</td>'
                     f'<td><code>{html.escape(params_text(row["parameters"]))}</code></td>'
                     f'<td class="{row["status"]}">{html.escape(status)}</td>'
                     f'<td>{row["seconds"]:.1f} s</td></tr>')
    lines.append("</table>")
    return "\n".join(lines)


def write_index(run_dir: Path, record: dict, summary: str) -> None:
    """`run_dir/index.md`: the run's table, then the pages in run order."""
    rows = [r for r in record["rows"] if r["page"]]
    toc = "\n".join(
        f"{title(run_dir / (r['name'] + '.ipynb'))}"
        f"{' (' + r['label'] + ')' if r['label'] else ''} <{r['name']}>" for r in rows)
    text = f"""# mk notebooks, run {run_dir.name}

Executed headless on CPU ({html.escape(summary)}). Run times are wall-clock times on the
machine that ran them, with every Pallas kernel in TPU interpret mode: they say nothing
about TPU time. <a href="../../../index.html">All runs</a>.

```{{raw}} html
{table(record["rows"], "../")}
```

```{{toctree}}
:maxdepth: 1
:hidden:

{toc}
```
"""
    (run_dir / "index.md").write_text(text, encoding="utf-8")


def build(run_dir: Path, mathjax: Path) -> None:
    """Run Sphinx on `run_dir` (its index.md and executed notebooks) into `run_dir/site/`;
    the pages load MathJax from `mathjax` (a folder with MathJax.js, inside the site)."""
    static = run_dir / SITE / "_static"
    env = dict(os.environ,
               MK_MATHJAX=f"{Path(os.path.relpath(mathjax, static)).as_posix()}/{MATHJAX_JS}")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c",
                           str(CONF), str(run_dir), str(run_dir / SITE)],
                          env=env, text=True, capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"sphinx-build failed:\n{done.stderr[-3000:]}")
    if done.stderr.strip():
        print(done.stderr.strip(), file=sys.stderr, flush=True)
