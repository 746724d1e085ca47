"""What run data cannot do to `make run` and its site, and what `make check-site` catches.

Untrusted text (a runs file's value, a notebook's error, a table cell, a config name) is
escaped by one helper, `mk.plots.escape`: an XSS payload and an `{include}` payload are run
through a real site build and checked in headless Chromium. runs.yaml values are YAML
scalars of the notebook's annotated types; papermill's unknown `-p` names and mistyped
values stop a notebook in the cell after its parameters (`mk.course.run.check_parameters`). A run
is `finished` only with its site, the final steps hold SIGINT/SIGTERM, one run at a time per
output folder, `--out` a file is a clear error. Each rule of tools/check_site.py fails on a
page planted with its defect.

Not here: the site's ordinary contents (tests/test_site.py).
"""

import contextlib
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import papermill
import pytest

from mk import plots
import mk.course.run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_site  # noqa: E402
import run_notebooks  # noqa: E402
from test_site import _chromium  # noqa: E402

pytestmark = pytest.mark.xdist_group("site")

XSS = '<img src=x onerror="document.title=\'pwned\'">'


def _notebook(path, parameters, *cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {path.stem}"),
                nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(nb, path)
    return path


def _main(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_notebooks.main([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


# -- One escaping helper --------------------------------------------------------------------
def test_escape_leaves_no_markup_in_html_or_markdown():
    payload = XSS + "\n```{include} /etc/hostname\n```\n| a | b | $x$ **bold** [l](javascript:x)"
    text = plots.escape(payload)
    assert not re.search(r"[<>\"'`|*$\[\]\n]", text), text
    assert plots.escape("plain text, 1.5 ms") == "plain text, 1.5 ms"
    html = plots.table([{"name": payload, "n": 1}])._repr_html_()
    assert "<img" not in html and "&#60;img src=x onerror=" in html
    assert html.count("<tr>") == 2 and html.startswith("<table")


# -- runs.yaml values and notebook parameters -----------------------------------------------
@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("typed")
    return _notebook(folder / "93_typed.ipynb",
                     'points: int = 3  # x values\nflag: bool = False  # a switch\n'
                     'name: str = "x"  # a name',
                     "import mk.course.run\n"
                     "mk.course.run.check_parameters(globals())", "print(points)")


@pytest.mark.parametrize("value, message", [
    ("!!binary Ig==", "parameters.points=b'\"' is a bytes"),
    ("2026-12-03", "parameters.points=datetime.date(2026, 12, 3) is a date"),
    ("!!set {a: null}", "is a set"),
    ('"3"', "parameter points='3' (str) must be int"),
    ("4096.0", "parameter points=4096.0 (float) must be int"),
    ("true", "parameter points=True (bool) must be int"),
])
def test_runs_yaml_refuses_values_of_other_types_naming_row_and_key(typed, tmp_path, value,
                                                                   message):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(f"93_typed:\n  - label: a\n    parameters:\n      points: {value}\n")
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        run_notebooks.load_runs(runs_file, [typed], known=[typed])
    assert "93_typed[0]" in str(err.value)


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text, message", [
    (LAUGHS, "the alias '*a' is refused (line 2)"),  # 10**9 strings if expanded
    ("93_typed:\n  - parameters: {points: &r [*r]}\n", "the alias '*r' is refused"),
    ("93_typed:\n  - parameters: {points: " + "[" * 40 + "]" * 40 + "}\n",
     "nesting deeper than the limit of 32 levels"),
    ("93_typed:\n  - parameters: {points: " + "9" * 10**5 + "}\n",
     "an integer of 100000 digits is over the limit of 64 (line 2)"),
    ("93_typed:\n  - parameters: {? [points]: 3}\n", "a key must be a name, not a list"),
    ("93_typed:\n  - parameters: {name: 2026-02-30}\n", "day is out of range"),
])
def test_runs_yaml_refuses_aliases_and_deep_nesting_naming_the_limit(typed, tmp_path, text,
                                                                     message):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        run_notebooks.load_runs(runs_file, [typed], known=[typed])
    assert "runs.yaml: not valid YAML" in str(err.value)
    assert time.perf_counter() - start < 1


def test_runs_yaml_refusals_echo_a_long_value_cut_short(typed, tmp_path):
    """A refusal quotes the file's value bounded (`mk.model.errors.shown`, `brief`), not a
    megabyte of it."""
    runs_file = tmp_path / "runs.yaml"
    for text in ("93_typed:\n  - label: " + "a" * 10**5 + "\n",
                 "93_typed:\n  - parameters: {points: [" + "1.5, " * 10**4 + "]}\n",
                 "93_typed:\n  - parameters: {" + "".join(f"p{i}: 1, " for i in range(10**4))
                 + "}\n",
                 "".join(f"n{i}: []\n" for i in range(10**4))):
        runs_file.write_text(text)
        with pytest.raises(ValueError) as err:
            run_notebooks.load_runs(runs_file, [typed], known=[typed])
        assert str(runs_file) in str(err.value) and len(str(err.value)) < 1000, str(
            err.value)[:2000]


def test_runs_yaml_must_be_a_small_regular_utf8_file(typed, tmp_path):
    runs_file = tmp_path / "runs.yaml"
    os.mkfifo(runs_file)
    with pytest.raises(ValueError, match="is a named pipe; only a regular file is read"):
        run_notebooks.load_runs(runs_file, [typed], known=[typed])
    runs_file.unlink()
    runs_file.write_bytes(b"93_typed: \xfe\n")
    with pytest.raises(ValueError, match="not UTF-8 text: byte offset 10"):
        run_notebooks.load_runs(runs_file, [typed], known=[typed])
    runs_file.write_text("#" * run_notebooks.RUNS_MAX_BYTES + "\n")
    with pytest.raises(ValueError, match=f"larger than the limit of "
                                         f"{run_notebooks.RUNS_MAX_BYTES} bytes"):
        run_notebooks.load_runs(runs_file, [typed], known=[typed])


def test_a_missing_notebook_on_the_command_line_is_a_clear_error(tmp_path):
    code, text = _main(tmp_path / "99_nope.ipynb", "--out", tmp_path / "build")
    assert code == 2 and "99_nope.ipynb'] named on the command line are not files" in text
    assert "Traceback" not in text and not (tmp_path / "build").exists()
    source = ROOT / "notebooks" / "01_weight_streaming.py"  # a pair's jupytext half
    code, text = _main(source, "--out", tmp_path / "build")
    assert code == 2 and "01_weight_streaming.py'] named on the command line are not .ipynb" \
        in text, text


def test_runs_yaml_refuses_the_string_false_for_a_bool(typed, tmp_path):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text('93_typed:\n  - parameters: {flag: "False"}\n')
    with pytest.raises(ValueError, match=r"flag='False' \(str\) must be bool"):
        run_notebooks.load_runs(runs_file, [typed], known=[typed])
    runs_file.write_text("93_typed:\n  - parameters: {flag: false, points: 4}\n")
    assert run_notebooks.load_runs(runs_file, [typed], known=[typed])[0].parameters == {
        "flag": False, "points": 4}


def test_check_parameters_names_an_unknown_injected_name_and_a_wrong_type():
    annotations = {"preset": str, "sweep_context": int, "layers": list[int]}
    ns = {"__annotations__": annotations, "preset": "tiny", "sweep_context": 4096,
          "layers": [2, 4], "In": ["", "# Parameters\npresett = \"tiny\"\n", ""]}
    with pytest.raises(ValueError, match=r"\['presett'\] are not parameters.*"
                                         r"\['preset', 'sweep_context', 'layers'\]"):
        mk.course.run.check_parameters(ns)
    ns["In"] = ["", "# Parameters\nsweep_context = 4096.0\n"]
    ns["sweep_context"] = 4096.0
    with pytest.raises(ValueError, match=r"sweep_context=4096.0 \(float\) must be int"):
        mk.course.run.check_parameters(ns)
    ns["sweep_context"], ns["layers"] = 4096, [2, "4"]
    with pytest.raises(ValueError, match=r"layers=\[2, '4'\] \(list\) must be list\[int\]"):
        mk.course.run.check_parameters(ns)
    ns["layers"] = [2, 4]
    mk.course.run.check_parameters(ns)  # all good: no error


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), [1.0, float("nan")]])
def test_a_float_parameter_must_be_finite(value):
    """`-p scale .nan` (or nan in runs.yaml) would run a notebook on a number that sets
    nothing; refused by name as any other wrong value."""
    kind = "list[float]" if isinstance(value, list) else "float"
    with pytest.raises(ValueError, match=re.escape(f"must be {kind} (finite)")):
        mk.course.run.check_parameter("scale", value, kind)
    mk.course.run.check_parameter("scale", [2, 0.5] if isinstance(value, list) else 2, kind)


def test_a_misspelled_papermill_parameter_stops_the_notebook(typed, tmp_path):
    """A plain papermill call, as a user would type it: the kernel's own check fails."""
    with pytest.raises(papermill.PapermillExecutionError) as err:
        papermill.execute_notebook(str(typed), str(tmp_path / "out.ipynb"),
                                   parameters={"pointz": 4}, kernel_name="python3",
                                   progress_bar=False)
    assert "['pointz'] are not parameters" in err.value.evalue
    assert "['points', 'flag', 'name']" in err.value.evalue


def test_every_notebook_checks_its_parameters_right_after_the_parameters_cell():
    for path in sorted((ROOT / "notebooks").glob(run_notebooks.PATTERN)):
        cells = nbformat.read(path, as_version=4).cells
        at = next(i for i, c in enumerate(cells)
                  if "parameters" in c.metadata.get("tags", []))
        following = next(c for c in cells[at + 1:] if c.cell_type == "code")
        assert "mk.course.run.check_parameters(globals())" in following.source, path.name
        before = following.source.split("mk.course.run.check_parameters")[0]
        assert all(line.startswith(("import ", "from ", "#", "    ", ")")) or not line.strip()
                   for line in before.splitlines()), f"{path.name}: work before the check"


# -- Runs that cannot lie or collide --------------------------------------------------------
def test_out_pointing_at_a_file_is_a_clear_error(typed, tmp_path):
    (tmp_path / "file").write_text("")
    code, text = _main(typed, "--out", tmp_path / "file")
    assert code == 2 and "--out" in text and "must be a folder" in text


def test_a_second_run_into_the_same_folder_is_refused(typed, tmp_path):
    with run_notebooks.locked(tmp_path):
        code, text = _main(typed, "--out", tmp_path)
    assert code == 2 and "another run is writing to" in text and str(os.getpid()) in text
    assert not (tmp_path / "runs").exists()


def test_signals_in_the_final_steps_wait_for_them():
    done = []
    with pytest.raises(SystemExit) as stop:
        with run_notebooks.deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            done.append("finished the block")
    assert done and stop.value.code == 128 + signal.SIGTERM


def _fake_run(monkeypatch, build):
    def run_one(run, run_dir, prefix="", cache=None):
        (run_dir / f"{run.name}.ipynb").write_text("{}")
        return run_notebooks._row(run, "ok", "", 0.1, f"site/{run.name}.html")
    monkeypatch.setattr(run_notebooks, "run_one", run_one)
    monkeypatch.setattr(run_notebooks.build_site, "write_index", lambda *a: None)
    monkeypatch.setattr(run_notebooks.build_site, "build", build)


def test_a_run_whose_site_failed_is_not_finished_and_links_no_page(typed, tmp_path,
                                                                  monkeypatch):
    def build(run_dir):
        raise RuntimeError("sphinx-build failed: planted")
    _fake_run(monkeypatch, build)
    with pytest.raises(RuntimeError, match="planted"):
        run_notebooks.run_all([run_notebooks.Run(typed)], tmp_path, [])
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "runs.json").read_text())
    assert record["executed"] and record["finished"] is None
    index = (tmp_path / "index.html").read_text()
    assert "site not built" in index and "href=" not in index


def test_sigterm_during_the_site_build_waits_for_it(typed, tmp_path, monkeypatch):
    def build(run_dir):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        (run_dir / "site").mkdir()
        (run_dir / "site" / "index.html").write_text("<title>t</title>")
    _fake_run(monkeypatch, build)
    previous = signal.signal(signal.SIGTERM, run_notebooks._terminate)
    try:
        with pytest.raises(SystemExit):
            run_notebooks.run_all([run_notebooks.Run(typed)], tmp_path, [])
    finally:
        signal.signal(signal.SIGTERM, previous)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "runs.json").read_text())["finished"]
    assert "site/index.html" in (tmp_path / "index.html").read_text()


def test_sigterm_that_kills_sphinx_exits_with_the_signal_and_says_so(typed, tmp_path,
                                                                    monkeypatch):
    """SIGTERM to the process group kills sphinx-build as well: the run ends with 128 +
    SIGTERM (not "sphinx-build failed" and 1), its record says it was interrupted during
    the site build, and no half-built site is left."""
    def build(run_dir):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        raise run_notebooks.build_site.BuildFailed("sphinx-build was killed by signal 15")
    _fake_run(monkeypatch, build)
    (tmp_path / "runs.yaml").write_text("")
    with pytest.raises(SystemExit) as stop:
        _main(typed, "--out", tmp_path, "--runs", tmp_path / "runs.yaml", "--no-cache")
    assert stop.value.code == 128 + signal.SIGTERM
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "runs.json").read_text())
    assert record["interrupted"] == "SIGTERM during the site build"
    assert record["finished"] is None and "killed by signal 15" in record["site_error"]
    assert not (run_dir / "site").exists()
    index = html.unescape((tmp_path / "index.html").read_text())  # run values are escaped
    assert "interrupted (SIGTERM during the site build)" in index


@pytest.mark.parametrize("where, err", [
    ("new_run_dir", PermissionError(30, "Read-only file system", "/ro/runs")),
    ("write_record", OSError(28, "No space left on device", "/full/runs.json"))])
def test_a_read_only_or_full_out_ends_with_a_message_and_exit_3(typed, tmp_path, monkeypatch,
                                                                 where, err):
    _fake_run(monkeypatch, lambda run_dir: None)

    def fail(*args):
        raise err
    monkeypatch.setattr(run_notebooks, where, fail)
    (tmp_path / "runs.yaml").write_text("")
    code, text = _main(typed, "--out", tmp_path, "--runs", tmp_path / "runs.yaml",
                       "--no-cache")
    assert code == 3 and "Traceback" not in text
    assert f"writing under --out {tmp_path} failed: {err.strerror}: {err.filename}" in text



# A run in a child process whose --out is a tmpfs of its own user and mount namespace:
# read-only, or filled to the last byte, so every write the runner makes meets the fault.
_FAULTED = """import pathlib, sys, pytest
sys.path[:0] = [{tests!r}]
import test_site_safety as t
t._fake_run(pytest.MonkeyPatch(), lambda run_dir: None)
code, text = t._main({notebook!r}, "--out", {out!r}, "--runs", {runs!r}, "--no-cache")
print(code, len(list(pathlib.Path({out!r}).glob("runs/*/runs.json"))), text)"""
_FAULTS = {"read-only": "mount -o remount,ro {out}",
           "full": "head -c 1M /dev/zero > {out}/filler 2>/dev/null; true"}


@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(
    ["unshare", "-r", "-m", "true"], capture_output=True).returncode != 0,
    reason="needs unprivileged user namespaces (unshare -r -m) to mount a faulty --out")
@pytest.mark.parametrize("fault, message", [("read-only", "Read-only file system"),
                                            ("full", "No space left on device")])
def test_a_real_read_only_or_full_out_ends_with_exit_3_and_no_run_record(typed, tmp_path,
                                                                         fault, message):
    """Every write meets the fault (the lock file first): a message, exit 3, and no
    runs.json a later index would trust (a record half-written stays runs.json.partial)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "runs.yaml").write_text("")
    code = _FAULTED.format(tests=str(ROOT / "tests"), notebook=str(typed), out=str(out),
                           runs=str(tmp_path / "runs.yaml"))
    shell = (f"mount -t tmpfs -o size=64k none {out} && {_FAULTS[fault].format(out=out)} && "
             f'exec "$0" -c "$1"')
    done = subprocess.run(["unshare", "-r", "-m", "sh", "-c", shell, sys.executable, code],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.startswith("3 0 "), done.stdout + done.stderr  # exit 3, no record
    assert f"writing under --out {out} failed: {message}" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# -- Payloads through a real site -----------------------------------------------------------
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    secret = folder / "secret.txt"
    secret.write_text("SECRET-6f2b9c\n")
    payload = f"{XSS}\n```\n```{{include}} {secret}\n```\n"
    notebook = _notebook(
        folder / "92_untrusted.ipynb", 'name: str = "x"  # untrusted text',
        "from IPython.display import Markdown, display\nfrom mk import plots",
        'display(plots.table([{"name": name, "n": 1}]))',
        'display(Markdown(f"Config **{plots.escape(name)}**"))',
        "from tqdm.auto import tqdm\nsum(tqdm(range(3), desc='planted bar'))",
        "raise ValueError(name)")
    (folder / "runs.yaml").write_text("92_untrusted:\n  - label: xss\n    parameters:\n"
                                      f"      name: {json.dumps(payload)}\n")
    out = tmp_path_factory.mktemp("hostile-build")
    code, text = _main(notebook, "--out", out, "--runs", folder / "runs.yaml")
    return {"out": out, "code": code, "text": text}


def test_xss_and_include_payloads_reach_the_site_only_as_text(hostile):
    assert hostile["code"] == 1, hostile["text"]  # the notebook fails; the site is built
    files = [p for p in hostile["out"].rglob("*") if p.is_file()]
    assert not [p for p in files if b"SECRET-6f2b9c" in p.read_bytes()]
    (page,) = hostile["out"].glob("runs/*/site/92_untrusted-xss.html")
    html = page.read_text()
    assert "<img src=x" not in html and "onerror=&#34;" in html
    # The tqdm widget's text where it ended (no widget manager on the page).
    assert re.search(r"planted bar: 100%\|\u2588{10}\| 3/3", html), "tqdm bar not as text"
    report = check_site.check_site(hostile["out"], chromium=_chromium())
    assert not report.problems, str(report)


def test_widget_text_is_rebuilt_from_the_saved_widget_state():
    import build_site

    ids = {"box": {"model_name": "VBoxModel", "state": {"children": [
        "IPY_MODEL_s", "IPY_MODEL_d", "IPY_MODEL_o"]}},
           "s": {"model_name": "IntSliderModel", "state": {"description": "tau", "value": 6}},
           "d": {"model_name": "DropdownModel", "state": {
               "description": "chip", "index": 1, "_options_labels": ["v5e", "v6e"]}},
           "o": {"model_name": "OutputModel", "state": {"outputs": [
               {"output_type": "stream", "text": "841 tokens/s\n"}]}},
           "bar": {"model_name": "HBoxModel", "state": {"children": [
               "IPY_MODEL_h", "IPY_MODEL_p"]}},
           "h": {"model_name": "HTMLModel", "state": {"value": "x\u2007&lt;50%"}},
           "p": {"model_name": "FloatProgressModel", "state": {"value": 1.0, "max": 2.0}}}
    assert build_site.widget_text(ids, "box") == "tau=6\nchip=v6e\n841 tokens/s"
    assert build_site.widget_text(ids, "bar") == "x <50%|\u2588\u2588\u2588\u2588\u2588     |"


# -- check_site's rules, each on a planted defect ---------------------------------------------
PLANTED = {
    "table.html": ("<title>t</title><p>| a | b |\n|---|---|\n| 1 | 2 |</p>",
                   "unrendered Markdown table"),
    "math.html": (r"<title>t</title><p>Raw <span class='math'>\(a^2\)</span></p>",
                  "math left untypeset"),
    "widget.html": ('<title>t</title><div class="cell_output"><div class="output">'
                    '<script type="application/vnd.jupyter.widget-view+json">{}</script>'
                    "</div></div>", "widget outputs show nothing"),
    "empty.html": ('<title>t</title><div class="cell_output"><div class="output"></div></div>',
                   "cell outputs show nothing"),
    "folder.html": ('<title>t</title><a href="assets/">assets</a>',
                    "link to a folder with no page: assets/"),
    "nothing.html": ('<title>t</title><a href="gone.ipynb">download</a>',
                     "link to nothing: gone.ipynb"),
    "untitled.html": ("<p>no title</p>", "the page has no title"),
    "big.html": ("<title>t</title>" + "<p>x</p>" * 40_000, "over the budget of 0.2 MB"),
    "handler.html": ('<title>t</title><div class="cell_output"><img alt="" src="data:," '
                     'onerror="1"></div>', "inline event handler in a cell output"),
}


def test_each_site_rule_fails_on_its_planted_defect(tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text("<title>index</title>" + "".join(
        f'<a href="{name}">{name}</a>' for name in [*PLANTED, "clean.html"]))
    (tmp_path / "clean.html").write_text(
        "<title>clean</title><table><tr><td>| a | b |</td></tr></table><pre>| x | y |</pre>"
        '<div class="cell_output"><div class="output"><pre>text</pre></div></div>')
    for name, (body, _) in PLANTED.items():
        (tmp_path / name).write_text(f"<!doctype html><html><head></head><body>{body}"
                                     "</body></html>")
    report = check_site.check_site(tmp_path, chromium=_chromium(), budget_mb=0.2)
    for name, (_, message) in PLANTED.items():
        assert any(p.startswith(f"{name}: ") and message in p for p in report.problems), (
            name, str(report))
    assert not [p for p in report.problems if p.startswith(("clean.html", "index.html"))], (
        str(report))


# -- The front door -------------------------------------------------------------------------
def test_course_map_names_every_notebook_once_in_course_order():
    import build_site

    parts = build_site.load_course()
    stems = [e["notebook"] for part in parts for e in part["notebooks"]]
    assert sorted(stems) == sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*_*.ipynb"))
    assert len(stems) == len(set(stems))
    assert [s.split("_")[0] for s in stems] == [
        "00b", "00", "00c", "01", "13", "02", "03", "04", "05", "06", "07", "08", "09", "10",
        "11", "14", "05b", "05c", "05d", "12", "11b"]
    assert all(e["teaches"].strip() and "\n" not in e["teaches"]
               for part in parts for e in part["notebooks"])


def test_every_notebook_has_a_students_time_and_comes_after_earlier_notebooks():
    import build_site

    parts = build_site.load_course()
    stems = [e["notebook"] for part in parts for e in part["notebooks"]]
    after = build_site.prerequisites(parts)
    assert all(e["minutes"] > 0 for part in parts for e in part["notebooks"])
    assert after[stems[0]] == [] and all(after[s] for s in stems[1:])
    assert all(stems.index(a) < stems.index(s) for s in stems for a in after[s])
    assert after["14_capstone"] == ["13_measure_your_tpu", "11_design_review"]
    assert after["03_decode_attention"] == ["02_attention_prologue"]  # the one before it
    assert after["01_weight_streaming"] == ["00_decode_is_memory_bound",
                                            "00c_first_pallas_kernel"]


@pytest.mark.parametrize("entry, message", [
    ("{notebook: 91_b, minutes: 0, teaches: t}", "91_b: minutes=0 must be a whole number"),
    ("{notebook: 91_b, minutes: true, teaches: t}", "91_b: minutes=True must be"),
    ("{notebook: 91_b, minutes: 1.5, teaches: t}", "91_b: minutes=1.5 must be"),
    ("{notebook: 91_b, teaches: t}", "must have the keys 'notebook', 'teaches', 'minutes'"),
    ("{notebook: 91_b, minutes: 5, after: [92_c], teaches: t}", "91_b: after=['92_c'] must"),
    ("{notebook: 91_b, minutes: 5, after: [91_b], teaches: t}", "91_b: after=['91_b'] must"),
    ("{notebook: 91_b, minutes: 5, after: [], teaches: t}", "91_b: after=[] must list"),
    ("{notebook: 91_b, minutes: 5, after: 90_a, teaches: t}", "91_b: after='90_a' must"),
])
def test_course_map_refuses_a_bad_time_or_a_prerequisite_not_earlier(tmp_path, entry,
                                                                      message):
    import build_site

    course = tmp_path / "course.yaml"
    course.write_text("parts:\n  - title: t\n    notebooks:\n"
                      "      - {notebook: 90_a, minutes: 5, teaches: t}\n"
                      f"      - {entry}\n      - {{notebook: 92_c, minutes: 5, teaches: t}}\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        build_site.load_course(course)
    course.write_text(course.read_text().replace(entry, "{notebook: 91_b, minutes: 5, "
                                                        "after: [90_a], teaches: t}"))
    assert build_site.prerequisites(build_site.load_course(course)) == {  # control
        "90_a": [], "91_b": ["90_a"], "92_c": ["91_b"]}


@pytest.mark.parametrize("bad", ["status", "rows", "deep", "pipe"])
def test_an_old_run_record_that_is_not_the_runners_is_listed_unreadable(tmp_path, bad):
    """An older run's runs.json is read back for the index: a status that would close the
    HTML attribute it sits in, rows that are not rows, deep nesting (a RecursionError) and
    a named pipe (a hang) each list that run as unreadable; the newest good run shows."""
    good = tmp_path / "runs" / "20260101-000000"
    good.mkdir(parents=True)
    row = run_notebooks._row(run_notebooks.Run(ROOT / "notebooks/06_megakernel.ipynb"),
                             "ok", "", 12.0, None)
    run_notebooks.write_record(good, {"rows": [row], "finished": "now", "source": "x"})
    old = tmp_path / "runs" / "20250101-000000"
    old.mkdir()
    if bad == "pipe":
        os.mkfifo(old / "runs.json")
    else:
        text = {"status": json.dumps({"rows": [dict(row, status=f'ok" onmouseover="{XSS}')]}),
                "rows": json.dumps({"rows": [1]}), "deep": "[" * 10**5 + "]" * 10**5}[bad]
        (old / "runs.json").write_text(text)
    run_notebooks.write_site_index(tmp_path)
    index = (tmp_path / "index.html").read_text()
    assert "20250101-000000: runs.json unreadable" in index
    assert "Newest run: 20260101-000000" in index and "\" onmouseover" not in index


def test_front_page_opens_with_the_course_map_linking_the_newest_pages(tmp_path):
    run = tmp_path / "runs" / "20260101-000000"
    (run / "site").mkdir(parents=True)
    (run / "site" / "index.html").write_text("<title>t</title>")
    rows = [run_notebooks._row(run_notebooks.Run(ROOT / "notebooks/06_megakernel.ipynb",
                                                 label), "ok", "", 12.0,
                               f"site/06_megakernel-{label}.html") for label in ("a", "b")]
    run_notebooks.write_record(run, {"rows": rows, "finished": "now", "source": "x"})
    run_notebooks.write_site_index(tmp_path)
    index = (tmp_path / "index.html").read_text()
    assert index.index("Part I") < index.index("Part II") < index.index("Newest run")
    row = re.search(r'<tr class="course"><td>06 · The decode megakernel.*?</tr>', index)[0]
    assert "<td>90 min</td><td>05</td>" in row  # a student's time; the notebook before it
    assert 'href="runs/20260101-000000/site/06_megakernel-a.html">a</a>' in row
    assert "06_megakernel-b.html" in row and "24 s" in row
    assert "not run yet" in index  # the notebooks no run has executed


# -- Quick to a first page ------------------------------------------------------------------
def test_default_run_takes_first_configurations_and_unchanged_ones_come_from_the_cache(
        typed, tmp_path):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text("93_typed:\n  - {label: a, parameters: {points: 1}}\n"
                         "  - {label: b, parameters: {points: 2}}\n")
    out = tmp_path / "out"

    def rows(*extra):
        code, text = _main(typed, "--out", out, "--runs", runs_file, *extra)
        assert code == 0, text
        newest = sorted((out / "runs").iterdir())[-1]
        return {r["name"]: r["cached"] for r in
                json.loads((newest / "runs.json").read_text())["rows"]}, text

    first, _ = rows()
    assert first == {"93_typed-a": False}  # the default: the first configuration only
    second, text = rows("--all")
    assert second == {"93_typed-a": True, "93_typed-b": False}, text
    assert "93_typed-a: ok, cached (executed in" in text
    third, _ = rows("--all", "--no-cache")
    assert third == {"93_typed-a": False, "93_typed-b": False}


@pytest.mark.parametrize("meta", ["", "{}", "[1]", '{"seconds": "x"}', '{"seconds": NaN}',
                                  '{"seconds": -1}', "\xff"])
def test_a_damaged_cache_record_is_a_miss_not_a_traceback(typed, tmp_path, meta):
    import run_cache

    cache = run_cache.Cache(tmp_path / "out", root=tmp_path)
    cache.put("k", typed, 1.5)
    assert cache.get("k", tmp_path / "copy.ipynb") == 1.5
    (cache.folder / "k.json").write_text(meta, encoding="latin-1")
    assert cache.get("k", tmp_path / "again.ipynb") is None
    assert not (tmp_path / "again.ipynb").exists()


def test_cache_key_follows_notebook_parameters_and_sources(typed, tmp_path):
    import run_cache

    (tmp_path / "mk").mkdir()
    (tmp_path / "mk" / "a.py").write_text("x = 1\n")
    key = run_cache.Cache(tmp_path / "out", root=tmp_path).key(typed, {"points": 1})
    assert run_cache.Cache(tmp_path / "out", root=tmp_path).key(typed, {"points": 1}) == key
    assert run_cache.Cache(tmp_path / "out", root=tmp_path).key(typed, {"points": 2}) != key
    (tmp_path / "mk" / "a.py").write_text("x = 2\n")
    assert run_cache.Cache(tmp_path / "out", root=tmp_path).key(typed, {"points": 1}) != key
