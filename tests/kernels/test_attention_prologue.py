"""Stage 02: RMSNorm, Q/K/V through one ring, QK-norm and RoPE against
mk.model.reference.attention_inputs, race-free, with plain or quantised (packed) weights; compiled
for TPUs at qwen3-8b shapes.

Interpret mode checks numerics and DMA/semaphore pairing; not time or the scoped VMEM
limit (the compile tests cover lowering and capacity).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mk
from mk.kernels import backend
from mk.model import quant, reference
from mk.measure import tpu
from mk.kinds.attention.attention_prologue import (attention_prologue, attention_prologue_buffers,
                                          layer_mixer)
from mk.kinds.layers import kinds_at
from mk.model.presets import preset
from mk.kernels.common import BlockSizes, vmem_budget
from mk.model.weights import abstract_params
from builders import plant_double_scale, quantised_cases, tiny_moe_in_ci
from tolerances import TOLERANCE as ALL_TOLERANCES

TOLERANCE = ALL_TOLERANCES["prologue"]
BLOCK = BlockSizes(slots=3, tile_rows=128, tile_cols=256)


def _check(config, params, batch, rows, positions, layer=1):
    """The kernel against the reference on params' values (quantised weights dequantised);
    returns a function that checks another params' values against the same kernel run."""
    x = jax.random.normal(jax.random.key(batch * 8 + rows), (batch, rows, config.hidden))
    positions = jnp.asarray(positions, jnp.int32)
    with backend.use("interpret", detect_races=True, strict_dma=True):
        got = attention_prologue(config, params, x, positions, layer=layer, block=BLOCK)
    assert not backend.races_found()

    def matches(params):
        want = reference.attention_inputs(config, quant.dequantize(params), layer, x,
                                          positions)
        for name, g, w in zip("qkv", got, want):
            np.testing.assert_allclose(g, w, err_msg=name, **TOLERANCE[config.dtype])

    matches(params)
    return matches


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matches_the_reference_at_ragged_positions(dtype):
    config = dataclasses.replace(mk.preset("tiny"), dtype=dtype)
    _check(config, mk.init_params(config), batch=3, rows=2, positions=[0, 127, 254])


@pytest.mark.parametrize("scheme, dtype", quantised_cases("fp8"))
def test_quantised_weights_stream_packed_and_match_the_reference(scheme, dtype):
    """wq, wk, wv stored in `scheme`: the reference on their dequantised values; the same
    check fails on a planted 2x scale in one group of wk (a kernel that mis-scaled one
    streamed group would fail it the same way)."""
    config = dataclasses.replace(mk.preset("tiny"), dtype=dtype)
    qparams = mk.quantize(config, mk.init_params(config), dense=scheme)
    matches = _check(config, qparams, batch=2, rows=2, positions=[3, 130], layer=1)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        matches(dict(qparams, wk=plant_double_scale(qparams["wk"], at=(1, 0, 0))))


def test_without_qk_norm_matches_the_reference():
    config = dataclasses.replace(mk.preset("tiny"), qk_norm=False)
    _check(config, mk.init_params(config), batch=1, rows=1, positions=[5], layer=0)


@tiny_moe_in_ci("tiny_model")
@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 8), rows=st.integers(1, 8),
       where=st.sampled_from([0, 127, 128, 255]))
def test_any_batch_and_rows_match_the_reference(tiny_model, batch, rows, where):
    config, params = tiny_model
    _check(config, params, batch, rows, [min(where, 256 - rows)] * batch)


def test_bad_inputs_are_named():
    config = mk.preset("tiny")
    params = mk.init_params(config)
    with pytest.raises(ValueError, match=r"layer=2 must be an integer in \[0, layers=2\)"):
        attention_prologue(config, params, jnp.zeros((1, 1, 256)), jnp.zeros(1, int), layer=2)
    with pytest.raises(ValueError, match=r"B\*T=72 activation rows"):
        attention_prologue(config, params, jnp.zeros((9, 8, 256)), jnp.zeros(9, int))


@pytest.mark.parametrize("name, layer, streams", [
    ("tiny-hybrid", 2, r"\(gqa\) streams \('wq', 'wk', 'wv', 'wq_gate', 'wo'\)"),  # the gate
    ("tiny-hybrid", 0, r"\(deltanet\) streams \('lin_qkv', 'lin_z', 'lin_out'\)"),
    ("tiny-kimi", 2, r"\(mla\) streams \('wq', 'wkv_a', 'wo'\)")])
def test_a_layer_whose_mixer_is_not_qwen3s_attention_is_refused_by_its_kind(name, layer,
                                                                           streams):
    """The stage kernels build Qwen3's attention: a layer's mixer kind streaming other
    weights (Qwen3.5's gated attention or its linear layers, Kimi's MLA) is named."""
    config = mk.preset(name)
    x = jnp.zeros((1, 1, config.hidden))
    with pytest.raises(ValueError, match=f"layer {layer}'s token mixer {streams}"):
        attention_prologue(config, abstract_params(config), x, jnp.zeros(1, int), layer=layer)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compiles_for_tpu_at_qwen3_8b_shapes(chip):
    config = dataclasses.replace(mk.preset("qwen3-8b"), layers=1)
    block = BlockSizes(slots=3, tile_rows=512, tile_cols=1024)
    params = abstract_params(config)
    budget = vmem_budget("attention_prologue",
                         attention_prologue_buffers(config, 8, block), mk.chip(chip))
    report = tpu.compile_for_chip(
        lambda p, x, pos: attention_prologue(config, p, x, pos, block=block),
        [params, jax.ShapeDtypeStruct((8, 1, 4096), jnp.float32),
         jax.ShapeDtypeStruct((8,), jnp.int32)], chip, vmem=budget)
    assert report.ok, report.error


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid", "tiny-kimi", "tiny-gpt-oss"])
def test_layer_mixer_names_the_kind_the_kinds_place_at_each_layer(name):
    """The stage kernels ask the weight table for a layer's token mixer
    (`layer_mixer`); `mk.kinds.layers.kinds_at` answers the same."""
    config = preset(name)
    assert [layer_mixer(config, layer) for layer in range(config.layers)] == \
        [kinds_at(config, layer)[0].name for layer in range(config.layers)]
