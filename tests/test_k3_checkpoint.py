"""Kimi K3 checkpoints: a tiny one written with the release's tensor names and formats
(tiny-k3's shapes, MXFP4 experts as safetensors) loads into the values written, and
`mk.model.reference` runs on them; a bad one is refused naming the tensor, the value and the
expectation.

The names are the release's (Inferact/tpu-megakernels, kimi/load.py: the prefix
language_model.model., language_model.lm_head.weight, each tensor its Checkpoint.dense
reads, the experts' w1/w2/w3 weight_packed and weight_scale). They are spelled out by
hand here, independently of `mk.model.weights` and `mk.model.hf_layout`, so the round trip tests the
loader's mapping rather than repeating it; the experts' values are decoded by hand too.
Not here: the reference's K3 equations (tests/test_k3.py).
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import mk
from mk.model import quant, reference
from mk.model.checkpoint import init_params, load_checkpoint
from tests.builders import write_hf_folder

TINY = dataclasses.replace(mk.preset("tiny-k3"), dtype="float32")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                np.float32)
MODEL, HEAD = "language_model.model.", "language_model."


def k3_config_json(c) -> dict:
    """config.json of `c` as K3's: model_type kimi_k3 wrapping text_config (the fields the
    release's Config.from_checkpoint reads and requires, plus MLA's head dims) and the
    compressed-tensors MXFP4 quantization_config of its routed experts."""
    text = {
        "model_type": "kimi_linear", "vocab_size": c.vocab, "hidden_size": c.hidden,
        "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
        "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_position,
        "tie_word_embeddings": False, "hidden_act": "situ",
        "activation_situ_beta": c.situ_beta, "activation_situ_linear_beta":
            c.situ_linear_beta, "intermediate_size": c.ffn,
        "q_lora_rank": c.q_rank, "kv_lora_rank": c.latent_rank,
        "qk_rope_head_dim": c.rope_dim, "qk_nope_head_dim": c.head_dim - c.rope_dim,
        "v_head_dim": c.value_dim, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i in c.full_layers],
            "kda_layers": [i + 1 for i in c.linear_layers],
            "num_heads": c.linear_value_heads, "head_dim": c.linear_key_dim,
            "short_conv_kernel_size": c.conv_kernel, "use_full_rank_gate": True,
            "gate_lower_bound": c.kda_gate_bound},
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": c.experts,
        "num_experts_per_token": c.experts_per_token,
        "moe_intermediate_size": c.expert_ffn,
        "num_shared_experts": c.shared_expert_ffn // c.expert_ffn,
        "routed_expert_hidden_size": c.moe_latent, "latent_moe_use_norm": True,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": c.routed_scale,
        "attn_res_block_size": c.residual_block}
    quantization = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "weights": {"group_size": 32, "num_bits": 4}}}}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "torch_dtype": c.dtype, "text_config": text, "quantization_config": quantization}


def mxfp4(rng, out: int, inp: int):
    """A random MXFP4 matrix as the checkpoint stores it: (weight_packed uint8 [out,
    inp/2], weight_scale uint8 [out, inp/32]) and its values [inp, out] (mk's layout),
    decoded by hand: code 2j in byte j's low nibble, e2m1 times 2^(scale - 127)."""
    codes = rng.integers(0, 16, (out, inp), dtype=np.uint8)
    scale = rng.integers(121, 124, (out, inp // 32), dtype=np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    values = E2M1[codes] * np.exp2(np.repeat(scale, 32, axis=1).astype(np.float32) - 127)
    return packed.astype(np.uint8), scale, values.T


def k3_checkpoint(c, seed: int = 0):
    """(tensors by K3's names, mk params of the same values): plain weights from
    `init_params`, the routed experts random MXFP4."""
    p = {name: np.array(v) for name, v in init_params(c, seed).items()}
    rng = np.random.default_rng(seed)
    t = {f"{MODEL}embed_tokens.weight": p["embed"], f"{MODEL}norm.weight": p["final_norm"],
         f"{HEAD}lm_head.weight": p["lm_head"].T,
         f"{MODEL}output_attn_res_norm.weight": p["output_res_norm"],
         f"{MODEL}output_attn_res_proj.weight": p["output_res_proj"].T}
    kw = c.linear_key_width
    for i in range(c.layers):
        at = f"{MODEL}layers.{i}."
        t |= {at + "input_layernorm.weight": p["attn_norm"][i],
              at + "post_attention_layernorm.weight": p["mlp_norm"][i],
              at + "self_attention_res_norm.weight": p["attn_res_norm"][i],
              at + "self_attention_res_proj.weight": p["attn_res_proj"][i].T,
              at + "mlp_res_norm.weight": p["mlp_res_norm"][i],
              at + "mlp_res_proj.weight": p["mlp_res_proj"][i].T}
        a = at + "self_attn."
        if i in c.linear_layers:
            r = c.linear_layers.index(i)
            for j, part in enumerate("qkv"):
                t[f"{a}{part}_proj.weight"] = p["lin_qkv"][r][:, j * kw:(j + 1) * kw].T
                t[f"{a}{part}_conv1d.weight"] = p["lin_conv"][r][:, j * kw:(j + 1) * kw].T[
                    :, None, :]
            t |= {a + "b_proj.weight": p["lin_b"][r].T, a + "f_a_proj.weight":
                  p["kda_f_a"][r].T, a + "f_b_proj.weight": p["kda_f_b"][r].T,
                  a + "g_proj.weight": p["kda_g"][r].T, a + "A_log": p["lin_a_log"][r],
                  a + "dt_bias": p["lin_dt_bias"][r], a + "o_norm.weight": p["lin_norm"][r],
                  a + "o_proj.weight": p["lin_out"][r].T}
        else:
            r = c.full_layers.index(i)
            t |= {a + "q_a_proj.weight": p["wq_a"][r].T,
                  a + "q_a_layernorm.weight": p["q_a_norm"][r],
                  a + "q_b_proj.weight": p["wq"][r].T,
                  a + "kv_a_proj_with_mqa.weight": p["wkv_a"][r].T,
                  a + "kv_a_layernorm.weight": p["kv_a_norm"][r],
                  a + "kv_b_proj.weight": p["wkv_b"][r].T, a + "g_proj.weight": p["wg"][r].T,
                  a + "o_proj.weight": p["wo"][r].T}
        if i in c.dense_layers:  # Moonshot's spelling, mlp. (kimi/load.py's dense_gu)
            r = c.dense_layers.index(i)
            t |= {f"{at}mlp.{w}_proj.weight": p[f"w_{w}"][r].T for w in ("gate", "up", "down")}
            continue
        r, m = c.moe_layers.index(i), at + "block_sparse_moe."
        t |= {m + "gate.weight": p["router"][r].T,
              m + "gate.e_score_correction_bias": p["router_bias"][r],
              m + "routed_expert_down_proj.weight": p["latent_down"][r].T,
              m + "routed_expert_norm.weight": p["latent_norm"][r],
              m + "routed_expert_up_proj.weight": p["latent_up"][r].T}
        t |= {f"{m}shared_experts.{w}_proj.weight": p[f"ws_{w}"][r].T
              for w in ("gate", "up", "down")}
        for e in range(c.experts):
            for name, param, (out, inp) in (
                    ("w1", "we_gate", (c.expert_ffn, c.moe_latent)),
                    ("w3", "we_up", (c.expert_ffn, c.moe_latent)),
                    ("w2", "we_down", (c.moe_latent, c.expert_ffn))):
                packed, scale, values = mxfp4(rng, out, inp)
                t[f"{m}experts.{e}.{name}.weight_packed"] = packed
                t[f"{m}experts.{e}.{name}.weight_scale"] = scale
                p[param][r, e] = values
    return t, p


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tensors, params = k3_checkpoint(TINY)
    folder = tmp_path_factory.mktemp("k3")
    write_hf_folder(k3_config_json(TINY), tensors, folder, shards=2)
    return folder, tensors, params


def _write(tmp_path, tensors, hf=None):
    return write_hf_folder(hf or k3_config_json(TINY), tensors, tmp_path / "ckpt")


def test_k3_config_json_reads_back_as_tiny_k3(written):
    config, _ = load_checkpoint(written[0])
    assert config == dataclasses.replace(TINY, name=config.name, max_context=4096)


def test_kimi_k3_s_config_json_reads_back_as_the_kimi_k3_preset():
    """The release's Config in config.json's spelling reads as `kimi-k3`, but for what is
    not in a config.json: the release's fp8 re-storing of gate and up (a kernel layout:
    expert_fp8_block, formats) and the context mk defaults to."""
    k3 = mk.preset("kimi-k3")
    got = mk.ModelConfig.from_hf(k3_config_json(k3), name="kimi-k3")
    assert got == dataclasses.replace(k3, max_context=4096, formats=(), expert_fp8_block=0)


def test_k3_checkpoint_loads_the_values_written(written):
    folder, _, want = written
    _, params = load_checkpoint(folder)
    assert set(params) == set(want)
    for name in ("we_gate", "we_up", "we_down"):  # MXFP4 experts stay MXFP4 (mk's fp4)
        assert isinstance(params[name], quant.QuantWeight) and params[name].scheme == "fp4"
    values = quant.dequantize(params)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(values[name], np.float32), value,
                                      err_msg=name)


def test_k3_experts_scales_load_bit_exactly(written):
    folder, tensors, _ = written
    _, params = load_checkpoint(folder)
    scale = tensors[f"{MODEL}layers.2.block_sparse_moe.experts.5.w2.weight_scale"]
    np.testing.assert_array_equal(np.asarray(params["we_down"].scale[1, 5]), scale.T)


def test_reference_runs_on_a_loaded_k3_checkpoint(written):
    folder, _, want = written
    config, params = load_checkpoint(folder)
    prompt = jnp.array([[1, 5, 9, 33, 7], [3, 2, 1, 4, 500]], jnp.int32)
    got, _ = reference.prefill(config, quant.dequantize(params), prompt)
    direct, _ = reference.prefill(config, {k: jnp.asarray(v) for k, v in want.items()},
                                  prompt)
    assert np.isfinite(np.asarray(got)).all() and np.asarray(got).std() > 0.1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(direct))


def test_a_bf16_k3_checkpoint_is_tiny_k3_in_its_own_dtype(tmp_path):
    """K3's checkpoint stores bf16 (tiny-k3's dtype): read as it is, no rounding."""
    config = mk.preset("tiny-k3")
    tensors, want = k3_checkpoint(config, seed=1)
    loaded, params = load_checkpoint(_write(tmp_path, tensors, k3_config_json(config)))
    assert loaded == dataclasses.replace(config, name=loaded.name, max_context=4096)
    assert params["embed"].dtype == jnp.bfloat16
    values = quant.dequantize(params)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(values[name], np.float32),
                                      np.asarray(value, np.float32), err_msg=name)


def test_a_quantization_config_inside_text_config_is_read(tmp_path, written):
    """Third-party K3 ports read it from text_config too; the release reads neither."""
    hf = k3_config_json(TINY)
    hf["text_config"]["quantization_config"] = hf.pop("quantization_config")
    _, params = load_checkpoint(_write(tmp_path, written[1], hf))
    assert params["we_up"].scheme == "fp4"


def test_vision_tower_tensors_are_not_the_language_model_s(tmp_path, written):
    """K3's other towers sit outside language_model. (kimi/load.py reads only it)."""
    tensors = written[1] | {"vision_tower.encoder.weight": np.zeros((2, 2), np.float32)}
    load_checkpoint(_write(tmp_path, tensors))


EXPERT = f"{MODEL}layers.1.block_sparse_moe.experts.3"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(f"{EXPERT}.w3.weight_scale"),
     f"missing tensor {EXPERT}.w3.weight_scale (mk we_up[0, 3])"),
    (lambda t: t.pop(f"{MODEL}layers.4.self_attn.g_proj.weight"),
     f"missing tensor {MODEL}layers.4.self_attn.g_proj.weight (mk wg[1])"),
    (lambda t: t.update({f"{EXPERT}.w1.weight_packed": np.zeros((128, 32), np.uint8)}),
     f"{EXPERT}.w1.weight_packed has shape (128, 32), expected (128, 64) (mk we_gate[0, 3])"),
    (lambda t: t.update({f"{EXPERT}.w2.weight_scale": np.ones((128, 4), np.int32)}),
     f"{EXPERT}.w2.weight_scale has dtype I32, expected one of ('U8',)"),
    (lambda t: t.update({f"{MODEL}layers.2.block_sparse_moe.routed_expert_up_proj.weight":
                         np.zeros((128, 256), np.float32)}),
     "routed_expert_up_proj.weight has shape (128, 256), expected (256, 128) "
     "(mk latent_up[1])"),
    (lambda t: t.update({f"{MODEL}layers.0.self_attn.A_log":
                         np.zeros((1, 1, 2, 1), np.float32)}),
     r"self_attn.A_log has shape (1, 1, 2, 1), expected (2,) (mk lin_a_log[0])"),
    (lambda t: t.update({f"{MODEL}layers.0.mlp.up_proj.weight": np.zeros((512, 256),
                                                                         np.int32)}),
     "mlp.up_proj.weight has dtype I32, expected one of ('F32', 'BF16', 'F16')"),
    (lambda t: t.update({f"{MODEL}layers.0.self_attn.z_proj.weight": np.zeros(2)}),
     f"unexpected tensor {MODEL}layers.0.self_attn.z_proj.weight"),
])
def test_a_bad_k3_tensor_is_refused_by_name_value_and_expectation(tmp_path, written,
                                                                  change, message):
    tensors = dict(written[1])
    change(tensors)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(_write(tmp_path, tensors))


@pytest.mark.parametrize("code", [0, 255])
def test_e8m0_scales_0_and_255_are_refused_as_the_release_refuses_them(tmp_path, written,
                                                                       code):
    tensors = dict(written[1])
    scale = tensors[f"{EXPERT}.w2.weight_scale"].copy()
    scale[7, 2] = code
    tensors[f"{EXPERT}.w2.weight_scale"] = scale
    with pytest.raises(ValueError, match=re.escape(
            f"{EXPERT}.w2.weight_scale': 1 of 512 e8m0 scales are 0 or 255, the first "
            f"{code} at (7, 2); expected normal, finite scales 1..254")):
        load_checkpoint(_write(tmp_path, tensors))


def _text(hf, **change):
    return hf | {"text_config": hf["text_config"] | change}


@pytest.mark.parametrize("hf, error, message", [
    (lambda hf: _text(hf, hidden_act="silu"), NotImplementedError,
     "hidden_act='silu' is not implemented for this model type (expected 'situ')"),
    (lambda hf: _text(hf, mla_use_output_gate=False), NotImplementedError,
     "mla_use_output_gate=False is not implemented (Kimi K3 has True)"),
    (lambda hf: _text(hf, latent_moe_use_norm=False), NotImplementedError,
     "latent_moe_use_norm=False is not implemented"),
    (lambda hf: _text(hf, linear_attn_config={**hf["text_config"]["linear_attn_config"],
                                              "use_full_rank_gate": False}),
     NotImplementedError, "linear_attn_config.use_full_rank_gate=False is not implemented"),
    (lambda hf: _text(hf, attn_res_block_size=0), ValueError,
     "attn_res_block_size=0 must be a positive integer"),
    (lambda hf: hf | {"quantization_config": {"quant_method": "compressed-tensors",
                                              "format": "int4-pack-quantized"}},
     NotImplementedError, "compressed-tensors format ['int4-pack-quantized'] is not read"),
    (lambda hf: {k: v for k, v in hf.items() if k != "text_config"}, ValueError,
     "model_type='kimi_k3' without a text_config"),
])
def test_a_bad_k3_config_is_refused_by_field(tmp_path, written, hf, error, message):
    with pytest.raises(error, match=re.escape(message)):
        load_checkpoint(_write(tmp_path, written[1], hf(k3_config_json(TINY))))
