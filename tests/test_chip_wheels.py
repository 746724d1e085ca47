"""tools/chip_wheels.py without a download: the wheel set is the closure of what the
notebooks and benchmarks/tpu_notebooks.py import, at the installed versions, without what
the chip machine has or a headless run never imports, xprof with only what its converter
imports; a venv that drifted from constraints.txt is refused. The download and
an install into a clean folder were run by hand (data/README.md's notebooks row)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import chip_wheels  # noqa: E402


def test_the_set_holds_the_runners_closure_and_not_what_the_chip_has():
    pins = chip_wheels.pins()
    assert {"papermill", "nbclient", "ipykernel", "jupyter-client", "pyzmq", "tornado",
            "plotly", "ipython", "jupytext", "nbformat", "pyyaml", "psutil"} <= set(pins)
    assert not set(chip_wheels.ON_CHIP + chip_wheels.LEFT_OUT + ("parso",)) & set(pins)
    assert {"xprof", "six", "protobuf"} <= set(pins) and "duckdb" not in pins


def test_a_venv_that_drifted_from_the_constraints_is_refused(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\npapermill==0.0.1\njax[tpu]==0.10.2\n")
    with pytest.raises(SystemExit, match="papermill==.* is installed here; constraints.txt "
                                         "pins 0.0.1"):
        chip_wheels.check_constraints(chip_wheels.pins(), constraints)
    chip_wheels.check_constraints(chip_wheels.pins())  # the checkout's own pins hold
