"""ruff finds nothing in mk/, tools/, tests/ and benchmarks/ (rules and the argued
exceptions: [tool.ruff] in pyproject.toml; the pre-commit hook runs the same check), and a
planted finding is reported, so the check is live.

Not here: the notebooks (jupytext percent scripts with cell magics; tests/test_notebooks.py
runs them).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINTED = ("mk", "tools", "tests", "benchmarks")


def _ruff(*args, cwd=ROOT):
    try:
        import ruff  # noqa: F401 - the test extra installs it
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: ruff is not installed (pip install -r requirements-test.txt)")
        pytest.skip("ruff is not installed (pip install -r requirements-test.txt)")
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args],
                          cwd=cwd, text=True, capture_output=True)


def test_ruff_finds_nothing():
    done = _ruff(*LINTED)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_ruff_reports_a_planted_finding(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "planted.py").write_text("import os\n")  # F401: unused import
    done = _ruff("planted.py", cwd=tmp_path)
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout + done.stderr
