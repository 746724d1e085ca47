"""`make run`'s site: runs from notebooks/runs.yaml, an index row per run, failures kept and
counted, nothing overwritten, and pages that work offline in a real browser; and Colab
readiness: a Colab link per notebook in docs/colab.md; the README's and docs' links resolve;
kernels that do not warn about TCP.

The site here is built by the same code `make run` calls (`tools/run_notebooks.main`) from
two notebooks generated here (the real ones take minutes): one with math, a plotly slider
figure made by `mk.plots.show` and a bar chart, run in two configurations from a runs file,
and one that fails half way. Headless Chromium (Debian's, driven by Playwright through
`tools/check_site.py`) then opens every page. Without chromium the browser tests skip,
unless CI=true, where that is a failure.

Not here: whether the real notebooks' pages pass in the browser (`make check-site` after
`make run`; each notebook is executed by tests/test_notebooks.py), how a page looks, and
anything that needs Colab itself (never available here).
"""

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill
import pytest
from jupyter_client.manager import AsyncKernelManager
from plotly.offline import get_plotlyjs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
import check_site  # noqa: E402
import notebook_header  # noqa: E402
import run_notebooks  # noqa: E402

# One worker builds the site for every test of this module (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("site")

SLIDER_CELL = """\
import plotly.graph_objects as go
from mk import plots

slopes = (1, 2, 3)
fig = go.Figure([go.Scatter(x=list(range(points)), y=[k * x for x in range(points)],
                            name=f"slope {k}", visible=k == slopes[0]) for k in slopes])
fig.update_layout(title="slope slider", sliders=[dict(active=0, steps=[
    dict(label=str(k), method="update", args=[{"visible": [j == k for j in slopes]}])
    for k in slopes])])
plots.show(fig)"""
RUNS_YAML = """\
90_site_figures:
  - label: three
    parameters: {points: 3}
  - label: five
    parameters: {points: 5}
"""


def _notebook(path, *cells):
    """Write a notebook: a markdown title, a `parameters` cell, then code `cells`."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {path.stem}\n\nInline math $a^2 + b^2$."),
                nbformat.v4.new_code_cell(cells[0], metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells[1:]]
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebooks")
    # The comment's apostrophe once hid `points` from papermill's parameter parser.
    figures = _notebook(folder / "90_site_figures.ipynb",
                        "points = 3  # x values; \"\" = the notebook's own", SLIDER_CELL,
                        'plots.show(go.Figure(go.Bar(x=["a", "b"], y=[1, points])))',
                        'print(f"points={points}")')
    fails = _notebook(folder / "91_site_fails.ipynb", 'message = "planted failure"',
                      'print("before the failure")', "raise RuntimeError(message)",
                      'print("after the failure")')
    (folder / "runs.yaml").write_text(RUNS_YAML)
    return figures, fails


def _main(*argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = run_notebooks.main([str(a) for a in argv])
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def site(notebooks, tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    figures, fails = notebooks
    code, stdout = _main(figures, fails, "--out", out,
                         "--runs", figures.parent / "runs.yaml", "--all")
    (run_dir,) = (out / "runs").iterdir()
    record = json.loads((run_dir / "runs.json").read_text())
    return {"out": out, "code": code, "stdout": stdout, "run_dir": run_dir,
            "rows": {row["name"]: row for row in record["rows"]}}


# -- runs.yaml ------------------------------------------------------------------------------
def test_project_runs_yaml_names_real_notebooks_and_parameters():
    notebooks = sorted((ROOT / "notebooks").glob(run_notebooks.PATTERN))
    runs = run_notebooks.load_runs(run_notebooks.RUNS_FILE, notebooks)
    assert {run.notebook for run in runs} == set(notebooks)
    # The fix cells ship as stubs: every headless run checks the worked solutions instead.
    staged = [r for r in runs if "solutions" in run_notebooks.notebook_parameters(r.notebook)]
    assert len({r.notebook for r in staged}) >= 5, staged
    assert all(r.parameters["solutions"] is True for r in staged), staged


@pytest.mark.parametrize("text, message", [
    ("90_site_figurs:\n  - {}\n", "name no notebook"),
    ("90_site_figures:\n  - parameters: {pointz: 3}\n", "['pointz'], which"),
    ("90_site_figures:\n  - {label: a}\n  - {label: a}\n", "label='a' is repeated"),
    ("90_site_figures:\n  - {label: a}\n  - {}\n", "[1] has no label"),
    ("90_site_figures:\n  - {label: 'a b'}\n", "label='a b' must be"),
    ("90_site_figures:\n  - {label: a, params: {}}\n", "the keys 'label'"),
    ("90_site_figures: []\n", "non-empty list"),
    ("- 90_site_figures\n", "the top level must map"),
    ("every_run:\n  parameters: {pointz: 3}\n", "['pointz'], which no notebook"),
    ("every_run: {points: 3}\n", "with the one key 'parameters'"),
    ("every_run:\n  parameters: {points: 2026-01-01}\n", "is a date"),
])
def test_runs_yaml_mistakes_are_value_errors(notebooks, tmp_path, text, message):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_notebooks.load_runs(runs_file, list(notebooks), known=list(notebooks))


def test_runs_yaml_configurations_become_runs(notebooks):
    figures, fails = notebooks
    runs = run_notebooks.load_runs(figures.parent / "runs.yaml", [figures, fails])
    assert [(r.name, r.parameters) for r in runs] == [
        ("90_site_figures-three", {"points": 3}), ("90_site_figures-five", {"points": 5}),
        ("91_site_fails", {})]


def test_every_run_parameters_go_under_each_runs_own_to_the_notebooks_assigning_them(
        notebooks, tmp_path):
    figures, fails = notebooks
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(RUNS_YAML.replace("{points: 5}", "{}")
                         + "every_run:\n  parameters: {points: 4}\n")
    runs = run_notebooks.load_runs(runs_file, [figures, fails], known=[figures, fails])
    assert [(r.name, r.parameters) for r in runs] == [
        ("90_site_figures-three", {"points": 3}), ("90_site_figures-five", {"points": 4}),
        ("91_site_fails", {})]


def test_colab_page_opens_every_notebook_in_colab():
    page = (ROOT / "docs" / "colab.md").read_text()
    ref = notebook_header.release_ref(notebook_header.bootstrap())
    missing = [p.stem for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.py"))
               if notebook_header.colab_link(p.stem, ref).split("(")[1][:-1] not in page]
    assert not missing, f"docs/colab.md's Colab checklist lacks {missing} at {ref}"


def test_readme_and_docs_link_to_files_that_exist():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "data" / "README.md", ROOT / "mk" / "data" / "README.md"]
    links = [(page, target) for page in pages
             for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
             if not target.startswith(("http://", "https://", "#"))]
    assert len(links) > 20, links  # the README's links to docs/ among them
    broken = [f"{page.relative_to(ROOT)}: {target}" for page, target in links
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def _kernel_warnings(manager_class, tmp_path, capfd):
    """What running a one-cell notebook with `manager_class` printed on stderr."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "one.ipynb")
    capfd.readouterr()
    papermill.execute_notebook(str(tmp_path / "one.ipynb"), str(tmp_path / "out.ipynb"),
                               kernel_name="python3", progress_bar=False,
                               kernel_manager_class=manager_class)
    return capfd.readouterr().err


def test_kernels_run_without_the_unencrypted_tcp_warning(tmp_path, capfd):
    warning = "Kernel is running over TCP without encryption"
    assert warning not in _kernel_warnings(run_notebooks._PatientKernelManager, tmp_path, capfd)
    # Control: jupyter_client's default manager (TCP) prints it, so the check can fail.
    assert warning in _kernel_warnings(AsyncKernelManager, tmp_path, capfd)


# A machine with no IP sockets, as the lent TPU is: socket(AF_INET) and getifaddrs fail.
NO_IP_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <ifaddrs.h>
#include <sys/socket.h>
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) { errno = EAFNOSUPPORT; return -1; }
    if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
int getifaddrs(struct ifaddrs **ifap) { errno = EAFNOSUPPORT; return -1; }
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("cc"),
                    reason="needs Linux and a C compiler for the LD_PRELOAD shim")
def test_a_kernel_runs_on_a_machine_without_ip_sockets(tmp_path, capfd, monkeypatch):
    """The lent TPU's machine refuses IP sockets; run_notebooks' kernels still run there
    (tools/kernel_launcher.py), where ipykernel's own launcher aborts before it answers."""
    source = tmp_path / "no_ip.c"
    source.write_text(NO_IP_SHIM)
    shim = tmp_path / "no_ip.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"],
                   check=True)
    monkeypatch.setenv("LD_PRELOAD", str(shim))  # the kernels inherit it; this process not
    _kernel_warnings(run_notebooks._PatientKernelManager, tmp_path, capfd)
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert out.cells[0].outputs[0]["data"]["text/plain"] == "1"

    class PlainLauncher(run_notebooks._PatientKernelManager):  # ipc, ipykernel_launcher
        format_kernel_cmd = AsyncKernelManager.format_kernel_cmd

    with pytest.raises(RuntimeError, match="Kernel died"):  # control: the shim bites
        _kernel_warnings(PlainLauncher, tmp_path, capfd)


# -- The site -------------------------------------------------------------------------------
def test_index_has_a_row_per_run_with_parameters_status_time_and_link(site):
    index = (site["out"] / "index.html").read_text()
    names = ["90_site_figures-three", "90_site_figures-five", "91_site_fails"]
    assert list(site["rows"]) == names
    rows = re.findall(r"<tr><td>(.*?)</tr>", index)
    assert len(rows) == len(names)
    for row, name in zip(rows, names):
        link = re.search(r'<a href="([^"]+)">', row)[1]
        assert link == f"runs/{site['run_dir'].name}/site/{name}.html"
        assert (site["out"] / link).exists()
        assert re.search(r"<td>\d+\.\d s</td>$", row), row
    assert "points=3" in rows[0] and "points=5" in rows[1] and "notebook defaults" in rows[2]
    assert [row.count('class="ok"') for row in rows] == [1, 1, 0]
    assert re.search(r"1 failed, \d+ s; source [0-9a-f]{7,}", index)  # the commit it ran


def test_failed_notebook_keeps_partial_output_and_fails_the_run(site):
    assert site["code"] == 1
    row = site["rows"]["91_site_fails"]
    assert row["status"] == "failed" and row["error"] == "RuntimeError: planted failure"
    executed = nbformat.read(site["run_dir"] / "91_site_fails.ipynb", as_version=4)
    outputs = [[o.get("text") or o.get("ename") for o in cell.outputs]
               for cell in executed.cells if cell.cell_type == "code"]
    assert outputs[1:] == [["before the failure\n"], ["RuntimeError"], []]
    assert (site["run_dir"] / row["page"]).exists()
    assert 'class="failed">failed: RuntimeError: planted failure' in (
        site["out"] / "index.html").read_text()


def test_progress_lines_name_each_run_with_time_and_status(site):
    for name, row in site["rows"].items():
        assert re.search(rf"^\[\d/3\] {re.escape(name)} *: running$", site["stdout"], re.M)
        assert re.search(rf"^\[\d/3\] {re.escape(name)} *: {row['status']} in \d+\.\d s",
                         site["stdout"], re.M), site["stdout"]
    assert re.search(r"^2 ok, 1 failed in \d+ s", site["stdout"], re.M)


def test_pages_load_the_sites_one_plotlyjs_and_nothing_from_outside(site):
    """plotly.js lies once in the site (`_static/plotly.min.js`), not in every page; the
    executed notebook (the download) keeps its own copy, so it stays whole."""
    header = get_plotlyjs()[:60]
    shared = site["run_dir"] / build_site.SITE / "_static" / build_site.PLOTLYJS
    assert shared.read_text() == get_plotlyjs()
    for name, row in site["rows"].items():
        page = (site["run_dir"] / row["page"]).read_text()
        figures = name != "91_site_fails"
        assert header not in page, name
        assert page.count(f'src="_static/{build_site.PLOTLYJS}"') == int(figures), name
        assert not re.findall(r'src="https?:', page), name
        notebook = nbformat.read(site["run_dir"] / f"{name}.ipynb", as_version=4)
        html = "".join(out.get("data", {}).get("text/html", "") for cell in notebook.cells
                       for out in cell.get("outputs", []))
        assert (header in html) == figures, name


def test_pages_have_their_notebook_title_index_link_and_neighbours(site):
    names = list(site["rows"])
    titles = {"90_site_figures-three": "90_site_figures (three)",
              "90_site_figures-five": "90_site_figures (five)",
              "91_site_fails": "91_site_fails"}
    pages = {n: (site["run_dir"] / site["rows"][n]["page"]).read_text() for n in names}
    for i, name in enumerate(names):
        page = pages[name]
        assert re.search(r"<title>90_site_figures|<title>91_site_fails", page), name
        assert 'href="index.html"' in page, f"{name} does not link its run's index"
        prev = re.search(r'class="left-prev"\s+href="([^"]+)"', page)
        nxt = re.search(r'class="right-next"\s+href="([^"]+)"', page)
        assert prev and prev[1] == ("index.html" if i == 0 else f"{names[i - 1]}.html"), name
        assert (nxt[1] if nxt else None) == (f"{names[i + 1]}.html"
                                             if i + 1 < len(names) else None), name
        assert "searchindex" in page or "search.html" in page, f"{name} has no search"
    navigation = (site["run_dir"] / "site" / "index.html").read_text()
    for name, text in titles.items():  # the table of contents names each configuration
        assert re.search(rf'href="{re.escape(name)}\.html">{re.escape(text)}</a>', navigation), \
            (name, text)


def test_each_executed_notebook_is_stored_once_per_run(site):
    """The run's executed notebook, the download button's copy in the site (a hard link)
    and no myst-nb working copies: one file's bytes per notebook, not three."""
    run_dir = site["run_dir"]
    executed = sorted(run_dir.glob("*.ipynb"))
    assert executed and not (run_dir / build_site.EXECUTE_COPIES).exists()
    for notebook in executed:
        served = run_dir / build_site.SITE / "_sources" / notebook.name
        assert served.samefile(notebook), served
    stored = [p for p in run_dir.rglob("*.ipynb")]
    assert len({p.stat().st_ino for p in stored}) == len(executed), stored


def test_run_folders_are_never_reused(tmp_path):
    first, second = run_notebooks.new_run_dir(tmp_path), run_notebooks.new_run_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


# -- In a browser ---------------------------------------------------------------------------
def _chromium():
    chromium = check_site.find_chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        chromium = None
    if chromium:
        return chromium
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true and no chromium/playwright: .ci/run installs Debian's chromium, "
                    "requirements-test.txt pins playwright")
    pytest.skip("no /usr/bin/chromium or no playwright (apt-get install -y chromium; "
                "pip install -r requirements-test.txt); under CI=true this fails instead")


def test_site_works_offline_in_headless_chromium(site):
    report = check_site.check_site(site["out"], chromium=_chromium())
    assert not report.problems, str(report)
    pages = {Path(p).name for p in report.pages}
    assert {f"{name}.html" for name in site["rows"]} | {"index.html"} <= pages
    # 90_site_figures: two figures, one of them with a slider, in each of two runs.
    assert report.figures == 4 and report.sliders_stepped == 2, str(report)


def test_browser_check_reports_broken_pages(tmp_path):
    figure = """<div id="{id}" class="plotly-graph-div" style="height:300px"></div>
<script>Plotly.newPlot("{id}", [{{y: [1, 3, 2]}}], {{sliders: [{{steps: [
  {{label: "a", method: "skip"}}, {{label: "b", method: "skip"}}]}}]}});</script>"""
    (tmp_path / "index.html").write_text('<a href="page.html">page</a>')
    (tmp_path / "page.html").write_text(
        f"<!doctype html><html><body><script>{get_plotlyjs()}</script>"
        + figure.format(id="inert") + '<div id="never" class="plotly-graph-div"></div>'
        + '<img src="http://example.invalid/x.png"><script>throw new Error("planted")</script>'
        + "</body></html>")
    report = check_site.check_site(tmp_path, chromium=_chromium())
    problems = "\n".join(report.problems)
    assert "JavaScript error: planted" in problems
    assert "figure never was not drawn by plotly" in problems
    assert "figure inert: slider step 1 did not change the plot" in problems
    assert "request leaves the site: http://example.invalid/x.png" in problems


def test_an_animated_figures_slider_steps_and_playing_on_load_or_clipping_is_caught(
        tmp_path, monkeypatch):
    """A figure with frames (the ring Gantt) drawn by `mk.plots.show`: its slider steps
    without error and every frame lies inside its axes. Planted: the same figure from
    plotly's to_html as is, which plays the frames on load (slowed here so the click surely
    lands in the play); the click interrupts the play, whose rejected promise is an
    uncaught error "undefined". And the Gantt as af5b9de showed it (no fixed ranges): the
    y axis keeps the 1-slot frame's range, so the 2- and 3-slot frames are clipped."""
    import plotly.io as pio

    from mk import plots
    from mk.course import teach
    from mk.kernels.common import BlockSizes
    from mk.kernels.stream import TileStream

    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=128),
                              [("wq", 256, 256), ("wo", 256, 256)])
    schedules = {f"{n} slots": teach.ring_schedule(
        stream, slots=n, latency_s=0.5e-6, dma_s=0.05e-6, compute_s=0.02e-6)
        for n in (1, 2, 3)}
    fig = plots.ring_gantt(schedules, title="ring")
    clipped = pio.to_html(plots.ring_gantt(schedules, title="ring"), include_plotlyjs=False,
                          full_html=False, auto_play=False)
    shown = []
    monkeypatch.setattr(plots, "display", lambda bundle, raw: shown.append(bundle))
    monkeypatch.setitem(plots.page_state, "plotlyjs_embedded", True)  # loaded once, below
    plots.show(fig)
    playing = pio.to_html(fig, include_plotlyjs=False, full_html=False,
                          animation_opts={"frame": {"duration": 20_000}})
    (tmp_path / "index.html").write_text(
        '<title>i</title><a href="shown.html">a</a> <a href="playing.html">b</a> '
        '<a href="clipped.html">c</a>')
    for name, html in (("shown", shown[0]["text/html"]), ("playing", playing),
                       ("clipped", clipped)):
        (tmp_path / f"{name}.html").write_text(
            f"<!doctype html><html><head><title>{name}</title></head><body>"
            f"<script>{get_plotlyjs()}</script>{html}</body></html>")
    report = check_site.check_site(tmp_path, chromium=_chromium())
    assert report.figures == 3 and report.sliders_stepped == 3, str(report)
    assert report.problems[0] == "playing.html: JavaScript error: undefined", str(report)
    assert len(report.problems) == 2 and report.problems[1].startswith(
        "clipped.html: figure "), str(report)
    assert "leave yaxis's range [-0.5, 0.5] in frame(s) ['2 slots', '3 slots']" in (
        report.problems[1]), str(report)


def test_a_site_copied_elsewhere_still_works_offline(site, tmp_path):
    """A run's `site/` alone, served from another folder: every page loads, its math is
    typeset by the MathJax copied into it, nothing is requested from outside."""
    copy = tmp_path / "copied-site"
    shutil.copytree(site["run_dir"] / "site", copy)
    assert (copy / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert not list(copy.rglob(".doctrees")) and not list(copy.rglob("*.doctree"))
    report = check_site.check_site(copy, chromium=_chromium())
    assert not report.problems, str(report)
    assert {f"{name}.html" for name in site["rows"]} <= set(report.pages)


# Last: it adds a second run to the module's site.
def test_a_second_run_leaves_the_first_untouched(site, notebooks):
    def digest(folder):
        return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in folder.rglob("*") if p.is_file()}

    first = digest(site["run_dir"])
    code, _ = _main(notebooks[1], "--out", site["out"])
    assert code == 1
    runs = sorted((site["out"] / "runs").iterdir())
    assert len(runs) == 2 and runs[0] == site["run_dir"]
    assert digest(site["run_dir"]) == first
    index = (site["out"] / "index.html").read_text()
    assert f"Newest run: {runs[1].name}" in index
    assert index.count("<tr><td>") == 1  # the newest run's table; the first is linked
    assert f'href="runs/{runs[0].name}/site/index.html"' in index
