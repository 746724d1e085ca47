"""benchmarks/tpu_models.py (issue 60) without a TPU: it refuses to write a chip's record
off a chip, and refuses a malformed record rather than merging it. Its rows run in
`make test-slow` in interpret mode (tests/test_tpu.py's tier judges the kernels on a chip;
this script's own rows run only there)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tpu_models  # noqa: E402

import mk  # noqa: E402
from mk import backend, measure, untrusted  # noqa: E402
from mk.kernels.plan import DecodePlan  # noqa: E402


@pytest.mark.skipif(backend.on_tpu(), reason="on a TPU main([]) would run every row")
def test_off_a_tpu_it_refuses_unless_interpret_mode_is_asked_for(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tpu_models.main([])
    assert "no TPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu_models.main(["--interpret", "--json", str(tmp_path / "v5e-models.json")])
    assert "a path not named for a TPU" in capsys.readouterr().err


@pytest.mark.parametrize("record", [[], {"rows": {}}, {"rows": [{"model": "tiny"}]}])
def test_a_malformed_record_is_refused_naming_the_file(tmp_path, record):
    path = tmp_path / "models.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="models.json: must be an object with a list 'rows'"):
        tpu_models._earlier_rows(path, dict(chip=None, jax="", libtpu=""))


@pytest.mark.slow
def test_the_interpret_rows_are_exact(tmp_path):
    """Each interpret row in its own process, judged exact, the record written."""
    path = tmp_path / "interpret-models.json"
    tpu_models.main(["--interpret", "--json", str(path), "--steps", "4"])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(tpu_models.INTERPRET_ROWS)
    assert all(r.get("exact") == r.get("total") for r in rows), rows


def test_tokens_not_the_references_own_are_judged_in_a_child_and_caught():
    """`run_row`'s other path: the reference (a CPU-only child) teacher-forced on tokens
    that differ from its own run; a planted wrong token is counted wrong."""
    expected, _ = tpu_models._in_cpu_child(tpu_models._reference, "tiny", {}, 1, 64, 4)
    tokens = expected.tokens.copy()
    tokens[0, 2] = (tokens[0, 2] + 1) % mk.preset("tiny").vocab  # the planted bug
    verdict = tpu_models._in_cpu_child(tpu_models._judge, "tiny", {}, 1, tokens)
    assert verdict.first == (2,) and verdict.wrong >= 1  # the tokens before it: exact
    assert verdict.exact + verdict.ties + verdict.wrong == 4 and verdict.exact >= 2


def test_the_committed_record_and_notebook_12_say_what_the_chip_measured():
    """data/measured/v5e-models.json: every row exact, its peak under the plan's count for
    a donating `generate` (which today's plan still counts), and notebook 12's prose quotes
    the numbers of each row it names (qwen3-4b bf16, qwen3-8b int8) as recorded."""
    record = untrusted.load_json(measure.MEASURED / "v5e-models.json", "models record")
    for row in record["rows"]:
        assert row["wrong"] == 0 and row["exact"] == row["total"] > 0, row
        assert row["peak_gib"] < row["planned_gib"] <= row["limit_gib"], row
        plan = DecodePlan.make(mk.preset(row["model"]), batch=row["batch"],
                               context=row["context"], formats=row["formats"])
        fit = plan.fits(record["chip"], prompt=tpu_models.PROMPT, donate=True)
        assert round(fit.hbm_bytes / tpu_models.GIB, 2) == row["planned_gib"], row
    prose = " ".join(line.lstrip("# ") for line in (
        Path(__file__).resolve().parent.parent / "notebooks" / "12_quantised_weights.py"
    ).read_text(encoding="utf-8").splitlines())
    for model, named in (("qwen3-4b", "qwen3-4b bf16"), ("qwen3-8b", "qwen3-8b int8")):
        row, = (r for r in record["rows"] if r["model"] == model)
        assert (f"{named} counted {row['planned_gib']:.1f} GiB for a donating `generate` "
                f"and peaked at {row['peak_gib']:.1f}") in prose, named
