"""mk.cost.sim: the simulator replays the kernel's own tile stream and keeps the invariants a
pipeline must have: the bytes it moves are the schedule's and the kernel's arrays, the step
is never shorter than the bytes over the bandwidth, one slot serialises, more slots never
slow a step down, a synthetic stream has its closed-form answer, and the fast-forward of
repeated tiles is the exact replay."""

import dataclasses
import math
import re

import jax
import pytest

import mk
from mk.cost import feed_costs, machine, perf, sim
from mk.step import megakernel
from mk.model.chips import chip
from mk.model.presets import PRESET_NAMES
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan, shard_config
from mk.kernels.stream import TileStream
from mk.model.weights import param_shapes
from builders import simulated_step, replay_tile_by_tile

NO_LATENCY = sim.Assumptions(dma_latency_s=0.0)


# -- Bytes ----------------------------------------------------------------------------------
def test_dense_step_streams_every_kernel_weight_array_once_and_its_kv_tiles():
    config, B, T, S = mk.preset("tiny"), 2, 3, 40
    s = simulated_step(config, "v6e", batch=B, rows=T, context=S)
    params = {k: jax.ShapeDtypeStruct(shape, d)
              for k, (shape, d) in param_shapes(config).items()}
    weights = jax.eval_shape(lambda p: megakernel.prepare(s.plan, p), params)
    streamed = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "norms",
                "qk_norms", "final_norm")
    assert s.weight_bytes == sum(weights[n].size * weights[n].dtype.itemsize
                                 for n in streamed)
    stream = s.plan.stream
    norms = s.family_bytes()["norms"]
    assert s.weight_bytes - norms == stream.total * stream.tile_bytes * 2
    # KV: (S + T - 1) // kv_tile + 1 tiles of K and V per sequence and layer, plus the
    # write-back window of the tile holding the new rows (`write_back_rows`: T=3 -> 16)
    K, H, tile = config.kv_heads, config.head_dim, s.block.kv_tile
    tiles = config.layers * B * ((S + T - 1) // tile + 1)
    window = min(tile, -(-(T - 1) // 16) * 16 + 16)
    kv = 2 * tiles * K * tile * H * 2 + 2 * config.layers * B * K * window * H * 2
    assert s.dma_bytes - s.weight_bytes == kv


def test_moe_step_streams_only_the_active_expert_slots_and_the_routers():
    config, M = mk.preset("tiny-moe"), 4
    plan = DecodePlan.make(config, rows=M, position=0)
    block, stream = plan.block, plan.stream
    def streamed(seg):  # a matrix's bytes (the experts' tiles are their own: model_block)
        return seg.tiles * stream.segment_tile_bytes(seg, 2)

    experts = [stream.segment(n) for n in ("we_gate", "we_up", "we_down")]
    assert any(seg.tile != stream.segment("wq").tile for seg in experts)  # tiles of two sizes
    per_slot, slots = sum(map(streamed, experts)), experts[0].copies
    layer = sum(streamed(seg) * seg.copies for seg in stream.segments)
    dense = sum(streamed(stream.segment(n)) for n in ("w_gate", "w_up", "w_down"))
    for active in (1, 3, 8):
        s = simulated_step(config, "v6e", rows=M, block=block, experts_active=active)
        weights = (config.layers * (layer - slots * per_slot) + sum(map(streamed, stream.tail))
                   - len(config.moe_layers) * (dense - active * per_slot))  # MoE layers skip
        routers = len(config.moe_layers) * config.hidden * config.experts * 2  # the dense MLP
        norms = plan.weight_bytes()["norms"]
        assert s.weight_bytes == weights + routers + norms
        assert s.experts_active == active


# One byte count: the simulator's DMAs are mk.cost.perf's HBM floor, family by family, over a
# grid beyond the recorded runs (presets x tp x B x T x S; ~3 s). Routing "disjoint" gives
# both an integer count of experts (under "uniform" the simulator rounds perf's expected
# count: `active_experts`). A ring deep enough to reach the next MoE layer's expert region
# loads none of its tiles before that layer's routing (`test_a_deep_ring_loads_no_expert_
# tile_twice`; tests/test_megakernel.py checks the kernel's DMAs).
BYTE_GRID = {"tiny": (1, 2, 4), "tiny-moe": (1, 2, 4), "tiny-hybrid": (1,), "tiny-kimi": (1,),
             "tiny-gpt-oss": (1,), "qwen3-0.6b": (1, 2, 4)}
PERF_BYTES = dict(attention="attention_bytes", norms="norm_bytes", dense_mlp="dense_mlp_bytes",
                  router="router_bytes", experts="expert_bytes", lm_head="lm_head_bytes",
                  linear="linear_bytes", kv_read="kv_read_bytes", kv_write="kv_write_bytes",
                  state_read="state_read_bytes", state_write="state_write_bytes")


def byte_gaps(name, tp, batch, rows, context, chip_name="v5e"):
    """{byte family: simulated - `mk.cost.perf.predict` bytes of one device} where they differ
    by more than 1e-9 of perf's; with "flags", the simulator's DMA bytes that are in no
    HBM family less a MoE layer's 4-byte-per-expert flags copy (VMEM to SMEM), and with
    "total" its HBM bytes less perf's total but the embedding (XLA's gather)."""
    config = mk.preset(name)
    kw = dict(batch=batch, rows=rows, context=context, tp=tp, routing="disjoint")
    step = simulated_step(config, chip_name, **kw)
    got = step.family_bytes()
    e = perf.predict(config, chip_name, **kw)
    want = {f: getattr(e, field) / tp for f, field in PERF_BYTES.items()}
    gaps = {f: got.get(f, 0) - want.get(f, 0) for f in set(got) | set(want)}
    gaps["flags"] = (step.dma_bytes - sum(step.family_bytes().values())
                     - 4 * config.experts * len(config.moe_layers))
    gaps["total"] = sum(got.values()) - (e.total_bytes - e.embed_bytes) / tp
    return {f: g for f, g in gaps.items() if abs(g) > 1e-9 * max(want.get(f, 0), 1)}


@pytest.mark.parametrize("name", BYTE_GRID)
def test_simulated_bytes_are_perfs_floor_over_presets_tp_batch_rows_and_contexts(name):
    points = [(tp, B, T, S) for tp in BYTE_GRID[name] for B in (1, 8) for T in (1, 4)
              for S in (256, 1024)]
    assert {p: byte_gaps(name, *p) for p in points} == dict.fromkeys(points, {})


@pytest.mark.parametrize("name, tp, batch, rows, context, chip_name", [
    ("qwen3-30b-a3b", 4, 8, 4, 1024, "tpu7x"), ("qwen3.5-27b", 2, 8, 4, 1024, "tpu7x")])
def test_simulated_bytes_are_perfs_floor_for_real_moe_and_hybrid_shards(
        name, tp, batch, rows, context, chip_name):  # ~1 s
    assert byte_gaps(name, tp, batch, rows, context, chip_name) == {}


def test_the_byte_grid_catches_a_floor_of_exact_kv_positions(monkeypatch):
    # The floor before the fix: B*S positions read and B*T rows written, not whole tiles
    # and aligned write-back windows. (qwen3-0.6b B8 T1 S256: sim 1678 MB, floor 1432 MB.)
    def exact(local, batch, rows, context, kv_tile):
        per = mk.model.cache.bytes_per_position(local)
        return {"kv_read": batch * context * per, "kv_write": batch * rows * per}

    monkeypatch.setattr(perf, "kv_step_bytes", exact)
    assert set(byte_gaps("tiny", 1, 8, 1, 256)) == {"kv_read", "kv_write", "total"}


def test_a_deep_ring_loads_no_expert_tile_twice():
    # tiny-moe at tp 4 on tpu7x, the issue's case: 11-18 ring slots reach layer 2's
    # experts from layer 1's. Before the slots knew their routed layer, one row moved 3
    # expert slots in layer 2 where 2 are active.
    assert byte_gaps("tiny-moe", 4, 1, 1, 1024, "tpu7x") == {}


def test_ring_tile_bytes_are_the_ring_buffer_the_kernel_allocates_per_slot():
    config = mk.preset("tiny-moe")
    plan = DecodePlan.make(config, rows=2, position=0)
    block, ring = plan.block, plan.buffers["ring"]
    s = simulated_step(config, "v6e", rows=2, block=block)
    tiles = [e for e in s.events if e.lane == "dma" and e.what == "wq"]
    assert {e.bytes / e.count for e in tiles} == {ring.bytes / block.slots}


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_step_is_never_below_the_hbm_floor_and_bubbles_fill_the_rest(name):
    s = simulated_step(mk.preset(name), "v5e", batch=3, rows=2, context=100)
    busy = s.dma_bytes / s.hbm_bandwidth
    assert s.step_s >= busy and 0 < s.hbm_utilisation <= 1
    assert sum(s.bubble_share().values()) == pytest.approx(s.step_s - busy, rel=1e-9)
    assert set(s.bubble_share()) <= set(machine.CAUSES)


# -- The pipeline ---------------------------------------------------------------------------
@pytest.mark.parametrize("c_over_d", [0.5, 3.0])
def test_synthetic_stream_matches_its_closed_form(c_over_d):
    # v6e: d = 256*256*2 B / 1.64 TB/s; c, the compute per tile, given directly (a
    # recorded loop's issue time) on either side of d.
    spec = chip("v6e")
    d = 256 * 256 * 2 / spec.hbm_bw
    c = c_over_d * d
    stream = TileStream.build(BlockSizes(slots=3, tile_rows=256, tile_cols=256),
                              [("w", 1024, 2048)], layers=2)
    n = stream.total
    s = sim.replay_matmul(stream, spec, rows=8,
                          assumptions=dataclasses.replace(NO_LATENCY, tile_issue_s=c))
    expected = n * d + c if c <= d else d + n * c
    assert s.step_s == pytest.approx(expected, rel=1e-12)


def test_one_slot_serialises_every_tile_latency_load_and_compute():
    spec, latency = chip("v5e"), 0.7e-6
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=256),
                              [("a", 256, 512), ("b", 512, 256)])
    s = sim.replay_matmul(stream, spec, rows=8,
                          assumptions=sim.Assumptions(dma_latency_s=latency))
    d, c = 128 * 256 * 2 / spec.hbm_bw, feed_costs.tile_s(spec, "bf16", 8, 128 * 256)
    assert s.step_s == pytest.approx(stream.total * (latency + d + c), rel=1e-12)


def test_more_slots_never_make_a_weight_stream_slower():
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=256, tile_cols=256),
                              [("a", 1024, 2048), ("b", 2048, 1024)], layers=3)
    steps = [sim.replay_matmul(dataclasses.replace(
        stream, block=dataclasses.replace(stream.block, slots=n)), "tpu7x", rows=8).step_s
        for n in range(1, 17)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:])), steps
    assert steps[-1] < steps[0] / 2


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_a_deeper_ring_pays_off_in_the_kernel_within_the_fifo_cost_of_kv_loads(name):
    """In the whole kernel a layer's first KV tiles are issued at the layer's start, and in
    the one first-in-first-out DMA engine they queue behind every weight tile in flight: a
    deeper ring can delay attention a little (seen: +3.4% on tiny from 10 to 15 slots).
    Below 5% of the best shallower ring, and the latency-covering depth beats the
    default and one slot."""
    block = DecodePlan.make(mk.preset(name), batch=2, rows=2, position=64).block
    need = sim.latency_slots(mk.preset(name), "tpu7x", block)
    steps = [simulated_step(mk.preset(name), "tpu7x", batch=2, rows=2, context=64,
                            block=dataclasses.replace(block, slots=n)).step_s
             for n in range(1, need + 1)]
    assert all(b <= min(steps[:i + 1]) * 1.05 for i, b in enumerate(steps[1:])), steps
    assert steps[-1] < steps[block.slots - 1] < steps[0]


def test_cross_layer_prefetch_removes_the_layer_boundary_bubble():
    config = mk.preset("qwen3-8b").first_layers(3)
    on = simulated_step(config, "tpu7x", context=256)
    off = simulated_step(config, "tpu7x", context=256, cross_layer_prefetch=False)
    assert "layer boundary" not in on.bubble_share()
    assert off.bubble_share()["layer boundary"] > 0 and off.step_s > on.step_s
    edges = [b for b in off.bubbles if b.cause == "layer boundary"]
    assert {b.layer for b in edges} == {1, 2, None}  # every layer edge, and the lm_head


def test_moe_layers_wait_for_routing_before_their_experts_load():
    s = simulated_step(mk.preset("tiny-moe"), "v6e", batch=2, context=16)
    share = s.bubble_share()
    assert share["routing"] > 0
    # every MoE layer; the chip's deep ring has the lm_head's tiles in flight by the last
    # layer's routing, so a gap may end at one of them (layer None)
    assert {1, 2} <= {b.layer for b in s.bubbles if b.cause == "routing"} <= {1, 2, None}


@pytest.mark.parametrize("name,kwargs", [
    ("tiny-moe", dict(batch=3, rows=2, context=40)),
    ("qwen3-8b", dict(batch=2, context=300)),
    ("kimi-k3-like", dict(rows=8, tp=32))])
def test_fast_forward_is_the_exact_replay(name, kwargs, monkeypatch):
    config = mk.preset(name).first_layers(3)
    fast = simulated_step(config, "tpu7x", **kwargs)
    replay_tile_by_tile(monkeypatch)
    slow = simulated_step(config, "tpu7x", **kwargs)
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12)
    assert fast.dma_bytes == slow.dma_bytes and len(fast.events) == len(slow.events)
    assert [(e.what, e.count) for e in fast.events] == [(e.what, e.count)
                                                        for e in slow.events]
    total = sum(slow.bubble_share().values())
    for cause, idle in slow.bubble_share().items():  # causes within a cycle's mix
        assert fast.bubble_share().get(cause, 0) == pytest.approx(idle, abs=0.05 * total)


# -- Tensor parallelism and experts ---------------------------------------------------------
def test_the_simulated_shard_is_the_kernels_heads_ffn_vocab_and_every_expert_sliced():
    s = simulated_step(mk.preset("kimi-k3-like").first_layers(2), "tpu7x", tp=32)
    kimi = s.plan.local
    assert kimi == shard_config(mk.preset("kimi-k3-like").first_layers(2), 32)
    assert (kimi.heads, kimi.kv_heads, kimi.ffn, kimi.vocab) == (2, 1, 640, 5120)
    # every expert on every device, 2048 / 32 = 64 columns padded to one 128-lane tile
    assert (kimi.experts, kimi.experts_per_token, kimi.expert_ffn) == (896, 16, 128)
    assert shard_config(mk.preset("qwen3-8b"), 1) == mk.preset("qwen3-8b")
    with pytest.raises(ValueError, match="tp=3 must be a power of two"):
        simulated_step(mk.preset("qwen3-8b"), "tpu7x", tp=3)


def test_active_experts_are_the_expected_distinct_experts_rounded():
    config = mk.preset("kimi-k3-like")
    assert sim.active_experts(config, 1) == 16
    assert sim.active_experts(config, 8) == round(perf.experts_touched(896, 16, 8))
    assert sim.active_experts(config, 64, "shared") == 16


def test_tensor_parallel_step_pays_the_collectives_on_the_compute_lane():
    config = mk.preset("qwen3-8b").first_layers(2)
    s = simulated_step(config, "tpu7x", batch=2, tp=8)
    collective = [e for e in s.events if e.what == "collective"]
    assert len(collective) == 2 * 2 + 1
    one = perf.allreduce_s(2 * config.hidden * 4, 8, chip("tpu7x"))  # f32 partial sums
    assert collective[0].busy_s == pytest.approx(one)
    assert s.bubble_share()["collective"] > 0


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_simulates_for_batch_and_rows_1_to_8_and_tp_1_to_32(name):
    config = mk.preset(name).first_layers(2)
    for tp in (1, 8, 32):
        widths = [config.heads, config.hidden, config.vocab]
        widths += [config.ffn] if config.dense_layers else []
        widths += [config.expert_ffn] if config.moe_layers else []
        K = config.kv_heads
        if any(w % tp for w in widths) or (K % tp and tp % K):
            with pytest.raises(ValueError, match=f"tp={tp}"):
                simulated_step(config, "tpu7x", tp=tp)
            continue
        for batch, rows in ((1, 1), (8, 1), (1, 8)):
            s = simulated_step(config, "tpu7x", batch=batch, rows=rows, context=32, tp=tp)
            assert s.step_s > 0 and math.isfinite(s.tokens_per_s_per_user())


# -- Inputs, sweeps, published ----------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(chip="gb200"), "chip='gb200' is a gpu"), (dict(batch=0), "batch=0"),
    (dict(chip=None), "a plan made for no chip"),
    (dict(context=-1), "position=-1"), (dict(tp=0), "tp=0"),
    (dict(experts_active=0), "experts_active=0"), (dict(block=(3, 128)), "block="),
    (dict(experts_active=2.5), r"experts_active=2.5 must be in \[1, "),
    (dict(cross_layer_prefetch="no"), "cross_layer_prefetch='no' must be True or False"),
    (dict(preset="tiny", experts_active=1), "experts_active=1: tiny has no MoE layers")])
def test_simulate_rejects_bad_inputs_naming_field_and_value(kwargs, match):
    kwargs = {"chip": "v6e", "preset": "tiny-moe"} | kwargs
    config = mk.preset(kwargs.pop("preset"))
    with pytest.raises(ValueError, match=match):
        simulated_step(config, kwargs.pop("chip"), **kwargs)


def test_simulate_replays_a_plan_made_for_a_chip_at_a_position():
    """The plan is the simulator's one argument of the step: its chip (the ring and feeds
    are that chip's) and its position (the cache a sequence reads) are the plan's."""
    config = mk.preset("tiny")
    with pytest.raises(ValueError, match="plan is a ModelConfig; it must be a DecodePlan"):
        sim.simulate(config)
    with pytest.raises(ValueError, match="a plan made for no chip"):
        sim.simulate(DecodePlan.make(config, position=0))
    with pytest.raises(ValueError, match=r"a plan of a cache of context=256: .*position="):
        sim.simulate(DecodePlan.make(config, chip="v6e", context=256))
    plan = DecodePlan.make(config, chip="v6e", rows=2, position=30)
    step = sim.simulate(plan)
    assert step.plan is plan and (step.context, step.rows) == (30, 2)


@pytest.mark.parametrize("accepted", [0, -1, float("nan"), float("inf"), 3, "2", True])
def test_tokens_per_second_refuses_an_acceptance_outside_0_to_rows(accepted):
    """A sequence keeps at most T tokens of a step (issue 65: nan and 0 came back as
    tokens per second); 2 of T = 2 is the whole step."""
    step = simulated_step(mk.preset("tiny"), "v6e", rows=2)
    with pytest.raises(ValueError, match=r"accepted=.* must be a finite number in \(0, 2\]"):
        step.tokens_per_s_per_user(accepted)
    assert step.tokens_per_s_per_user(2) == step.tokens_per_s_per_user() == 2 / step.step_s


def test_a_packed_fp4_stream_moves_half_a_byte_a_value_and_a_scale_byte_per_32():
    block = BlockSizes(slots=2, tile_rows=128, tile_cols=128)
    bf16 = sim.replay_matmul(TileStream.build(block, [("w", 512, 512)]), "v6e")
    fp4 = sim.replay_matmul(TileStream.build(block, [("w", 512, 512)], schemes={"w": "fp4"}),
                            "v6e")
    assert bf16.dma_bytes == 16 * 128 * 128 * 2
    assert fp4.dma_bytes == 16 * 128 * 128 * (1 / 2 + 1 / 32) == bf16.dma_bytes * 17 / 64
    with pytest.raises(ValueError, match="scheme='fp3'"):
        TileStream.build(block, [("w", 512, 512)], schemes={"w": "fp3"})


@pytest.mark.parametrize("name,kwargs", [("kimi-k3-like", dict(rows=8, tp=32)),
                                         ("qwen3.5-27b", dict(rows=8, tp=8))])
def test_fast_forwarded_bubbles_still_add_up_to_the_idle_time(name, kwargs):
    config = mk.preset(name).first_layers(2)
    for slots in (3, 16):
        plan = DecodePlan.make(config, tp=kwargs["tp"], rows=8, position=0, kernel=False)
        block = dataclasses.replace(plan.block, slots=slots)
        s = simulated_step(config, "tpu7x", block=block, **kwargs)
        idle = s.step_s - s.dma_bytes / s.hbm_bandwidth
        assert sum(s.bubble_share().values()) == pytest.approx(idle, rel=1e-9)


def test_the_chips_ring_keeps_hbm_busy_where_fewer_slots_than_littles_law_do_not():
    """The plan's ring for TPU7x covers RING_COVER_S (2 us, twice the latency) at one
    core's bandwidth: at a 1 us DMA latency qwen3-0.6b's HBM is >= 90 % busy (issue 14's
    bar), and so with the ring covering the latency alone; one slot fewer than that leaves
    it idle for a latency after every tile."""
    config = mk.preset("qwen3-0.6b")
    a = sim.Assumptions(dma_latency_s=1e-6)
    chip_ring = simulated_step(config, "tpu7x", context=1024, assumptions=a)
    slots = sim.latency_slots(config, "tpu7x", chip_ring.block, assumptions=a)

    def busy(n):
        return simulated_step(config, "tpu7x", context=1024, assumptions=a,
                              block=dataclasses.replace(chip_ring.block, slots=n)
                              ).hbm_utilisation

    assert chip_ring.block.slots > slots
    assert chip_ring.hbm_utilisation >= busy(slots) >= 0.9 > busy(slots - 1)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                                  "qwen3-30b-a3b"])
def test_every_single_core_preset_keeps_tpu7x_hbm_busy_at_one_microsecond(name):
    """Issue 14's bar on the plan's own ring, at B = 1, T = 1, S = 1024, a 1 us DMA
    latency and each weight tile at the tile cost table at the slow end of the bundle rate
    (`mk.cost.feed_costs`; the whole kernels' recorded loops: mk/data/tile_costs/single_core.json,
    notebook 11)."""
    s = simulated_step(mk.preset(name), "tpu7x", context=1024,
                       assumptions=sim.Assumptions(dma_latency_s=1e-6))
    assert s.hbm_utilisation >= 0.9, s.bubble_share()


@pytest.mark.parametrize("field, value, span", [
    ("dma_latency_s", math.inf, "[0, inf)"), ("ici_latency_s", math.inf, "[0, inf)"),
    ("dma_latency_s", "5e-7", "[0, inf)"), ("scalar_op_s", math.nan, "[0, inf)"),
    ("tile_issue_s", -1e-9, "[0, inf)"), ("hbm_share", 0, "(0, 1]"),
    ("vpu_flops_ratio", 1.5, "(0, 1]"), ("hbm_share", True, "(0, 1]"),
])
def test_assumptions_are_finite_typed_and_in_range_naming_the_field(field, value, span):
    with pytest.raises(ValueError, match=re.escape(
            f"Assumptions.{field}={value!r} must be a finite number in {span}")):
        sim.Assumptions(**{field: value})


@pytest.mark.parametrize("value", [math.inf, 285, [("int8", 128, 512, 300)]])
def test_assumptions_packed_bundles_must_be_a_tuple_of_entries(value):
    """Issue 65: a float or an int here raised "'float' object is not iterable" (a list
    would break the hashing every simulation cache keys on)."""
    with pytest.raises(ValueError, match=r"Assumptions.packed_bundles=.* must be a tuple"):
        sim.Assumptions(packed_bundles=value)
    assert sim.Assumptions(packed_bundles=(("int8", 128, 512, 300),)).packed_bundles


def test_simulate_refuses_a_routing_trace_of_another_model_as_predict_does():
    from mk.cost.routing_trace import RoutingTrace

    qwen = mk.preset("qwen3-30b-a3b")
    trace = RoutingTrace("tiny-kimi", 4, 2, ((2, 2, 2, 2),))  # one layer of 4 experts
    for config in (qwen, mk.preset("tiny")):  # a MoE model, and one with none
        with pytest.raises(ValueError, match="routing trace of 'tiny-kimi': MoE layers=1"):
            perf.predict(config, "v6e", routing=trace)
        with pytest.raises(ValueError, match="routing trace of 'tiny-kimi': MoE layers=1"):
            simulated_step(config, "v6e", routing=trace, experts_active=1)
