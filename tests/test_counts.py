"""The performance model's facts against counts made without it: the HBM a plan holds
against the arrays the megakernel is handed, KV tiles read and written against numpy's
tile index of every position a step reads or writes, the simulator's KV bytes against the
reference cache's shapes, and the all-reduce the ring covers against an [M, D] float32
array. Cases straddle tile ends, mix linear and full layers, and run M > 1 at tp > 1.

Nothing here calls the function it checks to make the expected number: the plan's
`kv_tiles`, `hbm_bytes`, `ring_cover_s` and the simulator's `kv_tiles` each have a
mutant (tools/mutate.py) these tests catch."""

import math

import jax
import numpy as np
import pytest

import mk
from mk.step import megakernel
from mk.model import reference
from mk.cost import sim
from mk.step import plan as plan_module
from mk.kinds.attention.decode_attention import write_back_rows
from mk.step.plan import DecodePlan
from mk.kinds.layers import TABLES
from mk.model.weights import abstract_params
from builders import simulated_step

FAMILIES = ["tiny", "tiny-moe", "tiny-hybrid", "tiny-kimi", "tiny-gpt-oss"]


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _read_tiles(p: int, T: int, tile: int) -> int:
    """Tiles a sequence whose T new rows sit at p .. p + T - 1 reads: every position it
    attends to, 0 .. p + T - 1."""
    return np.unique(np.arange(p + T) // tile).size


def _window_tiles(p: int, T: int, tile: int, window: int) -> int:
    """Tiles a sequence reads in a layer with a sliding window: the positions its rows
    see, p - window + 1 (its first row's oldest) .. p + T - 1."""
    return np.unique(np.arange(max(p - window + 1, 0), p + T) // tile).size


def _written_tiles(p: int, T: int, tile: int) -> int:
    """Tiles holding the T new rows p .. p + T - 1."""
    return np.unique(np.arange(p, p + T) // tile).size


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_hbm_bytes_are_the_megakernels_operands_and_no_kv_for_linear_layers(name):
    """What a device holds: the prepared weights (`megakernel.prepare`, less the four
    per-layer int32 tables), the reference's cache (`init_cache`: KV for full layers only,
    states for linear ones) and the T row states a hybrid's step writes."""
    config, B, T, S = mk.preset(name), 2, 3, 512
    plan = DecodePlan.make(config, batch=B, rows=T, context=S)
    params = abstract_params(config)
    weights = jax.eval_shape(lambda p: megakernel.prepare(plan, p), params)
    cache = jax.eval_shape(lambda: reference.init_cache(config, B, S))
    rows = T * _nbytes([cache.conv, cache.state]) if config.linear_layers else 0
    held = (_nbytes({k: w for k, w in weights.items() if k not in TABLES})
            + _nbytes(cache) + rows)
    assert plan.hbm_bytes() == held
    # the KV part by hand: K and V (or MLA's one latent row) of the full layers only
    kv = _nbytes([a for k, a in cache._asdict().items() if k in ("k", "v", "latent")])
    full, itemsize = len(config.full_layers), np.dtype(config.dtype).itemsize
    assert config.is_hybrid == (full < config.layers)  # hybrids: a cache per layer differs
    if config.is_mla:
        assert kv == full * B * S * config.latent_width * itemsize
    else:
        assert kv == 2 * full * B * config.kv_heads * S * config.head_dim * itemsize


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_plan_kv_tiles_read_and_written_match_numpys_tile_index(T):
    config = mk.preset("tiny")
    plan = DecodePlan.make(config, batch=1, rows=T, context=1024)
    tile = plan.block.kv_tile
    edges = [0, 1, tile - T - 1, tile - T, tile - T + 1, tile - 1, tile, 2 * tile - T,
             2 * tile - 1, 3 * tile - 2]
    positions = [p for p in edges if 0 <= p and p + T <= 1024]
    for p in positions:  # one sequence at a time, then all at once
        assert plan.kv_tiles([p]) == (_read_tiles(p, T, tile), _written_tiles(p, T, tile)), p
    assert plan.kv_tiles(positions) == (sum(_read_tiles(p, T, tile) for p in positions),
                                        sum(_written_tiles(p, T, tile) for p in positions))


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid", "tiny-kimi"])
@pytest.mark.parametrize("p, T", [(255, 2), (254, 2), (256, 1), (253, 4), (40, 3)])
def test_simulator_kv_bytes_count_the_new_rows_tiles_and_full_layers_only(name, p, T):
    """kv_read: every full layer reads, per sequence, the tiles of positions 0 .. p + T - 1
    (p = tile - 1, T = 2 straddles a tile end: the new rows' second tile); kv_write: the
    window of W rows around the new rows, per tile holding them. Tile bytes from the
    reference cache's shapes."""
    config, B = mk.preset(name), 2
    s = simulated_step(config, "v5e", batch=B, rows=T, context=p)
    tile = s.block.kv_tile
    cache = jax.eval_shape(lambda: reference.init_cache(config, B, tile))
    arrays = [cache.latent] if config.is_mla else [cache.k, cache.v]
    full = len(config.full_layers)
    # bytes of one row of one sequence's cache of one layer, over K and V (or the latent)
    row = sum(_nbytes(a) // (a.shape[0] * B * tile) for a in arrays)
    got = s.family_bytes()
    assert got["kv_read"] == full * B * _read_tiles(p, T, tile) * tile * row
    W = write_back_rows(T, tile, config.dtype)
    assert got["kv_write"] == full * B * _written_tiles(p, T, tile) * W * row


@pytest.mark.parametrize("p, T", [(300, 4), (143, 1), (40, 3), (0, 2)])
def test_a_sliding_layers_kv_reads_are_its_windows_tiles(p, T):
    """gpt-oss: a sliding layer reads the tiles of positions p - window + 1 .. p + T - 1
    (the plan's count, and the simulator's bytes: tiny-gpt-oss's two sliding and two full
    layers), its full layers every tile; writes as any full layer."""
    config, B = mk.preset("tiny-gpt-oss"), 2
    window, sliding = config.sliding_window, len(config.sliding_layers)
    plan = DecodePlan.make(config, batch=1, rows=T, context=512)
    tile = plan.block.kv_tile
    assert plan.kv_tiles([p], window) == (_window_tiles(p, T, tile, window),
                                          _written_tiles(p, T, tile))
    s = simulated_step(config, "v5e", batch=B, rows=T, context=p, block=plan.block)
    cache = jax.eval_shape(lambda: reference.init_cache(config, B, tile))
    row = sum(_nbytes(a) // (a.shape[0] * B * tile) for a in (cache.k, cache.v))
    full = len(config.full_layers) - sliding
    assert s.family_bytes()["kv_read"] == B * tile * row * (
        full * _read_tiles(p, T, tile) + sliding * _window_tiles(p, T, tile, window))


def test_ring_cover_holds_one_all_reduce_of_all_m_rows_at_tp_2(monkeypatch):
    """At tp > 1 the ring covers one all-reduce of the [M, D] float32 partial sums: M = B*T
    rows, not one."""
    sizes = []
    real = plan_module.allreduce_s

    def recorded(nbytes, tp, spec, *how):
        sizes.append((nbytes, tp))
        return real(nbytes, tp, spec, *how)

    monkeypatch.setattr(plan_module, "allreduce_s", recorded)
    config, B, T = mk.preset("tiny"), 4, 2
    plan = DecodePlan.make(config, tp=2, batch=B, rows=T, context=512, chip="v5e")
    partial_sums = np.zeros((B * T, config.hidden), np.float32)
    assert sizes and set(sizes) == {(partial_sums.nbytes, 2)}
    sizes.clear()
    cover = plan_module.ring_cover_s(plan.local, 2, B * T, mk.chip("v5e"))
    assert cover == plan_module.RING_COVER_S + real(partial_sums.nbytes, 2, mk.chip("v5e"))
    assert cover > plan_module.ring_cover_s(plan.local, 2, 1, mk.chip("v5e"))
    assert plan_module.ring_cover_s(plan.local, 1, B * T, mk.chip("v5e")) \
        == plan_module.RING_COVER_S


def test_simulator_all_reduces_m_rows_twice_a_layer_at_tp_2(monkeypatch):
    sizes = []
    real = sim.perf.allreduce_s

    def recorded(nbytes, tp, spec, *how):
        sizes.append(nbytes)
        return real(nbytes, tp, spec, *how)

    monkeypatch.setattr(sim.perf, "allreduce_s", recorded)
    config, B, T = mk.preset("tiny"), 2, 3
    simulated_step(config, "v5e", batch=B, rows=T, context=40, tp=2)
    partial_sums = np.zeros((B * T, config.hidden), np.float32).nbytes
    assert sizes.count(partial_sums) == 2 * config.layers
