"""mk.course.review: design sweeps tabulate the simulator per value."""

import dataclasses

import pytest

import mk
from mk.cost import perf, sim
from mk.course import review
from mk.step.plan import DecodePlan


def test_sweep_tabulates_each_value_and_explains_a_tile_that_does_not_divide():
    rows = review.sweep(mk.preset("tiny"), "v6e", "tile", [128, 256, 384], context=64)
    assert [r["tile"] for r in rows] == [128, 256, 384]
    assert rows[0]["step_ms"] > 0 and rows[2]["step_ms"] is None
    assert "not a whole number of tiles" in rows[2]["note"]
    with pytest.raises(ValueError, match="parameter='colour'"):
        review.sweep(mk.preset("tiny"), "v6e", "colour", [1])
    for values in ([], "128", 128):  # no rows, a row per character, a TypeError
        with pytest.raises(ValueError, match="must be a non-empty list of tile values"):
            review.sweep(mk.preset("tiny"), "v6e", "tile", values)


# Notebook 11's invariants (`review.check_invariants`) over a grid of presets, chips, B, T
# and tp, each with the tile cost table and with a recorded per-tile loop of `bundles`
# (the compiled kernel's, `mk.cost.bundles.TileCost.assumptions`), at both ends of the bundle
# rate. The first row is the held-out configuration whose recorded loop (285 bundles,
# compiled for v5p) simulated faster at the fast end than the table at the slow end: no
# statement about the rate.
GRID = [  # preset, chip, B, T, tp, bundles
    ("qwen3-30b-a3b", "v5p", 4, 4, 4, 285),
    ("tiny", "v6e", 1, 1, 1, 600),
    ("tiny-moe", "v5e", 4, 1, 1, 100),
    ("tiny-hybrid", "tpu7x", 1, 4, 1, 300),
    ("tiny-kimi", "v6e", 2, 2, 1, 150),
    ("tiny-gpt-oss", "v5p", 4, 4, 1, 400),
    ("qwen3-0.6b", "tpu7x", 8, 1, 2, 200),
    ("qwen3-30b-a3b", "v6e", 1, 1, 4, 1000),
]


@pytest.mark.parametrize("name, chip, batch, rows, tp, bundles", GRID,
                         ids=[f"{g[0]}-{g[1]}-B{g[2]}-T{g[3]}-tp{g[4]}" for g in GRID])
def test_notebook_11s_invariants_hold_over_a_grid(name, chip, batch, rows, tp, bundles):
    config, context = mk.preset(name), 256  # notebook 11's: a full cache of `context`
    block = DecodePlan.make(config, tp=tp, batch=batch, rows=rows, context=context,
                            chip=chip).block
    step_args = dict(batch=batch, rows=rows, context=context - rows, tp=tp, block=block)
    step = DecodePlan.make(config, chip=chip, position=context - rows, kernel=False,
                           **{k: v for k, v in step_args.items() if k != "context"})
    table = review.rate_ends(step)
    recorded = review.rate_ends(step, assumptions=sim.Assumptions(tile_bundles=bundles))
    args = {k: v for k, v in step_args.items() if k != "block"}
    review.check_invariants(
        table["slow"], no_prefetch=sim.simulate(step, cross_layer_prefetch=False),
        by_rate=[table, recorded], hbm_floor_ms=perf.predict(config, chip, **args).hbm_floor_ms)


def test_each_invariant_fails_on_a_step_that_breaks_it():
    config = mk.preset("tiny")
    ends = review.rate_ends(DecodePlan.make(config, chip="v6e", position=64))
    step = ends["slow"]
    slower = dataclasses.replace(step, step_s=step.step_s * 2)
    with pytest.raises(AssertionError, match="prefetch across layers made a step slower"):
        review.check_invariants(step, no_prefetch=dataclasses.replace(
            step, step_s=step.step_s / 2))
    with pytest.raises(AssertionError, match="a slower bundle rate made a step faster"):
        review.check_invariants(step, no_prefetch=step, by_rate=[
            {"slow": ends["fast"], "fast": slower}])
    with pytest.raises(AssertionError, match="beat its HBM floor"):
        review.check_invariants(step, no_prefetch=step, hbm_floor_ms=step.step_ms * 2)
    with pytest.raises(AssertionError, match="the bubbles add to"):
        review.check_invariants(slower, no_prefetch=slower)
    with pytest.raises(AssertionError, match="shorter than its bytes over the bandwidth"):
        review.check_invariants(dataclasses.replace(step, step_s=step.hbm_floor_s / 2),
                                no_prefetch=step)


TINY_STEP = DecodePlan.make(mk.preset("tiny"), chip="v6e", position=0)


def test_rate_ends_refuses_assumptions_that_are_not_assumptions():
    """Issue 65: a string ended in a TypeError from dataclasses.replace."""
    with pytest.raises(ValueError, match="assumptions is a str; it must be a "
                                         "mk.cost.sim.Assumptions"):
        review.rate_ends(TINY_STEP, assumptions="fast")
    assert set(review.rate_ends(TINY_STEP, assumptions=sim.Assumptions())) == {"slow", "fast"}


# -- mk.course.reviewed: the configuration notebooks 11 and 11b review -----------------------
def test_configure_refuses_a_gpu_and_applies_the_block_it_is_given():
    from mk.course import reviewed
    from mk.course.run import validate_run

    with pytest.raises(ValueError, match="chip='gb200' is a gpu"):
        reviewed.configure(validate_run(chip="gb200"))
    plain = reviewed.configure(validate_run(preset="tiny", chip="v6e", context=128))
    square = reviewed.configure(validate_run(preset="tiny", chip="v6e", context=128),
                                tile=128, slots=3, dense_format="int8")
    assert (square.block.tile_rows, square.block.tile_cols, square.block.slots) == (128, 128, 3)
    assert square.formats["dense"] == "int8" and "dense" not in plain.formats
    assert plain.position == 127 and plain.step_plan().block == plain.block


def test_simulator_error_is_the_records_device_loops_or_none():
    from mk.course import reviewed
    from mk.cost import calibration

    from mk.measure.measure import TPU_NAMES

    unmeasured = [c for c in TPU_NAMES if c not in reviewed.measured_chips()]
    assert "v5e" in reviewed.measured_chips() and unmeasured
    assert reviewed.simulator_error(unmeasured[0]) is None  # no record to hold it to
    error = reviewed.simulator_error("v5e")
    loops = [g.error for g in calibration.agreement("v5e", a=sim.Assumptions())
             if g.series == calibration.LOOP]
    assert error["loops"] == len(loops) and error["assumed"] == (min(loops), max(loops))
    assert -calibration.TOLERANCE < error["calibrated"][0] <= error["calibrated"][1] \
        < calibration.TOLERANCE
