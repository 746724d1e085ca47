"""benchmarks/tpu_trace.py (issue 59) without a TPU: it refuses, since a CPU trace is not
a TPU's (notebook 08 captures one; the chip's record is data/measured/v5e-trace.json,
which tests/test_profiling.py reads)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tpu_trace  # noqa: E402

from mk.cost import bundles  # noqa: E402
from mk.measure import measure  # noqa: E402


def test_off_a_tpu_it_refuses_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")  # main adds the phase flag: restored after
    before = sorted(measure.MEASURED.glob("*-trace.json"))
    with pytest.raises(SystemExit):
        tpu_trace.main(["--json", str(tmp_path / "v5e-trace.json")])
    assert "no TPU here" in capsys.readouterr().err
    assert not (tmp_path / "v5e-trace.json").exists()
    assert sorted(measure.MEASURED.glob("*-trace.json")) == before
    assert bundles.PHASE_FLAG in os.environ["LIBTPU_INIT_ARGS"]
