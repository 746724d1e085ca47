"""mk.measure.compile_time (benchmarks/compile_time.py's benchmark): its scan step is the reference
step, and its records are well formed.

The XLA scan variant is checked against `mk.model.reference.decode_step` on the CPU with tiny real
arrays (plain jit, no TPU), so the benchmark compares like with like. The benchmark itself
runs for 2 and 4 layers of the tiny preset on v6e, with a stand-in for the megakernel series.

Not here: how fast anything compiles (speed targets never go in tests; the benchmark prints
the numbers), and the real megakernel (its own tests compile it).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.measure import compile_time as ct
from mk.model import reference

CHIP = "v6e"


def test_scan_step_gives_the_reference_logits_and_cache():
    config = mk.preset("tiny")
    params = mk.init_params(config, seed=0)
    cache = reference.init_cache(config, batch=2, max_context=64)
    tokens = jnp.array([[3, 4], [5, 6]], jnp.int32)
    positions = jnp.array([0, 7], jnp.int32)  # ragged: each sequence writes its own rows
    cache = reference.decode_step(config, params, cache, tokens, positions)[1]  # non-empty
    want_logits, want = reference.decode_step(config, params, cache, tokens, positions + 2)
    logits, got = ct.forward_scan(config, params, cache, tokens, positions + 2)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.k, want.k)
    np.testing.assert_array_equal(got.v, want.v)


def test_model_at_extends_past_the_preset_like_its_last_layer():
    assert ct.model_at(mk.preset("qwen3-8b"), 4).layers == 4
    wide = ct.model_at(mk.preset("tiny"), 5)
    assert (wide.layers, wide.moe_layers) == (5, ())
    moe = ct.model_at(mk.preset("tiny-moe"), 5)  # layers (1, 2) are MoE: so are 3 and 4
    assert (moe.layers, moe.moe_layers) == (5, (1, 2, 3, 4))


def test_scan_of_mixed_dense_and_moe_layers_is_a_failed_record_not_a_crash():
    record = ct.measure_one("xla_scan", ct.XLA_SERIES["xla_scan"], mk.preset("tiny-moe"), CHIP,
                            batch=1, rows=1, context=128)
    assert not record.ok and record.error.startswith("NotImplementedError")


def test_growth_and_ratios_by_hand():
    records = [ct.Record(2, "xla_unrolled", 2.0, True), ct.Record(4, "xla_unrolled", 4.0, True),
               ct.Record(2, "xla_scan", 1.0, True), ct.Record(4, "xla_scan", 3.0, True),
               ct.Record(4, "megakernel", 0.0, False, "boom")]
    fit = ct.growth(records)
    assert fit["xla_unrolled"]["seconds_per_layer"] == pytest.approx(1.0)
    assert fit["xla_scan"]["intercept"] == pytest.approx(-1.0)
    # two layer counts: no exponent (a power through two points always fits)
    assert fit["xla_unrolled"]["exponent"] is None and "layers^" not in ct.format_table(records)
    three = records + [ct.Record(8, "xla_scan", 7.0, True)]
    assert ct.growth(three)["xla_scan"]["exponent"] == pytest.approx(
        np.polyfit(np.log([2, 4, 8]), np.log([1.0, 3.0, 7.0]), 1)[0])
    assert "xla_scan: " in ct.format_table(three) and "layers^" in ct.format_table(three)
    assert "megakernel" not in fit  # no compiled point
    assert ct.ratios(records) == {2: {"xla_scan": 0.5}, 4: {"xla_scan": 0.75}}
    assert "FAILED megakernel at 4 layers: boom" in ct.format_failures(records)


def _stand_in_megakernel(config, batch, rows, context):
    """Something cheap to compile in the megakernel's slot: (fn, args) of the same form."""
    return (lambda x: x * 2), [jax.ShapeDtypeStruct((batch, config.hidden), jnp.float32)]


def test_benchmark_records_every_series_at_every_layer_count():
    config = mk.preset("tiny")
    records = ct.measure(config, CHIP, [2, 4], batch=2, rows=1, context=128,
                         megakernel=ct.from_builder(_stand_in_megakernel))
    assert [(r.layers, r.series) for r in records] == [
        (n, s) for n in (2, 4) for s in ("xla_unrolled", "xla_scan", "megakernel")]
    for r in records:
        assert r.ok, r.error
        assert r.compile_seconds > 0 and r.hbm_bytes > 0
        assert (r.model, r.chip, r.error) == ("tiny", CHIP, "")
    assert set(ct.ratios(records)[4]) == {"xla_scan", "megakernel"}
    assert set(ct.growth(records)) == {"xla_unrolled", "xla_scan", "megakernel"}
