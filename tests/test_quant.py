"""`mk.quant` (int8, fp8, int4, fp4 storage) and the quantised checkpoints `load_checkpoint`
reads (Hugging Face fine-grained FP8, gpt-oss MXFP4 experts).

Bit level: the element decoders against ml_dtypes for every code, packing round trips,
re-quantising a dequantised weight gives the same bytes. Checks: every element within its
scheme's error bound, and a planted 2x scale caught. Checkpoints: fixtures written here with
safetensors in each documented layout, decoded by an independent formula (numpy for FP8,
transformers' own MXFP4 converter), load to the same bytes and decode to the same tokens.
Accuracy against bf16 on a transformers-written tiny checkpoint, per scheme. Lowering: a
one-tile dequantise-and-matmul pallas_call per scheme compiled ahead of time for v5e, v6e and
tpu7x, and run in TPU interpret mode. Not covered: kernels streaming packed tiles (they do
not exist yet), TPU timing.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from builders import build_hf_model, hf_config_dict, hf_tensors, write_hf_folder
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mk
from mk import quant, reference

TINY = dataclasses.replace(mk.preset("tiny"), max_context=4096)
TINY_MOE = dataclasses.replace(mk.preset("tiny-moe"), max_context=4096)
ALL = dict(dense=None, experts=None, lm_head=None)


def quantise_all(config, params, scheme):
    return mk.quantize(config, params, dense=scheme, lm_head=scheme,
                       experts=scheme if config.is_moe else None)


# -- Bits -------------------------------------------------------------------------------
def test_e4m3_decoder_equals_ml_dtypes_for_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(quant.e4m3_values(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, want)  # NaN codes 0x7f, 0xff included
    assert np.isnan(got[[0x7F, 0xFF]]).all()


def test_e2m1_decoder_equals_ml_dtypes_for_all_16_codes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_values(jnp.asarray(codes))), want)


def test_nibble_packing_round_trips_bit_exactly_in_the_documented_order():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 128, 256), dtype=np.uint8)
    codes = np.asarray(quant.unpack_nibbles(jnp.asarray(packed)))
    np.testing.assert_array_equal(np.asarray(quant.pack_nibbles(codes)), packed)
    # The order: byte row 64u + j holds row 128u + j (low) and 128u + 64 + j (high).
    np.testing.assert_array_equal(codes[:, 128 + 5], packed[:, 64 + 5] & 15)
    np.testing.assert_array_equal(codes[:, 128 + 64 + 5], packed[:, 64 + 5] >> 4)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_requantising_the_dequantised_weight_gives_the_same_codes(scheme):
    w = np.random.default_rng(1).standard_normal((2, 256, 384)).astype(np.float32)
    q = quant.quantize_weight(w, scheme)
    values = quant.dequantize_tile(scheme, q.data, q.scale)
    again = quant.quantize_weight(values, scheme)
    if scheme == "fp4":
        # A group whose absmax rounds down to <= 3 * 2^e comes back with scale 2^(e-1) and
        # doubled codes (1.5 = 3 x 0.5 = 6 x 0.25): other bytes, the same values.
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize_tile(scheme, again.data, again.scale)),
            np.asarray(values))
    else:
        np.testing.assert_array_equal(np.asarray(again.data), np.asarray(q.data))
        # int4's bf16 scales come back exactly; int8's and fp8's float32 scales as
        # absmax(q * s) / qmax, within an ulp or two of s.
        np.testing.assert_allclose(np.asarray(again.scale, np.float32),
                                   np.asarray(q.scale, np.float32), rtol=3e-7, atol=0)
    assert q.shape == w.shape and q.nbytes == sum(
        quant.storage_bytes(w.shape, scheme).values())


# -- Checks -----------------------------------------------------------------------------
def plant_double_scale(q: quant.QuantWeight) -> quant.QuantWeight:
    """One group's scale (the first) twice what it should be."""
    scale = np.array(q.scale)
    index = (0,) * scale.ndim
    scale[index] = scale[index] + 1 if q.scheme == "fp4" else scale[index] * 2  # e8m0: +1
    return dataclasses.replace(q, scale=jnp.asarray(scale))


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_every_element_within_its_bound_and_a_planted_2x_scale_is_caught(scheme):
    config, params = TINY_MOE, mk.init_params(TINY_MOE)
    qparams = quantise_all(config, params, scheme)
    names = [n for names in quant.FAMILIES.values() for n in names if n in config.param_shapes()]
    for name in names:
        quant.check_error(name, params[name], qparams[name])
    with pytest.raises(ValueError, match=rf"we_down \({scheme}\): \d+ of .* (worst at "
                                         r"\(0, 0, \d+, \d+\))"):
        quant.check_error("we_down", params["we_down"], plant_double_scale(qparams["we_down"]))


def test_quantize_rejects_bad_families_and_shapes_by_name():
    params = mk.init_params(TINY)
    for kwargs, match in ((dict(dense="int3"), "dense='int3' must be one of"),
                          (dict(experts="int4"), "tiny has no experts")):
        with pytest.raises(ValueError, match=match):
            mk.quantize(TINY, params, **kwargs)
    with pytest.raises(ValueError, match="we_down: in dim I=64 must be a multiple of 128"):
        small = dataclasses.replace(TINY_MOE, expert_ffn=64)
        mk.quantize(small, mk.init_params(small), experts="int4")
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    with pytest.raises(ValueError, match="ties its lm_head"):
        mk.quantize(tied, mk.init_params(tied), lm_head="int8")


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_family_bytes_equal_the_quantised_arrays(scheme):
    config = TINY_MOE
    qparams = quantise_all(config, mk.init_params(config), scheme)
    counted = quant.family_bytes(config, dense=scheme, experts=scheme, lm_head=scheme)
    for family, names in quant.FAMILIES.items():
        held = [qparams[n] for n in names if n in qparams]
        assert counted[family] == {"data": sum(q.data.nbytes for q in held),
                                   "scales": sum(q.scale.nbytes for q in held)}, family
    other = sum(v.nbytes for n, v in qparams.items() if not isinstance(v, quant.QuantWeight))
    assert counted["other"]["data"] == other and counted["other"]["scales"] == 0
