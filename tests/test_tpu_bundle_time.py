"""benchmarks/tpu_bundle_time.py without a TPU: the decode loop's bundles are counted from a
v5e compile here (libtpu, ~25 s), one dot's a trip whatever the trips, its timing runs in
interpret mode into a record named for no chip, and a CPU is refused a chip's record.
What it does not cover: the chip's time (the record the script writes there is held to
mk/data/chips.csv by tests/test_chips.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpu_bundle_time  # noqa: E402

from mk.measure import measure  # noqa: E402

# One trip of the decode loop (x [8, 512] @ w [512, 512], bf16) compiled for a v5e by
# libtpu 0.0.42.1: 16 128 x 128 weight tiles, 128 pushes, 16 matmuls.
V5E_DECODE_BODY = 183


def test_the_script_refuses_a_cpu_a_chips_record(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tpu_bundle_time.main([])
    assert "no TPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu_bundle_time.main(["--interpret", "--json", str(tmp_path / "v5e-bundles.json")])
    with pytest.raises(ValueError, match=r"trips=\(3, 3\) must be"):
        tpu_bundle_time.time_loop("decode", "v5e", trips=(3, 3), repeats=1,
                                  backend="interpret")
    with pytest.raises(ValueError, match=r"loop='prefill' must be one of"):
        tpu_bundle_time.time_loop("prefill", "v5e", trips=(2, 3), repeats=1,
                                  backend="interpret")


def test_the_decode_loops_body_is_counted_for_a_v5e_and_timed(tmp_path):
    path = tmp_path / "cpu-bundles.json"
    tpu_bundle_time.main(["--interpret", "--json", str(path), "--loops", "decode"])
    record = json.loads(path.read_text())
    assert record["label"] == measure.INTERPRET_LABEL and record["chip"] is None
    assert record["bundles_for"] == "v5e"
    row, = record["rows"]
    assert (row["loop"], row["m"], row["trips"]) == ("decode", 8, [2, 4])
    assert row["body_bundles"] == V5E_DECODE_BODY
    assert row["s_per_bundle"] == pytest.approx(
        (row["call_s"][1] - row["call_s"][0]) / (2 * V5E_DECODE_BODY))
