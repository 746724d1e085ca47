"""Stage 03: decode attention against mk.model.ops.attention, with the cache updated in
place exactly as mk.model.ops.write_rows does, race-free, at the tile-boundary positions;
the stage wrapper's errors; ahead-of-time compiles at qwen3-8b attention shapes.

The caches hold random rows below each sequence's new rows, large finite values in the
rest of its last tile (masked, so harmless), and NaN in every tile past it: a kernel that
reads one more tile than it should returns NaN.

Interpret mode checks numerics, the written rows, DMA/semaphore pairing and races; it says
nothing about time or the scoped VMEM limit. The compile tests cover Mosaic lowering and
capacity.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mk
from mk.kernels import backend
from mk.model import ops, reference
from mk.measure import tpu
from mk.kinds.attention import decode_attention as stage
from mk.kernels.common import BlockSizes, sublanes, vmem_budget
from mk.kinds.attention.decode_attention import decode_attention, decode_attention_buffers
from tolerances import TOLERANCE as ALL_TOLERANCES

TOLERANCE = ALL_TOLERANCES["attention"]
K, N, H, KV_TILE = 2, 4, 128, 128  # tiny GQA: G = 2 query heads per kv head
GARBAGE = 1e4  # the rest of a sequence's last tile


def _inputs(B, T, positions, dtype, *, S=384, L=2, kv_tile=KV_TILE, seed=0, window=0):
    """q, k_new, v_new, the caches and the positions; the caches hold NaN in every tile a
    sequence must not read: past its last one, and (with a sliding `window`) before the
    first its window reaches."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B * T, N * H), jnp.float32)
    k_new, v_new = (jax.random.normal(k, (B * T, K * H), jnp.float32) for k in keys[1:3])
    s = np.arange(S)[None, :, None]  # [1, S, 1] broadcast over [B, K, S, H]
    pos = np.asarray(positions)[:, None, None, None]
    end = ((pos + T - 1) // kv_tile + 1) * kv_tile  # one past the last tile read
    start = np.maximum(pos - window + 1, 0) // kv_tile * kv_tile if window else 0 * pos
    caches = []
    for key in keys[3:]:
        c = np.asarray(jax.random.normal(key, (L, B, K, S, H), jnp.float32))
        c = np.where(s[None] >= pos + T, GARBAGE, c)
        c = np.where((s[None] >= end) | (s[None] < start), np.nan, c)
        caches.append(jnp.asarray(c, dtype))
    return q, k_new, v_new, *caches, jnp.asarray(positions, jnp.int32)


def _expected(q, k_new, v_new, k_cache, v_cache, positions, layer, **attention):
    B, T = positions.shape[0], q.shape[0] // positions.shape[0]
    k, v = (c.at[layer].set(ops.write_rows(c[layer], new.reshape(B, T, K, H),
                                           positions))
            for c, new in ((k_cache, k_new), (v_cache, v_new)))
    # NaN tiles are never visible: zero them so the oracle's 0 * NaN stays 0.
    k_seen, v_seen = (jnp.where(jnp.isnan(c[layer]), 0, c[layer]) for c in (k, v))
    o = ops.attention(q.reshape(B, T, N, H), k_seen, v_seen, positions, **attention)
    return o.reshape(B * T, N * H), k, v


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.itemsize == 2 else np.uint32)


def _check(B, T, positions, dtype, *, S=384, slots=2, kv_tile=KV_TILE, layer=1):
    args = _inputs(B, T, positions, dtype, S=S, kv_tile=kv_tile)
    block = BlockSizes(kv_tile=kv_tile, kv_slots=slots)
    with backend.use("interpret", detect_races=True, strict_dma=True):
        o, k, v = jax.block_until_ready(decode_attention(*args, layer=layer, block=block))
        races = backend.races_found()
    o_ref, k_ref, v_ref = _expected(*args, layer)
    np.testing.assert_allclose(o, o_ref, **TOLERANCE[dtype])
    np.testing.assert_array_equal(_bits(k), _bits(k_ref))  # written rows, and nothing else
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))
    assert not races


CASES = {  # name: (B, T, positions, kv_slots, kv_tile)
    "first_row": (1, 1, [0], 2, KV_TILE),
    "last_row_of_first_tile": (1, 1, [KV_TILE - 1], 3, KV_TILE),
    "first_row_of_second_tile": (2, 1, [KV_TILE, 0], 2, KV_TILE),
    "last_legal_position": (2, 4, [384 - 4, 384 - 5], 2, KV_TILE),
    "rows_straddle_tile_edges": (2, 4, [KV_TILE - 2, 2 * KV_TILE - 1], 3, KV_TILE),
    "ragged_batch_of_8": (8, 2, [0, 127, 128, 382, 5, 200, 255, 64], 2, KV_TILE),
    "eight_rows_deep_ring": (3, 8, [KV_TILE - 3, 0, 376], 4, KV_TILE),
    # 16-row tiles: the write-back window is the whole tile, or clamped to its end.
    "small_tiles": (2, 8, [61, 16 * 23], 2, 16),
    # T=4 rows across a 16-row (bf16) and an 8-row (f32) sublane tile inside a KV tile:
    # the write-back window must span two sublane tiles.
    "rows_cross_a_sublane_tile": (2, 4, [14, 158], 2, KV_TILE),
}


# Every case in bf16, the ones that cross tile edges also in f32 (each run costs seconds).
DTYPE_CASES = [(c, "bfloat16") for c in CASES] + [
    (c, "float32") for c in ("last_legal_position", "rows_straddle_tile_edges",
                             "ragged_batch_of_8", "small_tiles", "rows_cross_a_sublane_tile")]


@pytest.mark.parametrize("case, dtype", DTYPE_CASES, ids=[f"{c}-{d}" for c, d in DTYPE_CASES])
def test_matches_the_reference_and_writes_only_the_new_rows_without_races(case, dtype):
    B, T, positions, slots, kv_tile = CASES[case]
    _check(B, T, positions, dtype, slots=slots, kv_tile=kv_tile)


SINKS = jnp.array([0.5, -1.0, 3.0, 8.0])  # [N]: one far above the scores


@pytest.mark.parametrize("window, positions, T", [
    pytest.param(0, [5, 300], 2, marks=pytest.mark.slow),  # sinks alone
    (16, [5, 200], 4),  # a window inside one tile, and one reaching back a tile
    pytest.param(200, [130, 383], 1, marks=pytest.mark.slow),  # a window over a tile
    (3, [129, 30], 4),  # rows t > 0 see none of the first tile's keys: the sink carries them
])
def test_sinks_and_a_sliding_window_match_the_reference_reading_only_the_windows_tiles(
        window, positions, T):
    """gpt-oss's attention: the tiles before a window's first hold NaN, so reading one
    poisons the output; the written rows are exact; no race."""
    B, dtype = len(positions), "bfloat16"
    args = _inputs(B, T, positions, dtype, kv_tile=KV_TILE, window=window)
    block = BlockSizes(kv_tile=KV_TILE, kv_slots=2)
    with backend.use("interpret", detect_races=True, strict_dma=True):
        o, k, v = jax.block_until_ready(decode_attention(*args, layer=1, block=block,
                                                         sinks=SINKS, window=window))
        races = backend.races_found()
    o_ref, k_ref, v_ref = _expected(*args, 1, window=window, sinks=SINKS)
    np.testing.assert_allclose(o, o_ref, **TOLERANCE[dtype])
    np.testing.assert_array_equal(_bits(k), _bits(k_ref))
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))
    assert not races
    if window:  # the same without the window: the oracle's own output moves
        assert not np.allclose(o_ref, _expected(*args, 1, sinks=SINKS)[0], **TOLERANCE[dtype])


def _one_sublane_tile_short(rows, kv_tile, dtype):
    """The planted bug: the window covers round_up(T) rows, not any T consecutive rows."""
    sub = sublanes(dtype)
    return min(kv_tile, -(-rows // sub) * sub)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_write_back_window_one_sublane_tile_short_is_caught(dtype, monkeypatch):
    """The rows past the sublane boundary never reach HBM: the next step would read a
    stale cache. The case that shows it is in CASES, and passes on the real window."""
    B, T, positions, slots, kv_tile = CASES["rows_cross_a_sublane_tile"]
    monkeypatch.setattr(stage, "write_back_rows", _one_sublane_tile_short)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        _check(B, T, positions, dtype, slots=slots, kv_tile=kv_tile)


@settings(max_examples=2, deadline=None)
@given(data=st.data(), B=st.integers(1, 8), T=st.integers(1, 8))
def test_any_batch_rows_and_boundary_positions_match_the_reference(data, B, T):
    S = 256
    boundary = st.sampled_from([0, KV_TILE - 1, KV_TILE, S - T])
    positions = data.draw(st.lists(boundary, min_size=B, max_size=B), label="positions")
    _check(B, T, positions, "bfloat16", S=S)


def test_a_traced_layer_and_traced_positions_give_the_same_result():
    # The megakernel passes its loop index as the layer: nothing may depend on its value.
    args = _inputs(3, 2, [KV_TILE - 1, 0, 300], "bfloat16")
    block = BlockSizes(kv_tile=KV_TILE)
    run = jax.jit(lambda *a, layer: decode_attention(*a, layer=layer, block=block))
    with backend.use("interpret", detect_races=True, strict_dma=True):
        o, k, v = jax.block_until_ready(run(*args, layer=jnp.int32(0)))
        assert not backend.races_found()
    o_ref, k_ref, v_ref = _expected(*args, 0)
    np.testing.assert_allclose(o, o_ref, **TOLERANCE["bfloat16"])
    np.testing.assert_array_equal(_bits(k), _bits(k_ref))
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))


def test_the_garbage_past_the_last_tile_poisons_any_reader():
    # What makes "reads only its tiles" checkable: attention over the raw cache is NaN.
    q, k_new, v_new, k_cache, v_cache, positions = _inputs(2, 1, [0, 200], "bfloat16")
    o = ops.attention(q.reshape(2, 1, N, H), k_cache[1], v_cache[1], positions)
    assert np.isnan(np.asarray(o)).all()


def _zeros(B, T, positions, *, S=384, L=2):  # shapes for the checks that raise
    cache = jnp.zeros((L, B, K, S, H), jnp.bfloat16)
    return (jnp.zeros((B * T, N * H)), jnp.zeros((B * T, K * H)), jnp.zeros((B * T, K * H)),
            cache, cache, jnp.asarray(positions, jnp.int32))


def test_a_position_past_the_cache_is_named():
    args = _zeros(2, 2, [0, 10])
    with pytest.raises(ValueError, match=r"positions\[1\]=383 with T=2 .* max_context=384"):
        decode_attention(*args[:5], jnp.array([0, 383], jnp.int32))
    with pytest.raises(ValueError, match=r"positions\[0\]=-1"):
        decode_attention(*args[:5], jnp.array([-1, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"layer=2 must be in \[0, L=2\)"):
        decode_attention(*args, layer=2)


def test_a_kv_tile_that_does_not_divide_the_cache_is_named():
    args = _zeros(1, 1, [0])
    with pytest.raises(ValueError, match=r"context=384 is not a multiple of kv_tile=256"):
        decode_attention(*args, block=BlockSizes(kv_tile=256))
    with pytest.raises(ValueError, match=r"BlockSizes.kv_tile=100 must be a positive multiple"):
        BlockSizes(kv_tile=100)


def test_too_many_rows_are_named():
    args = _zeros(9, 8, [0] * 9, S=256, L=1)
    with pytest.raises(ValueError, match=r"rows B\*T=72 must be in \[1, 64\]"):
        decode_attention(*args)


def test_the_budget_refuses_an_oversized_kv_ring():
    block = BlockSizes(kv_tile=4096, kv_slots=4)  # 2 x 4 x 8 MiB of bf16 tiles
    buffers = decode_attention_buffers(8, 1, 32, 8, 128, "bfloat16", block)
    with pytest.raises(ValueError, match=r"over tpu7x's 64 MiB per core; biggest: k_tiles"):
        vmem_budget("decode_attention", buffers, mk.chip("tpu7x"))


COMPILES = [(chip, T, "bfloat16") for chip in ("v5e", "v6e", "tpu7x") for T in (1, 4)] + [
    ("v6e", 3, "float32")]  # f32 tiles: 8-row write-back windows


@pytest.mark.parametrize("chip, T, dtype", COMPILES, ids=[f"{c}-T{t}-{d}" for c, t, d in COMPILES])
def test_compiles_for_tpu_at_qwen3_8b_attention_shapes(chip, T, dtype):
    c = mk.preset("qwen3-8b")
    B, L, S = 8, 2, 4096
    N, K_, H_ = c.heads, c.kv_heads, c.head_dim
    block = BlockSizes(kv_tile=256, kv_slots=3)
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct((B * T, N * H_), f32),
            jax.ShapeDtypeStruct((B * T, K_ * H_), f32),
            jax.ShapeDtypeStruct((B * T, K_ * H_), f32),
            jax.ShapeDtypeStruct((L, B, K_, S, H_), dtype),
            jax.ShapeDtypeStruct((L, B, K_, S, H_), dtype),
            jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32)]  # the layer, traced as in the megakernel
    budget = vmem_budget("decode_attention", decode_attention_buffers(
        B, T, N, K_, H_, dtype, block, operands=True), mk.chip(chip))

    def step(q, k_new, v_new, k_cache, v_cache, positions, layer):
        return decode_attention(q, k_new, v_new, k_cache, v_cache, positions, layer=layer,
                                block=block)

    report = tpu.compile_for_chip(step, args, chip, name=f"decode_attention T={T} {dtype}",
                                  vmem=budget)
    print(report.summary())
    assert report.ok, report.error
    assert report.code_bytes > 0


# -- MLA's absorbed decode over the latent cache ---------------------------------------------
# CI runs notebook 05c's check of the same (B = 1, T = 2); these run in make test-slow.
@pytest.mark.slow
@pytest.mark.parametrize("B, T", [(1, 1), (2, 4)])
def test_latent_attention_gives_the_mla_layer_of_the_reference_without_races(B, T):
    """tiny-kimi's MLA layer: the reference expands the latent cache into per-head keys and
    values every step; the kernel attends over the latent rows with absorbed queries
    (`mk.model.reference.mla_absorbed`: one shared "kv head", the values the keys' latent
    lanes). After the value up-projection and wo both give the same x after attention,
    and the kernel writes the reference's latent rows. Non-zero cache rows below each
    sequence's position, which both read."""
    config = mk.preset("tiny-kimi")
    params = mk.init_params(config, seed=0)
    layer, a = config.full_layers[0], 0
    S, W = 256, config.latent_width
    keys = jax.random.split(jax.random.key(B * 10 + T), 2)
    x = jax.random.normal(keys[0], (B, T, config.hidden))
    cache = (0.5 * jax.random.normal(keys[1], (1, B, S, W))).astype(config.dtype)
    positions = jnp.array([[3], [130]][:B], jnp.int32)[:, 0]  # the second across a tile
    _, want_cache, want_x = reference.mla_decoder_layer(config, params, layer, x, cache[a],
                                                        positions)
    h = ops.rms_norm(x, params["attn_norm"][layer], config.rms_eps).reshape(B * T, -1)
    queries, latent, up_v = reference.mla_absorbed(config, params, a, h)
    with backend.use("interpret", detect_races=True):
        o, got_cache = jax.block_until_ready(stage.latent_attention(
            queries, latent, cache, positions, layer=a,
            scale=1 / np.sqrt(config.head_dim), block=BlockSizes(kv_tile=128, kv_slots=2)))
        races = backend.races_found()
    o = reference.mla_output(config, o, up_v)
    got_x = x + ops.matmul(o, params["wo"][a]).reshape(B, T, -1)
    np.testing.assert_array_equal(np.asarray(got_cache[a], np.float32),
                                  np.asarray(want_cache, np.float32))
    scale = float(jnp.abs(want_x - x).max())  # the attention output's
    np.testing.assert_allclose(got_x, want_x, atol=1e-2 * scale, rtol=0)  # 4e-3 seen
    assert not races


def test_latent_attention_compiles_for_tpu7x_at_kimi_k3s_tp32_shard():
    """kimi-k2-shaped's MLA as one of 32 devices holds it: 2 of its 64 heads, B = 8, T = 4, over
    4,096 cached positions of 576-value latent rows (512 + 64: not whole 128-lane tiles)."""
    config = mk.preset("kimi-k2-shaped")
    B, T, S, N, W = 8, 4, 4096, config.heads // 32, config.latent_width
    f32, S_ = jnp.float32, jax.ShapeDtypeStruct
    block = BlockSizes(kv_tile=128, kv_slots=3)
    report = tpu.compile_for_chip(
        lambda q, new, cache, pos: stage.latent_attention(
            q, new, cache, pos, scale=1 / np.sqrt(config.head_dim), block=block),
        [S_((B * T, N * W), f32), S_((B * T, W), f32), S_((1, B, S, W), jnp.bfloat16),
         S_((B,), jnp.int32)], "tpu7x", name="latent_attention")
    assert report.ok, report.error
