"""Stage 04: dense SwiGLU (and under Kimi K3's SiTU) and the MoE block against
mk.model.ops.swiglu / moe (mk.model.reference.situ_dense_mlp), race-free,
with plain or quantised (packed) weights; only the selected experts are loaded; router ties
go to the lower expert id; the MoE body runs inside a bigger stream over layers; a planted
ring bug in the expert slots is caught; both kernels compile for TPUs at real shapes; the
VMEM budget and the compiler both refuse an oversized ring. Kimi's MoE block (the sigmoid
router with a bias and expert groups, the routed scale, a shared expert) against the
reference, and compiled for TPU7x at kimi-k2-shaped's TP32 shard.

Interpret mode checks numerics, DMA/semaphore pairing and races; it says nothing about
time or the scoped VMEM limit, and its uninitialised memory is NaN (so a read of a tile
that was never loaded shows up in the output). The compile tests cover Mosaic lowering
(the vector -> SMEM expert ids included) and capacity.
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
from mk.model import ops, quant
from mk.measure import tpu
from mk.kinds.mlp import joined_experts, mlp
from mk.kinds.mlp.routing import Routing
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kernels.ring import Ring, ring_layout
from mk.kernels.stream import TileStream
from mk.kernels.weight_streaming import stage_block
from builders import plant_double_scale, quantised_cases
from tolerances import TOLERANCE as ALL_TOLERANCES

TOLERANCE = ALL_TOLERANCES["mlp"]
BLOCK = BlockSizes(slots=3, tile_rows=128, tile_cols=128)
S = jax.ShapeDtypeStruct


@functools.cache
def _model(name, dtype):
    config = dataclasses.replace(mk.preset(name), dtype=dtype)
    return config, mk.init_params(config)


def _rows(M, D, seed=0):
    return jax.random.normal(jax.random.key(seed), (M, D), jnp.float32)


def _moe_args(params, row):
    return [params[n][row] for n in ("router", "we_gate", "we_up", "we_down")]


def _distinct_experts(h, config, params, row):
    _, experts = ops.route(h, params["router"][row], config.experts_per_token,
                           config.norm_topk)
    return len(np.unique(np.asarray(experts)))


def _interpret(fn, *args, dma_execution_mode="on_wait"):
    with backend.use("interpret", detect_races=True, dma_execution_mode=dma_execution_mode,
                     strict_dma=True):
        out = jax.block_until_ready(fn(*args))
    return out, backend.races_found()


# -- Dense SwiGLU ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_swiglu_matches_the_reference_on_the_tiny_preset_without_races(dtype):
    config, params = _model("tiny", dtype)
    h = _rows(6, config.hidden)
    w = [params[n] for n in ("w_gate", "w_up", "w_down")]
    # The layer row is traced: the kernel picks w_hbm.at[row] at run time.
    got, races = _interpret(jax.jit(lambda layer: mlp.swiglu(h, *w, layer=layer,
                                                             block=BLOCK)), 1)
    np.testing.assert_allclose(got, ops.swiglu(h, *(x[1] for x in w)),
                               **TOLERANCE[dtype])
    assert not races


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_situ_stage_kernel_matches_the_reference_without_races(dtype):
    """Kimi K3's dense SiTU MLP (`mk.kinds.mlp.kinds.SituDense.stage`: the swiglu kernel under
    its activation) against `mk.model.reference.situ_dense_mlp`, gate and up scaled so both of
    SiTU's soft caps bite (SwiGLU's output misses the tolerance there)."""
    from mk.model import reference
    from mk.kinds.mlp.kinds import SituDense

    config = dataclasses.replace(mk.preset("tiny"), dtype=dtype, situ_beta=4.0,
                                 situ_linear_beta=25.0)
    params = mk.init_params(config)
    params |= {"w_gate": 3 * params["w_gate"], "w_up": 20 * params["w_up"]}
    h = _rows(6, config.hidden)
    weights = {n: params[n][1] for n in ("w_gate", "w_up", "w_down")}
    got, races = _interpret(SituDense(config).stage, h, weights)
    want = reference.situ_dense_mlp(config, params, 1, h)
    scale = float(np.abs(want).max())  # ~40: the table's tolerances are at unit scale
    np.testing.assert_allclose(got / scale, want / scale, **TOLERANCE[dtype])
    assert not races
    assert np.abs(ops.swiglu(h, *weights.values()) - want).max() > 1.0


@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 8), rows=st.integers(1, 8),
       dtype=st.sampled_from(["bfloat16", "float32"]))
def test_swiglu_matches_the_reference_for_any_batch_and_rows(batch, rows, dtype):
    config, params = _model("tiny", dtype)
    h = _rows(batch * rows, config.hidden, seed=batch * 8 + rows)
    w = [params[n][0] for n in ("w_gate", "w_up", "w_down")]
    got, races = _interpret(functools.partial(mlp.swiglu, block=BLOCK), h, *w)
    np.testing.assert_allclose(got, ops.swiglu(h, *w), **TOLERANCE[dtype])
    assert not races


@pytest.mark.parametrize("scheme, dtype", quantised_cases("int8"))
def test_quantised_swiglu_streams_packed_tiles_and_matches_the_reference(scheme, dtype):
    """w_gate, w_up, w_down stored in `scheme`, multiplied in h's dtype: the reference on
    their dequantised values; the same check fails on a planted 2x scale in one group of
    w_down's layer 1 (the row the kernel streams)."""
    config, params = _model("tiny", dtype)
    qparams = mk.quantize(config, params, dense=scheme)
    names = ("w_gate", "w_up", "w_down")
    h = _rows(6, config.hidden).astype(dtype)
    got, races = _interpret(jax.jit(lambda layer: mlp.swiglu(
        h, *(qparams[n] for n in names), layer=layer, block=BLOCK)), 1)
    assert not races

    def matches(qparams):
        values = quant.dequantize(qparams)
        np.testing.assert_allclose(got, ops.swiglu(h, *(values[n][1] for n in names)),
                                   **TOLERANCE[dtype])

    matches(qparams)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        matches(dict(qparams, w_down=plant_double_scale(qparams["w_down"], at=(1, 0, 0))))


# -- MoE -------------------------------------------------------------------------------------
def _moe(config, h, args, layer=0, block=BLOCK):
    return mlp.moe(h, *args, top_k=config.experts_per_token, renormalise=config.norm_topk,
                   layer=layer, block=block, return_loaded=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_matches_the_reference_on_the_tiny_moe_preset_without_races(dtype):
    config, params = _model("tiny-moe", dtype)
    h = _rows(5, config.hidden)
    stacked = [params[n] for n in ("router", "we_gate", "we_up", "we_down")]
    (got, loaded), races = _interpret(lambda: _moe(config, h, stacked, layer=1))
    want = ops.moe(h, *_moe_args(params, 1), config.experts_per_token, config.norm_topk)
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])
    assert int(loaded[0]) == _distinct_experts(h, config, params, 1)
    assert not races


@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 8), rows=st.integers(1, 8), top_k=st.integers(1, 3),
       renormalise=st.booleans(), dtype=st.sampled_from(["bfloat16", "float32"]))
def test_moe_matches_the_reference_for_any_batch_rows_and_top_k(batch, rows, top_k,
                                                                 renormalise, dtype):
    config, params = _model("tiny-moe", dtype)
    config = dataclasses.replace(config, experts_per_token=top_k, norm_topk=renormalise)
    h = _rows(batch * rows, config.hidden, seed=batch * 8 + rows)
    (got, loaded), races = _interpret(lambda: _moe(config, h, _moe_args(params, 0)))
    want = ops.moe(h, *_moe_args(params, 0), top_k, renormalise)
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])
    assert int(loaded[0]) == _distinct_experts(h, config, params, 0)
    assert not races


@pytest.mark.parametrize("scheme, dtype", quantised_cases("fp4"))
def test_quantised_experts_stream_packed_tiles_and_match_the_reference(scheme, dtype):
    """The experts stored in `scheme` (the router plain), multiplied in h's dtype: the
    reference on their dequantised values, each selected expert loaded once; the same check
    fails on a planted 2x scale in one group of an expert row 0 selected."""
    config, params = _model("tiny-moe", dtype)
    qparams = mk.quantize(config, params, experts=scheme)
    h = _rows(5, config.hidden).astype(dtype)
    stacked = [qparams[n] for n in ("router", "we_gate", "we_up", "we_down")]
    (got, loaded), races = _interpret(lambda: _moe(config, h, stacked, layer=1))
    assert not races
    assert int(loaded[0]) == _distinct_experts(h, config, params, 1)

    def matches(qparams):
        want = ops.moe(h, *_moe_args(quant.dequantize(qparams), 1),
                       config.experts_per_token, config.norm_topk)
        np.testing.assert_allclose(got, want, **TOLERANCE[dtype])

    matches(qparams)
    _, experts = ops.route(h, params["router"][1], config.experts_per_token,
                           config.norm_topk)
    planted = plant_double_scale(qparams["we_down"], at=(1, int(experts[0, 0]), 0, 0))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        matches(dict(qparams, we_down=planted))


def test_only_the_selected_experts_are_loaded():
    """Unselected experts hold NaN: one byte of them read would poison the output."""
    config, params = _model("tiny-moe", "float32")
    h = _rows(2, config.hidden, seed=3)
    router, we_gate, we_up, we_down = _moe_args(params, 0)
    _, experts = ops.route(h, router, config.experts_per_token, config.norm_topk)
    picked = np.unique(np.asarray(experts))
    assert len(picked) < config.experts, "pick rows that leave some expert unselected"
    unused = jnp.asarray(~np.isin(np.arange(config.experts), picked))[:, None, None]
    poisoned = [jnp.where(unused, jnp.nan, w) for w in (we_gate, we_up, we_down)]
    (got, loaded), races = _interpret(lambda: _moe(config, h, [router, *poisoned]))
    assert np.isfinite(np.asarray(got)).all()
    want = ops.moe(h, router, we_gate, we_up, we_down, config.experts_per_token,
                   config.norm_topk)
    np.testing.assert_allclose(got, want, **TOLERANCE["float32"])
    assert int(loaded[0]) == len(picked)
    assert not races


def test_router_ties_go_to_the_lower_expert_id():
    """Experts 2, 5 and 6 share one router column, the largest logit: top-2 keeps 2 and 5."""
    config, params = _model("tiny-moe", "float32")
    h = jnp.ones((1, config.hidden), jnp.float32)  # logits 1, 0, -1: exact in any order
    router = np.zeros((config.hidden, config.experts), np.float32)
    router[:, [2, 5, 6]] = 1.0 / config.hidden
    router[:, 0] = -1.0 / config.hidden
    _, we_gate, we_up, we_down = _moe_args(params, 0)
    args = [jnp.asarray(router), we_gate, we_up, we_down]
    weights, experts = ops.route(h, args[0], 2, False)
    assert sorted(np.asarray(experts)[0]) == [2, 5]
    # Poison expert 6: if the kernel broke the tie the other way, the output would be NaN.
    args[1] = args[1].at[6].set(jnp.nan)
    (got, loaded), races = _interpret(lambda: mlp.moe(h, *args, top_k=2, renormalise=False,
                                                      block=BLOCK, return_loaded=True))
    want = ops.moe(h, jnp.asarray(router), we_gate, we_up, we_down, 2, False)
    np.testing.assert_allclose(got, want, **TOLERANCE["float32"])
    assert int(loaded[0]) == 2 and not races


# -- The MoE body inside a bigger stream ----------------------------------------------------
def _fused_kernel(h_vmem, w_pre_hbm, router_hbm, we_gate_hbm, we_up_hbm, we_down_hbm,
                  w_post_hbm, pre_vmem, moe_vmem, post_vmem, loaded_smem, ring_vmem, sems,
                  router_vmem, combine_vmem, selected_vmem, gate_vmem, up_vmem, down_vmem,
                  small_sems, selected_smem, ids_smem, count_smem, *, stream, top_k,
                  renormalise):
    """Per layer: pre = h @ w_pre, the MoE body, post = moe @ w_post; one ring for all."""
    fetch = {"w_pre": lambda layer: (w_pre_hbm.at[layer], None),
             "w_post": lambda layer: (w_post_hbm.at[layer], None),
             **mlp.moe_fetch(dict(zip(mlp.EXPERT_WEIGHTS, (we_gate_hbm, we_up_hbm,
                                                           we_down_hbm))),
                             lambda layer: layer, ids_smem, count_smem)}
    ring = Ring(stream, fetch, {"ring": ring_vmem}, sems)
    count_smem[0], count_smem[mlp.ROUTED_LAYER] = 0, -1  # no layer routed yet
    ring.prime()

    def layer_body(layer, carry):
        router = pltpu.make_async_copy(router_hbm.at[layer], router_vmem, small_sems.at[0])
        router.start()
        ring.matmul("w_pre", h_vmem, pre_vmem.at[layer], layer=layer)
        router.wait()
        moe_vmem[layer] = jnp.zeros(moe_vmem.shape[1:], jnp.float32)
        loaded_smem[layer] = mlp.moe_body(
            ring, layer, h_vmem, router_vmem, combine_vmem, selected_vmem, selected_smem,
            small_sems.at[1], ids_smem, count_smem, gate_vmem, up_vmem, down_vmem,
            moe_vmem.at[layer], routing=Routing(top_k, renormalise))
        ring.matmul("w_post", moe_vmem.at[layer], post_vmem.at[layer], layer=layer)
        return carry

    lax.fori_loop(0, stream.layers, layer_body, 0)


def test_moe_body_runs_inside_a_bigger_stream_over_layers():
    """w_pre has 4 tiles and the ring 5 slots: the prologue already reaches the expert
    region, off slots sit between the experts and w_post, and layer 1 follows layer 0.

    DMAs run eagerly here (every other test waits "on_wait"): a tile issued twice (e.g. an
    expert tile issued before routing with a stale count, then again after) then leaves
    its semaphore non-zero at kernel exit; `_interpret`'s strict_dma raises on it."""
    config, params = _model("tiny-moe", "float32")
    M, D, E, Fe, X = 3, config.hidden, config.experts, config.expert_ffn, 2
    slots = mlp.expert_slots(E, X, M)
    block = BlockSizes(slots=5, tile_rows=128, tile_cols=128)
    stream = TileStream.build(block, [("w_pre", D, D), *mlp.moe_segments(D, Fe, slots),
                                      ("w_post", D, D)], layers=2)
    keys = jax.random.split(jax.random.key(1), 2)
    w_pre, w_post = (jax.random.normal(k, (2, D, D), jnp.float32) / 16 for k in keys)
    h = _rows(M, D, seed=11)
    f32 = jnp.float32
    kernel = functools.partial(  # built inside the interpret mode, by _interpret
        pl.pallas_call,
        functools.partial(_fused_kernel, stream=stream, top_k=X, renormalise=True),
        out_shape=[S((2, M, D), f32)] * 3 + [S((2,), jnp.int32)],
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)]
                 + [pl.BlockSpec(memory_space=pl.ANY)] * 6,
        out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] * 3
                  + [pl.BlockSpec(memory_space=pltpu.SMEM)],
        scratch_shapes=[pltpu.VMEM((5, 128, 128), f32), pltpu.SemaphoreType.DMA((5,)),
                        pltpu.VMEM((E, D), f32), pltpu.VMEM((M, E), f32),
                        pltpu.VMEM((1, E), jnp.int32), pltpu.VMEM((M, Fe), f32),
                        pltpu.VMEM((M, Fe), f32), pltpu.VMEM((M, D), f32),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1, E), jnp.int32),
                        pltpu.SMEM((slots,), jnp.int32), pltpu.SMEM((2,), jnp.int32)])
    laid = ring_layout(dict(w_pre=w_pre, w_post=w_post) | {
        n: params[n] for n in ("router", "we_gate", "we_up", "we_down")}, stream)
    (pre, moe, post, loaded), races = _interpret(
        lambda *args: kernel()(*args), h,
        *(laid[n].swapaxes(1, 2) if n == "router" else laid[n]  # moe_body's [E, D]
          for n in ("w_pre", "router", "we_gate", "we_up", "we_down", "w_post")),
        dma_execution_mode="eager")
    for layer in range(2):
        want = ops.moe(h, *_moe_args(params, layer), X, True)
        np.testing.assert_allclose(pre[layer], ops.matmul(h, w_pre[layer]),
                                   **TOLERANCE["float32"])
        np.testing.assert_allclose(moe[layer], want, **TOLERANCE["float32"])
        np.testing.assert_allclose(post[layer], ops.matmul(want, w_post[layer]),
                                   rtol=1e-5, atol=1e-4)
        assert int(loaded[layer]) == _distinct_experts(h, config, params, layer) < slots
    assert not races


# -- The race check can fail ----------------------------------------------------------------
def _expert_slots_with_early_prefetch(ids_smem, count_smem, x_vmem, we_gate_hbm,
                                      we_up_hbm, we_down_hbm, out_vmem, ring_vmem, sems, *,
                                      stream):
    """The planted bug: tile g + slots is issued BEFORE tile g (same slot) is read."""
    weights = dict(zip(mlp.EXPERT_WEIGHTS, (we_gate_hbm, we_up_hbm, we_down_hbm)))
    ring = Ring(stream, mlp.moe_fetch(weights, lambda layer: 0, ids_smem, count_smem),
                {"ring": ring_vmem}, sems)
    ring.prime()
    n, tk = stream.block.slots, stream.block.tile_rows

    def tile(g, acc):
        # a wait needs only the semaphore and the tile's size: any tile-shaped copy names it
        pltpu.make_async_copy(we_gate_hbm.at[0, 0, 0], ring.slot(g % n), sems.at[g % n]).wait()
        ring.start(g + n)  # too early: the slot is still to be read
        return acc + jnp.dot(x_vmem[:, :tk], ring.slot(g % n)[...],
                             preferred_element_type=jnp.float32)

    per_slot = stream.segment("we_gate").stride
    out_vmem[...] = lax.fori_loop(0, count_smem[0] * per_slot, tile,
                                  jnp.zeros(out_vmem.shape, jnp.float32))


def test_the_race_detector_catches_a_prefetch_into_the_expert_slot_being_read():
    config, params = _model("tiny-moe", "float32")
    D, Fe = config.hidden, config.expert_ffn
    stream = TileStream.build(BLOCK, mlp.moe_segments(D, Fe, 4))
    # 3 active slots, routed for layer 0 (count_smem's [count, routed layer])
    ids, count = jnp.array([1, 4, 6, 0], jnp.int32), jnp.array([3, 0], jnp.int32)
    with backend.use("interpret", detect_races=True):  # a kernel is built inside the mode
        kernel = pl.pallas_call(
            functools.partial(_expert_slots_with_early_prefetch, stream=stream),
            out_shape=S((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
                     + [pl.BlockSpec(memory_space=pltpu.VMEM)]
                     + [pl.BlockSpec(memory_space=pl.ANY)] * 3,
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((3, 128, 128), jnp.float32),
                            pltpu.SemaphoreType.DMA((3,))])
        laid = ring_layout({n: params[n][:1] for n in mlp.EXPERT_WEIGHTS}, stream)
        jax.block_until_ready(kernel(ids, count, _rows(8, D), *laid.values()))
    assert backend.races_found()


# -- Static checks ---------------------------------------------------------------------------
def test_expert_slots_stream_gate_up_down_per_slot_in_order():
    stream = TileStream.build(BLOCK, mlp.moe_segments(256, 128, 3))
    names = [name for _, _, name, _, _ in stream.tiles()]
    assert names == [f"{w}[{s}]" for s in range(3)
                     for w in ("we_gate",) * 2 + ("we_up",) * 2 + ("we_down",) * 2]
    assert stream.total == 3 * 6 == len(names)
    assert [g for g, *_ in stream.tiles()] == list(range(stream.total))


def test_bad_inputs_are_named():
    config, params = _model("tiny-moe", "bfloat16")
    h = _rows(4, config.hidden)
    args = _moe_args(params, 0)
    with pytest.raises(ValueError, match=r"top_k=9 must be an integer in \[1, experts=8\]"):
        mlp.moe(h, *args, top_k=9, renormalise=True)
    with pytest.raises(ValueError, match=r"layer=2 must be in \[0, 2\)"):
        mlp.moe(h, *[params[n] for n in ("router", "we_gate", "we_up", "we_down")],
                top_k=2, renormalise=True, layer=2)
    with pytest.raises(ValueError, match=r"M in \[1, 64\]"):
        mlp.moe(_rows(65, config.hidden), *args, top_k=2, renormalise=True)
    with pytest.raises(ValueError, match=r"weight dtypes .* must be one and the same"):
        mlp.moe(h, args[0].astype(jnp.float32), *args[1:], top_k=2, renormalise=True)
    with pytest.raises(ValueError, match=r"router is a int8 QuantWeight: only \('we_gate'"):
        mlp.moe(h, quant.quantize_weight(args[0], "int8"), *args[1:], top_k=2,
                renormalise=True)
    w = [params[n][0] for n in ("w_gate", "w_up", "w_down")]
    with pytest.raises(ValueError, match=r"weight w_gate \[256, 512\], nor its transpose "
                                         r".* tile_rows=384"):
        mlp.swiglu(h, *w, block=BlockSizes(tile_rows=384, tile_cols=128))
    with pytest.raises(ValueError, match=r"must be \[M, D\], \[Ld, D, F\]"):
        mlp.swiglu(h, w[0], w[0], w[0])
    with pytest.raises(ValueError, match=r"dense weights mix storage formats"):
        mlp.swiglu(h, quant.quantize_weight(w[0], "int4"), *w[1:])


# -- Kimi's MoE: the sigmoid grouped router and a shared expert ------------------------------
@functools.cache
def _kimi_moe(seed=0):
    """tiny-kimi's first MoE layer, its router bias made random (init_params' is zero, which
    would hide a bias the kernel forgot), and rows h (built once: read-only)."""
    config = mk.preset("tiny-kimi")
    params = mk.init_params(config, seed=seed)
    bias = 0.5 * jax.random.normal(jax.random.key(seed + 1), params["router_bias"].shape)
    params["router_bias"] = bias.astype(params["router_bias"].dtype)
    return config, params, _rows(6, config.hidden, seed=seed)


def _route_grouped(config, params, h, groups=None, bias=True):
    bias = params["router_bias"][0] if bias else jnp.zeros_like(params["router_bias"][0])
    return ops.route_grouped(h, params["router"][0], bias, config.experts_per_token,
                             groups or config.expert_groups, config.topk_groups,
                             config.norm_topk, config.routed_scale)


def test_kimi_moe_matches_the_reference_without_races():
    """tiny-kimi's MoE block: sigmoid scores plus a bias choose among the best of 2 groups,
    the weights renormalised and scaled by 2.5, plus the shared expert. The rows are chosen
    so that the groups and the bias both change the choice (a kernel that ignored either
    would differ)."""
    config, params, h = _kimi_moe()
    weights, experts = _route_grouped(config, params, h)
    for other in (_route_grouped(config, params, h, groups=1),
                  _route_grouped(config, params, h, bias=False)):
        assert not np.array_equal(np.sort(other[1]), np.sort(experts))
    shared = [params[n][0] for n in mlp.SHARED_WEIGHTS]
    want = (ops.mix_experts(h, weights, experts, *_moe_args(params, 0)[1:])
            + ops.swiglu(h, *shared))
    (got, loaded), races = _interpret(lambda: mlp.moe(
        h, *_moe_args(params, 0), top_k=config.experts_per_token,
        renormalise=config.norm_topk, router_score="sigmoid",
        router_bias=params["router_bias"][0], expert_groups=config.expert_groups,
        topk_groups=config.topk_groups, routed_scale=config.routed_scale, shared=shared,
        block=BLOCK, return_loaded=True))
    np.testing.assert_allclose(got, want, **TOLERANCE["bfloat16"])
    assert int(loaded[0]) == len(np.unique(np.asarray(experts)))
    assert not races


@pytest.mark.parametrize("change, message", [
    (dict(router_score="sigmoid"), "router_bias is missing"),
    (dict(router_bias=jnp.zeros(8)), "router_bias is given"),
    (dict(expert_groups=2), "the softmax router has no groups"),
    (dict(router_score="sigmoid", router_bias=jnp.zeros(8), expert_groups=3),
     "expert_groups=3 must divide"),
    (dict(router_score="sigmoid", router_bias=jnp.zeros(8), expert_groups=4, top_k=3),
     "must hold top_k=3"),
    (dict(router_score="sparse"), "router_score='sparse' must be one of"),
    (dict(router_score="sigmoid", router_bias=jnp.zeros(8), routed_scale=0.0),
     "routed_scale=0.0 must be"),
])
def test_bad_routing_is_rejected(change, message):
    config, params, h = _kimi_moe()
    args = dict(top_k=2, renormalise=True) | change
    with pytest.raises(ValueError, match=message):
        mlp.moe(h, *_moe_args(params, 0), **args)


# -- TPU compiles ----------------------------------------------------------------------------
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_swiglu_compiles_for_tpu_at_qwen3_8b_shapes(chip):
    config = mk.preset("qwen3-8b")
    M, D, F = 8, config.hidden, config.ffn
    block = stage_block(mlp.swiglu_segments(D, F), "bfloat16")
    budget = vmem_budget("mk_swiglu", mlp.swiglu_buffers(M, D, F, "bfloat16", block),
                         mk.chip(chip))
    report = tpu.compile_for_chip(
        mlp.swiglu, [S((M, D), jnp.float32), S((D, F), jnp.bfloat16),
                     S((D, F), jnp.bfloat16), S((F, D), jnp.bfloat16)], chip, vmem=budget)
    assert report.ok, report.error


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_moe_compiles_for_tpu_at_qwen3_30b_a3b_shapes(chip):
    config = mk.preset("qwen3-30b-a3b")
    M, D, E, Fe, X = 8, config.hidden, config.experts, config.expert_ffn, 8
    block = stage_block(mlp.moe_segments(D, Fe, 1), "bfloat16")
    budget = vmem_budget("mk_moe", mlp.moe_buffers(M, D, E, Fe, "bfloat16", block),
                         mk.chip(chip))
    bf16 = jnp.bfloat16
    report = tpu.compile_for_chip(
        functools.partial(mlp.moe, top_k=X, renormalise=config.norm_topk),
        [S((M, D), jnp.float32), S((D, E), bf16), S((E, D, Fe), bf16), S((E, D, Fe), bf16),
         S((E, Fe, D), bf16)], chip, vmem=budget)
    assert report.ok, report.error


@pytest.mark.parametrize("groups, topk_groups", [
    (1, 1), pytest.param(8, 4, marks=pytest.mark.slow)])
def test_kimi_moe_compiles_for_tpu7x_at_kimi_k3s_tp32_shard(groups, topk_groups):
    """kimi-k2-shaped's MoE layer as one of 32 tensor-parallel devices holds it: all 896 experts,
    each expert's and the shared expert's width split 32 ways (2,048 / 32 = 64, padded to
    128 lanes: `mk.step.plan.shard_config`), top-16 of the sigmoid router with its bias,
    scaled by 2.827; bf16 experts (the preset's FP4 needs packed sharding, issue 14). Its
    one expert group, and DeepSeek-V3's grouping (the best 4 of 8 groups) to lower the
    group choice."""
    config = mk.preset("kimi-k2-shaped")
    M, D, E, X = 8, config.hidden, config.experts, config.experts_per_token
    Fe = Fs = 128
    block = stage_block(mlp.moe_segments(D, Fe, 1, Fs), "bfloat16")
    budget = vmem_budget("mk_moe", mlp.moe_buffers(M, D, E, Fe, "bfloat16", block,
                                                   shared_ffn=Fs, router_bias=True),
                         mk.chip("tpu7x"))
    bf16 = jnp.bfloat16
    report = tpu.compile_for_chip(
        lambda h, router, bias, g, u, d, sg, su, sd: mlp.moe(
            h, router, g, u, d, top_k=X, renormalise=config.norm_topk, router_score="sigmoid",
            router_bias=bias, expert_groups=groups, topk_groups=topk_groups,
            routed_scale=config.routed_scale, shared=(sg, su, sd)),
        [S((M, D), jnp.float32), S((D, E), bf16), S((E,), bf16), S((E, D, Fe), bf16),
         S((E, D, Fe), bf16), S((E, Fe, D), bf16), S((D, Fs), bf16), S((D, Fs), bf16),
         S((Fs, D), bf16)], "tpu7x", vmem=budget)
    assert report.ok, report.error


def test_an_oversized_expert_ring_is_refused_by_the_budget_and_by_the_compiler():
    M, D, E, Fe = 8, 4096, 8, 4096
    block = BlockSizes(slots=3, tile_rows=4096, tile_cols=4096)  # 3 x 32 MiB of bf16 tiles
    with pytest.raises(ValueError, match=r"over tpu7x's 64 MiB per core; biggest: ring"):
        vmem_budget("mk_moe", mlp.moe_buffers(M, D, E, Fe, "bfloat16", block),
                    mk.chip("tpu7x"))
    bf16 = jnp.bfloat16
    report = tpu.compile_for_chip(
        functools.partial(mlp.moe, top_k=2, renormalise=True, block=block),
        [S((M, D), jnp.float32), S((D, E), bf16), S((E, D, Fe), bf16), S((E, D, Fe), bf16),
         S((E, Fe, D), bf16)], "tpu7x")
    assert not report.ok and "RESOURCE_EXHAUSTED" in report.error


@pytest.mark.parametrize("used, joined, width", [(64, 128, 128), (32, 128, 128),
                                                 (96, 256, 128)])
def test_a_joined_products_gate_and_up_come_out_of_their_lanes(used, joined, width):
    """`split_gate_up` (the joined-expert layout, `gate_up_width`) in one kernel: gate's
    values are lanes [0, used) of the joined product, up's [used, 2 used), each brought
    to lanes [0, used) of a [M, width] part (Kimi K3 at TP32: 64 + 64 in 128 lanes; at
    TP64 32 + 32); a rotation the wrong way or by the wrong amount fails here."""
    x = jax.random.normal(jax.random.key(used), (8, joined), jnp.float32)
    with backend.use("interpret"):
        gate, up = joined_experts.gate_up(x, used, width)
    want = np.zeros((2, 8, width), np.float32)
    want[0, :, :used], want[1, :, :used] = x[:, :used], x[:, used:2 * used]
    np.testing.assert_array_equal(np.asarray(gate), want[0])
    np.testing.assert_array_equal(np.asarray(up), want[1])
    assert joined_experts.gate_up_width(128, used) == (128 if 2 * used <= 128 else None)
