"""mk.step.plan: one device's decode step as data, held against the kernel's own DMAs.

The byte-count test runs one megakernel step in TPU interpret mode with every DMA the
kernel starts recorded where it starts (`mk.kernels.common.dma_log`: a host callback
under the same `pl.when` as the DMA, so a switched-off tile is not counted), for tiny,
tiny-kimi (MLA over its latent cache, KDA, a shared expert, the sigmoid router), tiny-hybrid,
tiny-moe and tiny-moe at tp 2 and 4 (a subprocess with virtual devices), and compares the
bytes per family with the plan's ledger (`DecodePlan.weight_bytes`), with the simulator's
replay of the same plan and with `mk.cost.perf.predict`, exactly. One sequence of one row
routes to exactly top-k experts per MoE layer, so the active experts are known.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.kernels import backend
from mk.step import megakernel
from mk.cost import perf, sim
from mk.model import quant, reference
from mk.step import shards
from mk.step import tensor_parallel as tpar
from mk.kernels.collectives import tp_mesh
from mk.model.chips import all_chips
from mk.kernels.common import (OTHERS_OVER_REPEAT_BYTES, PANEL_COLS, QUANT_TILE_ELEMENTS,
                              VMEM_HEADROOM, VMEM_ROOM, BlockSizes, Cut, dma_log)
from mk.step.plan import (RING_COVER_S, DecodePlan, capacity, default_block, ring_cover_s,
                             shard_config)
from mk.kernels.stream import TileStream, little_slots, ring_slots
from mk.step.step_bytes import WEIGHT_FAMILIES, family_of
from multidevice import run
from builders import simulated_step

POSITION = 37  # the one sequence's cached positions before its new row
SLOW = pytest.mark.slow


def _step_plan(name: str, tp: int, formats=None, **overrides) -> DecodePlan:
    config = dataclasses.replace(mk.preset(name), **overrides)
    return DecodePlan.make(config, tp=tp, batch=1, rows=1, context=config.max_context,
                           formats=formats)


def counted_moe(tp: int) -> dict:
    """`counted("tiny-moe", tp)`, the entry point of the subprocess (tests/multidevice.py)."""
    return counted("tiny-moe", tp)


def counted(name: str, tp: int, formats=None, **overrides) -> dict:
    """One megakernel step of `name` (its config's fields `overrides` replaced) on tp
    devices with every DMA recorded -> bytes per family, summed over the devices (runs in
    a subprocess when tp > 1); formats: the mk.model.quant schemes its params are quantised to
    first."""
    plan = _step_plan(name, tp, formats, **overrides)
    config = plan.config
    params = quant.quantize(config, mk.init_params(config), **(formats or {}))
    prompt = (jnp.arange(POSITION, dtype=jnp.int32) * 7 % config.vocab)[None]
    _, cache = reference.prefill(config, quant.dequantize(params), prompt,
                                 max_context=config.max_context)
    tokens, positions = jnp.array([[5]], jnp.int32), jnp.array([POSITION], jnp.int32)
    with dma_log(megakernel.traced_step) as log, backend.use("interpret"):
        weights = megakernel.prepare(plan, params)
        if tp == 1:
            out = megakernel.decode_step(plan, weights, cache, tokens, positions)
        else:
            out = tpar.decode_step(plan, weights,
                                   shards.shard_cache(config, cache, tp), tokens, positions,
                                   mesh=tp_mesh(tp))
        jax.block_until_ready(out)
    families: dict = {}
    for what, nbytes in log:
        families[family_of(what)] = families.get(family_of(what), 0) + nbytes
    return {f: np.array(b) for f, b in families.items()}


# CPU seconds: 17, ~34, 29, 50, 59, 79. CI runs the dense model (and, in
# tests/test_quant_shards.py, a packed MoE shard's bytes at tp 2); `make test-slow` Kimi's
# MLA, KDA, shared expert and sigmoid router (tiny-kimi), the hybrid (its linear weights
# and states) and the MoE model at tp 1, 2 and 4 (every family, the collectives' shard).
@pytest.mark.parametrize("name, tp", [("tiny", 1), pytest.param("tiny-kimi", 1, marks=SLOW),
                                      pytest.param("tiny-hybrid", 1, marks=SLOW),
                                      pytest.param("tiny-moe", 1, marks=SLOW),
                                      pytest.param("tiny-moe", 2, marks=SLOW),
                                      pytest.param("tiny-moe", 4, marks=SLOW)])
def test_the_kernel_moves_the_bytes_the_plan_the_simulator_and_perf_count(name, tp):
    got = counted(name, tp) if tp == 1 else run("test_plan:counted_moe", tp)
    got = {f: int(b) for f, b in got.items()}
    plan = _step_plan(name, tp)
    config, local = plan.config, plan.local
    active = config.experts_per_token if config.is_moe else 0  # one row: exactly top-k
    ledger = plan.weight_bytes(active)
    want = {f: tp * b for f, b in ledger.items() if b}
    replay = simulated_step(config, "v5e", batch=1, rows=1, context=POSITION, tp=tp,
                            block=plan.block, experts_active=active or None)
    roof = perf.predict(config, "v5e", batch=1, rows=1, context=POSITION, tp=tp,
                        routing="shared")
    assert {f: got[f] for f in want} == want  # every weight family the plan names
    assert {f: tp * b for f, b in replay.family_bytes().items()} == got  # KV included
    by_perf = dict(attention=roof.attention_bytes, norms=roof.norm_bytes,
                   dense_mlp=roof.dense_mlp_bytes, router=roof.router_bytes,
                   experts=roof.expert_bytes, lm_head=roof.lm_head_bytes,
                   linear=roof.linear_bytes)
    assert {f: b for f, b in by_perf.items() if b} == want
    states = plan.state_bytes()  # one row: read once, written once
    assert {f: got.get(f, 0) for f in states} == states == dict(
        state_read=roof.state_read_bytes, state_write=roof.state_write_bytes)
    kv = {"kv_read", "kv_write"} | ({f for f in states} if config.is_hybrid else set())
    assert set(got) == set(want) | kv
    # Switched-off segments are not counted: every layer's period holds the dense MLP's
    # tiles (and a shared expert's), but only the dense layers' (the MoE layers') move.
    if config.is_moe:
        row = 3 * local.hidden * 2  # bf16 bytes of a SwiGLU per unit of width
        moved = row * (len(local.dense_layers) * local.ffn
                       + len(local.moe_layers) * local.shared_expert_ffn)
        every_layer = row * local.layers * (local.ffn + local.shared_expert_ffn)
        assert tp * moved == got["dense_mlp"] < tp * every_layer


# CI: tiny with fp8 dense weights and an fp4 lm_head (CPU seconds ~17); `make test-slow`:
# tiny-moe with int4 experts (~50) and tiny with int8. Every scheme's tile bytes are also
# checked in CI by stage 01's test (tests/kernels/test_weight_streaming.py) and its bits
# per value in mk.cost.perf by tests/test_quant.py.
@pytest.mark.parametrize("name, formats", [
    ("tiny", dict(dense="fp8", lm_head="fp4")),
    pytest.param("tiny-moe", dict(dense="int8", experts="int4", lm_head="int4"), marks=SLOW),
    pytest.param("tiny", dict(dense="int8", lm_head="int8"), marks=SLOW)])
def test_quantised_tiles_move_the_packed_bytes_and_scales_the_plan_and_perf_count(
        name, formats):
    got = {f: int(b) for f, b in counted(name, 1, formats).items()}
    config = mk.preset(name)
    plan = DecodePlan.make(config, batch=1, rows=1, context=config.max_context,
                           formats=formats)
    active = config.experts_per_token if config.is_moe else 0
    want = {f: b for f, b in plan.weight_bytes(active).items() if b}
    assert {f: got[f] for f in want} == want
    replay = simulated_step(config, "v5e", batch=1, rows=1, context=POSITION,
                            block=plan.block, experts_active=active or None, formats=formats)
    assert replay.family_bytes() == got
    roof = perf.predict(config, "v5e", batch=1, rows=1, context=POSITION,
                        routing="shared", formats=formats)
    assert roof.attention_bytes == want["attention"] and roof.lm_head_bytes == want["lm_head"]
    # packed data plus the tile's scale block, per element: int8 1 + 4/tile_rows, fp8
    # 1 + 4/128^2, int4 1/2 + 2/128, fp4 1/2 + 1/32 bytes
    plain = DecodePlan.make(config, batch=1, rows=1, context=config.max_context,
                            block=plan.block)  # the same tiles (and padding), unquantised
    elements = {f: b / 2 for f, b in plain.weight_bytes(active).items()}
    per = {"int8": 1 + 4 / plan.block.tile_rows, "fp8": 1 + 4 / 128 ** 2,
           "int4": 0.5 + 2 / 128, "fp4": 0.5 + 1 / 32}
    for family, scheme in (("attention", formats["dense"]), ("lm_head", formats["lm_head"]),
                           ("experts", formats.get("experts"))):
        if scheme:
            assert got[family] == pytest.approx(elements[family] * per[scheme], rel=1e-12)


def test_quantised_plans_refuse_what_is_not_built_by_name():
    config = mk.preset("tiny-moe")
    with pytest.raises(ValueError, match=r"we_gate \(fp8\).*tp=4 cuts a scale block"):
        DecodePlan.make(dataclasses.replace(config, expert_ffn=768), tp=4, batch=1,
                        context=256, formats={"experts": "fp8"})
    with pytest.raises(ValueError, match="scheme='int3'|'int3'"):
        DecodePlan.make(config, batch=1, context=256, formats={"dense": "int3"})
    with pytest.raises(ValueError, match="group='mlp'"):
        DecodePlan.make(config, batch=1, context=256, formats={"mlp": "int8"})
    low_rank_q = dataclasses.replace(mk.preset("tiny-kimi"), q_rank=128)
    with pytest.raises(NotImplementedError, match=r"wq \(mla, path 'dma'\)"):
        DecodePlan.make(low_rank_q, batch=1, context=256, formats={"dense": "int8"})
    assert DecodePlan.make(low_rank_q, tp=2, batch=1, context=256,
                           formats={"experts": "fp4"}).stream.schemes == ("fp4",)
    plan = DecodePlan.make(config, batch=1, context=256, formats={"experts": "fp4"})
    rows, cols = dict(plan.block.tiles)["we_gate"]  # the experts' own tiles, packed
    packed = f"ring_fp4_{rows}x{cols}"
    assert {"ring", packed, f"{packed}_scales"} <= set(plan.buffers)
    assert plan.buffers[packed].shape == (plan.block.slots, rows // 2, cols)
    every = DecodePlan.make(config, batch=1, context=256,
                            formats=dict(dense="int8", experts="int8", lm_head="int8"))
    assert "ring" not in every.buffers  # no plain segment: no bf16 slots


FEED_FORMATS = dict(dense="int8", experts="fp4", lm_head="fp8")


@pytest.mark.parametrize("chip, fed", [("tpu7x", "fp8"), ("v6e", "bf16"), ("v5e", "bf16"),
                                       (None, "bf16")])
def test_each_chip_feeds_fp8_and_fp4_as_its_mxu_takes_them_and_int_as_bf16(chip, fed):
    """The plan's feeds follow the chip's `mxu_feeds`: fp8 and fp4 fed fp8 where the MXU
    takes e4m3 (TPU7x), bf16 elsewhere and without a chip; int8 always bf16. The stream's
    segments carry them, and the bytes and buffers do not depend on them."""
    config = mk.preset("tiny-moe")
    plan = DecodePlan.make(config, batch=1, context=256, formats=FEED_FORMATS, chip=chip)
    assert dict(plan.feeds) == dict(dense="bf16", experts=fed, lm_head=fed)
    got = {s.name: s.feed for s in plan.stream.segments + plan.stream.tail if s.scheme}
    assert got == {n: f for n, f in quant.schemes_of(dict(plan.feeds)).items() if n in got}
    assert set(got.values()) == {"bf16", fed}
    bf16 = DecodePlan.make(config, batch=1, context=256, formats=FEED_FORMATS, chip=chip,
                           feeds=dict(experts="bf16", lm_head="bf16"))
    assert dict(bf16.feeds) == dict.fromkeys(FEED_FORMATS, "bf16")
    assert (bf16.buffers, bf16.weight_bytes()) == (plan.buffers, plan.weight_bytes())


def test_a_feed_the_chip_or_the_scheme_cannot_take_is_refused_before_tracing():
    config = mk.preset("tiny-moe")
    make = functools.partial(DecodePlan.make, config, batch=1, context=256,
                             formats=FEED_FORMATS)
    with pytest.raises(ValueError, match=r"feeds\['experts'\]='fp8': v6e's MXU takes "
                                         r"\('bf16',\) \(mxu_feeds"):
        make(chip="v6e", feeds=dict(experts="fp8"))
    with pytest.raises(ValueError, match=r"feeds\['dense'\]='fp8': int8 weights feed the "
                                         r"MXU exactly only as \('bf16',\)"):
        make(chip="tpu7x", feeds=dict(dense="fp8"))
    with pytest.raises(ValueError, match=r"feeds\['experts'\]='fp16'"):
        make(feeds=dict(experts="fp16"))
    with pytest.raises(ValueError, match=r"feeds\['lm_head'\]='fp8': lm_head is not "
                                         r"stored packed"):
        make(formats=dict(experts="fp4"), feeds=dict(lm_head="fp8"))
    assert dict(make(feeds=dict(experts="fp8")).feeds)["experts"] == "fp8"  # no chip: any


def test_weight_bytes_are_the_shards_matrices_padded_and_the_norms_in_float32():
    plan = _step_plan("tiny-moe", 4)
    local, D = plan.local, plan.local.hidden
    assert local.expert_ffn == 128 and plan.config.expert_ffn // 4 == 32  # padded 4x
    assert local.own_width("expert_ffn") == 32
    assert local.kv_heads == 1 and plan.config.kv_heads == 2  # replicated at tp > K
    bytes_ = plan.weight_bytes(experts=2)
    # gate|up joined: 32 + 32 columns in one 128-lane tile; down's 32 rows padded to 128
    assert bytes_["experts"] == len(local.moe_layers) * 2 * 2 * D * 128 * 2
    assert bytes_["norms"] == (local.layers * 2 * (D + local.head_dim) + D) * 4
    assert bytes_["lm_head"] == D * plan.vocab * 2
    assert set(bytes_) == set(WEIGHT_FAMILIES)


def test_every_buffer_is_named_once_and_the_scratch_comes_from_them():
    plan = _step_plan("tiny-moe", 2)
    scratch = plan.scratch()
    assert set(scratch) == {"layer", "vectors", "attention", "all_reduce", "argmax"}
    vmem = [n for n, b in plan.buffers.items() if b.group != "operand"]
    leaves = [k for group in scratch.values() for k, v in group.items()
              if v is not None and not str(v).startswith("SemaphoreType")]
    assert len(vmem) <= len(leaves)
    assert plan.group("operand").keys() == {"x", "logits", "next_tokens"}
    assert plan.buffers["ring"].shape == (plan.block.slots, plan.block.tile_rows,
                                          plan.block.tile_cols)


def test_the_default_tiling_is_one_rule():
    config = mk.preset("qwen3-8b")
    plan = DecodePlan.make(config, batch=8, context=4096)
    assert plan.block == default_block(config, 4096) == BlockSizes(
        slots=3, tile_rows=2048, tile_cols=512, kv_tile=256,  # 2 MiB, panels of 512
        kv_slots=7)  # 6 KV tiles of 1 MiB (K and V of 8 heads) hold the ring's 6 MiB
    # for a chip, the ring Little's law asks for: one core's bandwidth x 2 us in whole
    # tiles, plus one computing and one landing
    spec = mk.chip("tpu7x")
    deep = DecodePlan.make(config, batch=8, context=4096, chip=spec).block
    assert deep.slots == little_slots(spec.hbm_bw / 2, RING_COVER_S, 2 * 2**20) == 6
    assert deep.kv_slots == 13  # 12 MiB of KV tiles, as the ring's
    assert default_block(mk.preset("tiny"), 64).kv_tile == 64  # capped by the cache
    assert capacity(4097) == 4352 and capacity(100) == 112
    assert DecodePlan.make(config, batch=8, position=4096).block == dataclasses.replace(
        plan.block)


def test_tiles_feed_every_mxu_and_experts_take_tiles_of_their_own():
    """PANEL_COLS is every TPU's MXUs x their width (data/chips.csv). Of tiles as large,
    the plan takes the one whose output panels feed every MXU: qwen3-4b's 1280 x 512, not
    2560 x 256 (whose loops issued in 1.06x their DMA at TPU7x's 1.03 G bundles/s; now 0.89x).
    qwen3-30b-a3b's expert slots take 2048 x 768 tiles of their own beside 2048 x 512
    ones (2048 x 256 for all issued in 1.22x; now 0.68x and 0.81x), in a ring buffer of
    their own on the one slot index. Kimi K3's TP32 shard's FP4 experts, fed fp8 on TPU7x
    (never dequantised whole, so not held to QUANT_TILE_ELEMENTS), take one tile a matrix
    (gate and up [7168, 128], down [128, 7168]: packed, never transposed) and the other
    matrices tiles of at most OTHERS_OVER_REPEAT_BYTES (2) x their bytes (3584 x 128 bf16;
    1792 x 128 of no more bytes before: their loops issued in up to 1.48x their DMA at
    1.03 G bundles/s, now 1.19x), so a run of expert tiles keeps bytes in flight near the others'
    on the one slot index (all shared 128 x 128 before, 850 slots); fed bf16 (v6e) its
    experts' tiles are held to QUANT_TILE_ELEMENTS and the rest's shrink to match."""
    assert {s.mxus_per_core * s.mxu_rows for s in all_chips() if s.kind == "tpu"} == {
        PANEL_COLS}
    four = DecodePlan.make(mk.preset("qwen3-4b"), context=1024, chip="tpu7x").block
    assert (four.tile_rows, four.tile_cols, four.tiles) == (1280, 512, ())
    plan = DecodePlan.make(mk.preset("qwen3-30b-a3b"), context=1024, chip="tpu7x")
    b = plan.block
    assert (b.tile_rows, b.tile_cols) == (2048, 512)
    assert dict(b.tiles) == dict.fromkeys(("we_gate", "we_up", "we_down"), (2048, 768))
    assert [(n, x.shape) for n, x in plan.buffers.items() if n.startswith("ring")] == [
        ("ring", (b.slots, 2048, 512)), ("ring_2048x768", (b.slots, 2048, 768))]
    assert plan.stream.segment("we_down").transposed  # [768, 2048] stored [2048, 768]
    kimi = DecodePlan.make(mk.preset("kimi-k2-shaped"), tp=32, context=1152, chip="tpu7x",
                           kernel=False).block
    assert (kimi.tile_rows, kimi.tile_cols, dict(kimi.tiles)) == (3584, 128, {
        "we_gate_up": (7168, 128), "we_down": (128, 7168)})  # gate|up: 64 + 64 columns
    expert, most = quant.tile_bytes("fp4", 7168, 128), OTHERS_OVER_REPEAT_BYTES
    assert quant.tile_bytes("fp4", 128, 7168) == expert
    assert most * expert >= 3584 * 128 * 2 > most * expert / 2
    fed_bf16 = DecodePlan.make(mk.preset("kimi-k2-shaped"), tp=32, context=1152, chip="v6e",
                               kernel=False).block
    assert dict(fed_bf16.tiles)["we_gate_up"][0] * 128 <= QUANT_TILE_ELEMENTS
    assert fed_bf16.tile_rows * fed_bf16.tile_cols * 2 <= most * quant.tile_bytes(
        "fp4", *dict(fed_bf16.tiles)["we_gate_up"])
    for tiles, field in (((("wq", (100, 128)),), "wq"), ((("wq", (128, 128)),) * 2, "twice")):
        with pytest.raises(ValueError, match=rf"BlockSizes.tiles.*{field}"):
            BlockSizes(tiles=tiles)
    for name in ("lm_head", "we_gatee"):  # padded to the block's tile; a typo
        with pytest.raises(ValueError, match=rf"BlockSizes.tiles names \['{name}'\]"):
            DecodePlan.make(mk.preset("tiny-moe"), context=128, block=BlockSizes(
                tile_rows=128, tile_cols=256, tiles=((name, (256, 128)),)))


def test_the_ring_holds_its_bytes_in_flight_over_the_streams_own_tiles():
    """Little's law counted over the stream's tile sequence (`ring_slots`): on tiles of one
    size it is `little_slots`; 4 small FP4 tiles among 60 plain ones cost 9 tiles more
    than the plain tiles' 8 of the bytes (the window must hold the FP4 run and 7 plain
    tiles), not the 31 FP4 tiles the smallest tile alone would ask for."""
    block = BlockSizes(tile_rows=128, tile_cols=128)
    plain, fp4 = 128 * 128 * 2, quant.tile_bytes("fp4", 128, 128)  # 32768, 8704 bytes
    uniform = TileStream.build(block, [("a", 128, 128 * 64)])
    assert ring_slots(uniform, 2, 8 * plain) == little_slots(1, 8 * plain, plain) == 10
    mixed = TileStream.build(block, [("a", 128, 128 * 30), ("b", 128, 128 * 4),
                                     ("c", 128, 128 * 30)], schemes={"b": "fp4"})
    assert [s.scheme for s in mixed.segments] == [None, "fp4", None]
    assert ring_slots(mixed, 2, 8 * plain) == 4 + 7 + 2  # 4 * fp4 + 7 * plain >= 8 * plain
    assert little_slots(1, 8 * plain, fp4) == 33
    # a window no run of a layer's period reaches: the period, plus 2
    assert ring_slots(mixed, 2, 64 * plain) == mixed.period + 2


@pytest.mark.parametrize("name, tp, batch, formats", [
    ("qwen3.5-27b", 8, 8, dict(dense="fp8", lm_head="int4")),
    ("qwen3.5-27b", 8, 8, dict(dense="int8", lm_head="fp4"))])
def test_a_packed_shards_default_ring_is_shortened_to_leave_mosaic_its_room(
        name, tp, batch, formats):
    """Plain and packed tiles share the ring's slot index, so every ring buffer is as deep
    as Little's law asks over the small packed tiles: over TPU7x's VMEM (the 27B's TP8
    shard: 876 slots, 71 MiB). The default plan's ring is the deepest whose buffers
    leave Mosaic its room (1.5 x buffers + 8 MiB within the core's 64 MiB). (Kimi K3's
    TP32 shard keeps the ring covering RING_COVER_S, which fits its VMEM though not that
    room: tests/test_tensor_parallel.py compiles it.)"""
    config, spec = mk.preset(name), mk.chip("tpu7x")
    plan = DecodePlan.make(config, tp=tp, batch=batch, context=4096, chip=spec,
                           formats=formats)
    little = ring_slots(plan.stream, 2, spec.device_hbm_bw
                        * ring_cover_s(plan.local, tp, batch, spec))
    assert 2 <= plan.block.slots < little
    assert plan.stream.schemes and None in {q for q, _ in plan.stream.storages}
    total = sum(b.bytes for b in plan.buffers.values())
    assert total * VMEM_HEADROOM + VMEM_ROOM <= spec.vmem_bytes
    assert plan.fits(spec).vmem is not None
    deeper = DecodePlan.make(config, tp=tp, batch=batch, context=4096, chip=spec,
                             formats=formats, block=dataclasses.replace(
                                 plan.block, slots=plan.block.slots + 1))
    assert sum(b.bytes for b in deeper.buffers.values()) * VMEM_HEADROOM + VMEM_ROOM \
        > spec.vmem_bytes


def test_narrow_weights_moved_by_dma_are_held_transposed():
    """`mk.model.weights.TRANSPOSED`: a router's experts and a linear layer's per-head gates are a
    few columns; held as rows they fill a few sublanes (Kimi K3's TP32 lin_b, 2 x 7168:
    16 bf16 sublanes, 224 KiB a slot, where [7168, 2] would pad each row to 128 lanes,
    1.75 MiB), and the megakernel's prepared weights are laid out so."""
    k3 = DecodePlan.make(mk.preset("kimi-k2-shaped"), tp=32, batch=1, rows=8, context=2048,
                         chip="tpu7x")
    lin_b, router = k3.buffers["linear.lin_b"], k3.buffers["router"]
    assert (lin_b.shape, router.shape) == ((2, 2, 7168), (28, 7168))
    assert (lin_b.bytes, router.bytes) == (2 * 16 * 7168 * 2, 32 * 7168 * 2)
    config = mk.preset("tiny-hybrid")
    params = mk.init_params(config)
    weights = megakernel.prepare(DecodePlan.make(config, context=64), params)
    for name in ("lin_a", "lin_b"):
        np.testing.assert_array_equal(weights[name], params[name].swapaxes(-1, -2))


def test_a_default_ring_that_cannot_fit_at_two_slots_is_refused_naming_the_buffers():
    """Never a kernel's plan over the chip's VMEM by default: when even a 2-slot ring
    leaves the step's buffers over a core's VMEM, the plan raises, naming the biggest
    buffers; the simulator's plan keeps the ring Little's law asks for and its fit names
    them."""
    small = dataclasses.replace(mk.chip("tpu7x"), vmem_bytes=8 * 2**20)
    with pytest.raises(ValueError, match=r"qwen3-8b: megakernel qwen3-8b \(2-slot ring\): "
                                         r"VMEM buffers need [\d.]+ MiB, over tpu7x's 8 MiB "
                                         r"per core; biggest: .*ring \(2, 2048, 512\)"):
        DecodePlan.make(mk.preset("qwen3-8b"), batch=8, context=4096, chip=small)
    replayed = DecodePlan.make(mk.preset("qwen3-8b"), batch=8, context=4096, chip=small,
                               kernel=False)  # the simulator's: fits() says the same
    assert replayed.block == DecodePlan.make(mk.preset("qwen3-8b"), batch=8, context=4096,
                                             chip="tpu7x").block  # Little's law's ring
    assert "VMEM buffers need" in replayed.fits(small).error


def test_a_presets_formats_are_charged_and_packed_at_any_tp():
    """kimi-k2-shaped stores its experts in FP4 (`formats`): its plan at tp 32 streams them
    packed (each device's shard of the packed experts, `mk.step.shards`) and charges every
    expert element mk.model.quant's packed FP4 bytes, half a byte and a scale byte per 32, on
    the same tiles as formats={} (bf16)."""
    k3 = mk.preset("kimi-k2-shaped").first_layers(2)
    assert k3.formats == (("experts", "fp4"),)
    fp4 = DecodePlan.make(k3, tp=32, batch=1, context=256)
    bf16 = DecodePlan.make(k3, tp=32, batch=1, context=256, formats={}, block=fp4.block)
    assert fp4.stream.schemes == ("fp4",) and bf16.stream.schemes == ()
    assert dict(fp4.formats) == {"experts": "fp4"} and bf16.formats == ()
    got, plain = fp4.weight_bytes(), bf16.weight_bytes()
    assert got["experts"] == plain["experts"] / 2 * (1 / 2 + 1 / 32)
    assert {f: b for f, b in got.items() if f != "experts"} == {
        f: b for f, b in plain.items() if f != "experts"}
    assert fp4.hbm_bytes() < bf16.hbm_bytes()


@pytest.mark.parametrize("name, tp", [("qwen3-0.6b", 1), ("qwen3-4b", 1), ("qwen3-8b", 1),
                                      ("qwen3-30b-a3b", 1), ("qwen3.5-27b", 8),
                                      ("kimi-k3-like", 32)])
def test_a_shard_streams_tiles_of_a_mebibyte_or_more_cut_d_major(name, tp):
    """Every matrix of the shard is cut by one tile of >= 1 MiB of bf16 (issue 14: 128 x
    128, 32 KiB, was what divided both sides of every matrix of a TP shard): the
    row-sharded [narrow, D] ones transposed, every tile D rows or a divisor of D."""
    config = mk.preset(name)  # kimi-k3-like's kernel at TP32 streams bf16 experts
    plan = DecodePlan.make(config, tp=tp, batch=1, context=1024, formats={})
    block, D = plan.block, config.hidden
    assert block.tile_rows * block.tile_cols * 2 >= 2**20
    assert D % block.tile_rows == 0
    for seg in plan.stream.segments + plan.stream.tail:
        K, N = plan.stream.shape(seg)
        assert seg.transposed == (K % block.tile_rows != 0), seg
        assert D in (K, N), seg


def test_a_matrix_is_stored_transposed_only_when_its_transpose_is_what_the_tiles_cut():
    block = BlockSizes(tile_rows=512, tile_cols=128)
    assert block.cut("w", 1024, 256) == Cut(False, 2, 2)
    assert block.cut("wo", 256, 1024) == Cut(True, 2, 2)  # stored [1024, 256]
    with pytest.raises(ValueError,
                       match=r"weight we \[256, 1024\] \(a quantised weight is never"):
        block.cut("we", 256, 1024, transpose=False)
    with pytest.raises(ValueError, match=r"nor its transpose \[384, 384\]"):
        block.cut("w", 384, 384)


def test_the_simulator_replays_the_kernels_shard():
    config = mk.preset("qwen3-30b-a3b")
    s = simulated_step(config, "tpu7x", batch=8, context=1024, tp=4)
    assert s.plan.local == shard_config(config, 4)
    assert s.plan.local.experts == config.experts  # every expert on every device
    assert s.plan.local.expert_ffn == 256  # 768 / 4 = 192, padded to two lane tiles


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tp=3 must be a power of two"),
    (dict(batch=0), "batch=0 must be a positive integer"),
    (dict(context=100, block=BlockSizes(kv_tile=128)), "context=100 is not a multiple"),
    (dict(block=BlockSizes(tile_rows=384, tile_cols=384)), r"weight wq \[256, 512\]"),
])
def test_a_plan_the_kernel_cannot_run_is_refused_with_the_field(kwargs, message):
    args = dict(batch=1, context=128) | kwargs
    with pytest.raises(ValueError, match=message):
        DecodePlan.make(mk.preset("tiny"), **args)


def test_a_hybrid_shards_its_linear_heads_and_output_gate_and_names_what_does_not_split():
    """Qwen3.5 at tp=2: wq_gate split as wq, each linear layer by its key and value heads
    (their conv channels, state and out_proj rows with them); Nk=1 cannot split."""
    config = dataclasses.replace(mk.preset("tiny-hybrid"), linear_key_heads=2,
                                 linear_value_heads=4)
    plan = DecodePlan.make(config, tp=2, batch=1, context=128)
    local, shapes = plan.local, {s.name: s for s in plan.stream.segments}
    assert (local.linear_key_heads, local.linear_value_heads) == (1, 2)
    shape = plan.stream.shape
    assert shape(shapes["wq_gate"]) == shape(shapes["wq"])
    assert shape(shapes["lin_qkv"])[1] == config.conv_channels // 2
    assert shape(shapes["lin_out"])[0] == config.linear_value_width // 2
    assert plan.state_bytes()["state_read"] == mk.model.cache.state_bytes_per_sequence(config) // 2
    with pytest.raises(ValueError, match="linear_key_heads=1 is not a multiple of tp=2"):
        DecodePlan.make(mk.preset("tiny-hybrid"), tp=2, batch=1, context=128)


def test_the_layers_program_order_is_data_the_kinds_declare_and_the_simulator_walks(
        monkeypatch):
    """`layer_body` runs LAYER_PHASES in order, each kind in the phases it declares; a
    kind declaring a phase outside the list (which neither the kernel nor the simulator
    would run) is refused, and the simulator names a phase it has no cost model for."""
    from mk.kinds.base import LAYER_PHASES
    from mk.kinds.layers import KINDS, check_kind
    from mk.kinds.mlp.kinds import MoE

    for kind in KINDS:
        assert check_kind(kind) is kind

    class Stray(MoE):
        phases = ("mlp", "after_lm_head")

    with pytest.raises(ValueError, match="layer kind moe: .*'after_lm_head'.* among "
                                         "LAYER_PHASES"):
        check_kind(Stray)
    monkeypatch.setattr(sim, "LAYER_PHASES", (*LAYER_PHASES, "new_phase"))
    with pytest.raises(ValueError, match="no cost model for layer phase 'new_phase'"):
        simulated_step(mk.preset("tiny"), "v5e")
