"""mk.cost.bundles: the per-tile loops read from libtpu's bundle dump of the compiled megakernel,
and the simulator's use of their cost. The parser is checked on hand-written dumps in the
real format; one real compile (qwen3-0.6b on TPU7x, ~20 s) checks the kernel's per-tile
loops and the issue-time rule of issue 14 on it. The whole kernel's static schedule
(`read_schedule`) is checked on a toy kernel compiled with the dumps, and the one launcher
of those compiles on a child that fails and one that outlives its timeout."""

import dataclasses
import json
from pathlib import Path

import pytest

import mk
from mk.cost import bundles, ledger, probes, sim
from mk.kernels.common import SLOTS
from mk.step.plan import RING_COVER_S, DecodePlan
from mk.kernels.stream import little_slots
from builders import simulated_step

DUMP = """\
= control target key start
LB: loop body
= control target key end

  0x10   :  { %1 = sst [smem:[#allocation1]] %s1_s1 }
  0x11 LB: > { %2 = sadd.s32 1, %s2_s2  ;;  %3 = vmatpush1.bf16.msra.mxu0 %v1_v1 }
  0x12   : > { %4 = dma.general /*src=*/%s3_s3, /*size_in_granules=*/16384, /*dst=*/%s4_s4 /* hbm-to-vmem */ }
  0x13   :  {}
  0x14   : > { %5 = dma.done.wait %s5_s5, 16384 }
  0x15   : > { %6 = scmp.lt.s32.totalorder %s6_s6, 0 }
  0x16   :  { %7 = smov 0 }
  0x17 LB: > { %8 = vpop.eup %v3_v3  ;;  %9 = vmatmul.mubr.bf16.vlgmr.msra.gmra.mrb %v1_v1 }
  0x18   : > { %10 = dma.general /*src=*/%s3_s3, /*size_in_granules=*/16384, /*dst=*/%s4_s4 }
  0x19   :  { %11 = smov 1 }
"""


def test_loops_are_read_from_a_dump_in_libtpus_format():
    first, second = bundles.loops(DUMP)
    assert (first.depth, first.bundles, first.mxu, first.scalar_only, first.dma_granules,
            first.waits, first.eup, first.nested) == (1, 5, 1, 1, (16384,), 1, 0, 0)
    assert (second.bundles, second.mxu, second.eup) == (2, 1, 1)
    # an empty bundle closing a predicated region (a DMA under pl.when) is still inside
    # the loop: it does not end it
    regioned = DUMP.replace("0x13   :  {}", "0x13   :  {} /* End region 2 */")
    assert bundles.loops(regioned) == [first, second]
    # the branch back printed a level out, its delay slots filled with the trip's last
    # bundles (TPU7x): the branch and the bundles after it are still the loop's
    branch = "  0x149  :  { %12 = sbr.rel (!%p1_p1) target = $region3 }\n  0x15   : >"
    delayed, _ = bundles.loops(DUMP.replace("  0x15   : >", branch))
    assert delayed == dataclasses.replace(first, bundles=6, scalar_only=2)
    # so is code predicated on the loop's exit, printed a level out inside the trip, one
    # bundle or a run of them
    exiting = "  0x129  :  { %13 = ssub.s32 (%p1_p1), 0, %s7_s7 }\n"
    early, _ = bundles.loops(DUMP.replace("  0x13   :", exiting + "  0x13   :"))
    assert early == dataclasses.replace(first, bundles=6, scalar_only=2)
    early, _ = bundles.loops(DUMP.replace("  0x13   :", 2 * exiting + "  0x13   :"))
    assert early == dataclasses.replace(first, bundles=7, scalar_only=3)
    # the next phase's EUP work under the exit (an activation) is not the loop's own
    ahead = "  0x129  :  { %14 = vpop.eup (%p1_p1), %v3_v3 }\n"
    early, _ = bundles.loops(DUMP.replace("  0x13   :", ahead + "  0x13   :"))
    assert (early.bundles, early.eup) == (6, 0)
    # a lone branch before an inner loop's body is not a branch back
    inner = DUMP.replace("  0x16   :  { %7 = smov 0 }\n  0x17 LB: >",
                         "  0x16   : > { %7 = sbr.rel (%p1_p1) target = $region4 }\n"
                         "  0x17 LB: >>")
    outer, nested = bundles.loops(inner)
    assert (outer.bundles, outer.nested, nested.depth, nested.bundles) == (7, 1, 2, 1)


# A bundle whose comment runs on over the next lines: a DMA's bounds check quotes the DMA
# (v5e and v6e write one before each weight tile's DMA).
CHECKED = """\
  0x20 LB: > { %1 = shalt.err (!%p1_p1) /* BoundsCheck 0 [deref of %s2] for %3 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s2, /*size_in_granules=*/16384, /*vmem=*/%s4
hlo: mk_megakernel.1
 */ }
  0x21   : > { %3 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s2_s2, /*size_in_granules=*/16384, /*vmem=*/%s4_s4  ;;  %5 = vmatpush1.bf16.msra.mxu0 %v1_v1 }
  0x22   : > { %6 = dma.done.wait %s5_s5, 16384 }
"""


def test_a_bundle_running_over_several_lines_is_one_bundle_and_its_quote_no_dma():
    """The bounds check is a bundle (the schedule-analysis total counts it), its op is
    shalt.err; the DMA it quotes in its comment is not issued there."""
    check, dma, wait = bundles.read_bundles(CHECKED)
    assert (check.mark, check.depth, check.ops, check.granules, check.dmas) == (
        "LB", 1, ("shalt.err",), (), 0)
    assert (dma.ops, dma.granules, dma.dmas, wait.waits) == (
        ("dma.hbm_to_vmem", "vmatpush1.bf16.msra.mxu0"), (16384,), 1, 1)
    loop, = bundles.loops(CHECKED)
    assert (loop.bundles, loop.dma_granules, loop.waits, loop.scalar_only) == (
        3, (16384,), 1, 1)


def test_tile_loops_are_those_streaming_tiles_of_the_size_and_no_softmax():
    found = bundles.loops(DUMP)
    plain = bundles.tile_parts(None, 512, 512)
    assert bundles.tile_loops(found, plain) == [found[0]]  # the EUP loop is not
    assert bundles.tile_loops(found, bundles.tile_parts(None, 256, 256)) == []  # another size
    # a packed tile of the same data size issues its scale block too: not this loop
    assert bundles.tile_loops(found, (*plain, 2048)) == []
    assert bundles.tile_parts("fp4", 2048, 128) == (2048 * 128 // 2, 2048 // 32 * 128)
    # a trip that issues nothing (the stream's last tiles; tiles only a skipped kind could
    # follow) still brings and multiplies a tile
    quiet = dataclasses.replace(found[0], dma_granules=())
    assert bundles.tile_loops([quiet], plain) == [quiet]


def test_a_trip_through_an_expert_of_one_tile_matrices_costs_each_tile_its_share():
    """Kimi K3's TP32 expert slot (three FP4 tiles, gate and up [7168, 128], down [128,
    7168]: the same bytes) is one trip of a loop that waits for all three, data and scales
    at once, and runs the activation on the EUP between them: a per-tile loop of those
    packed tiles, each a third of the trip; the simulator charges a packed tile its
    recorded loop (`Assumptions.packed_bundles`) and the table's row without one."""
    parts = bundles.tile_parts("fp4", 7168, 128)
    assert parts == bundles.tile_parts("fp4", 128, 7168) == (458752, 28672)
    trip = bundles.Loop(first=0, depth=2, bundles=2741, mxu=1431, scalar_only=40,
                        dma_granules=(14336, 896), waits=3, wait_granules=(15232,) * 3,
                        eup=2, nested=0)
    assert bundles.tile_loops([trip], parts) == [trip] and bundles.per_tile(trip) == 914
    plain = dataclasses.replace(trip, wait_granules=(14336,))  # a plain tile's bytes
    assert bundles.tile_loops([plain], (458752,)) == []  # with the EUP: softmax's, not a tile
    plan = DecodePlan.make(mk.preset("kimi-k2-shaped"), tp=32, rows=8, context=1152, chip="tpu7x",
                           kernel=False)
    spec, formats = mk.chip("tpu7x"), dict(plan.formats)
    table = sim.tile_seconds(plan.stream, spec, plan.M, formats, plan.local.dtype,
                             sim.Assumptions())
    recorded = sim.tile_seconds(plan.stream, spec, plan.M, formats, plan.local.dtype,
                                sim.Assumptions(packed_bundles=(("fp4", 7168, 128, 914),)))
    assert recorded["we_gate_up"] == 914 / spec.bundle_rate("slow", plan.M)  # gate|up joined
    assert recorded["we_down"] == table["we_down"] != recorded["we_gate_up"]  # [128, 7168]
    with pytest.raises(ValueError, match="packed_bundles entry"):
        sim.Assumptions(packed_bundles=(("fp5", 7168, 128, 914),))


def test_the_simulator_charges_the_issue_time_per_tile():
    config = mk.preset("qwen3-0.6b")
    plain = simulated_step(config, "tpu7x", context=256)
    slow = simulated_step(config, "tpu7x", context=256,
                          assumptions=sim.Assumptions(tile_issue_s=1e-6))
    tiles = plain.plan.stream.total  # every one consumed: a dense model
    assert plain.step_s < tiles * 1e-6 <= slow.step_s
    with pytest.raises(ValueError, match=r"tile_issue_s=-1"):
        sim.Assumptions(tile_issue_s=-1)


def test_the_simulator_turns_bundles_into_seconds_at_either_end_of_the_bundle_rate():
    """tile_bundles per tile cost bundles / the chip's bundle rate at the `rate_end` end:
    2000 bundles bound a dense step on TPU7x at either end (2.2 us at its slow end, 1.9 us
    at its fast end), and the slower rate never makes the step faster."""
    config, spec = mk.preset("qwen3-0.6b"), mk.chip("tpu7x")
    tiles = simulated_step(config, spec, context=256).plan.stream.total
    step = {end: simulated_step(config, spec, context=256, assumptions=sim.Assumptions(
        tile_bundles=2000, rate_end=end)).step_s for end in ("slow", "fast")}
    assert step["slow"] >= tiles * 2000 / spec.bundle_rate("slow") > step["fast"]
    assert step["fast"] >= tiles * 2000 / spec.bundle_rate("fast")
    a = sim.Assumptions(tile_bundles=2000, rate_end="fast")
    assert a.issue_s(spec, 1) == 2000 / spec.bundle_rate("fast")
    with pytest.raises(ValueError, match=r"rate_end='high'"):
        sim.Assumptions(rate_end="high")
    with pytest.raises(ValueError, match=r"tile_bundles=-3"):
        sim.Assumptions(tile_bundles=-3)
    with pytest.raises(ValueError, match=r"tile_bundles=5 and tile_issue_s=1e-06 both"):
        sim.Assumptions(tile_bundles=5, tile_issue_s=1e-6)


def test_the_compiled_per_tile_loops_issue_faster_than_their_tiles_stream():
    """Issue 14's rule on one model: the costliest per-tile loop's bundles / the bundle rate
    <= 0.9 x the tile's DMA time on TPU7x, at the slow end of its rate. Each loop waits once
    (for its own tile) and searches at most the segments that can follow its matrix, not
    the whole stream."""
    config = mk.preset("qwen3-0.6b")
    plan = DecodePlan.make(config, tp=1, batch=1, rows=1, context=1024, chip="tpu7x")
    cost = bundles.measure(plan)
    assert cost.tile_bytes == plan.stream.tile_bytes * 2
    assert all(lp.waits == 1 and lp.mxu > 0 for lp in cost.loops)
    sites = len(plan.stream.segments + plan.stream.tail)
    assert max(len(lp.dma_granules) for lp in cost.loops) < sites, cost.row()
    assert cost.issue_s("fast") < cost.issue_s("slow") <= 0.9 * cost.dma_s, cost.row()
    # and the simulator takes its bundles as the compute lane's floor per tile
    a = cost.assumptions(dma_latency_s=1e-6)
    assert a.issue_s(mk.chip("tpu7x"), plan.M) == cost.issue_s("slow")
    assert dataclasses.replace(a, tile_bundles=0) == sim.Assumptions(dma_latency_s=1e-6)


def test_a_plan_that_does_not_fit_is_reported_not_measured():
    cost = bundles.measure(DecodePlan.make(mk.preset("qwen3-8b"), chip="v5e", batch=8,
                                           context=32768))
    assert not cost.report.ok and "HBM" in cost.report.error and cost.loops == ()
    with pytest.raises(ValueError, match="did not compile"):
        cost.issue_s()


RECORDED = (Path(__file__).resolve().parent.parent / "mk" / "data" / "tile_costs"
            / "single_core.json")


@pytest.mark.parametrize("row", json.loads(RECORDED.read_text()),
                         ids=lambda r: f"{r['preset']}-{r['chip']}")
def test_the_recorded_single_core_kernels_stream_at_the_hbm_floor(row):
    """Issue 14's bar, at the slow end of the bundle rate (issues 34, 61), on every
    single-core preset and chip that benchmarks/tile_costs.py recorded
    (mk/data/tile_costs/single_core.json): the recorded kernel is the plan's own for the
    chip, priced at today's rates (a stale recording fails here: rebuild it, or `--rerate`
    it), its per-tile loops of every storage issue in <= 0.9 x their own tile's DMA time
    at today's slow end but where ISSUE_OVER says, and the simulator with the plain
    tiles' costliest loop and a 1 us DMA latency, replayed now, keeps HBM >= 90 % busy,
    as recorded."""
    config, spec = mk.preset(row["preset"]), mk.chip(row["chip"])
    plan = DecodePlan.make(config, batch=row["batch"], rows=row["rows"],
                           position=row["context"], chip=spec, kernel=False)
    assert (plan.block.slots, plan.stream.tile_bytes * 2 / 1024,
            dict(plan.block.tiles)) == (row["slots"], row["tile_KiB"],
                                        {n: tuple(t) for n, t in row.get("tiles", {}).items()})
    if not row["fits"]:  # the weights need more HBM than one core has: nothing to run
        assert "HBM" in row["error"] and not plan.fits(spec).ok
    m = row["batch"] * row["rows"]
    assert (row["bundle_rate_slow"], row["bundle_rate_fast"]) == (
        spec.bundle_rate("slow", m), spec.bundle_rate("fast", m))
    assert _issue_over(row) == {k: v for k, v in ISSUE_OVER.items()
                                if k[:3] == (row["preset"], row["chip"], 1)}, row
    again = simulated_step(config, spec, batch=row["batch"], rows=row["rows"],
                           context=row["context"], block=plan.block,
                           assumptions=ledger.recorded_assumptions(row))
    assert again.hbm_utilisation == pytest.approx(row["hbm_busy"], rel=1e-9)
    assert again.hbm_utilisation >= 0.9, again.bubble_share()


PUBLISHED = RECORDED.parent / "published.json"


def _resimulated(row, block=None):
    config, spec = mk.preset(row["preset"]), mk.chip(row["chip"])
    kw = dict(tp=row["tp"], batch=row["batch"], rows=row["rows"])
    plan = DecodePlan.make(config, chip=spec, position=row["context"], kernel=False, **kw)
    return plan, simulated_step(config, spec, block=block or plan.block, context=row["context"],
                                **kw,
                                assumptions=ledger.recorded_assumptions(row))


# (preset, chip, tp, storage) -> the ends of the bundle rate at which a recorded kernel's
# tiles of that storage ("plain", a packed scheme, or either with a tile shape of its own:
# `mk.cost.bundles.storage_name`) issue slower than 0.9 x their own DMA (bundles / rate
# against the tile's bytes at one core's bandwidth). TPU7x's rate, derived from the
# release's MXU push rate (issue 61: 0.93-1.03 G bundles/s, where the clock range had
# run to 4.40 GHz), puts two plain loops over the bar at its slow end: qwen3-4b's on one
# core (0.93x its DMA; 0.84x at the fast end) and the 27B's TP8 shard's (issue 34: 5120
# x 128 tiles, its MLP's 2176 columns a device are 17 x 128, stored folded 4, [1280, 512],
# `mk.kernels.fold`; its costliest loop, a transposed tile's, 0.95x; 0.86x).
# Kimi K3's TP32 shard (the release's kimi-k3 since issue 66; kimi-k2-shaped's before)
# streams its FP4 experts in tiles of their own (a device's 96 columns of each expert
# padded to 128, gate and up apart: 3584 x 128, down 128 x 3584, fed fp8) and the rest in
# 3584 x 128 ones of at most twice their bytes: its plain loops issue for up to 1.7x their
# DMA at the slow end (1.5x at the fast), an FP4 tile for 9.0-10.3x (8.2-9.3x). No loop
# can bring an FP4 tile under 0.9 at either end: the MXU's own fp8 feed floor is over
# 0.9x an FP4 weight's DMA there (`mk.cost.feed_costs.feed_floor_over_dma`;
# tests/test_feed_costs.py's MXU_BOUND), and the trip's vector work (unpacking, each
# 32-row group's product scaled and summed) alone fills more (2,837 vector ALU ops a trip
# in kimi-k2-shaped's dump, at most four a bundle).
# Issue 38: gpt-oss-20b (2944 = 23 x 128 wide) takes 128 x 2944 tiles on one core (its
# fp4 experts' one 128-row panel of their width, within QUANT_TILE_ELEMENTS): plain
# 0.2-0.3x their DMA; the fp4 tiles, dequantised to bf16 (neither Colab chip's MXU takes
# fp8), 5.8x (4.5x) on v6e and 3.3x at v5e's one measured rate.
ISSUE_OVER = {("qwen3-4b", "tpu7x", 1, "plain"): {"slow"},
              ("qwen3.5-27b", "tpu7x", 8, "plain"): {"slow"},
              ("kimi-k3", "tpu7x", 32, "plain"): {"slow", "fast"},
              ("kimi-k3", "tpu7x", 32, "fp4 128x3584"): {"slow", "fast"},
              ("kimi-k3", "tpu7x", 32, "fp4 3584x128"): {"slow", "fast"},
              ("gpt-oss-20b", "v6e", 1, "fp4"): {"slow", "fast"},
              ("gpt-oss-20b", "v5e", 1, "fp4"): {"slow", "fast"}}


def _issue_over(row) -> dict:
    """ISSUE_OVER's entries of one recorded row, from its bundles."""
    spec, out, m = mk.chip(row["chip"]), {}, row["batch"] * row["rows"]
    storages = {"plain": (ledger.tile_bundles(row), row["dma_ns"])} | {
        q: (p["bundles"], p["dma_ns"]) for q, p in row.get("packed", {}).items()}
    for storage, (bundles_, dma_ns) in storages.items():
        ends = {e for e in ("slow", "fast")
                if bundles_ / spec.bundle_rate(e, m) * 1e9 > 0.9 * dma_ns}
        if ends:
            out[(row["preset"], row["chip"], row.get("tp", 1), storage)] = ends
    return out


def _published_rows():
    """One param per recorded shard; CI replays the speculative runs (B 1, T 8) and B 1,
    `make test-slow` the other batches too (each a Kimi K3 TP32 replay of 8-15 s)."""
    return [pytest.param(r, id=f"{r['preset']}-tp{r['tp']}-b{r['batch']}t{r['rows']}",
                         marks=() if r["batch"] == 1 else pytest.mark.slow)
            for r in json.loads(PUBLISHED.read_text())]


@pytest.mark.parametrize("row", _published_rows())
def test_the_recorded_tensor_parallel_shards_stream_through_their_collectives(row):
    """Issue 14's bar on the shards of the published runs (mk/data/tile_costs/published.json):
    the recorded kernel is the plan's own (its packed schemes the plan's formats), its
    per-tile loops issue in <= 0.9 x their own tile's DMA time except where ISSUE_OVER
    says, and the simulated step, replayed now with that cost and a 1 us DMA latency,
    is within 10 % of max(HBM floor, the compute lane's busy time: tiles, vectors and the
    collectives), so weight streaming does not wait on the all-reduces."""
    plan, run = _resimulated(row)
    assert (plan.block.slots, plan.stream.tile_bytes * 2 / 1024) == (row["slots"],
                                                                      row["tile_KiB"])
    assert _issue_over(row) == {k: v for k, v in ISSUE_OVER.items()
                                if k[:3] == (row["preset"], row["chip"], row["tp"])}, row
    assert {p["scheme"] for p in row.get("packed", {}).values()} == set(
        dict(plan.formats).values())
    assert run.step_ms == pytest.approx(row["sim_step_ms"], rel=1e-9)
    assert run.step_s <= 1.1 * max(run.hbm_floor_s, run.compute_s), run.bubble_share()


GPT_OSS = RECORDED.parent / "gpt_oss.json"


@pytest.mark.parametrize("row", json.loads(GPT_OSS.read_text()),
                         ids=lambda r: f"{r['preset']}-{r['chip']}")
def test_the_recorded_gpt_oss_20b_kernels_replay_their_simulated_step(row):
    """Issue 38: gpt-oss-20b whole on one core of each Colab TPU
    (mk/data/tile_costs/gpt_oss.json, benchmarks/tile_costs.py): the recorded kernel is the
    plan's own for the chip (its 128 x 2944 tiles and ring; a stale recording fails here),
    its fp4 experts packed (their own loop recorded on both chips), and the
    simulator, replayed now with its bundle-measured per-tile costs and a 1 us DMA
    latency, gives the recorded step and HBM busy. Issue 14's bar holds for the plain
    tiles; the fp4 tiles' dequantisation issues for longer than their DMA (ISSUE_OVER)."""
    plan, run = _resimulated(row)
    assert (plan.block.slots, plan.stream.tile_bytes * 2 / 1024) == (row["slots"],
                                                                      row["tile_KiB"])
    assert (plan.block.tile_rows, plan.block.tile_cols) == (128, 2944)
    assert dict(plan.formats) == {"experts": "fp4"}
    assert {p["scheme"] for p in row.get("packed", {}).values()} == {"fp4"}
    assert row["fits"] and plan.fits(row["chip"]).ok
    assert run.step_ms == pytest.approx(row["sim_step_ms"], rel=1e-9)
    assert run.hbm_utilisation == pytest.approx(row["hbm_busy"], rel=1e-9)
    assert run.step_s >= run.hbm_floor_s


def test_the_recorded_kernels_issue_time_at_both_ends_of_the_bundle_rate():
    """Every recorded row's tiles (plain and packed, from their recorded bundles) against
    their own DMA at both ends of today's bundle rate: over 0.9 exactly where ISSUE_OVER
    says (a re-recording that moves a row either way fails here)."""
    over = {}
    for path in (RECORDED, PUBLISHED, GPT_OSS):
        rows = json.loads(path.read_text())
        for row in rows:
            if "tile_ns" in row:
                for key, ends in _issue_over(row).items():
                    over.setdefault(key, set()).update(ends)
    assert over == ISSUE_OVER


def test_a_ring_not_sized_by_littles_law_misses_that_bar():
    """The guard of the test above: the 27B TP8 shard with the SLOTS-deep ring of a plan
    made without a chip (3 slots, not the plan's 16) drains at every tile and misses it
    (1.5x). The ring RING_COVER_S alone asks for (8 slots) now meets it (+8 %): the skips
    of the switched-off regions come before the all-reduces (`layer_matrices`), so the
    refills load during them."""
    row = next(r for r in json.loads(PUBLISHED.read_text()) if r["preset"] == "qwen3.5-27b")
    plan, _ = _resimulated(row)
    spec = mk.chip(row["chip"])
    cover = little_slots(spec.device_hbm_bw, RING_COVER_S,
                         plan.stream.tile_bytes * 2)  # bf16 tiles
    assert SLOTS < cover < plan.block.slots
    bound = {}
    for slots in (SLOTS, cover):
        _, run = _resimulated(row, dataclasses.replace(plan.block, slots=slots))
        bound[slots] = run.step_s / max(run.hbm_floor_s, run.compute_s)
    assert bound[SLOTS] > 1.1 >= bound[cover], bound


# -- The static schedule ----------------------------------------------------------------------
TOY = """import sys, jax, jax.numpy as jnp, mk
from jax.experimental import pallas as pl

def kernel(x_ref, o_ref):
    with jax.named_scope("scale"):
        y = x_ref[...] * 2.0
    with jax.named_scope("shift"):
        o_ref[...] = y + 1.0

def f(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          name="mk_toy")(x)

r = mk.measure.tpu.compile_for_chip(f, [jax.ShapeDtypeStruct((8, 128), jnp.float32)], sys.argv[1])
sys.exit(0 if r.ok else 1)
"""


def test_named_scopes_become_phases_of_the_static_schedule(tmp_path):
    jf = bundles.compile_with_dumps(TOY, ["v6e"], tmp_path)
    s = bundles.read_schedule(jf, "mk_toy")
    assert set(s.phases) == {"scale", "shift"} and all(n > 0 for n in s.phases.values())
    assert s.bundles > sum(s.phases.values())
    # every bundle is read, those running over several lines too (the analysis counts them)
    text = bundles.dump_file(jf, "mk_toy", "final_bundles.txt").read_text()
    assert len(bundles.read_bundles(text)) == s.bundles
    assert (s.dmas, s.waits) == (2, 2)  # x in, o out; not the bounds checks quoting them
    assert set(s.utilisation) >= {"MXU", "VALU", "VLOAD", "VSTORE"}
    assert all(0 <= u <= 1 for u in s.utilisation.values())


def test_reading_a_folder_without_dumps_says_which_flag(tmp_path):
    with pytest.raises(ValueError, match="xla_jf_dump_to"):
        bundles.read_schedule(tmp_path)


def test_a_failing_or_late_child_is_reported_with_its_stderr_tail(tmp_path):
    """The one launcher's failure report: the exit code and the end of the child's stderr;
    a child outliving the timeout is stopped and reported the same way."""
    fail = "import sys; sys.stderr.write('x' * 5000 + 'the compiler said no'); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*the compiler said no") as failed:
        bundles.compile_with_dumps(fail, [], tmp_path)
    assert len(str(failed.value)) < 2200  # the tail, not the whole stream
    late = "import sys, time; sys.stderr.write('still compiling'); sys.stderr.flush(); " \
           "time.sleep(30)"
    with pytest.raises(RuntimeError, match=r"(?s)timeout=1.0 s.*still compiling"):
        bundles.compile_with_dumps(late, [], tmp_path, timeout=1.0)



# -- The bound a schedule puts on an MXU-bound bundle rate ---------------------------------
CLOCK_PROBES = json.loads(probes.CLOCK_PROBES.read_text())


@pytest.mark.parametrize("row", [pytest.param(r, marks=() if r["chip"] == "tpu7x"
                                              else pytest.mark.slow) for r in CLOCK_PROBES],
                         ids=lambda r: r["chip"])  # tpu7x in CI, the others under slow
def test_the_recorded_schedule_implied_rate_bound_is_libtpus_today(row):
    """benchmarks/clock_probe.py's record (data/clock_probes.json, the bound chips.csv's
    MXU-bound rates stay under: tests/test_chips.py) against a fresh compile (~5 s a
    chip): a libtpu that schedules the probe matmul in other bundles, or addresses other
    MXUs, fails here (then rerun the benchmark and check chips.csv's rates and notes)."""
    probe = probes.probe_clock(row["chip"], tuple(row["shape"]))
    assert (probe.bundles, list(probe.mxus)) == (row["bundles"], row["mxus"]), (
        f"libtpu {probe.libtpu} (recorded with {row['libtpu']}): {probe.row()}")
    assert probe.clock_hz == pytest.approx(row["clock_hz"], rel=1e-12)
    assert len(probe.mxus) == mk.chip(row["chip"]).mxus_per_core


def test_the_probe_measures_the_mxu_span_of_a_straight_line_matmul():
    """The guard of the re-check: the probe's numbers follow from its own dump (a fresh
    compile of another shape has half the FLOPs and fewer bundles), and a probe cannot be
    asked of a GPU or a shape the MXU does not tile."""
    tpu7x = next(r for r in CLOCK_PROBES if r["chip"] == "tpu7x")
    m, k, n = tpu7x["shape"]
    probe = probes.probe_clock("tpu7x", (m, k // 2, n))
    assert 2 * probe.flops == tpu7x["flops"] and probe.bundles < tpu7x["bundles"]
    assert probe.total_bundles >= probe.bundles
    assert probe.clock_hz == pytest.approx(probe.peak_flops * probe.bundles / probe.flops)
    assert probe.peak_flops == mk.chip("tpu7x").bf16_flops / 2
    with pytest.raises(ValueError, match="h200.*gpu"):
        probes.probe_clock("h200")
    with pytest.raises(ValueError, match=r"shape=\(512, 100, 512\)"):
        probes.probe_clock("v6e", (512, 100, 512))
