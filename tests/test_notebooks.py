"""The conventions of notebooks/TEMPLATE.md hold for every numbered notebook, and each one
runs end to end.

Each `notebooks/NN_topic.py` (the reviewed source) must have an `NN_topic.ipynb` twin (what
Colab opens) with the same cells, no outputs, a python3 kernelspec, the Colab bootstrap as
its first code cell and a `parameters` cell with the common parameters; then papermill
executes it on the tiny preset on the CPU, as `make run` does.

Not here: whether the prose's numbers match the cell outputs (review), and how long a
notebook takes (`make run` prints it).
"""

import ast
import inspect
import json
import re
import sys
from pathlib import Path

import jupytext
import pytest

import mk.run

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.py"))

sys.path.insert(0, str(ROOT / "tools"))
import run_notebooks  # noqa: E402

each_notebook = pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])


def _ipynb(source):
    return json.loads(source.with_suffix(".ipynb").read_text(encoding="utf-8"))


def _text(cell):
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _bootstrap():
    template = (NOTEBOOKS / "TEMPLATE.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- BEGIN BOOTSTRAP -->\n```python\n(.*?)\n```\n<!-- END BOOTSTRAP -->",
                      template, re.S)
    assert block, "notebooks/TEMPLATE.md lost its BEGIN/END BOOTSTRAP block"
    return block[1]


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
    assert code and code[0] == _bootstrap(), (
        "the first code cell must be the bootstrap block of notebooks/TEMPLATE.md, verbatim")


@each_notebook
def test_parameters_cell_has_the_common_parameters(source):
    cells = [c for c in _ipynb(source)["cells"]
             if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{len(cells)} cells are tagged 'parameters'; papermill needs one"
    assigned = {target.id for node in ast.parse(_text(cells[0])).body
                if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Name)}
    missing = set(inspect.signature(mk.run.validate_run).parameters) - assigned
    assert not missing, f"the parameters cell lacks {sorted(missing)}"


@each_notebook
def test_notebook_runs_on_tiny_preset(source, tmp_path):
    # papermill raises PapermillExecutionError, with the failing cell, if any cell raises.
    notebook = source.with_suffix(".ipynb")
    run_notebooks.execute(notebook, tmp_path / notebook.name, {"preset": "tiny"})
