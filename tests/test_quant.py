"""`mk.model.quant` (int8, fp8, int4, fp4 storage) and the quantised checkpoints `load_checkpoint`
reads (Hugging Face fine-grained FP8, gpt-oss MXFP4 experts).

Bit level: the element decoders against ml_dtypes for every code, a packed tile's
byte-wise decode against numpy's for every byte at every position, packing round trips,
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
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import (build_hf_model, hf_config_dict, hf_tensors, plant_double_scale,
                      write_hf_folder)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mk
from mk.model import ops, quant, random_codes, reference, unpack
from mk.step.plan import default_block
from mk.model.weights import FORMAT_GROUPS, param_shapes

TINY = dataclasses.replace(mk.preset("tiny"), max_context=4096)
TINY_MOE = dataclasses.replace(mk.preset("tiny-moe"), max_context=4096)


def quantise_all(config, params, scheme):
    return mk.quantize(config, params, dense=scheme, lm_head=scheme,
                       experts=scheme if config.is_moe else None)


# -- Bits -------------------------------------------------------------------------------
def test_e4m3_decoder_equals_ml_dtypes_for_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(jnp.float8_e4m3fn).astype(np.float32)
    got = np.asarray(unpack.e4m3_values(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, want)  # NaN codes 0x7f, 0xff included
    assert np.isnan(got[[0x7F, 0xFF]]).all()


def test_e2m1_decoder_equals_ml_dtypes_for_all_16_codes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(jnp.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(unpack.e2m1_values(jnp.asarray(codes))), want)


@pytest.mark.parametrize("scheme", ["int4", "fp4"])
def test_a_packed_tile_decodes_byte_wise_to_ml_dtypes_values_times_its_scales(scheme):
    """`dequantize_tile` works on four packed bytes per 32-bit op (int4: one xor a word and
    the words viewed as int4, `int4_codes`; fp4: `fp4_words_to_e4m3`): every byte value at
    every byte position of a word, between random neighbours, decodes to the value
    ml_dtypes gives its code (numpy unpacks the documented order) times its group's scale,
    in float32 and rounded once to bf16: no shift carries a bit across a byte."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (256, 256), dtype=np.uint8)
    packed[:, :64] = np.arange(256, dtype=np.uint8).reshape(256, 1) ^ np.arange(64)
    units = packed.reshape(2, 2, 64, 256)  # 2 tiles' worth of 128-row units
    if scheme == "int4":  # byte row b: row 2b in the low nibble, row 2b + 1 in the high
        nibbles = np.stack([packed & 15, packed >> 4], axis=1).reshape(512, 256)
    else:  # the first rows' s e1 e0 m at bits 7 4 3 2; the others' at 5 6 1 0
        pair = (((units >> 4) & 8) | ((units >> 2) & 7),
                ((units >> 2) & 8) | ((units >> 4) & 4) | (units & 3))
        nibbles = np.concatenate(pair, axis=2).reshape(512, 256)
    if scheme == "int4":
        scale = rng.normal(size=(4, 256)).astype(jnp.bfloat16)
        values = (nibbles.astype(np.float32) - 8) * np.repeat(scale.astype(np.float32), 128, 0)
    else:
        scale = rng.integers(100, 155, (16, 256), dtype=np.uint8)
        values = nibbles.view(jnp.float4_e2m1fn).astype(np.float32) * np.repeat(
            np.ldexp(np.float32(1), scale.astype(np.int32) - 127), 32, 0)
    got = unpack.dequantize_tile(scheme, jnp.asarray(packed), jnp.asarray(scale))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.bfloat16)).view(np.uint16),
                                  values.astype(jnp.bfloat16).view(np.uint16))


@pytest.mark.parametrize("scheme", ["int4", "fp4"])
def test_packing_round_trips_bit_exactly_in_the_documented_order(scheme):
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 128, 256), dtype=np.uint8)
    codes = np.asarray(unpack.unpack_codes(scheme, jnp.asarray(packed)))
    np.testing.assert_array_equal(np.asarray(unpack.pack_codes(scheme, codes)), packed)
    # The order: int4's byte row b holds rows 2b (low nibble) and 2b + 1 (high); fp4's
    # byte row 64u + j holds rows 128u + j (first) and 128u + 64 + j (second).
    byte = packed[:, 64 + 5]
    if scheme == "int4":
        np.testing.assert_array_equal((codes[:, 128 + 10], codes[:, 128 + 11]),
                                      (byte & 15, byte >> 4))
    else:  # the first code where its e4m3 byte has its bits; the second's s, e1, e0 m at
        first, second = codes[:, 128 + 5], codes[:, 128 + 64 + 5]
        np.testing.assert_array_equal(unpack.e2m1_to_e4m3(jnp.asarray(first)), byte & 0x9C)
        np.testing.assert_array_equal(  # bits 5, 6 and 1..0
            second, ((byte >> 2) & 8) | ((byte >> 4) & 4) | (byte & 3))
    with pytest.raises(ValueError, match="scheme='int8': only int4 and fp4 pack"):
        unpack.pack_codes("int8", codes)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_requantising_the_dequantised_weight_gives_the_same_codes(scheme):
    w = np.random.default_rng(1).standard_normal((2, 256, 384)).astype(np.float32)
    q = quant.quantize_weight(w, scheme)
    values = unpack.dequantize_tile(scheme, q.data, q.scale)
    again = quant.quantize_weight(values, scheme)
    if scheme == "fp4":
        # A group whose absmax rounds down to <= 3 * 2^e comes back with scale 2^(e-1) and
        # doubled codes (1.5 = 3 x 0.5 = 6 x 0.25): other bytes, the same values.
        np.testing.assert_array_equal(
            np.asarray(unpack.dequantize_tile(scheme, again.data, again.scale)),
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
def test_int_weights_multiply_as_codes_with_their_scales_on_the_product_by_hand():
    """`mk.model.ops.scaled_dot` on a hand-computed case: activations rounded to bf16 (1 + 2^-9
    -> 1) times the codes, each 128-row block summed and then scaled: 3 (1 + 2^-10) +
    5 (1/2 + 2^-11) per column, every step exact in float32, where the weights rounded to
    bf16 (1 + 2^-10 -> 1) or unrounded activations give other sums."""
    x = jnp.full((1, 256), 1 + 2.0 ** -9, jnp.float32)
    codes = jnp.zeros((256, 2), jnp.int8).at[0].set(3).at[128].set(5)
    scales = jnp.array([[1 + 2.0 ** -10] * 2, [0.5 + 2.0 ** -11] * 2], jnp.float32)
    w = ops.Scaled(codes, scales, jnp.bfloat16)
    want = 3 * (1 + 2.0 ** -10) + 5 * (0.5 + 2.0 ** -11)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, w)), [[want, want]])
    assert float(ops.matmul(x, w.astype(jnp.bfloat16))[0, 0]) == 5.5
    assert float(ops.matmul(x, w.astype(jnp.float32))[0, 0]) != want
    np.testing.assert_array_equal(ops.dot("md,edf->mef", x, w[None], w.dtype), [[[want] * 2]])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dequantize_gives_int_weights_as_codes_and_scales_the_ring_multiplies_so(scheme):
    """`mk.model.quant.dequantize`'s int8 and int4 weights are `mk.model.ops.Scaled` (codes, float32
    scales, the model's dtype for the activations) whose values are `dequantize_tile`'s,
    and whose product is the ring's own function on the whole weight as one tile
    (`mk.model.unpack.int_product`, bf16 activations), to float32 summation order; with a dtype,
    plain arrays."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(2, 384, 128)), jnp.bfloat16)
    q = quant.quantize_weight(w, scheme)
    got = quant.dequantize({"embed": w[0], "w": q})["w"]
    assert isinstance(got, ops.Scaled) and got.dtype == jnp.bfloat16 and got.shape == w.shape
    np.testing.assert_array_equal(got.astype(jnp.float32),
                                  unpack.dequantize_tile(scheme, q.data, q.scale))
    x = jnp.asarray(rng.normal(size=(8, 384)), jnp.float32)
    tile = jax.jit(unpack.int_product, static_argnums=0)(
        scheme, q.data[1], q.scale[1], x.astype(jnp.bfloat16))
    np.testing.assert_allclose(ops.matmul(x, got[1]), tile, rtol=1e-6, atol=1e-5)
    plain = quant.dequantize({"embed": w[0], "w": q}, jnp.bfloat16)["w"]
    assert plain.dtype == jnp.bfloat16 and plain.shape == w.shape


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_every_element_within_its_bound_and_a_planted_2x_scale_is_caught(scheme):
    config, params = TINY_MOE, mk.init_params(TINY_MOE)
    qparams = quantise_all(config, params, scheme)
    names = [n for names in FORMAT_GROUPS.values() for n in names if n in param_shapes(config)]
    for name in names:
        quant.check_error(name, params[name], qparams[name])
    with pytest.raises(ValueError, match=rf"we_down \({scheme}\): \d+ of .* (worst at "
                                         r"\(0, 0, \d+, \d+\))"):
        quant.check_error("we_down", params["we_down"], plant_double_scale(qparams["we_down"]))


@pytest.mark.parametrize("w, message", [
    ("1.5", "a weight is an array .* not a str"), ([[1.0], [1.0, 2.0]], "numbers; got list"),
    (np.ones(256), r"shape \(256,\) has no \[I, O\] matrix")])
def test_quantize_weight_refuses_what_is_no_matrix_of_numbers_by_name(w, message):
    """Issue 65: a string was parsed as a number, a vector failed unpacking its shape."""
    with pytest.raises(ValueError, match=f"wq: .*{message}"):
        quant.quantize_weight(w, "int8", "wq")
    assert quant.quantize_weight(np.ones((128, 8)), "int8", "wq").scheme == "int8"


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
    without_wk = {k: v for k, v in params.items() if k != "wk"}
    with pytest.raises(ValueError, match=r"params has no 'wk', which tiny needs "
                                         r"\(bfloat16\[2, 256, 256\]\); 1 of its"):
        mk.quantize(TINY, without_wk, dense="int8")
    with pytest.raises(ValueError, match="params is a list"):
        mk.quantize(TINY, list(params), dense="int8")
    with pytest.raises(ValueError, match="config='tiny' must be a ModelConfig"):
        mk.quantize("tiny", params, dense="int8")  # was AttributeError: no 'is_mla'
    for wk, got in ((params["wk"][:, :128], r"bfloat16\[2, 128, 256\]"),  # were quantised
                    (params["wk"].astype(jnp.float32), r"float32\[2, 256, 256\]"),
                    ([[1.0]], "a list, not an array"), (None, "a NoneType, not an array")):
        with pytest.raises(ValueError, match=rf"params\['wk'\] is {got}; tiny needs "
                                             r"bfloat16\[2, 256, 256\]"):
            mk.quantize(TINY, params | {"wk": wk}, dense="int8")
    with pytest.raises(ValueError, match="params has 'zz', which tiny has no place for"):
        mk.quantize(TINY, params | {"zz": params["wk"]}, dense="int8")
    low_rank_q = dataclasses.replace(mk.preset("tiny-kimi"), q_rank=128)  # wq DMA'd whole
    with pytest.raises(NotImplementedError, match=r"wq \(mla, path 'dma'\) would be stored"):
        mk.quantize(low_rank_q, mk.init_params(low_rank_q), dense="int8")


def test_a_configs_own_formats_are_its_stored_bytes_and_group_bytes_default():
    config = dataclasses.replace(TINY_MOE, formats={"experts": "fp4", "dense": "int8"})
    groups = quant.group_bytes(config)
    assert groups == quant.group_bytes(TINY_MOE, dict(config.formats))
    assert quant.stored_bytes(config) == sum(sum(g.values()) for g in groups.values())
    assert quant.stored_bytes(config) < quant.stored_bytes(TINY_MOE)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_group_bytes_equal_the_quantised_arrays(scheme):
    config = TINY_MOE
    qparams = quantise_all(config, mk.init_params(config), scheme)
    counted = quant.group_bytes(config, dict(dense=scheme, experts=scheme, lm_head=scheme))
    for family, names in FORMAT_GROUPS.items():
        held = [qparams[n] for n in names if n in qparams]
        assert counted[family] == {"data": sum(q.data.nbytes for q in held),
                                   "scales": sum(q.scale.nbytes for q in held)}, family
    other = sum(v.nbytes for n, v in qparams.items() if not isinstance(v, quant.QuantWeight))
    assert counted["other"]["data"] == other and counted["other"]["scales"] == 0


# -- Quantised checkpoints ----------------------------------------------------------------
PROMPT = np.random.default_rng(2).integers(0, 512, (2, 8))
STEPS, CONTEXT = 16, 32


def fp8_tensors(config, params, qparams) -> dict:
    """HF fine-grained FP8 tensors: each quantised projection as `weight` float8_e4m3fn
    [O, I] plus `weight_scale_inv` float32 [O/128, I/128], written from scratch here."""
    plain = hf_tensors(config, params)
    out = {}
    for name, value in plain.items():
        param = slot_of(config, name)
        q = qparams.get(param[0]) if param else None
        if not isinstance(q, quant.QuantWeight):
            out[name] = value
            continue
        data, scale = np.asarray(q.data)[param[1]], np.asarray(q.scale)[param[1]]
        out[name] = data.T.view(jnp.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.T.copy()
    return out


def fp8_checkpoint(config):
    """(params, their fp8 quantisation, config.json dict, HF tensors) of a fixture."""
    params = mk.init_params(config)
    qparams = quantise_all(config, params, "fp8")
    hf = {**hf_config_dict(config), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}}
    return params, qparams, hf, fp8_tensors(config, params, qparams)


def slot_of(config, hf_name):
    """(mk param, index) of an HF tensor name, spelled out independently of hf_layout."""
    parts = hf_name.split(".")
    if hf_name == "lm_head.weight":
        return "lm_head", ()
    if parts[1] != "layers":
        return None
    i = int(parts[2])
    proj = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
    if parts[4] in proj:
        return proj[parts[4]], (i,)
    if parts[3] == "mlp" and parts[4] == "experts":
        return f"we_{parts[6][:-5]}", (config.moe_layers.index(i), int(parts[5]))
    if parts[3] == "mlp" and parts[4].endswith("_proj"):
        return f"w_{parts[4][:-5]}", (config.dense_layers.index(i),)
    return None


def numpy_fp8_params(config, folder) -> dict:
    """The fixture decoded by HF's formula in numpy: w = weight * scale_inv per block."""
    path = folder / "model.safetensors"
    with open(path, "rb") as f:  # safetensors' numpy reader has no float8: read the bytes
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        raw = f.read()
    tensors = {}
    for name, info in header.items():
        if name != "__metadata__":
            dtype = {"F8_E4M3": jnp.float8_e4m3fn, "F32": np.float32,
                     "BF16": jnp.bfloat16}[info["dtype"]]
            start, end = info["data_offsets"]
            tensors[name] = np.frombuffer(raw[start:end], dtype).reshape(info["shape"])
    params = {}
    for name, value in tensors.items():
        if value.dtype == jnp.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"]
            full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)
            value = value.astype(np.float32) * full
        elif name.endswith("_scale_inv"):
            continue
        param, index = slot_of(config, name) or (None, None)
        if param is None:
            continue
        params.setdefault(param, np.zeros(param_shapes(config)[param][0], np.float32))
        params[param][index] = value.T
    return params


@pytest.mark.parametrize("config", [TINY, pytest.param(TINY_MOE, marks=pytest.mark.slow)],
                         ids=["tiny", "tiny-moe"])
def test_hf_fp8_checkpoint_loads_its_bytes_and_decodes_the_dequantised_models_tokens(
        config, tmp_path):
    _, qparams, hf, tensors = fp8_checkpoint(config)
    folder = write_hf_folder(hf, tensors, tmp_path)
    loaded_config, loaded = mk.load_checkpoint(folder)
    assert loaded_config == config
    for name, q in qparams.items():
        got = loaded[name]
        if isinstance(q, quant.QuantWeight):
            assert got.scheme == "fp8"
            np.testing.assert_array_equal(np.asarray(got.data), np.asarray(q.data), name)
            np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(q.scale), name)
    tokens = reference.generate(config, quant.dequantize(loaded), PROMPT, STEPS,
                                max_context=CONTEXT)
    want = reference.generate(config, quant.dequantize(qparams), PROMPT, STEPS,
                              max_context=CONTEXT)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
    # HF's own formula on the file's tensors, in numpy: the same weights.
    dequantised = quant.dequantize(loaded)
    for name, value in numpy_fp8_params(config, folder).items():
        np.testing.assert_array_equal(np.asarray(dequantised[name], np.float32),
                                      value.astype(jnp.bfloat16).astype(np.float32))


def test_a_bad_fp8_checkpoint_names_every_problem_in_one_error(tmp_path):
    params, _, hf, tensors = fp8_checkpoint(TINY)
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    tensors["model.layers.1.self_attn.q_proj.weight_scale_inv"] = np.ones((2, 4), np.float32)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.asarray(  # one layer of w_up in bf16
        params["w_up"][1], np.float32).T
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    tensors["model.embed_tokens.weight_scale_inv"] = np.ones((4, 2), np.float32)
    write_hf_folder(hf, tensors, tmp_path)
    with pytest.raises(ValueError) as err:
        mk.load_checkpoint(tmp_path)
    message = str(err.value)
    for expected in ("(4 problems)",
                     "missing tensor model.layers.0.self_attn.k_proj.weight_scale_inv",
                     "q_proj.weight_scale_inv has shape (2, 4), expected (4, 2)",
                     "mk w_up: some of its tensors are float8_e4m3fn and some are not",
                     "unexpected tensor model.embed_tokens.weight_scale_inv"):
        assert expected in message, message
    with pytest.raises(ValueError, match=r"weight_block_size=\[64, 64\]"):
        hf["quantization_config"]["weight_block_size"] = [64, 64]
        (tmp_path / "config.json").write_text(json.dumps(hf))
        mk.load_checkpoint(tmp_path)


def test_fp8_nan_codes_and_scales_and_unknown_quant_methods_are_refused(tmp_path):
    """A NaN code in a weight and a NaN scale in another, each named by its mk weight and
    field (`mk.model.quant.check_values`), in one error."""
    _, _, hf, tensors = fp8_checkpoint(TINY)
    name = "model.layers.0.mlp.down_proj.weight"
    codes = tensors[name].view(np.uint8).copy()
    codes[3, 5] = 0x7F  # e4m3's NaN
    tensors[name] = codes.view(jnp.float8_e4m3fn)
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    tensors[scale] = tensors[scale].copy()
    tensors[scale][0, 1] = np.nan  # [O/128, I/128]: mk's [1 (layer), 1, 0]
    write_hf_folder(hf, tensors, tmp_path)
    with pytest.raises(ValueError, match=r"\(2 problems\):\n  mk wo \(fp8\): 1 of 16 scale "
                                         r"values are NaN or inf, the first at \(1, 1, 0\);.*"
                                         r"\n  mk w_down \(fp8\): 1 of 262144 data values "
                                         r"are codes 0x7f / 0xff \(NaN\), the first at "
                                         r"\(0, 5, 3\)"):
        mk.load_checkpoint(tmp_path)
    hf["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(NotImplementedError, match="quant_method='gptq' is not read"):
        mk.load_checkpoint(tmp_path)


def gpt_oss_blocks(q: quant.QuantWeight, layer: int):
    """mk fp4 [E, I/2, O] -> gpt-oss blocks [E, O, I/32, 16], scales [E, O, I/32]:
    values 2k (low nibble) and 2k + 1 (high) of each 32-value block along I."""
    codes = np.swapaxes(np.asarray(unpack.unpack_codes("fp4", q.data[layer])), -1, -2)
    pairs = codes.reshape(*codes.shape[:-1], -1, 16, 2).astype(np.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4), np.swapaxes(np.asarray(q.scale[layer]), -1, -2)


def test_gpt_oss_mxfp4_experts_load_bit_exactly_and_match_transformers_dequantisation(
        tmp_path):
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config, params = TINY_MOE, mk.init_params(TINY_MOE)
    qparams = mk.quantize(config, params, experts="fp4")
    tensors = {k: v for k, v in hf_tensors(config, params).items() if ".experts." not in k}
    for j, i in enumerate(config.moe_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        (gb, gs), (ub, us) = (gpt_oss_blocks(qparams[p], j) for p in ("we_gate", "we_up"))
        # gpt-oss interleaves rows: 2f is gate row f, 2f + 1 is up row f.
        tensors[prefix + "gate_up_proj_blocks"] = np.stack([gb, ub], 2).reshape(
            gb.shape[0], -1, *gb.shape[2:])
        tensors[prefix + "gate_up_proj_scales"] = np.stack([gs, us], 2).reshape(
            gs.shape[0], -1, gs.shape[2])
        tensors[prefix + "down_proj_blocks"], tensors[prefix + "down_proj_scales"] = \
            gpt_oss_blocks(qparams["we_down"], j)
    hf = {**hf_config_dict(config), "quantization_config": {"quant_method": "mxfp4"}}
    write_hf_folder(hf, tensors, tmp_path)
    _, loaded = mk.load_checkpoint(tmp_path)
    for name in FORMAT_GROUPS["experts"]:
        np.testing.assert_array_equal(np.asarray(loaded[name].data),
                                      np.asarray(qparams[name].data), name)
        np.testing.assert_array_equal(np.asarray(loaded[name].scale),
                                      np.asarray(qparams[name].scale), name)
    deq = quant.dequantize(loaded)
    prefix = f"model.layers.{config.moe_layers[1]}.mlp.experts."
    hf_gate_up = convert_moe_packed_tensors(
        torch.from_numpy(tensors[prefix + "gate_up_proj_blocks"]),
        torch.from_numpy(tensors[prefix + "gate_up_proj_scales"])).float().numpy()
    for name, rows in (("we_gate", slice(0, None, 2)), ("we_up", slice(1, None, 2))):
        np.testing.assert_array_equal(np.asarray(deq[name][1], np.float32),
                                      hf_gate_up[..., rows], name)
    scales = tensors[prefix + "down_proj_scales"]
    tensors[prefix + "down_proj_scales"] = scales[:, :, :2]
    write_hf_folder(hf, tensors, tmp_path)
    with pytest.raises(ValueError, match=r"down_proj_scales has shape \(8, 256, 2\), "
                                         r"expected \(8, 256, 4\)"):
        mk.load_checkpoint(tmp_path)
    tensors[prefix + "down_proj_scales"] = scales.copy()
    tensors[prefix + "down_proj_scales"][2, 7, 1] = 255  # e8m0's NaN: mk [layer 1, 2, 1, 7]
    write_hf_folder(hf, tensors, tmp_path)
    with pytest.raises(ValueError, match=r"mk we_down \(fp4\): 1 of \d+ scale values are "
                                         r"codes 0xff \(NaN\), the first at \(1, 2, 1, 7\)"):
        mk.load_checkpoint(tmp_path)


# -- Accuracy against bf16 ------------------------------------------------------------------
ACCURACY_STEPS = 64
# A transformers Qwen3-MoE with TPU-legal widths (128-multiples): layer 0 dense, layer 1 MoE,
# untied lm_head, so every family (dense, experts, lm_head) is quantised.
ACCURACY_MODEL = dict(vocab_size=512, hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, intermediate_size=256,
                      moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=2, mlp_only_layers=[0], norm_topk_prob=True,
                      tie_word_embeddings=False, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=10_000.0, attn_implementation="eager",
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Upper bounds on the relative RMS of logits and lower bounds on greedy agreement (the
# fraction of steps whose argmax is the bf16 model's), both teacher-forced on the bf16
# model's 2 x 64 greedy tokens; the test prints the measured values and the free-running
# common prefix (once one token differs, the sequences part, so that is not a rate).
ACCURACY_BOUNDS = {"int8": (0.03, 0.95), "fp8": (0.1, 0.85), "int4": (0.3, 0.65),
                   "fp4": (0.3, 0.65)}


@pytest.fixture(scope="module")
def accuracy_model(tmp_path_factory):
    """(config, bf16 params) of a transformers-written tiny Qwen3-MoE checkpoint."""
    folder = tmp_path_factory.mktemp("accuracy")
    build_hf_model("qwen3_moe", ACCURACY_MODEL).save_pretrained(folder)
    return mk.load_checkpoint(folder, dtype="bfloat16")


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_accuracy_against_bf16_on_a_transformers_checkpoint(accuracy_model, scheme):
    config, params = accuracy_model
    got = quant.accuracy(config, params, quantise_all(config, params, scheme), PROMPT,
                         ACCURACY_STEPS)
    print(f"\n{scheme}: relative RMS of logits {got.rel_rms:.4f}, greedy agreement "
          f"{got.agreement:.3f} (teacher-forced, {PROMPT.shape[0]} x {ACCURACY_STEPS} steps), "
          f"free-running common prefix {got.prefix} of {ACCURACY_STEPS}")
    max_rms, min_agree = ACCURACY_BOUNDS[scheme]
    assert got.rel_rms < max_rms and got.agreement >= min_agree
    # The same measure sees a planted 2x scale in every group of layer 0's wo (not wq:
    # QK-norm divides a uniformly doubled q by its own RMS, so logits would not move).
    planted = quantise_all(config, params, scheme)
    scale = np.array(planted["wo"].scale)
    scale[0] = scale[0] + 1 if scheme == "fp4" else scale[0] * 2
    planted["wo"] = dataclasses.replace(planted["wo"], scale=jnp.asarray(scale))
    planted_rms = quant.accuracy(config, params, planted, PROMPT, ACCURACY_STEPS).rel_rms
    print(f"{scheme} with wo[0]'s scales doubled: relative RMS {planted_rms:.4f}")
    assert planted_rms > max_rms  # the bound separates a correct scheme from this bug


# -- Lowering: one tile, dequantised in VMEM, on every chip -------------------------------
TILE_ROWS = 8  # M activation rows of the probe


def dequant_matmul(scheme: str, data, scale, x):
    """x [M, I] @ (the tile dequantised to bf16) -> [M, O] float32, as one pallas_call whose
    body is mk.model.quant's decoder: the code a streaming kernel runs on each tile."""
    def kernel(data_ref, scale_ref, x_ref, out_ref):
        w = unpack.dequantize_tile(scheme, data_ref[...], scale_ref[...]).astype(jnp.bfloat16)
        out_ref[...] = jnp.dot(x_ref[...].astype(jnp.bfloat16), w,
                               preferred_element_type=jnp.float32)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(
        (x.shape[0], data.shape[-1]), jnp.float32), name=f"mk_dequant_{scheme}")(
            data, scale, x)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_one_tile_dequantises_in_interpret_mode_and_compiles_for_v5e_v6e_tpu7x(scheme):
    rng = np.random.default_rng(3)
    q = quant.quantize_weight(rng.standard_normal((256, 256)).astype(np.float32), scheme)
    x = jnp.asarray(rng.standard_normal((TILE_ROWS, 256)), jnp.float32)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = jax.jit(functools.partial(dequant_matmul, scheme))(q.data, q.scale, x)
    w = unpack.dequantize_tile(scheme, q.data, q.scale).astype(jnp.bfloat16)
    want = ops.dot("mi,io->mo", x, w, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for chip in ("v5e", "v6e", "tpu7x"):
        report = mk.measure.tpu.compile_for_chip(functools.partial(dequant_matmul, scheme),
                                         [q.data, q.scale, x], chip)
        assert report.ok, report.summary()


def test_a_native_float4_tile_is_refused_by_mosaic_on_v5e():
    """Why mk.model.quant packs fp4 into uint8: the native float4_e2m1fn type does not lower on
    v5e (nor v6e; it does on tpu7x), measured with the pinned libtpu."""
    def kernel(w_ref, x_ref, out_ref):
        w = w_ref[...].astype(jnp.float32).astype(jnp.bfloat16)
        out_ref[...] = jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32)

    def native(w, x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((TILE_ROWS, 256),
                                                                     jnp.float32))(w, x)

    args = [jax.ShapeDtypeStruct((256, 256), jnp.float4_e2m1fn),
            jax.ShapeDtypeStruct((TILE_ROWS, 256), jnp.bfloat16)]
    report = mk.measure.tpu.compile_for_chip(native, args, "v5e")
    assert not report.ok and "f4E2M1FN" in report.error


# -- Bytes per step -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "qwen3-0.6b", "qwen3-30b-a3b"])
def test_predicted_step_bytes_shrink_by_each_formats_bits_per_value(name):
    """mk.cost.perf.predict(formats=) streams each quantised family at mk.model.quant.tile_bytes per
    tile of the default tiling (the kernel's DMAs: tests/test_plan.py); per value that is
    the format's bits plus its scales' share (an expert matrix's by its own tile, where
    the experts take tiles of their own: `BlockSizes.tiles`)."""
    config = mk.preset(name)
    plain = mk.cost.perf.predict(config, "v6e", batch=4, rows=2, context=512)
    per_value = {"int8": lambda tk: 8 + 32 / tk, "fp8": lambda tk: 8 + 32 / 128 ** 2,
                 "int4": lambda tk: 4 + 16 / 128, "fp4": lambda tk: 4 + 8 / 32}  # bits:
    for scheme, value_bits in per_value.items():  # data plus scales, per tile_rows tk
        formats = dict(dense=scheme) | ({} if config.tie_embeddings else dict(lm_head=scheme)
                                        ) | (dict(experts=scheme) if config.is_moe else {})
        block = default_block(config, 512, formats=formats)
        own = dict(block.tiles)
        bits = value_bits(block.tile_rows)
        experts = ("we_gate", "we_up", "we_down")  # each [D, Fe] or [Fe, D]: a third each
        expert_bits = sum(value_bits(own.get(n, (block.tile_rows,))[0]) for n in experts) / 3
        est = mk.cost.perf.predict(config, "v6e", batch=4, rows=2, context=512, formats=formats)
        fields = ["attention_bytes", "dense_mlp_bytes", "expert_bytes"]
        for field in fields + ([] if config.tie_embeddings else ["lm_head_bytes"]):
            want = expert_bits if field == "expert_bytes" else bits
            assert getattr(est, field) == pytest.approx(getattr(plain, field) * want / 16,
                                                        rel=1e-12), (scheme, field)
        assert est.router_bytes == plain.router_bytes and est.kv_read_bytes == plain.kv_read_bytes


# -- Random weights drawn as codes (`random_weight`, `init_params(formats=)`) ----------------
@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_random_weight_decodes_to_finite_values_near_its_rms_with_varied_scales(scheme):
    """Every code a real one (no NaN code: `check_values`), the values' root mean square
    within 2x of the target, and the blocks' scales not all equal (a kernel applying the
    wrong block's scale would otherwise pass)."""
    rms = 0.03
    q = random_codes.random_weight((3, 256, 256), scheme, np.random.default_rng(0), rms)
    quant.check_values("w", q)
    values = np.asarray(quant.dequantize({"w": q}, jnp.float32)["w"], np.float64)
    assert np.isfinite(values).all()
    assert rms / 2 < np.sqrt(np.mean(values ** 2)) < 2 * rms
    assert len(np.unique(np.asarray(q.scale.astype(jnp.float32)))) > 1


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_a_random_weights_codes_past_its_own_shape_are_zero(scheme):
    """A lane-padded weight: the codes in the corner are random, past it zero values."""
    q = random_codes.random_weight((256, 256), scheme, np.random.default_rng(1), 0.05,
                                   own=(200, 130))
    values = np.asarray(quant.dequantize({"w": q}, jnp.float32)["w"])
    assert not values[200:].any() and not values[:, 130:].any()
    assert np.count_nonzero(values[:200, :130]) > 0.8 * 200 * 130
    with pytest.raises(ValueError, match=r"w: own=\(300, 130\) must fit"):
        random_codes.random_weight((256, 256), scheme, np.random.default_rng(1), 0.05,
                                   own=(300, 130), name="w")


@pytest.mark.parametrize("config, formats", [
    (TINY, dict(dense="int4", lm_head="fp8")),
    (dataclasses.replace(TINY_MOE, expert_ffn=96).lane_padded(),
     dict(experts="fp4", dense="int8"))], ids=["tiny", "tiny-moe-padded"])
def test_init_params_with_formats_draws_codes_in_quantizes_layout(config, formats):
    """`init_params(config, seed, formats)`: the same tensors, shapes and dtypes as
    `quantize(config, init_params(config, seed), **formats)` (the plain ones equal), the
    chosen ones drawn as codes; the same seed gives the same bytes, another seed others;
    a lane-padded model's padding decodes to zero."""
    made = mk.init_params(config, 0, formats)
    want = mk.quantize(config, mk.init_params(config, 0), **formats)
    assert made.keys() == want.keys()
    for name, w in want.items():
        got = made[name]
        if not isinstance(w, quant.QuantWeight):
            np.testing.assert_array_equal(got, w, err_msg=name)
            continue
        assert (got.scheme, got.data.shape, got.data.dtype, got.scale.shape,
                got.scale.dtype) == (w.scheme, w.data.shape, w.data.dtype, w.scale.shape,
                                     w.scale.dtype), name
        again = mk.init_params(config, 0, formats)[name]
        np.testing.assert_array_equal(got.data, again.data, err_msg=name)
        assert not np.array_equal(got.data, mk.init_params(config, 1, formats)[name].data)
    if config.padding:
        values = np.asarray(quant.dequantize({"w": made["we_down"]}, jnp.float32)["w"])
        assert not values[..., 96:, :].any() and values[..., :96, :].any()
