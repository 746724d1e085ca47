"""Stage 01: the streamed matmul against mk.model.ops.matmul, race-free, for every slot count of the
teaching progression and every quantised scheme and MXU feed (its oracle
`mk.model.unpack.oracle_dtype`; tpu7x compiles and pushes of the fp8 feed); planted ring bugs
prove the race check and the DMA bookkeeping check (`strict_dma`) can fail; the VMEM budget
and the TPU compiler both reject an oversized ring.

Interpret mode checks numerics, DMA/semaphore pairing (every start waited for exactly
once, no semaphore count left at exit) and races; it says nothing about time or the
scoped VMEM limit. The compile tests cover Mosaic lowering and capacity.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mk
from mk.kernels import backend
from mk.measure import exactness, tpu
from mk.model import ops, quant, unpack
from mk.kernels.common import BlockSizes, default_block, dma_log, vmem_budget
from mk.step.plan import DecodePlan
from mk.kinds.layers import kinds_at, layer_kinds
from mk.kernels.ring import Ring, ring_layout
from mk.kernels.stream import TileStream, rivals
from mk.kernels.weight_streaming import stream_matmul, stream_matmul_buffers
from tolerances import TOLERANCE as ALL_TOLERANCES

TOLERANCE = ALL_TOLERANCES["matmul"]


def _operands(M, K, N, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (M, K), jnp.float32),
            jax.random.normal(kw, (K, N), jnp.float32).astype(dtype))


def _run(x, w, block):
    with backend.use("interpret", detect_races=True, strict_dma=True):
        y = jax.block_until_ready(stream_matmul(x, w, block=block))
    return y, backend.races_found()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_every_slot_count_matches_the_reference_without_races(slots, dtype):
    x, w = _operands(8, 384, 256, dtype)
    y, races = _run(x, w, BlockSizes(slots=slots, tile_rows=128, tile_cols=128))
    np.testing.assert_allclose(y, ops.matmul(x, w), **TOLERANCE[dtype])
    assert not races


FEEDS = [(scheme, feed) for scheme in quant.SCHEMES for feed in unpack.FEEDABLE[scheme]]


def _oracle(x, q, feed=None):
    """The reference's product with `q` dequantised as its feed multiplies it (int8 and
    int4: codes and scales, `mk.model.unpack.scaled_weight`; the others
    `mk.model.unpack.oracle_dtype`; None: rounded to bf16), x rounded to bf16 as the kernel rounds
    it."""
    if feed is not None and q.scheme in unpack.INT_SCHEMES:
        return ops.matmul(x, unpack.scaled_weight(q.scheme, q.data, q.scale, jnp.bfloat16))
    w = unpack.dequantize_tile(q.scheme, q.data, q.scale)
    into = jnp.bfloat16 if feed is None else unpack.oracle_dtype(q.scheme, feed, jnp.bfloat16)
    return ops.matmul(x.astype(jnp.bfloat16), w.astype(into))


@pytest.mark.parametrize("scheme, feed", FEEDS)
def test_a_quantised_weight_streams_packed_tiles_and_scales_race_free(scheme, feed):
    """Each tile is two DMAs on its slot's semaphore (packed data, scale block), both
    waited for (strict_dma), and reaches the MXU as its feed says (int8 and int4: their
    codes, scales on the product; fp8 and fp4 fed bf16: dequantised in VMEM; fed fp8: e4m3
    codes, one product per 128 rows, 256 rows of 384 so fp4's 32-row groups and fp8's
    and int4's 128-row blocks straddle tiles' edges); the product is the reference's on
    `mk.model.unpack.oracle_dtype`'s weights, and where those are float32 visibly not the
    product of the weights rounded to bf16; the DMAs move `mk.model.quant.tile_bytes` per tile
    whatever the feed."""
    x, w = _operands(8, 384, 256, "float32")
    q = quant.quantize_weight(w, scheme)
    block = BlockSizes(slots=3, tile_rows=128, tile_cols=128)
    with dma_log() as log, backend.use("interpret", detect_races=True, strict_dma=True):
        y = jax.block_until_ready(stream_matmul(x, q, block=block, feed=feed))
    exact = unpack.oracle_dtype(scheme, feed, jnp.bfloat16) == jnp.bfloat16
    np.testing.assert_allclose(y, _oracle(x, q, feed), **TOLERANCE["float32"])
    assert not backend.races_found()
    assert sum(n for _, n in log) == 3 * 2 * quant.tile_bytes(scheme, 128, 128)
    if not exact:  # int8, int4, fp8 fed fp8: bf16-rounded weights give another product
        assert np.abs(np.asarray(y - _oracle(x, q))).max() > 100 * (
            TOLERANCE["float32"]["atol"] + TOLERANCE["float32"]["rtol"] * np.abs(y).max())


@pytest.mark.parametrize("scheme, feed", FEEDS)
def test_a_float32_kernels_every_feed_multiplies_at_highest_precision(scheme, feed):
    """Every scheme and feed of a float32 kernel multiplies as float32 at HIGHEST
    (`mk.model.ops.exact`): at default precision a chip multiplies in one bf16 pass where
    interpret mode does not (`mk.measure.exactness`). Before `mk.model.unpack.fp8_product` converted
    its codes, fp8 and fp4 fed fp8 did."""
    block = BlockSizes(slots=2, tile_rows=256, tile_cols=256)
    call = functools.partial(stream_matmul, block=block, dtype=jnp.float32, feed=feed)
    assert exactness.default_precision_f32_dots(
        call, jax.ShapeDtypeStruct((8, 512), jnp.float32),
        quant.abstract_weight((512, 256), scheme)) == []


def test_a_feed_a_scheme_cannot_reach_exactly_is_refused_by_name():
    x, w = _operands(8, 256, 256, "float32")
    with pytest.raises(ValueError, match=r"feed='fp8': int8 feeds as \('bf16',\)"):
        stream_matmul(x, quant.quantize_weight(w, "int8"), feed="fp8")
    with pytest.raises(ValueError, match=r"feed='fp8': a plain float32 weight"):
        stream_matmul(x, w, feed="fp8")


@pytest.mark.parametrize("scheme", ["fp8", "fp4"])
def test_fp8_fed_tiles_compile_for_tpu7x(scheme):
    """bf16 x float8_e4m3fn lowers for TPU7x at a shard's tile (4096 x 256, 32 fp8 scale
    blocks or 128 fp4 groups per tile): the path `DecodePlan.make` chooses there."""
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    q = quant.abstract_weight((4096, 1024), scheme)
    block = BlockSizes(slots=3, tile_rows=4096, tile_cols=256)
    report = tpu.compile_for_chip(functools.partial(stream_matmul, block=block, feed="fp8"),
                                  [x, q], "tpu7x")
    assert report.ok, report.error


@settings(max_examples=6, deadline=None)
@given(M=st.integers(1, 64), k_tiles=st.integers(1, 3), n_tiles=st.integers(1, 3),
       slots=st.integers(2, 4))
def test_any_small_shape_matches_the_reference(M, k_tiles, n_tiles, slots):
    x, w = _operands(M, 128 * k_tiles, 128 * n_tiles, "bfloat16", seed=M)
    y, races = _run(x, w, BlockSizes(slots=slots, tile_rows=128, tile_cols=128))
    np.testing.assert_allclose(y, ops.matmul(x, w), **TOLERANCE["bfloat16"])
    assert not races


def _prefetch_into_the_slot_being_read(x_vmem, w_hbm, out_vmem, ring_vmem, sems, *, stream):
    """The planted bug: tile g + slots is issued BEFORE tile g (same slot) is read.
    w_hbm is the weight in the ring's layout (`ring_layout`: tile g at w_hbm[g])."""
    ring = Ring(stream, {"w": lambda layer: (w_hbm, None)}, {"ring": ring_vmem}, sems)
    ring.prime()
    nk, tk, tn = (stream.segments[0].in_tiles, stream.block.tile_rows,
                  stream.block.tile_cols)

    def tile(g, acc):
        i, j = g % nk, g // nk
        n = stream.block.slots
        pltpu.make_async_copy(w_hbm.at[g], ring.slot(g % n), sems.at[g % n]).wait()
        ring.start(g + n)  # too early: the slot is still to be read
        part = jnp.dot(x_vmem[:, pl.ds(pl.multiple_of(i * tk, tk), tk)],
                       ring.slot(g % n)[...], preferred_element_type=jnp.float32)
        acc = jnp.where(i == 0, part, acc + part)
        out_vmem[:, pl.ds(pl.multiple_of(j * tn, tn), tn)] = acc
        return acc

    lax.fori_loop(0, stream.total, tile, jnp.zeros((x_vmem.shape[0], tn), jnp.float32))


def test_the_race_detector_catches_a_prefetch_into_the_slot_being_read():
    x, w = _operands(8, 256, 256, "float32")
    block = BlockSizes(slots=2, tile_rows=128, tile_cols=128)
    stream = TileStream.build(block, [("w", 256, 256)])
    w = ring_layout({"w": w}, stream)["w"]
    with backend.use("interpret", detect_races=True):  # a kernel is built inside the mode
        kernel = pl.pallas_call(
            functools.partial(_prefetch_into_the_slot_being_read, stream=stream),
            out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((2, 128, 128), jnp.float32),
                            pltpu.SemaphoreType.DMA((2,))])
        jax.block_until_ready(kernel(x, w))
    assert backend.races_found()


# -- The DMA bookkeeping check can fail ------------------------------------------------------
def _issue_the_last_tile_twice(matmul):
    """After its loops the ring issues the stream's last tile again: numerically right
    (it was consumed already) and no race (nothing reads it), but one DMA is never
    waited for."""
    def mutant(ring, *args, **kwargs):
        matmul(ring, *args, **kwargs)
        ring.start(jnp.int32(ring.stream.total - 1))
    return mutant


def _issue_the_first_tile_twice(prime):
    def mutant(ring, first=0):
        prime(ring, first)
        ring.start(jnp.int32(first))
    return mutant


RING_MUTANTS = {"last-tile-twice": ("matmul", _issue_the_last_tile_twice),
                "first-tile-twice": ("prime", _issue_the_first_tile_twice)}


@pytest.mark.parametrize("dma_execution_mode", ["on_wait", "eager"])
@pytest.mark.parametrize("mutant", RING_MUTANTS)
def test_the_dma_bookkeeping_check_catches_a_planted_ring_bug(mutant, dma_execution_mode,
                                                               monkeypatch):
    """The bug gives the right product without races: only the leftover DMA (on_wait) or
    semaphore count (eager) at kernel exit shows it, and strict_dma makes that an error."""
    name, plant = RING_MUTANTS[mutant]
    x, w = _operands(8, 384, 256, "float32")
    block = BlockSizes(slots=3, tile_rows=128, tile_cols=128)
    monkeypatch.setattr(Ring, name, plant(getattr(Ring, name)))
    with backend.use("interpret", detect_races=True, dma_execution_mode=dma_execution_mode):
        y = jax.block_until_ready(stream_matmul(x, w, block=block))
    np.testing.assert_allclose(y, ops.matmul(x, w), **TOLERANCE["float32"])
    assert not backend.races_found()
    assert backend.dma_leftovers()
    with pytest.raises(RuntimeError, match=r"DMA bookkeeping left at kernel exit"):
        _run(x, w, block)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_weight_only_its_transpose_tiles_streams_transposed_and_matches(dtype):
    """[384, 256] in 256 x 128 tiles: 384 rows do not divide, so the ring stores W^T
    [256, 384] (3 contraction steps of 128 per 256-wide output panel) and multiplies each
    step by its tile transposed; the DMAs still move the weight once."""
    x, w = _operands(8, 384, 256, dtype)
    block = BlockSizes(slots=2, tile_rows=256, tile_cols=128)
    assert TileStream.build(block, [("w", 384, 256)]).segments[0].transposed
    with dma_log() as log:
        y, races = _run(x, w, block)
    np.testing.assert_allclose(y, ops.matmul(x, w), **TOLERANCE[dtype])
    assert not races
    assert sum(n for _, n in log) == w.nbytes


@pytest.mark.parametrize("K, N", [(512, 256), (128, 512)])
@pytest.mark.parametrize("M", [1, 8, 24, 64])
def test_a_narrow_tile_stored_folded_matches_the_reference_without_races(M, K, N):
    """512 x 128 tiles are stored folded 4 ([128, 512], `mk.kernels.fold`), plain ([512,
    256]: x's column blocks stacked along M) and transposed ([128, 512]: x
    block-diagonal); M 1 and 8 stack all four blocks, 24 two, 64 none. The products are
    the reference's, the DMAs move the weight once, the slots hold the folded tile."""
    x, w = _operands(M, K, N, "bfloat16", seed=M)
    block = BlockSizes(slots=2, tile_rows=512, tile_cols=128)
    segment = TileStream.build(block, [("w", K, N)]).segments[0]
    assert (segment.fold, segment.transposed) == (4, K < 512)
    assert [b.shape for b in stream_matmul_buffers(M, K, N, w.dtype, block)
            if b.name == "ring"] == [(2, 128, 512)]
    with dma_log() as log:
        y, races = _run(x, w, block)
    np.testing.assert_allclose(y, ops.matmul(x, w), **TOLERANCE["bfloat16"])
    assert not races
    assert sum(n for _, n in log) == w.nbytes


def test_the_default_tile_is_the_largest_that_cuts_the_weight_ties_to_wide_panels():
    """Of the tiles as large, the one cutting more weights into output panels of
    PANEL_COLS (every MXU of a core at once), then the taller."""
    assert default_block([("w", 4096, 12288)]) == BlockSizes(tile_rows=2048, tile_cols=512)
    assert default_block([("w", 4096, 12288)], itemsize=4) == BlockSizes(
        tile_rows=1024, tile_cols=512)  # 2 MiB of float32
    shard = [("wq", 5120, 768), ("wk", 5120, 256), ("wo", 768, 5120)]  # a TP shard's
    # 5120 x 128 holds as many elements, but its panels are narrower (wq and wk 128 wide
    # plain against 256; wo's transposed 5120 and 2560 both feed every MXU)
    assert default_block(shard) == BlockSizes(tile_rows=2560, tile_cols=256)
    # where the panels are as wide, the taller tile
    assert default_block([("w", 5120, 128), ("wo", 128, 5120)]) == BlockSizes(
        tile_rows=5120, tile_cols=128)


def test_tiles_that_do_not_divide_the_weight_are_named():
    x, w = _operands(8, 384, 256, "float32")
    with pytest.raises(ValueError, match=r"weight w \[384, 256\], nor its transpose .* "
                                         r"tile_rows=256"):
        stream_matmul(x, w, block=BlockSizes(tile_rows=256, tile_cols=256))
    with pytest.raises(ValueError, match=r"BlockSizes.tile_cols=100 must be a positive "):
        BlockSizes(tile_cols=100)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compiles_for_tpu_at_qwen3_8b_mlp_shapes(chip):
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16)
    block = BlockSizes(slots=3, tile_rows=512, tile_cols=1024)
    budget = vmem_budget("stream_matmul", stream_matmul_buffers(8, 4096, 12288, w.dtype, block),
                         mk.chip(chip))
    report = tpu.compile_for_chip(functools.partial(stream_matmul, block=block), [x, w], chip,
                                  vmem=budget)
    assert report.ok, report.error
    assert report.code_bytes > 0


PUSHES = """import functools
import jax, jax.numpy as jnp
from mk.model import quant
from mk.measure import tpu
from mk.kernels.common import BlockSizes
from mk.kernels.weight_streaming import stream_matmul
block = BlockSizes(slots=2, tile_rows=256, tile_cols=256)
report = tpu.compile_for_chip(functools.partial(stream_matmul, block=block, feed="fp8"),
                              [jax.ShapeDtypeStruct((8, 512), jnp.bfloat16),
                               quant.abstract_weight((512, 256), "fp8")], "tpu7x")
assert report.ok, report.error
"""


def test_an_fp8_fed_tile_reaches_tpu7xs_mxu_as_e4m3_pushes(tmp_path):
    """In libtpu's bundles (`mk.cost.bundles`, a child compile), fed fp8 the weights are pushed
    into the MXU as e4m3 (`vmatpush1.f8e4m3`; fed bf16 they are `vmatpush1.bf16`): the fp8
    feed is native, not converted on the way."""
    from mk.cost import bundles
    jf = bundles.compile_with_dumps(PUSHES, [], tmp_path, phases=False)
    text = bundles.dump_file(jf, "mk_stream_matmul", "final_bundles.txt").read_text()
    assert {op.split(".")[1] for b in bundles.read_bundles(text) for op in b.ops
            if op.startswith("vmatpush")} == {"f8e4m3"}


def test_an_oversized_ring_is_refused_by_the_budget_and_by_the_compiler():
    M, K, N = 8, 4096, 20480
    block = BlockSizes(slots=5, tile_rows=4096, tile_cols=4096)  # 5 x 32 MiB of bf16 tiles
    buffers = stream_matmul_buffers(M, K, N, "bfloat16", block)
    with pytest.raises(ValueError, match=r"over tpu7x's 64 MiB per core; biggest: ring"):
        vmem_budget("stream_matmul", buffers, mk.chip("tpu7x"))
    report = tpu.compile_for_chip(
        functools.partial(stream_matmul, block=block),
        [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16)],
        "tpu7x")
    assert not report.ok and "RESOURCE_EXHAUSTED" in report.error


def _missed_followers(stream, slots, following):
    """(segment, layer, copy, tile g + slots past its end) whose owner `following` does
    not name, for each tile g of a segment's edge (its last `slots` tiles): as a whole and
    tile by tile (`Ring.matmul`'s edge loops)."""
    owner = {g: name.split("[")[0] for g, _, name, _, _ in stream.tiles()}
    missed = []
    for seg in stream.segments + stream.tail:
        edge = range(max(0, seg.tiles - slots), seg.tiles)
        names = {s.name for s in following(seg, slots)}
        each = {t: {s.name for s in following(seg, slots, (t,))} for t in edge}
        assert set().union(*each.values()) == names
        for layer in range(1 if seg in stream.tail else stream.layers):
            for copy in range(seg.copies):
                base = stream.base(layer, seg, copy)
                missed += [(seg.name, layer, copy, base + t + slots) for t in edge
                           if base + t + slots in owner
                           and owner[base + t + slots] not in each[t]]
    return missed


@pytest.mark.parametrize("name, tp", [("tiny-hybrid", 1), ("tiny-kimi", 1),
                                      ("qwen3.5-27b", 8), ("kimi-k2-shaped", 32)])
@pytest.mark.parametrize("slots", [2, 3, 19, 40])
def test_an_edge_tile_searches_the_kinds_on_where_it_runs_and_drops_their_rivals(name, tp,
                                                                                 slots):
    """`following_on`, checked against each layer's kinds (`kind_at`): from every edge
    tile of a segment, in every layer of its kind, tile g + slots is named whenever its
    segment is on in its layer; only rivals are dropped (a layer runs one kind of each
    role), and some are where the ring is shallow."""
    config = mk.preset(name)
    plan = DecodePlan.make(config, tp=tp, batch=1, rows=1, context=256)
    block = dataclasses.replace(plan.block, slots=slots)
    stream = DecodePlan.make(config, tp=tp, batch=1, rows=1, context=256, block=block).stream
    kinds = layer_kinds(plan.local)
    on_in = {layer: {(k.role, k.name) for k in kinds_at(plan.local, layer)}
             for layer in range(stream.layers)}
    owner = {g: (layer, name.split("[")[0]) for g, layer, name, _, _ in stream.tiles()}
    missed, dropped = [], set()
    for seg in stream.segments:
        assert seg.kind in {(k.role, k.name) for k in kinds}, seg
        edge = range(max(0, seg.tiles - slots), seg.tiles)
        dropped |= {(seg.name, s.name) for s in stream.following(seg, slots)
                    if s not in stream.following_on(seg, slots)}
        searched = {t: {s.name for s in stream.following_on(seg, slots, (t,))} for t in edge}
        for layer in (lr for lr in range(stream.layers) if seg.kind in on_in[lr]):
            for t in edge:
                layer_at, held = owner.get(stream.base(layer, seg) + t + slots, (None, None))
                kind = stream.segment(held).kind if held else None
                if held and (kind is None or kind in on_in[layer_at]) \
                        and held not in searched[t]:
                    missed.append((seg.name, layer, t, held))
    assert missed == []
    assert all(rivals(stream.segment(a), stream.segment(b)) for a, b in dropped)
    if 2 * slots < stream.period:  # a deeper ring reaches the rivals in the next layer too
        assert dropped


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "qwen3-30b-a3b"])
@pytest.mark.parametrize("slots", [2, 3, 9, 40])
def test_an_edge_tile_searches_every_segment_that_can_follow_and_few_others(name, slots):
    config = mk.preset(name)
    plan = DecodePlan.make(config, tp=1, batch=2, rows=1, context=256)
    block = dataclasses.replace(plan.block, slots=slots)
    stream = DecodePlan.make(config, tp=1, batch=2, rows=1, context=256, block=block).stream
    assert _missed_followers(stream, slots, stream.following) == []
    shortest = min(s.tiles for s in stream.segments)
    if slots <= shortest:  # a shallow ring: the search is narrower than the whole stream
        assert max(len(stream.following(s, slots)) for s in stream.segments) < len(
            stream.segments)
    # a search that forgets the tail (the lm_head after the last layer) is caught, where a
    # layer's edge issues one of its tiles (not when the ring is deeper than the stream)
    layered = {g for g, layer, *_ in stream.tiles() if layer is not None}
    if any(g - slots in layered for g, layer, *_ in stream.tiles() if layer is None):
        assert _missed_followers(stream, slots, lambda seg, n, tiles=None: tuple(
            s for s in stream.following(seg, n, tiles) if s not in stream.tail))
