"""Installing mk on Colab moves none of Colab's own Jupyter packages.

The wheel (built here) is resolved with its `colab` extra, the one the bootstrap installs,
by `pip install --dry-run` for Python 3.13 (Colab's TPU image) against
tests/colab_tpu_constraints.txt, Colab's Jupyter pins: pip fails to resolve if any would
have to move. A control asks for IPython 8 against the same file and must fail. Needs the
package index: without it (no network) the test skips, saying so, unless CI=true.

Not here: Colab itself (never reachable from here), the notebooks on Colab.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "tests" / "colab_tpu_constraints.txt"
PYTHON = "3.13"


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
    return _pip("install", "--dry-run", "--ignore-installed", "--target", str(tmp_path / "t"),
                "--python-version", PYTHON, "--only-binary=:all:", "-c", str(COLAB),
                "--report", str(tmp_path / "report.json"), *requirements)


def test_colab_extra_resolves_without_moving_colabs_jupyter_pins(tmp_path):
    _index_reachable()
    wheels = tmp_path / "wheels"
    built = _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                 str(ROOT))
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(wheels.glob("mk_megakernel-*.whl"))
    done = _resolve(tmp_path, f"{wheel}[colab]")
    assert done.returncode == 0, f"a Colab pin would move:\n{done.stderr[-3000:]}"
    installed = {Requirement(i["metadata"]["name"]).name.lower().replace("_", "-"):
                 i["metadata"]["version"]
                 for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    pins = [Requirement(line) for line in COLAB.read_text().splitlines()
            if line and not line.startswith("#")]
    for pin in pins:
        version = installed.get(pin.name.lower())
        assert version is None or pin.specifier.contains(version), (pin, version)
    assert "xprof" in installed and "jupyterlab" not in installed  # the extra, no Jupyter


def test_a_requirement_that_moves_a_colab_pin_fails_to_resolve(tmp_path):
    _index_reachable()
    done = _resolve(tmp_path, "--no-deps", "ipython>=8")
    assert done.returncode != 0 and "ipython" in done.stderr.lower(), done.stderr[-2000:]


def test_every_colab_link_and_mk_source_point_at_the_release_tag():
    """The repository URL is pyproject.toml's [project.urls].Source, the release tag of
    version X is vX; every Colab link (README, notebook titles) and the bootstrap's
    MK_SOURCE use both, and in a checkout that has tags the tag must be one of them."""
    sys.path.insert(0, str(ROOT / "tools"))
    import notebook_header

    ref = notebook_header.release_ref(notebook_header.bootstrap())
    assert ref == notebook_header.RELEASE_TAG
    texts = [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("[0-9]*_*.py"))]
    links = {m for path in texts for m in re.findall(
        r"https://colab\.research\.google\.com/github/[^)\s]+", path.read_text())}
    assert links and all(link.startswith(f"{notebook_header.COLAB}/{ref}/notebooks/")
                         for link in links), sorted(links)[:3]
    tags = subprocess.run(["git", "tag", "--list"], cwd=ROOT, text=True,
                          capture_output=True).stdout.split()
    if tags:
        assert ref in tags, f"the links point at {ref}; tags: {tags} (git tag {ref})"
