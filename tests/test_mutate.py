"""tools/mutate.py's list of mutants is current: every original snippet occurs once in its
module, every listed test file exists, every mutant names tests or why it is equivalent
(`--check`, seconds). The mutants themselves run in `make mutate` (`make test-slow`)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402


def test_every_mutant_still_applies_to_the_tree():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "mutate.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(mutate.MUTANTS)} mutants, 0 stale" in done.stdout


def test_a_stale_snippet_and_a_missing_test_file_are_reported():
    gone = mutate._m("gone", "mk/model/reference.py", "no such line", "x", "tests/nope.py")
    problems = mutate.stale(gone)
    assert any("occurs 0 times" in p for p in problems)
    assert any("tests/nope.py: no such test file" in p for p in problems)


def test_a_mutant_gives_tests_or_a_reason_not_both():
    with pytest.raises(ValueError, match="not both"):
        mutate._m("both", "mk/model/reference.py", "a", "b", "tests/test_reference.py",
                  equivalent="because")
    assert len({m.name for m in mutate.MUTANTS}) == len(mutate.MUTANTS)


def test_a_mutant_whose_tests_outlive_the_timeout_is_hung_not_caught(tmp_path):
    """A planted wait that never ends (a ring waiting on a semaphore no DMA signals hangs
    interpret mode) is reported "hung" after --timeout, its file restored."""
    (tmp_path / "lib.py").write_text("DELAY = 0\n")
    (tmp_path / "test_lib.py").write_text(
        "import time\nimport lib\n\n\ndef test_lib():\n    time.sleep(lib.DELAY)\n")
    hang = mutate._m("sleeps", "lib.py", "DELAY = 0", "DELAY = 60", "test_lib.py")
    result, seconds, detail = mutate.run_one(hang, tmp_path, sys.executable, 3)
    assert (result, "--timeout 3 s" in detail) == ("hung", True)
    assert seconds < 30
    assert (tmp_path / "lib.py").read_text() == "DELAY = 0\n"
    fine = mutate._m("returns", "lib.py", "DELAY = 0", "DELAY = 0.0", "test_lib.py")
    assert mutate.run_one(fine, tmp_path, sys.executable, 60)[0] == "SURVIVED"
