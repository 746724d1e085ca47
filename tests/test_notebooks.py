"""The conventions of notebooks/TEMPLATE.md hold for every numbered notebook, and each one
runs end to end.

Each `notebooks/NN_topic.py` (the reviewed source) must have an `NN_topic.ipynb` twin (what
Colab opens) with the same cells, no outputs, a python3 kernelspec, a Colab link in its
title, the Colab bootstrap as its first code cell (which installs on Colab and names a
folder that shadows the package) and a `parameters` cell whose every parameter has a type
and a one-line help; then papermill executes, on the CPU, every configuration `make run`
executes (notebooks/runs.yaml; an unlisted notebook once with its own parameters), and the
tiny preset of a notebook whose configurations are all too slow for CI. A run passes when no
cell raises (each notebook's last cell holds its checks: asserts that fail on a wrong
result) and every figure it displays keeps the figure rules of `mk.figure_rules` (titled
axes with units, at most 10 legend entries, the weight families' colours). The
configurations CI cannot afford (`SLOW_RUNS`) run in `make test-slow`, and so
do the runs with the notebook's own values of the knobs CI turns down (`CI_KNOBS`).

Not here: whether the prose's numbers match the cell outputs (review), and how long a
notebook takes (`make run` prints it).
"""

import ast
import dataclasses
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import types
from pathlib import Path

import jupytext
import nbformat
import papermill
import pytest
from IPython.core.inputtransformer2 import TransformerManager

import mk.course.run
from mk import figure_rules

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.py"))

sys.path.insert(0, str(ROOT / "tools"))
import notebook_header  # noqa: E402
import run_notebooks  # noqa: E402

each_notebook = pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])


def _ipynb(source):
    return json.loads(source.with_suffix(".ipynb").read_text(encoding="utf-8"))


def _text(cell):
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _template_parameters():
    """{name: (annotation, help)} of the common parameters block of TEMPLATE.md."""
    template = (NOTEBOOKS / "TEMPLATE.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- BEGIN PARAMETERS -->\n```python\n(.*?)\n```\n"
                      r"<!-- END PARAMETERS -->", template, re.S)
    assert block, "notebooks/TEMPLATE.md lost its BEGIN/END PARAMETERS block"
    return {name: (p["inferred_type_name"], p["help"])
            for name, p in _parameters(block[1]).items()}


def _parameters(code):
    """papermill's reading of a parameters cell: {name: {inferred_type_name, help, ...}}."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        code, metadata={"tags": ["parameters"]})])
    nb.metadata.kernelspec = {"name": "python3", "language": "python",
                              "display_name": "Python 3"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "parameters.ipynb"
        nbformat.write(nb, path)
        return papermill.inspect_notebook(path)


def _parameters_cell(source):
    cells = [c for c in _ipynb(source)["cells"]
             if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{len(cells)} cells are tagged 'parameters'; papermill needs one"
    return _text(cells[0])


def _untyped_or_unexplained(code):
    """The parameters papermill reads from `code` without a type or without a help comment,
    plus the top-level assignments it does not read at all."""
    read = _parameters(code)
    bad = [n for n, p in read.items() if p["inferred_type_name"] == "None" or not p["help"]]
    assigned = [n.id for node in ast.parse(code).body
                if isinstance(node, (ast.Assign, ast.AnnAssign))
                for n in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
                if isinstance(n, ast.Name)]
    return bad + [n for n in assigned if n not in read]


def test_every_ipynb_has_a_py_source():
    orphans = [p.name for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")
               if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without their jupytext .py source: {orphans}"


def test_python3_kernel_runs_this_interpreter():
    run_notebooks.check_kernel()


@each_notebook
def test_py_and_ipynb_have_the_same_cells(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), f"{source.name} has no paired {ipynb.name} (Colab opens it)"
    cells = [[(c.cell_type, c.source) for c in jupytext.read(p).cells] for p in (source, ipynb)]
    assert cells[0] == cells[1], (
        f"{source.name} and {ipynb.name} differ: run jupytext --sync {source.name}")


@each_notebook
def test_ipynb_has_no_outputs(source):
    dirty = [i for i, c in enumerate(_ipynb(source)["cells"])
             if c.get("outputs") or c.get("execution_count") is not None]
    assert not dirty, f"cells {dirty} of {source.stem}.ipynb carry outputs or execution counts"


@each_notebook
def test_ipynb_has_python3_kernelspec(source):
    kernelspec = _ipynb(source)["metadata"].get("kernelspec", {})
    assert kernelspec.get("name") == "python3", f"kernelspec is {kernelspec!r}"


@each_notebook
def test_first_code_cell_is_the_template_bootstrap(source):
    code = [_text(c) for c in _ipynb(source)["cells"] if c["cell_type"] == "code"]
    assert code and code[0] == notebook_header.bootstrap(), (
        "the first code cell must be the bootstrap block of notebooks/TEMPLATE.md, verbatim: "
        "python tools/notebook_header.py")
    first = next(c for c in _ipynb(source)["cells"] if c["cell_type"] == "code")
    assert notebook_header.BOOTSTRAP_TAG in first.get("metadata", {}).get("tags", []), (
        "the site collapses the bootstrap by its tag: python tools/notebook_header.py")


@each_notebook
def test_title_links_this_notebook_in_colab_at_the_release_tag(source):
    title = _text(_ipynb(source)["cells"][0])
    ref = notebook_header.release_ref(notebook_header.bootstrap())
    link = notebook_header.colab_link(source.stem, ref)
    assert title.split("\n")[2] == link, f"the title cell's third line must be {link}"


def test_bootstrap_installs_the_tag_of_this_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert notebook_header.release_ref(notebook_header.bootstrap()) == f"v{version}"


def _run_bootstrap(monkeypatch, *, colab, installed, env=None):
    """Run the bootstrap cell here as IPython would; return the magics it ran and how it
    ended (None, or the exception it raised)."""
    magics = []
    shell = types.SimpleNamespace(run_line_magic=lambda name, line: magics.append(
        (name, line.replace("{MK_SOURCE}", namespace["MK_SOURCE"]))))
    namespace = {"get_ipython": lambda: shell}
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)

    def version(name):
        if installed:
            return "0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    code = TransformerManager().transform_cell(notebook_header.bootstrap())
    try:
        exec(compile(code, "bootstrap", "exec"), namespace)  # noqa: S102 - our own cell
    except BaseException as err:  # noqa: BLE001 - SystemExit is the expected ending
        return magics, err
    return magics, None


def test_bootstrap_installs_on_colab_only_when_the_package_is_missing(monkeypatch):
    magics, ended = _run_bootstrap(monkeypatch, colab=True, installed=False)
    assert magics == [("pip", 'install -q "mk-megakernel[colab] @ '
                       'git+https://github.com/mk-megakernel/mk@v0.1.0"')]
    assert isinstance(ended, SystemExit) and "Restart session" in str(ended)
    assert _run_bootstrap(monkeypatch, colab=True, installed=True) == ([], None)
    assert _run_bootstrap(monkeypatch, colab=False, installed=False) == ([], None)


def test_bootstrap_restart_exit_carries_no_exception_context(monkeypatch):
    """IPython 7.34 (Colab's) on Python 3.13 shows "Internal Python error in the inspect
    module" instead of the message of an exit raised while handling another exception: the
    exit must be raised `from None` or outside the `except`."""
    _, ended = _run_bootstrap(monkeypatch, colab=True, installed=False)
    assert isinstance(ended, SystemExit)
    assert ended.__context__ is None or ended.__suppress_context__, repr(ended.__context__)


def test_bootstrap_source_is_overridable(monkeypatch):
    fork = "git+https://example.org/fork/mk@my-branch"
    magics, _ = _run_bootstrap(monkeypatch, colab=True, installed=False,
                               env={"MK_SOURCE": fork})
    assert magics == [("pip", f'install -q "mk-megakernel[colab] @ {fork}"')]


def test_bootstrap_names_a_folder_that_shadows_the_package(tmp_path):
    # Without site-packages (-S) the mk/ folder in the working directory is all there is:
    # the namespace package that once made the old bootstrap skip its install.
    (tmp_path / "mk").mkdir()
    code = TransformerManager().transform_cell(notebook_header.bootstrap())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                          text=True, capture_output=True)
    assert done.returncode != 0
    assert "is a folder named mk, not the package" in done.stderr
    assert str(tmp_path / "mk") in done.stderr
    # Control: the same interpreter with mk installed passes the cell.
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@each_notebook
def test_parameters_cell_has_the_common_parameters(source):
    code = _parameters_cell(source)
    read = _parameters(code)
    common = set(inspect.signature(mk.course.run.validate_run).parameters)
    missing = common - set(read)
    assert not missing, f"the parameters cell lacks {sorted(missing)}"
    template = _template_parameters()
    assert set(template) == common, "TEMPLATE.md's parameters block is the common set"
    differ = {n: (read[n]["inferred_type_name"], read[n]["help"]) for n in common
              if (read[n]["inferred_type_name"], read[n]["help"]) != template[n]}
    assert not differ, f"common parameters typed or explained unlike TEMPLATE.md: {differ}"


@each_notebook
def test_every_parameter_has_a_type_and_a_help_line(source):
    assert _untyped_or_unexplained(_parameters_cell(source)) == []


def test_untyped_or_unexplained_parameters_are_found():
    code = 'a: int = 1  # fine\nb = 2  # no type\nc: str = "x"\nd: int = 3  # it\'s read\n'
    assert _untyped_or_unexplained(code) == ["b", "c"]


# Configurations over CI's budget (`make test` is ~20 of its 25 minutes on 2 cores), with
# the seconds each took headless in `make run`: `make test-slow` runs them.
SLOW_RUNS = {"06_megakernel-tiny-moe-b3-t2": 209, "06_megakernel-tiny-hybrid": 155,
             "05_one_layer-tiny-moe": 38, "07_compile_for_tpu-qwen3-8b-v6e": 140,
             "07_compile_for_tpu-qwen3-4b-v5e": 119,
             # 11 and 11b, split by issue 62 (196 s as one): pytest's call times, 2026-12-07
             "11_design_review-qwen3-8b-tpu7x": 52, "11b_design_review_appendix-qwen3-8b-tpu7x": 98,
             # on a CPU the same tiny token check as its first configuration (24 s), at B=8
             "14_capstone-qwen3-1.7b-b8": 25}


def _configurations():
    """Every run of `make run`, and a tiny-preset run of each notebook whose runs are all
    slow (so `make test` runs every notebook)."""
    runs = run_notebooks.load_runs(NOTEBOOKS / "runs.yaml",
                                   [s.with_suffix(".ipynb") for s in SOURCES])
    out = []
    for source in SOURCES:
        mine = [r for r in runs if r.notebook.stem == source.stem]
        if all(r.name in SLOW_RUNS for r in mine):
            mine.append(run_notebooks.Run(source.with_suffix(".ipynb"), "tiny-preset",
                                          {"preset": "tiny"}))
        out += mine
    return out


CONFIGURATIONS = _configurations()


def test_slow_runs_name_configurations():
    # A renamed label would otherwise move a slow configuration into `make test`.
    assert set(SLOW_RUNS) <= {r.name for r in CONFIGURATIONS}


# Knobs CI turns down (fewer tokens, steps, sequences or live compiles; the same cells and
# checks run), per notebook, where a configuration does not set them itself: with their own
# values 07 (tiny), 08, 09, 10 and 12 took 46, 56, 115, 49 and 76 s headless. 06 skips
# its mystery lab (~35 s; tests/test_course.py runs a mystery with its checks); 11b shows
# its headline rows at the default collective latency only (each other latency of the
# grid simulates the release's headline runs again, ~50 s); 10 compiles the first two of
# its five multi-chip targets (one refused by HBM, one compiled: the qwen3.5-27b TP8 and
# Kimi compiles, ~30 s, are tests/test_tensor_parallel.py's too). `make test-slow` also
# runs each configuration with the notebook's own values (id "<run>-own-knobs").
CI_KNOBS = {"05c_kimi_layers": {"batch": 1}, "05d_gpt_oss_layers": {"batch": 1},
            "06_megakernel": {"mystery_seed": -1},
            "07_compile_for_tpu": {"measure_layers": [2]},
            "08_profile_bubbles": {"steps": 1},
            "09_speculative_sweep": {"tau_steps": 4, "tau_batch": 2, "megakernel_steps": 2},
            "10_tensor_parallel": {"steps": 2, "compiles": 2},
            "11b_design_review_appendix": {"collective_latencies_us": [1.0]},
            "12_quantised_weights": {"accuracy_steps": 4}}


def _params():
    """One pytest param per configuration, with CI's knobs; and, slow, the same with the
    notebook's own knobs."""
    out = []
    for r in CONFIGURATIONS:
        slow = [pytest.mark.slow] if r.name in SLOW_RUNS else []
        knobs = {k: v for k, v in CI_KNOBS.get(r.notebook.stem, {}).items()
                 if k not in r.parameters}
        if knobs and not slow:
            out.append(pytest.param(dataclasses.replace(r, parameters=knobs | r.parameters),
                                    id=r.name))
            out.append(pytest.param(r, id=f"{r.name}-own-knobs", marks=pytest.mark.slow))
        else:
            out.append(pytest.param(r, id=r.name, marks=slow))
    return out


def test_ci_knobs_are_parameters_of_their_notebooks():
    # A renamed parameter would otherwise fail only inside papermill, or not at all.
    for stem, knobs in CI_KNOBS.items():
        read = _parameters(_parameters_cell(NOTEBOOKS / f"{stem}.py"))
        assert set(knobs) <= set(read), (stem, set(knobs) - set(read))


def _broken_figures(nb) -> list[str]:
    """Each figure an executed notebook displays that breaks the course's figure rules
    (mk.figure_rules), with its cell and title, and the rules it breaks."""
    out = []
    for cell, fig in figure_rules.notebook_figures(nb):
        problems = figure_rules.check(fig)
        if problems:
            title = fig.get("layout", {}).get("title", {})
            title = title.get("text") if isinstance(title, dict) else title
            out.append(f"cell {cell} ({title!r}): " + "; ".join(problems))
    return out


def test_broken_figures_are_found_in_a_notebooks_outputs():
    """The check test_notebook_runs makes, against a planted untitled axis."""
    good = {"data": [{"type": "bar", "x": ["a"], "y": [1.0]}],
            "layout": {"title": {"text": "t"}, "xaxis": {"title": {"text": "run"}},
                       "yaxis": {"title": {"text": "step (ms)"}}}}
    bad = json.loads(json.dumps(good))
    del bad["layout"]["yaxis"]["title"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("display_data", data={figure_rules.PLOTLY_MIME: fig,
                                                     "text/plain": "fig"})])
        for fig in (good, bad)])
    assert _broken_figures(nb) == ["cell 1 ('t'): yaxis carries data but has no title"]


@pytest.mark.parametrize("run", _params())
def test_notebook_runs(run, tmp_path):
    # papermill raises PapermillExecutionError, with the failing cell, if any cell raises;
    # then every figure the run displays must keep the figure rules.
    out = tmp_path / f"{run.name}.ipynb"
    run_notebooks.execute(run.notebook, out, run.parameters)
    broken = _broken_figures(json.loads(out.read_text(encoding="utf-8")))
    assert not broken, "figures that break mk.figure_rules:\n" + "\n".join(broken)


@pytest.mark.parametrize("scale", [0.0, -2.0, float("nan")])
def test_notebook_12_refuses_an_exercise_scale_that_is_no_factor(scale):
    """Notebook 12's exercise multiplies a scale by `exercise_scale` (fp4's is an exponent:
    it adds log2 of it), so a value <= 0 or not finite is refused by name where the
    parameters are checked, before any weight is drawn: its parameters cell and the next
    run."""
    cells = [c for c in jupytext.read(NOTEBOOKS / "12_quantised_weights.py").cells
             if c.cell_type == "code"]
    at = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    space: dict = {}
    exec(TransformerManager().transform_cell(cells[at].source), space)
    space["exercise_scale"] = scale
    with pytest.raises(ValueError, match=r"exercise_scale=(0\.0|-2\.0|nan) .*must be"):
        exec(TransformerManager().transform_cell(cells[at + 1].source), space)
