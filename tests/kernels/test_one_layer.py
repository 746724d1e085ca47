"""Stage 05: one fused layer (prologue, attention, wo, MLP or MoE, residuals) against
mk.reference.decoder_layer, race-free, with the caches updated in place; compiled for TPUs
at qwen3-8b (dense) and qwen3-30b-a3b (MoE) shapes.

Interpret mode checks numerics, DMA/semaphore pairing and races; not time or the scoped
VMEM limit (the compile tests cover lowering and capacity).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mk
from mk import backend, reference, tpu
from mk.kernels.common import vmem_budget
from mk.kernels.one_layer import one_layer, one_layer_buffers
from mk.kernels.plan import default_block
from tolerances import TOLERANCE as ALL_TOLERANCES

TOLERANCE = ALL_TOLERANCES["layer"]
CONTEXT = 256


def _inputs(config, batch, rows, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (batch, rows, config.hidden))
    shape = (config.layers, batch, config.kv_heads, CONTEXT, config.head_dim)
    k = jax.random.normal(keys[1], shape).astype(config.dtype)
    v = jax.random.normal(keys[2], shape).astype(config.dtype)
    return x, k, v


def _assert_one_rounding_apart(got, want):
    """The new V rows: the kernel sums the V projection in float32 tile by tile through
    the ring, the reference in one dot, so the float32 sums differ by a few float32 ulps;
    rounded to the cache dtype they can land one step apart (seen in bf16: -2.140625 vs
    -2.15625). So each value may differ by one step of its dtype at that value, plus that
    float32 difference (1e-5 >> a few ulps of these O(1) sums); a wrong row, head or
    position is off by O(1)."""
    step = np.spacing(np.abs(np.asarray(want))).astype(np.float32)
    got, want = (np.asarray(a, np.float32) for a in (got, want))
    off = np.abs(got - want) > step + 1e-5
    assert not off.any(), (f"{off.sum()} of {off.size} values more than one rounding apart, "
                           f"first at {np.argwhere(off)[0]}: {got[off][0]} vs {want[off][0]}")


def _check(config, params, layer, batch, rows, positions):
    x, k, v = _inputs(config, batch, rows)
    positions = jnp.asarray(positions, jnp.int32)
    with backend.use("interpret", detect_races=True, strict_dma=True):
        got_x, got_k, got_v = one_layer(config, params, x, k, v, positions, layer=layer)
    assert not backend.races_found()
    want_x, want_k, want_v, _ = reference.decoder_layer(config, params, layer, x, k[layer],
                                                        v[layer], positions)
    np.testing.assert_allclose(got_x, want_x, **TOLERANCE[config.dtype])
    # V rows within one rounding (see above); K rows also went through RoPE in the kernel.
    _assert_one_rounding_apart(got_v[layer], want_v)
    np.testing.assert_allclose(got_k[layer].astype(jnp.float32),
                               want_k.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    others = np.array([i for i in range(config.layers) if i != layer])
    np.testing.assert_array_equal(got_k[others], k[others])
    np.testing.assert_array_equal(got_v[others], v[others])


@pytest.mark.parametrize("name, layer", [("tiny", 1), ("tiny-moe", 0), ("tiny-moe", 2)])
def test_dense_and_moe_layers_match_the_reference(name, layer):
    config = mk.preset(name)
    _check(config, mk.init_params(config), layer, batch=3, rows=2, positions=[0, 127, 254])


def test_float32_layer_matches_the_reference_tightly():
    config = dataclasses.replace(mk.preset("tiny-moe"), dtype="float32")
    _check(config, mk.init_params(config), 1, batch=2, rows=1, positions=[5, 128])


@settings(max_examples=2, deadline=None)
@given(batch=st.integers(1, 8), rows=st.integers(1, 8),
       where=st.sampled_from([0, 127, 128, CONTEXT - 1]))
def test_any_batch_and_rows_match_the_reference(tiny_model, batch, rows, where):
    config, params = tiny_model
    _check(config, params, config.layers - 1, batch, rows,
           [min(where, CONTEXT - rows)] * batch)


def test_one_rounding_apart_admits_one_step_and_no_more():
    want = jnp.array([-2.15625, 1.0, 0.0], jnp.bfloat16)
    _assert_one_rounding_apart(jnp.array([-2.140625, 1.0078125, 0.0], jnp.bfloat16), want)
    with pytest.raises(AssertionError, match="1 of 3 values more than one rounding apart"):
        _assert_one_rounding_apart(jnp.array([-2.125, 1.0, 0.0], jnp.bfloat16), want)


def test_bad_inputs_are_named():
    config = mk.preset("tiny")
    params = mk.init_params(config)
    x, k, v = _inputs(config, 1, 2)
    with pytest.raises(ValueError, match=r"positions\[0\]=255 with T=2 rows.*max_context=256"):
        one_layer(config, params, x, k, v, jnp.array([255]), layer=0)
    with pytest.raises(ValueError, match=r"layer=2 must be an integer in \[0, layers=2\)"):
        one_layer(config, params, x, k, v, jnp.array([0]), layer=2)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b"])
def test_compiles_for_tpu_at_real_shapes(name, chip):
    config = mk.preset(name).first_layers(2)
    B, T, S = 8, 1, 4096
    block = default_block(config, 256)
    params = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in config.param_shapes().items()}
    cache = jax.ShapeDtypeStruct((2, B, config.kv_heads, S, config.head_dim), config.dtype)
    kind = config.mlp_index(1)[0]
    budget = vmem_budget("one_layer", one_layer_buffers(config, (kind,), B, T, block),
                         mk.chip(chip))
    report = tpu.compile_for_chip(
        lambda p, x, k, v, pos: one_layer(config, p, x, k, v, pos, layer=1, block=block),
        [params, jax.ShapeDtypeStruct((B, T, config.hidden), jnp.float32), cache, cache,
         jax.ShapeDtypeStruct((B,), jnp.int32)], chip, vmem=budget)
    assert report.ok, report.error
