"""Installing mk on Colab moves none of Colab's own packages but the jax it comes for.

The wheel (built here) is resolved with its `colab` extra, the one the bootstrap installs,
by `pip install --dry-run` for Python 3.13 (Colab's TPU image) with every package of
Colab's TPU image (tests/colab_tpu_pip_freeze.txt, Colab's published `pip freeze`) as a
constraint, except `COLAB_MOVES`: pip fails to resolve if another would have to move, and
the test names it. A control asks for af5b9de's plotly floor (`plotly>=7.1`) against the
same list and must fail, naming plotly. Needs the package index: without it (no network)
the test skips, saying so, unless CI=true.

Not here: Colab itself (never reachable from here), the notebooks on Colab.
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "tests" / "colab_tpu_pip_freeze.txt"
PYTHON = "3.13"
# What the bootstrap moves on purpose: the jax the kernels are written for, with its jaxlib
# and libtpu (Colab's TPU image has jax 0.7.2); hence its "Restart session".
COLAB_MOVES = frozenset({"jax", "jaxlib", "libtpu"})


def colab_pins() -> dict[str, str]:
    """{package: version} of every `name==version` line of the recorded image."""
    pins = {}
    for line in COLAB.read_text().splitlines():
        if line.strip() and not line.startswith("#") and "@" not in line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    return pins


def _pip(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, text=True,
                          capture_output=True)


def _index_reachable() -> None:
    done = _pip("index", "versions", "ipython")
    if done.returncode != 0:
        reason = f"pip cannot reach the package index ({done.stderr.strip()[-200:]})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)


def _resolve(tmp_path, *requirements):
    constraints = tmp_path / "colab-constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version
                                   in colab_pins().items() if name not in COLAB_MOVES))
    return _pip("install", "--dry-run", "--ignore-installed", "--target", str(tmp_path / "t"),
                "--python-version", PYTHON, "--only-binary=:all:", "-c", str(constraints),
                "--report", str(tmp_path / "report.json"), *requirements)


def _would_move(output: str) -> list[str]:
    """The Colab packages pip names in a failed resolution (the constraints it could not
    keep)."""
    return sorted({canonicalize_name(m) for m in re.findall(
        r"The user requested \(constraint\) ([A-Za-z0-9_.-]+)==", output)})


def test_recorded_image_is_colabs_tpu_runtime_with_its_jupyter_stack():
    pins = colab_pins()
    assert len(pins) > 250 and "google-colab" not in pins  # a URL line, left out
    assert {k: pins[k] for k in ("ipython", "ipykernel", "ipywidgets", "tornado",
                                 "jupyter-client", "plotly")} == {
        "ipython": "7.34.0", "ipykernel": "6.17.1", "ipywidgets": "7.7.1",
        "tornado": "6.5.7", "jupyter-client": "7.4.9", "plotly": "5.24.1"}
    assert COLAB_MOVES <= set(pins)


def test_colab_extra_resolves_without_moving_a_colab_package(tmp_path):
    _index_reachable()
    wheels = tmp_path / "wheels"
    built = _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                 str(ROOT))
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(wheels.glob("mk_megakernel-*.whl"))
    done = _resolve(tmp_path, f"{wheel}[colab]")
    moving = _would_move(done.stdout + done.stderr)
    assert done.returncode == 0, f"Colab packages that would move: {moving}\n{done.stdout[-3000:]}"
    installed = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                 for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    pins = colab_pins()
    moved = {name: (pins[name], version) for name, version in installed.items()
             if name in pins and name not in COLAB_MOVES and version != pins[name]}
    assert not moved, f"Colab packages that would move (Colab's, mk's): {moved}"
    assert "xprof" in installed and "jupyterlab" not in installed  # the extra, no Jupyter
    assert installed["jax"] == "0.10.2"  # what the bootstrap comes to install


def test_the_figure_tests_pass_on_colabs_plotly(tmp_path):
    """mk's plotly floor is Colab's plotly (5.24.1, not 7): tests/test_plots.py and
    tests/test_figures.py run in a subprocess with Colab's plotly first on the path."""
    _index_reachable()
    version = colab_pins()["plotly"]
    got = _pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tmp_path),
               f"plotly=={version}")
    assert got.returncode == 0, got.stderr[-2000:]
    site = tmp_path / "site"
    with zipfile.ZipFile(next(tmp_path.glob("plotly-*.whl"))) as wheel:
        wheel.extractall(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", "import plotly; print(plotly.__version__)"],
                          env=env, text=True, capture_output=True)
    assert done.stdout.strip() == version, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "tests/test_plots.py", "tests/test_figures.py"],
                          cwd=ROOT, env=env, text=True, capture_output=True)
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_requirement_that_moves_a_colab_package_fails_naming_it(tmp_path):
    _index_reachable()
    done = _resolve(tmp_path, "--no-deps", "plotly>=7.1")  # af5b9de's floor
    assert done.returncode != 0, done.stdout[-2000:]
    assert _would_move(done.stdout + done.stderr) == ["plotly"], done.stdout[-2000:]


def test_every_colab_link_and_mk_source_point_at_the_release_tag():
    """The repository URL is pyproject.toml's [project.urls].Source, the release tag of
    version X is vX; every Colab link (README, docs/, notebook titles) and the bootstrap's
    MK_SOURCE use both, and in a checkout that has tags the tag must be one of them."""
    sys.path.insert(0, str(ROOT / "tools"))
    import notebook_header

    ref = notebook_header.release_ref(notebook_header.bootstrap())
    assert ref == notebook_header.RELEASE_TAG
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "notebooks").glob("[0-9]*_*.py"))]
    links = {m for path in texts for m in re.findall(
        r"https://colab\.research\.google\.com/github/[^)\s]+", path.read_text())}
    assert links and all(link.startswith(f"{notebook_header.COLAB}/{ref}/notebooks/")
                         for link in links), sorted(links)[:3]
    tags = subprocess.run(["git", "tag", "--list"], cwd=ROOT, text=True,
                          capture_output=True).stdout.split()
    if tags:
        assert ref in tags, f"the links point at {ref}; tags: {tags} (git tag {ref})"
