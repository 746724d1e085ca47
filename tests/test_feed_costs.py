"""mk.cost.feed_costs: the tile cost table (data/tile_feed_costs.json) that the simulator and
mk.cost.perf's compute floor read, its lookup, and its re-check against a fresh compile of the
ring kernel's per-tile loop (`mk.cost.probes.probe_tile`: one cheap row in CI, ~10 s; every
row under `slow`, ~15 min)."""

import json
import os
import math

import pytest

import mk
from mk.cost import feed_costs, perf, probes, sim
from mk.model.chips import all_chips
from mk.step.one_layer import model_block
from mk.step.plan import padded_vocab
from mk.step.step_bytes import shard_weight_elements
from builders import simulated_step

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


# -- The floor under the table ---------------------------------------------------------------
FLOOR_ROWS = json.loads(feed_costs.FEED_FLOORS.read_text())
# The storages whose feed floor alone issues for more than 0.9 x their own DMA (the
# `feed_floor_over_dma` of the best feed, M = 8, at the MXU-bound bundle rate) at each end
# of the rate: on these no ring loop, however lean, streams at HBM rate. A re-recording, a
# bundle rate or a bandwidth that moves one fails the test below (and the closing note
# that quotes it). TPU7x at 0.93 / 1.03 G bundles/s: int8 1.09 / 0.98, int4 2.12 / 1.91,
# fp4 (fed fp8) 1.10 / 0.99 (bf16 0.55 / 0.49, fp8 0.58 / 0.53). v5p (2,765 GB/s on v5e's
# MXU schedule, which v5e meets with 819): every packed storage at both ends (fp8 1.07 /
# 0.97, int4 2.08 / 1.88). v5e, v6e: all under 0.9 at both.
MXU_BOUND = {(chip, dtype, end) for chip, dtype in (
    ("tpu7x", "int8"), ("tpu7x", "int4"), ("tpu7x", "fp4"), ("v5p", "fp8"), ("v5p", "int8"),
    ("v5p", "int4"), ("v5p", "fp4")) for end in ("slow", "fast")}


# Where the ring's own loop (a table row) takes a weight in fewer bundles than the
# straight-line probe: the floor is the loop's there (`feed_floor_per_element`). With
# 4096 x 256 tiles, v5e's and v5p's bf16 loops at M 64; with today's 2048 x 512, none.
LOOP_UNDER_PROBE = set()


def test_the_floors_cover_every_chip_feed_and_m_and_lie_under_the_table():
    """Every chip's feeds at every M bucket are recorded; the straight-line probe is
    under every table row of its (chip, feed, M) except LOOP_UNDER_PROBE's, and the floor
    read is the lesser of the two."""
    floors, table = feed_costs.recorded_feed_floors(), feed_costs.recorded()
    want = {(c, f, m) for c in {k[0] for k in table} for f in mk.chip(c).mxu_feeds
            for m in feed_costs.M_BUCKETS}
    assert want == set(floors), sorted(want ^ set(floors))
    under = {key for key, cost in table.items()
             if cost.bundles_per_element < floors[(key[0], key[2], key[3])].bundles_per_element}
    assert under == LOOP_UNDER_PROBE
    for chip, _dtype, feed, m in table:
        assert feed_costs.feed_floor_per_element(chip, feed, m) == min(
            floors[(chip, feed, m)].bundles_per_element,
            *(c.bundles_per_element for k, c in table.items() if (k[0], k[2], k[3]) == (
                chip, feed, m)))
    assert feed_costs.feed_floor_per_element("tpu7x", "fp8", 8) == \
        floors[("tpu7x", "fp8", 8)].bundles_per_element


def test_a_recorded_floor_is_todays_compile_and_a_tampered_one_is_caught(tmp_path):
    """tpu7x's fp8 floor at M 8 re-compiled at its recorded shape (~6 s) equals its record;
    the reader refuses a row whose bundles per Mi no longer follow from its bundles."""
    row = next(r for r in FLOOR_ROWS if (r["chip"], r["feed"], r["shape"][0])
               == ("tpu7x", "fp8", 8))
    fresh = probes.probe_floor("tpu7x", "fp8", 8, shapes=(tuple(row["shape"][1:]),))
    assert fresh.bundles == row["bundles"], (fresh.row(), row)
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps([dict(row, bundles=row["bundles"] - 40)]))
    with pytest.raises(ValueError, match="disagrees with its own bundles"):
        feed_costs.recorded_feed_floors(path)
    with pytest.raises(ValueError, match="v6e's MXU takes"):
        probes.probe_floor("v6e", "fp8", 8)


def test_which_storages_the_mxu_alone_keeps_from_hbm_rate():
    """MXU_BOUND, recomputed from the floors, the table's bytes and chips.csv's bundle
    rates and bandwidths: on TPU7x at either end a bf16 or an fp8-fed weight can stream
    at HBM rate, int8 and the 4-bit formats cannot (half or a quarter of the bytes for
    the same MXU work)."""
    bound = set()
    for chip in sorted({k[0] for k in feed_costs.recorded()}):
        spec = mk.chip(chip)
        for dtype in feed_costs.DTYPES:
            for end in ("slow", "fast"):
                feed, ratio = feed_costs.feed_floor_over_dma(spec, dtype, 8, end)
                if ratio > 0.9:
                    bound.add((chip, dtype, end))
    assert bound == MXU_BOUND
    # the best feed is the cheaper: fp4 on TPU7x is fed fp8, not bf16
    fp8, bf16 = (feed_costs.feed_floor_over_dma(mk.chip("tpu7x"), "fp4", 8, "slow", f)
                 for f in ("fp8", "bf16"))
    assert feed_costs.feed_floor_over_dma(mk.chip("tpu7x"), "fp4", 8) == fp8
    assert fp8[1] < bf16[1]


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


def test_the_simulator_charges_each_weight_tile_the_table_at_either_rate_end():
    """A dense model's wq tiles cost the table's bf16 row x tile elements / the bundle
    rate at each end of it; the slower rate never makes the step faster; a recorded
    whole-kernel loop replaces the table; the bytes moved are the same whichever the
    cost."""
    config, spec = mk.preset("qwen3-0.6b"), mk.chip("tpu7x")
    runs = {end: simulated_step(config, spec, context=256, assumptions=sim.Assumptions(
        rate_end=end)) for end in ("slow", "fast")}
    block = runs["slow"].plan.block
    for end, run in runs.items():
        (wq,) = _tile_events(run, "wq")[:1]
        per_tile = feed_costs.tile_s(spec, "bf16", 1, block.tile_rows * block.tile_cols, end)
        assert wq.busy_s == pytest.approx(wq.count * per_tile, rel=1e-9)
    assert runs["fast"].compute_s < runs["slow"].compute_s
    assert runs["fast"].step_s <= runs["slow"].step_s
    loop = simulated_step(config, spec, context=256,
                          assumptions=sim.Assumptions(tile_bundles=777))
    (wq,) = _tile_events(loop, "wq")[:1]
    assert wq.busy_s == pytest.approx(wq.count * 777 / spec.bundle_rate("slow"), rel=1e-9)
    assert loop.dma_bytes == runs["slow"].dma_bytes == runs["fast"].dma_bytes


def test_a_packed_format_costs_its_own_row():
    """qwen3-30b-a3b with int4 experts on v6e: an expert tile costs the int4 row (its
    dequantisation), the attention tiles the bf16 row; the bytes are the packed ones."""
    config, spec = mk.preset("qwen3-30b-a3b"), mk.chip("v6e")
    run = simulated_step(config, spec, context=256, formats={"experts": "int4"})
    for name, dtype in (("we_gate[0]", "int4"), ("wq", "bf16")):
        tile = math.prod(run.plan.stream.segment(name.partition("[")[0]).tile)
        e = _tile_events(run, name)[0]
        assert e.busy_s == pytest.approx(e.count * feed_costs.tile_s(spec, dtype, 1, tile),
                                         rel=1e-9), name
    assert run.family_bytes()["experts"] < simulated_step(
        config, spec, context=256).family_bytes()["experts"] / 3


def test_a_tile_fed_fp8_costs_the_fp8_feed_row():
    """On tpu7x the plan feeds fp8 experts to the MXU as fp8 (`mk.model.unpack.choose_feeds`):
    an expert tile costs that row, cheaper than the same storage's bf16-feed row."""
    config, spec = mk.preset("qwen3-30b-a3b"), mk.chip("tpu7x")
    run = simulated_step(config, spec, context=256, formats={"experts": "fp8"})
    assert dict(run.plan.feeds) == {"experts": "fp8"}
    tile = math.prod(run.plan.stream.segment("we_gate").tile)  # the experts' own tile
    e = _tile_events(run, "we_gate[0]")[0]
    fed = feed_costs.tile_s(spec, "fp8", 1, tile, feed="fp8")
    assert e.busy_s == pytest.approx(e.count * fed, rel=1e-9)
    assert fed < feed_costs.tile_s(spec, "fp8", 1, tile, feed="bf16")


def test_perfs_tile_floor_sums_the_same_table():
    """mk.cost.perf's compute floor is every streamed weight element at the table's cost: on
    a dense model, its elements x the bf16 row / the bundle rate; the fast end scales it;
    FP4 experts cost their own row; the modelled step adds the collectives to it."""
    config, spec = mk.preset("qwen3-8b"), mk.chip("v6e")
    low = perf.tile_floor_ms(config, spec)
    high = perf.tile_floor_ms(config, spec, rate_end="fast")
    assert high == pytest.approx(low * spec.bundle_rate("slow") / spec.bundle_rate("fast"))
    elements = sum(v for f, v in shard_weight_elements(
        config, padded_vocab(config, model_block(config)), 0).items() if f != "norms")
    assert low == pytest.approx(1e3 * elements * feed_costs.bundles_per_element(
        "v6e", "bf16", 1) / spec.bundle_rate("slow"))
    moe = mk.preset("qwen3-30b-a3b")
    assert perf.tile_floor_ms(moe, spec, formats={"experts": "fp4"}) != perf.tile_floor_ms(
        moe, spec)
    e = perf.predict(config, spec, context=1024)
    assert perf.modelled_step_ms(config, spec, context=1024) == pytest.approx(
        max(e.hbm_floor_ms, low + e.collective_ms))


def test_a_slower_bundle_rate_never_makes_a_modelled_step_faster():
    """mk.cost.perf at both ends of every TPU's rate, dense and MoE (fp4 experts), B 1 and
    64 (the largest M a step has): the slow end's tile floor and modelled step are never
    below the fast end's, and strictly above where the range is one."""
    for spec in all_chips("tpu"):
        for config, formats in ((mk.preset("qwen3-8b"), None),
                                (mk.preset("qwen3-30b-a3b"), {"experts": "fp4"})):
            for batch in (1, 64):
                kw = dict(batch=batch, formats=formats)
                floor = {e: perf.tile_floor_ms(config, spec, rate_end=e, **kw)
                         for e in ("slow", "fast")}
                step = {e: perf.modelled_step_ms(config, spec, context=1024, rate_end=e, **kw)
                        for e in ("slow", "fast")}
                assert step["slow"] >= step["fast"], (spec.name, config.name, batch)
                rates = spec.bundle_rate("slow", batch), spec.bundle_rate("fast", batch)
                assert floor["slow"] == pytest.approx(floor["fast"] * rates[1] / rates[0])
                assert (floor["slow"] > floor["fast"]) == (rates[0] < rates[1]), spec.name


@pytest.mark.parametrize("read", [feed_costs.recorded, feed_costs.recorded_feed_floors,
                                  probes.recorded_clock_probes])
def test_the_recorded_tables_are_read_with_the_untrusted_files_limits(tmp_path, read):
    """A path handed in is untrusted (issue 65): a named pipe is refused before it blocks,
    nesting past the limit before json recurses, both naming the file."""
    pipe, deep = tmp_path / "pipe.json", tmp_path / "deep.json"
    os.mkfifo(pipe)
    deep.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match=r"pipe\.json' is a named pipe"):
        read(pipe)
    with pytest.raises(ValueError, match=r"deep\.json' nests 5000 levels deep; the limit"):
        read(deep)


@pytest.mark.parametrize("read, data", [
    (feed_costs.recorded.__wrapped__, feed_costs.FEED_COSTS),
    (feed_costs.recorded_feed_floors.__wrapped__, feed_costs.FEED_FLOORS),
    (probes.recorded_clock_probes, probes.CLOCK_PROBES)])
def test_a_recorded_tables_rows_are_checked_by_key_and_kind_naming_the_row(tmp_path, read,
                                                                          data):
    """Issue 65 re-check: a row of another shape ended in AttributeError, KeyError,
    TypeError ('int' object is not subscriptable) or, for the clock probes, was accepted;
    now each names the file, the row and the field."""
    good = json.loads(data.read_text())
    row = good[0]
    path = tmp_path / "record.json"
    for bad, match in (({}, "holds a dict; expected a list of rows"),
                       ([1], r"row 0 must be an object with the keys .*; got 1"),
                       ([{"chip": "v5e"}], r"row 0 must be an object with the keys"),
                       ([row, row | {"shape": [1, "2"]}],
                        r"row 1's shape=\[1, '2'\] must be a list of \d integers"),
                       ([row | {"bundles": True}], "row 0's bundles=True must be an integer"),
                       ([row | {"chip": ["v5e"]}], r"row 0's chip=\['v5e'\] must be a string")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=rf"record.json'.*{match}"):
            read(path)
    path.write_text(json.dumps(good))
    assert len(read(path)) == len(good)
