"""mk.feed_costs: the tile cost table (data/tile_feed_costs.json) that the simulator and
mk.perf's compute floor read, its lookup, and its re-check against a fresh compile of the
ring kernel's per-tile loop (`mk.probes.probe_tile`: one cheap row in CI, ~10 s; every
row under `slow`, ~15 min)."""

import json

import pytest

import mk
from mk import feed_costs, perf, probes, sim
from mk.kernels.one_layer import model_block
from mk.kernels.plan import padded_vocab
from mk.step_bytes import shard_weight_elements

ROWS = json.loads(feed_costs.FEED_COSTS.read_text())
CHECKED = ("chip", "dtype", "feed", "m", "shape", "tile", "tile_bytes", "bundles",
           "mxu_bundles", "scalar_only_bundles")  # compile_s is this machine's, libtpu shown


def _differences(fresh: feed_costs.FeedCost, row: dict) -> dict:
    """{field: (recorded, fresh)} of the re-checked fields that differ."""
    now = fresh.row()
    return {k: (row[k], now[k]) for k in CHECKED if row[k] != now[k]}


def _recheck(row: dict) -> None:
    fresh = probes.probe_tile(row["chip"], row["dtype"], row["m"], row["feed"],
                               shape=tuple(row["shape"]))
    assert not _differences(fresh, row), (
        f"libtpu {fresh.libtpu} (recorded with {row['libtpu']}): {_differences(fresh, row)}; "
        "rerun benchmarks/tile_feed_costs.py")


def test_the_table_covers_every_chip_dtype_feed_and_m_bucket():
    table = feed_costs.recorded()
    want = {(c, d, f, m) for c in ("tpu7x", "v6e", "v5e")
            for d, f in feed_costs.rows(mk.chip(c)) for m in feed_costs.M_BUCKETS}
    assert {f for _, _, f, _ in want} == set(feed_costs.FEEDS)  # tpu7x's fp8 feed too
    assert want <= set(table), sorted(want - set(table))
    assert all(r.libtpu and r.compile_s > 0 for r in table.values())


def test_a_recorded_row_is_todays_compile_and_a_tampered_one_is_caught(tmp_path):
    """One cheap row re-compiled (tpu7x, bf16, M 8) equals its record; the same
    comparison flags a row whose bundles were changed, and the reader refuses a row whose
    derived bundles per Mi no longer follow from its bundles."""
    row = next(r for r in ROWS if (r["chip"], r["dtype"], r["m"]) == ("tpu7x", "bf16", 8))
    fresh = probes.probe_tile("tpu7x", "bf16", 8)
    assert not _differences(fresh, row), _differences(fresh, row)
    tampered = dict(row, bundles=row["bundles"] - 40)
    assert set(_differences(fresh, tampered)) == {"bundles"}
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps([tampered]))
    with pytest.raises(ValueError, match="disagree with its tile and bundles"):
        feed_costs.recorded(path)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['chip']}-{r['dtype']}-{r['feed']}"
                                                     f"-m{r['m']}")
def test_every_recorded_row_is_todays_compile(row):
    _recheck(row)


def test_the_lookup_rounds_m_up_to_a_bucket_and_names_what_is_missing():
    table = feed_costs.recorded()
    at = {m: feed_costs.bundles_per_element("v6e", "int8", m) for m in (1, 2, 8, 9, 64, 65)}
    assert at[2] == at[8] == table[("v6e", "int8", "bf16", 8)].bundles_per_element
    assert at[9] == at[64] and at[65] == table[("v6e", "int8", "bf16", 256)].bundles_per_element
    with pytest.raises(ValueError, match=r"M=257 rows is past .* largest M bucket 256"):
        feed_costs.bucket(257)
    with pytest.raises(ValueError, match=r"no tile cost row for chip='h200'"):
        feed_costs.bundles_per_element("h200", "bf16", 1)
    with pytest.raises(NotImplementedError, match=r"dtype='float32'"):
        feed_costs.weight_dtype("float32", None)
    assert feed_costs.weight_dtype("bfloat16", "fp4") == "fp4"
    with pytest.raises(ValueError, match=r"feed='fp8': v6e's kernel does not feed fp8"):
        probes.probe_tile("v6e", "fp8", 1, "fp8")
    with pytest.raises(ValueError, match=r"feed='fp8': tpu7x's kernel does not feed int8"):
        probes.probe_tile("tpu7x", "int8", 1, "fp8")


def _tile_events(run, name):
    return [e for e in run.events if e.lane == "compute" and e.what == name]


def test_the_simulator_charges_each_weight_tile_the_table_at_either_clock_end():
    """A dense model's wq tiles cost the table's bf16 row x tile elements / clock at
    each end of the clock range; a recorded whole-kernel loop replaces the table; the
    bytes moved are the same whichever the cost."""
    config, spec = mk.preset("qwen3-0.6b"), mk.chip("tpu7x")
    runs = {end: sim.simulate(config, spec, context=256, assumptions=sim.Assumptions(
        clock=end)) for end in ("low", "high")}
    block = runs["low"].plan.block
    for end, run in runs.items():
        (wq,) = _tile_events(run, "wq")[:1]
        per_tile = feed_costs.tile_s(spec, "bf16", 1, block.tile_rows * block.tile_cols, end)
        assert wq.busy_s == pytest.approx(wq.count * per_tile, rel=1e-9)
    assert runs["high"].compute_s < runs["low"].compute_s
    loop = sim.simulate(config, spec, context=256,
                        assumptions=sim.Assumptions(tile_bundles=777))
    (wq,) = _tile_events(loop, "wq")[:1]
    assert wq.busy_s == pytest.approx(wq.count * 777 / spec.clock("low"), rel=1e-9)
    assert loop.dma_bytes == runs["low"].dma_bytes == runs["high"].dma_bytes


def test_a_packed_format_costs_its_own_row():
    """qwen3-30b-a3b with int4 experts on v6e: an expert tile costs the int4 row (its
    dequantisation), the attention tiles the bf16 row; the bytes are the packed ones."""
    config, spec = mk.preset("qwen3-30b-a3b"), mk.chip("v6e")
    run = sim.simulate(config, spec, context=256, formats={"experts": "int4"})
    block = run.plan.block
    tile = block.tile_rows * block.tile_cols
    for name, dtype in (("we_gate[0]", "int4"), ("wq", "bf16")):
        e = _tile_events(run, name)[0]
        assert e.busy_s == pytest.approx(e.count * feed_costs.tile_s(spec, dtype, 1, tile),
                                         rel=1e-9), name
    assert run.family_bytes()["experts"] < sim.simulate(
        config, spec, context=256).family_bytes()["experts"] / 3


def test_a_tile_fed_fp8_costs_the_fp8_feed_row():
    """On tpu7x the plan feeds fp8 experts to the MXU as fp8 (`mk.unpack.choose_feeds`):
    an expert tile costs that row, cheaper than the same storage's bf16-feed row."""
    config, spec = mk.preset("qwen3-30b-a3b"), mk.chip("tpu7x")
    run = sim.simulate(config, spec, context=256, formats={"experts": "fp8"})
    assert dict(run.plan.feeds) == {"experts": "fp8"}
    tile = run.plan.block.tile_rows * run.plan.block.tile_cols
    e = _tile_events(run, "we_gate[0]")[0]
    fed = feed_costs.tile_s(spec, "fp8", 1, tile, feed="fp8")
    assert e.busy_s == pytest.approx(e.count * fed, rel=1e-9)
    assert fed < feed_costs.tile_s(spec, "fp8", 1, tile, feed="bf16")


def test_perfs_tile_floor_sums_the_same_table():
    """mk.perf's compute floor is every streamed weight element at the table's cost: on
    a dense model, its elements x the bf16 row / the clock; the high clock end scales it;
    FP4 experts cost their own row; the modelled step adds the collectives to it."""
    config, spec = mk.preset("qwen3-8b"), mk.chip("v6e")
    low = perf.tile_floor_ms(config, spec)
    high = perf.tile_floor_ms(config, spec, clock="high")
    assert high == pytest.approx(low * spec.clock("low") / spec.clock("high"))
    elements = sum(v for f, v in shard_weight_elements(
        config, padded_vocab(config, model_block(config)), 0).items() if f != "norms")
    assert low == pytest.approx(1e3 * elements * feed_costs.bundles_per_element(
        "v6e", "bf16", 1) / spec.clock("low"))
    moe = mk.preset("qwen3-30b-a3b")
    assert perf.tile_floor_ms(moe, spec, formats={"experts": "fp4"}) != perf.tile_floor_ms(
        moe, spec)
    e = perf.predict(config, spec, context=1024)
    assert perf.modelled_step_ms(config, spec, context=1024) == pytest.approx(
        max(e.hbm_floor_ms, low + e.collective_ms))
