"""Build one run's site with Sphinx: myst-nb reads the executed notebooks of a run folder,
the book theme gives each page its notebook's title, the navigation, prev/next and search.

tools/run_notebooks.py calls `prepare` on each executed notebook (its configuration in its
title, its widgets' text form from their saved state), `write_index` and `build(run_dir)`
after a run (the execution step stays there); the configuration is docs/conf.py. It writes
`run_dir/index.md` (the run's table, every run value through `mk.plots.escape`, and the
table of contents, in run order) and the pages into `run_dir/site/`: `site/index.html` and
one `site/<NN_topic[-label]>.html` per executed notebook, with MathJax copied inside
(`install_mathjax`) and plotly.js once (`share_plotlyjs`); each executed notebook is
stored once per run (`one_copy`).
`course_map` is the front page's course map (notebooks/course.yaml, `load_course`), with
each notebook's student time, what it comes after (`prerequisites`) and its run on a chip
(`chip_cell`, from the records of tools/chip_record.py).

Not here: executing notebooks (papermill, in run_notebooks), writing the index of every run
(`OUT/index.html`, run_notebooks), checking the pages in a browser (tools/check_site.py).
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

from plotly.offline import get_plotlyjs

from mk.plots import escape, plotlyjs_script

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "docs"
SITE = "site"  # the built pages, inside the run folder
PARTIAL = SITE + ".partial"  # the pages while Sphinx writes them (docs/conf.py skips it)
MATHJAX = "mathjax"  # MathJax's folder inside the site's _static/: a copied site keeps it
MATHJAX_PACKAGE = "sphinx-mathjax-offline"  # MathJax 3.2.2 (pinned in pyproject's docs extra)
MATHJAX_JS = "tex-chtml.js"  # TeX in, CommonHTML out; with the parts it loads on demand:
MATHJAX_PARTS = (MATHJAX_JS, "input", "output", "ui", "a11y")
EXECUTE_COPIES = "jupyter_execute"  # myst-nb's copies of the notebooks, beside the site
PLOTLYJS = "plotly.min.js"  # in the site's _static/: the one copy its pages load


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


def prepare(notebook: Path, label: str) -> None:
    """Ready an executed notebook for its page: ` (label)` after its title, so the page of
    each configuration has its own title (the browser tab, the navigation, search), and
    each widget's text form rebuilt from the widget state saved at the end of the run
    (`widget_text`), since the page has no widget manager: a tqdm bar shows where it
    ended, not the 0% it was displayed at."""
    nb = nbformat.read(notebook, as_version=4)
    heading = next((cell for cell in nb.cells
                    if cell.cell_type == "markdown" and cell.source.startswith("# ")), None)
    if heading is None:  # a page needs a title (Sphinx, warnings being errors)
        heading = nbformat.v4.new_markdown_cell(f"# {escape(notebook.stem)}")
        nb.cells.insert(0, heading)
    if label:
        first, _, rest = heading.source.partition("\n")
        heading.source = f"{first} ({label})" + (f"\n{rest}" if rest else "")
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view and view.get("model_id") in state:
                output["data"]["text/plain"] = widget_text(state, view["model_id"])
    nbformat.write(nb, notebook)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
_TAG = re.compile(r"<[^>]+>")


def widget_text(state: dict, model_id: str) -> str:
    """The text form of widget `model_id` in a notebook's saved widget `state`: text and
    HTML as their text, a progress bar drawn in blocks, a control as `description=value`,
    an Output widget's printed text, boxes as their children (side by side or stacked)."""
    model = state.get(model_id, {})
    name, s = model.get("model_name", ""), model.get("state", {})
    children = [widget_text(state, ref.removeprefix("IPY_MODEL_"))
                for ref in s.get("children", [])]
    if name in ("HBoxModel", "GridBoxModel"):
        return "".join(children)
    if children or name.endswith("BoxModel"):
        return "\n".join(c for c in children if c)
    if name == "OutputModel":
        return "".join(o.get("text") or o.get("data", {}).get("text/plain", "")
                       for o in s.get("outputs", [])).rstrip("\n")
    if "Progress" in name:
        share = s.get("value", 0) / s["max"] if s.get("max") else 0.0
        return "|" + "\u2588" * round(10 * share) + " " * (10 - round(10 * share)) + "|"
    label = s.get("description", "")
    if "_options_labels" in s and s.get("index") is not None:
        value = s["_options_labels"][s["index"]]
    elif name in ("HTMLModel", "HTMLMathModel", "LabelModel"):
        value = html.unescape(_TAG.sub("", str(s.get("value", ""))))
        return (f"{label} " if label else "") + value.replace("\u2007", " ")
    else:
        value = s.get("value", "")
    return f"{label}={value}" if label else str(value)


def params_text(parameters: dict) -> str:
    if not parameters:
        return "notebook defaults"
    return ", ".join(f"{k}={v!r}" for k, v in parameters.items())


def table(rows: list[dict], prefix: str) -> str:
    """The HTML table of a run's rows; page links are `prefix` + the row's page. Every value
    from the run (parameters, error texts) goes through `escape`: no newline, backtick or
    tag of theirs reaches the page, so none can end the raw block it sits in."""
    lines = ["<table><tr><th>notebook</th><th>configuration</th><th>parameters</th>"
             "<th>status</th><th>run time</th></tr>"]
    for row in rows:
        name = escape(row["notebook"])
        link = (f'<a href="{html.escape(prefix + row["page"])}">{name}</a>'
                if row["page"] else name)
        status = row["status"] + (f": {row['error']}" if row["error"] else "")
        lines.append(f'<tr><td>{link}</td><td>{escape(row["label"] or "-")}</td>'
                     f'<td><code>{escape(params_text(row["parameters"]))}</code></td>'
                     f'<td class="{escape(row["status"])}">{escape(status)}</td>'
                     f'<td>{row["seconds"]:.1f} s{" (cached)" if row.get("cached") else ""}'
                     "</td></tr>")
    lines.append("</table>")
    return "\n".join(lines)


def write_index(run_dir: Path, record: dict, summary: str) -> None:
    """`run_dir/index.md`: the run's table, then the pages in run order: every notebook
    the run wrote, an interrupted one's partial outputs too (Sphinx reads every notebook
    in the folder and, warnings being errors, refuses one outside the table of contents)."""
    rows = [r for r in record["rows"] if (run_dir / (r["name"] + ".ipynb")).is_file()]
    for r in rows:
        if not r["page"]:  # interrupted before `prepare`: its partial outputs, titled
            prepare(run_dir / (r["name"] + ".ipynb"), "")
    toc = "\n".join(
        f"{title(run_dir / (r['name'] + '.ipynb'))} <{r['name']}>" for r in rows)
    text = f"""# mk notebooks, run {run_dir.name}

Executed headless on CPU ({escape(summary)}). Run times are wall-clock times on the
machine that ran them, with every Pallas kernel in TPU interpret mode: they say nothing
about TPU time. <a href="../../../index.html">All runs</a>.

```{{raw}} html
{table([dict(r, page=r["page"] and Path(r["page"]).name) for r in record["rows"]], "")}
```

```{{toctree}}
:maxdepth: 1
:hidden:

{toc}
```
"""
    (run_dir / "index.md").write_text(text, encoding="utf-8")


COURSE = ROOT / "notebooks" / "course.yaml"


COURSE_KEYS = ("notebook", "teaches", "minutes")  # and `after`, where given


def load_course(course_file: Path = COURSE) -> list[dict]:
    """The parts of the course map: [{title, notebooks: [{notebook, teaches, minutes,
    after?}]}], checked: `minutes` a whole number > 0 (a student's time), `after` a list
    of notebooks earlier on the map (what it builds on, where not the one before it);
    ValueError naming the file, the notebook, the field and the value."""
    import yaml  # only the map needs it

    parts = yaml.safe_load(course_file.read_text(encoding="utf-8"))["parts"]
    seen = []
    for part in parts:
        for entry in part["notebooks"]:
            if not set(COURSE_KEYS) <= set(entry) <= {*COURSE_KEYS, "after"}:
                raise ValueError(f"{course_file.name}: {entry!r} must have the keys "
                                 f"{', '.join(map(repr, COURSE_KEYS))} and may have 'after'")
            where = f"{course_file.name}: {entry['notebook']}"
            minutes, after = entry["minutes"], entry.get("after", seen[-1:])
            if isinstance(minutes, bool) or not isinstance(minutes, int) or minutes < 1:
                raise ValueError(f"{where}: minutes={minutes!r} must be a whole number of "
                                 "minutes > 0")
            if not isinstance(after, list) or "after" in entry and not after or any(
                    a not in seen for a in after):
                raise ValueError(f"{where}: after={after!r} must list notebooks earlier on "
                                 "the map")
            seen.append(entry["notebook"])
    return parts


def prerequisites(parts: list[dict]) -> dict[str, list[str]]:
    """{notebook: the notebooks it comes after}: its `after`, else the one before it on
    the map (none for the first)."""
    entries = [e for part in parts for e in part["notebooks"]]
    return {e["notebook"]: e.get("after", [p["notebook"] for p in entries[max(i - 1, 0):i]])
            for i, e in enumerate(entries)}


def course_map(parts: list[dict], records: list[tuple[str, dict]], notebooks: Path,
               chip_runs: list[dict] = ()) -> str:
    """The front page's course map as HTML: per part, each notebook in order with its title,
    what it teaches, a student's time for it and what it comes after (`prerequisites`,
    by number) and, from the newest run that ran it (`records`: (run name, record),
    newest first), its configurations linked to their pages, status and run time; and how
    its run on each chip went (`chip_runs`: records of `chip_record`, `chip_cell`)."""
    lines, after = [], prerequisites(parts)
    for part in parts:
        lines.append(f"<h2>{escape(part['title'])}</h2>\n<table class=\"course\"><tr>"
                     "<th>notebook</th><th>what it teaches</th><th>student time</th>"
                     "<th>after</th><th>configurations (newest run)</th><th>run time</th>"
                     "<th>on a chip (hardware mode)</th></tr>")
        for entry in part["notebooks"]:
            stem = entry["notebook"]
            found = next(((name, [r for r in rec["rows"] if r["notebook"] == stem])
                          for name, rec in records
                          if any(r["notebook"] == stem for r in rec["rows"])), (None, []))
            name, rows = found
            configs = ", ".join(_config_link(name, r) for r in rows) or "not run yet"
            seconds = f"{sum(r['seconds'] for r in rows):.0f} s" if rows else "-"
            name_cell = escape(title(notebooks / f"{stem}.ipynb"))
            before = ", ".join(a.split("_")[0] for a in after[stem]) or "-"
            lines.append(f'<tr class="course"><td>{name_cell}</td>'
                         f"<td>{escape(entry['teaches'])}</td>"
                         f"<td>{escape(str(entry['minutes']))} min</td>"
                         f"<td>{escape(before)}</td><td>{configs}</td>"
                         f"<td>{seconds}</td><td>{chip_cell(stem, chip_runs)}</td></tr>")
        lines.append("</table>")
    return "\n".join(lines)


NOT_ON_A_CHIP = "hardware path not yet run on a chip"
ERROR_SHOWN = 160  # characters of a chip run's error on the map


def chip_cell(stem: str, chip_runs: list[dict]) -> str:
    """How notebook `stem` went on each chip that ran it ("ran on v5e, 2026-12-07,
    6956f2f, ok"; a failure with its cell and error), from records of `chip_record`, or
    `NOT_ON_A_CHIP`. Every value from a record is escaped."""
    lines = []
    for record in chip_runs:
        for row in (r for r in record["rows"] if r["notebook"] == stem):
            status = escape(row["status"])
            text = (f"ran on {escape(record['chip'])}, {escape(row['when'][:10])}, "
                    f"{escape(row['commit'][:7])}, <span class=\"{status}\">{status}</span>")
            if row["status"] != "ok":
                at = (f" at cell {row['failing_cell']} of {row['cells']}"
                      if row["failing_cell"] else "")
                text += f"{at}: {escape(row['error'][:ERROR_SHOWN])}"
            lines.append(text)
    return "<br>".join(lines) or NOT_ON_A_CHIP


def _config_link(run_name: str, row: dict) -> str:
    label = escape(row["label"] or "default")
    href = html.escape(f"runs/{run_name}/{row['page']}")
    link = f'<a href="{href}">{label}</a>' if row["page"] else label
    return f'{link} <span class="{escape(row["status"])}">{escape(row["status"])}</span>'


def install_mathjax(site: Path) -> Path:
    """Copy MathJax (`MATHJAX_PARTS` of the pinned sphinx-mathjax-offline) into
    `site/_static/mathjax`: into a temporary folder first, checked file by file against the
    source's sizes, then renamed into place, so a full disk or a kill never leaves a
    partial copy behind."""
    spec = importlib.util.find_spec(MATHJAX_PACKAGE)
    if spec is None:
        raise RuntimeError(f"{MATHJAX_PACKAGE} is not installed: pip install -r "
                           "requirements.txt")
    source = Path(spec.submodule_search_locations[0]) / "static" / "mathjax"
    target = site / "_static" / MATHJAX
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".mathjax-", dir=target.parent))
    try:
        for part in MATHJAX_PARTS:
            if (source / part).is_dir():
                shutil.copytree(source / part, partial / part)
            else:
                shutil.copy2(source / part, partial / part)
        wanted = {p.relative_to(source): p.stat().st_size for part in MATHJAX_PARTS
                  for p in [source / part, *(source / part).rglob("*")] if p.is_file()}
        got = {p.relative_to(partial): p.stat().st_size for p in partial.rglob("*")
               if p.is_file()}
        if got != wanted:
            bad = sorted(str(k) for k in wanted if got.get(k) != wanted[k])
            raise RuntimeError(f"MathJax copy into {partial} differs from {source} "
                               f"({len(bad)} of {len(wanted)} files: {bad[:3]})")
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


class BuildFailed(RuntimeError):
    """Sphinx failed (or was killed) building a run's site; no `site/` was left."""


def build(run_dir: Path) -> None:
    """Run Sphinx on `run_dir` (its index.md and executed notebooks) into `run_dir/site/`,
    warnings as errors; the pages load MathJax from the site's own `_static/mathjax`. The
    doctrees (Sphinx's cache) go to a temporary folder, not into the site. Built into
    `site.partial/` and renamed `site/` only when whole, so a failure, a kill or a full
    disk never leaves a half-built site where the index would link it (`BuildFailed`)."""
    site, partial = run_dir / SITE, run_dir / PARTIAL
    env = dict(os.environ, MK_MATHJAX=f"{MATHJAX}/{MATHJAX_JS}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="mk-doctrees-") as doctrees:
            done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W",
                                   "--keep-going", "-d", doctrees, "-c", str(CONF),
                                   str(run_dir), str(partial)], env=env, text=True,
                                  capture_output=True)
        if done.returncode < 0:
            raise BuildFailed(f"sphinx-build was killed by signal {-done.returncode}")
        if done.returncode != 0:
            raise BuildFailed(f"sphinx-build failed:\n{done.stderr[-3000:]}")
        if done.stderr.strip():
            print(done.stderr.strip(), file=sys.stderr, flush=True)
        install_mathjax(partial)
        share_plotlyjs(partial)
        if site.exists():
            shutil.rmtree(site)
        partial.rename(site)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    one_copy(run_dir)


def share_plotlyjs(site: Path) -> None:
    """plotly.js once per site, not once per page: the copy `mk.plots.show` embeds in a
    notebook's first figure (4.6 MB; the notebook itself keeps it, to stay whole when
    downloaded) becomes `_static/plotly.min.js`, which each page loads from the site."""
    inline = plotlyjs_script()
    shared = site / "_static" / PLOTLYJS
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        if inline in text:
            if not shared.exists():
                shared.write_text(get_plotlyjs(), encoding="utf-8")
            src = Path(os.path.relpath(shared, page.parent)).as_posix()
            page.write_text(text.replace(inline, f'<script type="text/javascript" '
                                                 f'src="{src}"></script>'), encoding="utf-8")


def one_copy(run_dir: Path) -> None:
    """Keep one copy of each executed notebook in `run_dir`: myst-nb's working copies
    (`jupyter_execute/`, only read while Sphinx builds) go, and the download button's copy
    (`site/_sources/<name>.ipynb`, the same bytes) becomes a hard link to the run's own
    `<name>.ipynb` (a copied site gets its own file again)."""
    shutil.rmtree(run_dir / EXECUTE_COPIES, ignore_errors=True)
    for notebook in run_dir.glob("*.ipynb"):
        served = run_dir / SITE / "_sources" / notebook.name
        if served.is_file() and served.read_bytes() == notebook.read_bytes():
            link = served.with_name(served.name + ".link")
            link.unlink(missing_ok=True)
            os.link(notebook, link)
            os.replace(link, served)
