"""pyproject.toml is the one list of dependencies (ranges) and pins (`[tool.mk].pins`, each
inside its range), the generated pin files agree with it, and
`import mk` chooses the CPU off a TPU.

Not here: whether the pinned versions install together (`make test` on a fresh clone
builds the venv from them, which is that check) or whether the built wheel works outside
the checkout (tests/test_install.py).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import pins  # noqa: E402


def test_every_declared_package_has_an_exact_pin_inside_its_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert pins.problems(text) == [], "pyproject.toml: [tool.mk].pins and the ranges"
    # Controls: a pin outside its range, a range with no pin, a pin that is not exact.
    moved = text.replace('"numpy==2.4.6"', '"numpy==1.26.4"')
    assert pins.problems(moved) == ["pin numpy==1.26.4 lies outside the declared range "
                                    "numpy<3,>=2.0"]
    assert pins.problems(text.replace('    "tqdm==4.70.1",\n', "")) == [
        "tqdm>=4.64 has no pin in [tool.mk].pins"]
    assert pins.problems(text.replace('"tqdm==4.70.1"', '"tqdm>=4"')) == [
        "pin tqdm>=4 is not one exact name==version",
        "pin tqdm>=4 lies outside the declared range tqdm>=4.64"]


def test_generated_pin_files_match_pyproject(tmp_path):
    assert pins.stale() == [], "run: python tools/pins.py"
    # Control: a copy whose pyproject moves a core pin makes the files that list it stale.
    for name in ["pyproject.toml", *pins.render((ROOT / "pyproject.toml").read_text())]:
        shutil.copy(ROOT / name, tmp_path / name)
    text = (tmp_path / "pyproject.toml").read_text()
    assert '"numpy==2.4.6"' in text
    (tmp_path / "pyproject.toml").write_text(text.replace('"numpy==2.4.6"', '"numpy==2.4.5"'))
    assert sorted(pins.stale(tmp_path)) == ["constraints.txt", "environment.yml",
                                            "requirements.txt"]


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


def _profiles(cwd, **env_vars):
    env = {k: v for k, v in os.environ.items() if k != "MK_PROFILES"}
    env.update(env_vars, PYTHONPATH=str(ROOT))
    code = "import mk.measure.profiling; print(mk.measure.profiling.PROFILES)"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, text=True,
                          capture_output=True, check=True).stdout.strip()


def test_profiles_go_to_mk_profiles_else_the_checkouts_from_any_working_directory(tmp_path):
    """mk imported from this checkout: its profiles/ from any working directory (the
    rule's other branch, an installed package, is tests/test_profiling.py's and
    tests/test_install.py's)."""
    assert _profiles(tmp_path) == str(ROOT / "profiles")
    assert _profiles(ROOT / "notebooks") == str(ROOT / "profiles")
    assert _profiles(tmp_path, MK_PROFILES=str(tmp_path / "elsewhere")) == str(
        tmp_path / "elsewhere")
