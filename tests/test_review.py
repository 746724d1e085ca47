"""mk.review: design sweeps tabulate the simulator per value."""

import pytest

import mk
from mk import review


def test_sweep_tabulates_each_value_and_explains_a_tile_that_does_not_divide():
    rows = review.sweep(mk.preset("tiny"), "v6e", "tile", [128, 256, 384], context=64)
    assert [r["tile"] for r in rows] == [128, 256, 384]
    assert rows[0]["step_ms"] > 0 and rows[2]["step_ms"] is None
    assert "not a whole number of tiles" in rows[2]["note"]
    with pytest.raises(ValueError, match="parameter='colour'"):
        review.sweep(mk.preset("tiny"), "v6e", "colour", [1])
