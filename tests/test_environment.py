"""The pins agree wherever they are written, and `import mk` chooses the CPU off a TPU.

Not here: whether the pinned versions install together (`make test` on a fresh clone
builds the venv from them, which is that check).
"""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines, where):
    """{canonical name: pin line} for requirement lines; each must be an exact `==` pin."""
    pins = {}
    for line in lines:
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#") or line in ("-r requirements.txt", "-e ."):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise AssertionError(f"{where}: {line!r} is not an exact pin (name==version)")
        name = canonicalize_name(req.name)
        assert name not in pins, f"{where}: {req.name} is pinned twice"
        pins[name] = line
    return pins


def _requirements_pins():
    runtime = (ROOT / "requirements.txt").read_text().splitlines()
    test = (ROOT / "requirements-test.txt").read_text().splitlines()
    assert "-r requirements.txt" in test, "requirements-test.txt must include requirements.txt"
    return _pins(runtime + test, "requirements*.txt")


def _environment_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps, f"environment.yml must ask for python=3.11, has {deps}"
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip section"
    return _pins(pip_sections[0], "environment.yml")


def test_environment_yml_pins_equal_requirements_pins():
    req, env = _requirements_pins(), _environment_pins()
    differ = {name: (req.get(name), env.get(name)) for name in req.keys() | env.keys()
              if req.get(name) != env.get(name)}
    assert not differ, f"(requirements*.txt, environment.yml) disagree: {differ}"


def test_pyproject_dependencies_are_pinned_in_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = _pins((ROOT / "requirements.txt").read_text().splitlines(), "requirements.txt")
    for dep in project["dependencies"]:
        req = Requirement(dep)
        pin = runtime.get(canonicalize_name(req.name))
        assert pin, f"pyproject dependency {dep!r} is not pinned in requirements.txt"
        version = next(iter(Requirement(pin).specifier)).version
        assert req.specifier.contains(version, prereleases=True), \
            f"pyproject {dep!r} excludes the requirements.txt pin {pin!r}"


def _import_mk(**env_vars):
    """(TPU present?, JAX_PLATFORMS after `import mk`) in a fresh interpreter whose
    environment has `env_vars` and no JAX_PLATFORMS otherwise."""
    # Only JAX_PLATFORMS is observable here: jax's own import sets TPU_SKIP_MDS_QUERY=1
    # whenever it finds no TPU chip, whatever mk did before it.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(env_vars)
    code = "import os, mk; print(mk._tpu_present(), os.environ.get('JAX_PLATFORMS'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                         capture_output=True, check=True).stdout.split()
    return out[0] == "True", out[1]


def test_import_mk_pins_cpu_when_no_tpu():
    tpu, platforms = _import_mk()
    if tpu:
        pytest.skip("a TPU is present: mk leaves JAX to pick it")
    assert platforms == "cpu"


def test_import_mk_keeps_an_existing_jax_platforms():
    assert _import_mk(JAX_PLATFORMS="tpu")[1] == "tpu"
