"""The built wheel works outside the checkout: installed non-editable with its `notebooks`
and `profile` extras into a clean venv, it finds its chip table, runs a tiny megakernel
generate, and papermill runs notebooks 00, 07, 08, 09, 11 and 11b from a folder that is not
the repo (07 and 11b draw recorded runs and run a benchmark that ship in the package; CI checks
the wheel carries them).

Marked slow: the wheel, the venv (jax, libtpu, Jupyter, TensorBoard; installed with
`-c constraints.txt`) and the five notebooks (11 and 11b were one then) took 307 s on 2
shared cores (2026-12-03; `make test-slow` runs it); on Python 3.13.0 (pyenv) 332 s
(2026-12-06).

The venv's Python is the one running the tests, or `MK_INSTALL_PYTHON`; a second run
builds it with Python 3.13 (Colab's TPU runtime) where one is found (`MK_PYTHON313`, PATH or
pyenv). Not here: Colab itself (its bootstrap installs the same extras from a git URL).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each notebook on the tiny preset, with CI's knobs where it has them (tests/test_notebooks.py);
# 07 and 11b read recorded runs and run a benchmark that ship inside the package.
NOTEBOOKS = {"00_decode_is_memory_bound": {}, "07_compile_for_tpu": {"measure_layers": [2]},
             "08_profile_bubbles": {}, "09_speculative_sweep": {}, "11_design_review": {},
             "11b_design_review_appendix": {}}

SMOKE = """
import jax, mk, mk.step.megakernel, mk.cost.published
from pathlib import Path
assert "site-packages" in mk.__file__, mk.__file__
assert mk.chip("v6e").hbm_bytes > 0 and len(mk.model.chips.CHIP_NAMES) > 3
assert len(mk.cost.published.published()) > 0
config = mk.preset("tiny")
prompt = jax.random.randint(jax.random.key(0), (1, 4), 0, config.vocab)
tokens = mk.step.megakernel.generate(config, mk.init_params(config), prompt, 2,
                                backend="interpret", max_context=128)
assert tokens.shape == (1, 2), tokens.shape
from mk.measure import profiling
assert profiling.PROFILES == Path.cwd() / "profiles", profiling.PROFILES
print("smoke ok")
"""




def _python313() -> str | None:
    """A Python 3.13 that runs (Colab's TPU image runs 3.13): MK_PYTHON313, python3.13 on
    PATH, or pyenv's; None if none does (a pyenv shim whose version is not active fails)."""
    home = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in [os.environ.get("MK_PYTHON313"), shutil.which("python3.13"),
                      *map(str, sorted(home.glob("versions/3.13*/bin/python3.13")))]:
        if candidate and subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 13)"],
                capture_output=True).returncode == 0:
            return candidate
    return None


PY313 = _python313()


@pytest.mark.slow
@pytest.mark.parametrize("base", [
    pytest.param(os.environ.get("MK_INSTALL_PYTHON", sys._base_executable), id="default"),
    pytest.param(PY313, id="py3.13", marks=pytest.mark.skipif(
        PY313 is None, reason="no Python 3.13 (MK_PYTHON313, PATH or pyenv)"))])
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path, base):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MK_PROFILES", "VIRTUAL_ENV")}
    env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True, env=env)
    wheel = next(wheels.glob("mk_megakernel-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                    f"{wheel}[notebooks,profile]"],
                   check=True, env=env)
    subprocess.run([python, "-m", "ipykernel", "install", "--sys-prefix", "--name",
                    "python3"], check=True, env=env, capture_output=True)
    work = tmp_path / "work"  # not the checkout: nothing of the repo is importable here
    work.mkdir()
    done = subprocess.run([python, "-c", SMOKE], cwd=work, env=env, text=True,
                          capture_output=True)
    assert done.returncode == 0 and "smoke ok" in done.stdout, done.stderr[-3000:]
    for name, knobs in NOTEBOOKS.items():
        shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", work)
        done = subprocess.run([venv / "bin" / "papermill", "--no-progress-bar", "-k", "python3",
                               f"{name}.ipynb", f"{name}.out.ipynb", "-p", "preset", "tiny",
                               "-y", json.dumps(knobs)], cwd=work, env=env, text=True,
                              capture_output=True)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    assert any((work / "profiles").iterdir()), "notebook 08 wrote no capture into ./profiles"


def test_wheel_ships_what_notebooks_07_and_11b_read(tmp_path):
    """In CI (fast: the wheel only): the recorded runs 07 and 11b draw and the compile-time
    benchmark 07 runs are inside the package, where the notebooks look for them."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)], check=True,
                   capture_output=True)
    names = set(zipfile.ZipFile(next(tmp_path.glob("mk_megakernel-*.whl"))).namelist())
    source = {n: (ROOT / "notebooks" / f"{n}.py").read_text()
              for n in ("07_compile_for_tpu", "11b_design_review_appendix")}
    wanted = {"mk/measure/compile_time.py"} | {
        f"mk/data/{path}" for text in source.values()
        for path in re.findall(r'^\w+: str = "((?:compile_time|tile_costs)/[^"]+)"', text, re.M)}
    assert len(wanted) == 4 and wanted <= names, wanted - names
    assert "from mk.measure import compile_time" in source["07_compile_for_tpu"]
    assert "benchmarks" not in "".join(re.findall(r"ROOT / .*", "".join(source.values())))
