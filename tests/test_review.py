"""mk.review: design sweeps tabulate the simulator per value, and the published-numbers
table sets every published row against the models with its error and a note."""

import pytest

import mk
from mk import perf, review


def test_sweep_tabulates_each_value_and_explains_a_tile_that_does_not_divide():
    rows = review.sweep(mk.preset("tiny"), "v6e", "tile", [128, 256, 384], context=64)
    assert [r["tile"] for r in rows] == [128, 256, 384]
    assert rows[0]["step_ms"] > 0 and rows[2]["step_ms"] is None
    assert "not a whole number of tiles" in rows[2]["note"]
    with pytest.raises(ValueError, match="parameter='colour'"):
        review.sweep(mk.preset("tiny"), "v6e", "colour", [1])


def test_published_table_has_a_prediction_error_and_a_note_for_each_chip_row():
    rows = review.published_table(simulate_tpu=False)
    assert len(rows) == len(perf.published())
    for r in rows:
        if "roofline" in r:
            assert r["roofline_error"] == pytest.approx(r["roofline"] / r["published"] - 1)
            assert r["note"] and r["roofline_dominant"] in ("hbm", "compute", "collective")
    gpu = [r for r in rows if "conventional" in r]
    assert gpu and all(r["conventional"] < r["roofline"] for r in gpu)
