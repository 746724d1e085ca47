"""JupyterLab on this checkout: `make lab`'s server opens a notebooks/*.py as a notebook, and
a Lab run followed by the pre-commit hooks leaves the committed notebooks unchanged.

`make lab` runs `jupyter lab` with the settings the Makefile copies into the venv
(tools/jupyterlab-overrides.json); here a server with the same settings file is asked
through its REST API. The hooks of .pre-commit-config.yaml are run by their commands
(entry and args), not through pre-commit, which would fetch its own environments.

Not here: the browser side of Lab (which viewer a double-click picks is the setting checked
here, applied by Lab's document manager).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "00_decode_is_memory_bound"
DOCMANAGER = "@jupyterlab/docmanager-extension:plugin"


def _hooks():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}


def _run_hook(hook, paths, cwd):
    """Run one hook's command as pre-commit would on `paths` (its module, this python)."""
    entry = hook["entry"].split()
    subprocess.run([sys.executable, "-m", *entry, *hook.get("args", []), *map(str, paths)],
                   cwd=cwd, check=True, capture_output=True)


def test_hook_pins_are_pyproject_pins():
    pins = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mk"]["pins"])
    for hook in _hooks().values():
        assert set(hook["additional_dependencies"]) <= pins, (
            f"hook {hook['id']} pins {hook['additional_dependencies']}, pyproject.toml "
            f"does not")


def _lab_run(ipynb: Path) -> None:
    """What a Run All and a save in Lab do to an .ipynb: outputs, counts, run metadata."""
    nb = nbformat.read(ipynb, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * 1000)]
        cell.metadata["execution"] = {"iopub.status.busy": "2026-12-01T00:00:00Z"}
        cell.metadata["scrolled"] = True
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.2"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(nb, ipynb)


def test_lab_run_then_hooks_leave_the_committed_pair_unchanged(tmp_path):
    shutil.copy(ROOT / "jupytext.toml", tmp_path)
    (tmp_path / "notebooks").mkdir()
    pair = [f"notebooks/{NOTEBOOK}.py", f"notebooks/{NOTEBOOK}.ipynb"]
    for name in pair:
        shutil.copy(ROOT / name, tmp_path / name)
    _lab_run(tmp_path / pair[1])
    os.utime(tmp_path / pair[1])  # Lab saved the .ipynb last
    # Control: the Lab run dirtied the notebook, so the comparison below can fail.
    assert (tmp_path / pair[1]).read_bytes() != (ROOT / pair[1]).read_bytes()
    hooks = _hooks()
    _run_hook(hooks["nbstripout"], [pair[1]], tmp_path)
    _run_hook(hooks["jupytext-sync"], pair, tmp_path)
    for name in pair:
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), (
            f"{name} after a Lab run and the pre-commit hooks differs from the committed one")


def test_committed_notebooks_are_left_alone_by_nbstripout(tmp_path):
    committed = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    copies = [shutil.copy(p, tmp_path / p.name) for p in committed]
    _run_hook(_hooks()["nbstripout"], copies, tmp_path)
    changed = [p.name for p in committed if (tmp_path / p.name).read_bytes() != p.read_bytes()]
    assert not changed, f"nbstripout changes {changed}: commit them stripped"


# -- make lab's server ---------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, token):
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - localhost
        return response.read().decode()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on the checkout, with make lab's settings; (url, token)."""
    settings = tmp_path_factory.mktemp("lab-settings")
    shutil.copy(ROOT / "tools" / "jupyterlab-overrides.json", settings / "overrides.json")
    port, token = _free_port(), "mk-test"
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ip=127.0.0.1", f"--IdentityProvider.token={token}", "--allow-root",
         f"--ServerApp.root_dir={ROOT}", f"--LabApp.app_settings_dir={settings}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"{url}/api/status", token)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("jupyter lab did not start") from None
                time.sleep(0.5)
        yield url, token
    finally:
        server.terminate()
        server.wait(timeout=30)


def _python_viewer(url, token):
    settings = json.loads(_get(f"{url}/lab/api/settings/{DOCMANAGER}", token))
    return settings["schema"]["properties"]["defaultViewers"]["default"].get("python")


def test_lab_opens_a_py_notebook_as_a_notebook(lab):
    url, token = lab
    assert _python_viewer(url, token) == "Jupytext Notebook"
    page = _get(f"{url}/lab", token)
    assert re.search(r'"name":\s*"jupyterlab-jupytext"', page), \
        "the jupytext Lab extension (which defines the Jupytext Notebook viewer) is missing"
    model = json.loads(_get(f"{url}/api/contents/notebooks/{NOTEBOOK}.py"
                            "?type=notebook&content=1", token))
    assert model["type"] == "notebook"
    assert model["content"]["cells"][0]["source"].startswith("# 00 ·")
    # Control: Lab's own default (its schema as shipped) opens a .py in the text editor,
    # so the viewer above comes from make lab's settings.
    schema = Path(sys.prefix, "share/jupyter/lab/schemas/@jupyterlab/docmanager-extension",
                  "plugin.json")
    shipped = json.loads(schema.read_text())["properties"]["defaultViewers"]["default"]
    assert "python" not in shipped
