"""Sphinx configuration of the site `make run` builds from one run's executed notebooks.

tools/build_site.py calls sphinx-build with this folder as the configuration directory
and a run folder (`build/runs/<stamp>/`: the executed .ipynb and an index.md it writes) as
the source: myst-nb reads the notebooks as they ran (nothing is executed again) and the
book theme gives every page its notebook's title, the navigation, prev/next and search.

The pages must work offline, also when a run's `site/` is copied elsewhere: plotly.js is
embedded once per page by `mk.plots.show`, no widget manager is loaded (a widget needs a
live kernel; the page shows each widget's text form: a tqdm bar as its last text line),
and MathJax is the copy inside the site (`MK_MATHJAX`, a path relative to `_static/`,
copied there by tools/build_site.py). Tables are HTML (`mk.plots.table`). The download
button serves the page's executed notebook (`_sources/<page>.ipynb`).
"""

import os
import tomllib
from pathlib import Path

project = "mk notebooks"
author = "the mk authors"
html_title = "mk: a TPU decode megakernel"
extensions = ["myst_nb"]
exclude_patterns = ["site", "site.partial", "**.html", "runs.json"]

# Executed by papermill already; failed notebooks are shown as they stopped.
nb_execution_mode = "off"
nb_ipywidgets_js = {}
# Without a widget manager a widget's view is an empty box: show its text/plain instead.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None),
                              ("html", "application/vnd.jupyter.widget-state+json", None)]
# mk.plots.show writes each figure as text/html (plotly.js once per page), which the page
# shows; myst-nb warns about the plotly JSON beside it in the same output, never shown.
# Sphinx runs with warnings as errors (tools/build_site.py), except a traceback Pygments
# cannot lex strictly (a failed notebook's error text): Sphinx shows it relaxed, and a
# failed notebook must still get its page.
suppress_warnings = ["mystnb.unknown_mime_type", "misc.highlighting_failure"]
myst_enable_extensions = ["dollarmath"]
# A notebook links another by its file (`[notebook 00's ledger](00_decode_is_memory_bound.ipynb)`,
# which Jupyter opens too, and myst turns into the other page's link); in a run that did not
# execute the other notebook the link is left as text, not a build error.
nitpick_ignore_regex = [("myst", r"\d\d[a-z]?_[a-z0-9_]+\.ipynb")]

mathjax_path = os.environ.get("MK_MATHJAX", "")
# MathJax 3; `ui/safe` filters what a formula may link or style (myst adds the classes to
# typeset: only its own math elements, never a `$` in an output's text).
mathjax3_config = {"loader": {"load": ["ui/safe"]}}

html_theme = "sphinx_book_theme"
html_theme_options = {
    # The repository's one URL: pyproject.toml's [project.urls].Source.
    "repository_url": tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                                    .read_text(encoding="utf-8"))["project"]["urls"]["Source"],
    "use_repository_button": True,
    "show_navbar_depth": 1,
    "home_page_in_toc": True,
}
# Without a mode the theme logs "Got invalid theme mode" to the console (an error).
html_context = {"default_mode": "light"}
html_show_sourcelink = False
html_copy_source = True  # the executed notebook, for the download button
