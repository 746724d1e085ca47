"""mk.model.config: presets, validation, derived sizes and Hugging Face config parsing."""

import dataclasses
import re

import numpy as np
import pytest

from mk.model.cache import bytes_per_position
from mk.model.checkpoint import init_params
from mk.model.config import ModelConfig
from mk.step.plan import shard_config
from mk.model.presets import PRESET_NAMES, preset
from mk.model.quant import stored_bytes
from mk.model.weights import param_count


def test_every_preset_builds():
    for name in PRESET_NAMES:
        assert preset(name).name == name


def test_real_presets_have_their_published_parameter_counts():
    # Qwen3 model cards: 0.6B (0.44B non-embedding), 8.2B, 30.5B total.
    assert param_count(preset("qwen3-0.6b")) == pytest.approx(0.6e9, rel=0.03)
    assert param_count(preset("qwen3-8b")) == pytest.approx(8.2e9, rel=0.01)
    assert param_count(preset("qwen3-30b-a3b")) == pytest.approx(30.5e9, rel=0.01)


def test_tiny_presets_are_tpu_legal_shapes():
    for name in ("tiny", "tiny-moe"):
        c = preset(name)
        assert c.head_dim == 128
        for width in (c.hidden, c.ffn, c.q_width, c.kv_width, c.vocab):
            assert width % 128 == 0, (name, width)
        assert 2 <= c.layers <= 4


def test_tiny_weight_bytes_by_hand():
    c = preset("tiny")  # V=512 D=256 L=2 N=4 K=2 H=128 F=512, bf16, untied
    attn = 256 * (2 * 512 + 2 * 256) + 256 + 2 * 128
    mlp = 3 * 256 * 512 + 256
    embed = 2 * 512 * 256 + 256
    assert stored_bytes(c) == 2 * (embed + 2 * (attn + mlp))
    assert bytes_per_position(c) == 2 * 2 * 256 * 2


def test_fp4_experts_count_half_a_byte_each_and_a_scale_byte_per_32():
    c = preset("kimi-k3-like")  # formats={"experts": "fp4"}: mk.model.quant's packed MXFP4
    assert c.formats == (("experts", "fp4"),) and c.expert_bits == 4
    layers = len(c.moe_layers)
    experts = layers * c.experts * c.expert_params * (16 + 1) // 32
    assert stored_bytes(c, "moe") == experts + layers * c.hidden * c.experts * 2  # + router
    plain = dataclasses.replace(c, formats=())
    assert stored_bytes(plain, "moe") == 2 * layers * (c.experts * c.expert_params
                                                        + c.hidden * c.experts)


def test_formats_are_kept_as_sorted_items_and_follow_a_cut_to_dense_layers():
    c = dataclasses.replace(preset("tiny-moe"), formats={"experts": "int4", "dense": "int8",
                                                         "lm_head": None})
    assert c.formats == (("dense", "int8"), ("experts", "int4"))
    assert hash(c) == hash(dataclasses.replace(c))
    assert c.first_layers(1).formats == (("dense", "int8"),)  # layer 0 is dense
    assert c.first_layers(2).formats == c.formats


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"preset='qwen9'.*tiny"):
        preset("qwen9")


@pytest.mark.parametrize("change, message", [
    (dict(heads=5), r"heads=5 must be a multiple of kv_heads=2"),
    (dict(head_dim=0), r"head_dim=0 must be a positive integer"),
    (dict(max_context=5000), r"max_context=5000 exceeds max_position=4096"),
    (dict(dtype="int8"), r"dtype='int8' must be one of"),
    (dict(experts=4), r"moe_layers is empty"),
    (dict(formats={"mlp": "int8"}), r"formats group='mlp' must be one of"),
    (dict(formats={"dense": "int3"}), r"formats dense='int3' must be one of"),
    (dict(formats={"experts": "fp4"}), r"experts='fp4': tiny has no experts"),
    (dict(formats="fp4"), r"formats='fp4' must be a dict"),
])
def test_bad_fields_are_named_in_the_error(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(preset("tiny"), **change)


def test_a_tied_lm_head_has_no_format_of_its_own():
    with pytest.raises(ValueError, match="lm_head='int8'.*ties its lm_head"):
        dataclasses.replace(preset("qwen3-0.6b"), formats={"lm_head": "int8"})


def test_moe_layers_out_of_range_is_an_error():
    with pytest.raises(ValueError, match=r"moe_layers=\(1, 7\)"):
        dataclasses.replace(preset("tiny-moe"), moe_layers=(1, 7))


@pytest.mark.parametrize("extra, match", [
    (dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer_types\[1\]='sliding_attention', but every layer of this model type is "
     r"'full_attention'"),
    (dict(layer_types=["full_attention"] * 3), "must hold num_hidden_layers=2"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' must be true or false"),
    (dict(num_hidden_layers=10**9), "num_hidden_layers=1000000000 is over the limit of 100000"),
])
def test_a_qwen3_config_contradicting_itself_or_too_deep_is_refused(extra, match):
    """A sliding layer mk would run as full attention; the string "false" read as true;
    10**9 layers (per-layer tuples filled memory before any check ran)."""
    for model_type in ("qwen3", "qwen3_moe"):
        hf = _hf_qwen3(**extra, model_type=model_type, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64)
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(hf)
    hf = _hf_qwen3(layer_types=["full_attention"] * 2, tie_word_embeddings=None)
    assert not ModelConfig.from_hf(hf).tie_embeddings
    moe = _hf_qwen3(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, norm_topk_prob="false")
    with pytest.raises(ValueError, match="norm_topk_prob='false' must be true or false"):
        ModelConfig.from_hf(moe)
    with pytest.raises(ValueError, match="moe_renormalize='false' must be true or false"):
        ModelConfig.from_hf(_hf_kimi(moe_renormalize="false"))
    with pytest.raises(ValueError, match="topk_group=0 must be a positive integer"):
        ModelConfig.from_hf(_hf_kimi(topk_group=0))


def _hf_qwen3(**extra):
    d = dict(model_type="qwen3", vocab_size=1000, hidden_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, rms_norm_eps=1e-6, max_position_embeddings=2048,
             rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
             tie_word_embeddings=True, dtype="bfloat16")
    d.update(extra)
    return d


def test_from_hf_reads_new_and_old_spellings_alike():
    new = ModelConfig.from_hf(_hf_qwen3(), name="x")
    old = _hf_qwen3(rope_theta=5e5)
    del old["rope_parameters"]
    assert ModelConfig.from_hf(old, name="x") == new
    assert new.rope_theta == 5e5 and new.tie_embeddings and new.head_dim == 64


def test_from_hf_moe_layers_follow_sparse_step_and_mlp_only_layers():
    d = _hf_qwen3(model_type="qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                  mlp_only_layers=[3], num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=128, norm_topk_prob=True)
    c = ModelConfig.from_hf(d)
    assert c.moe_layers == (1, 5) and c.experts == 8 and c.norm_topk
    d["num_local_experts"] = d.pop("num_experts")
    assert ModelConfig.from_hf(d) == c


def test_from_hf_heads_that_do_not_divide_hidden_without_head_dim():
    d = _hf_qwen3(num_attention_heads=3)
    del d["head_dim"]
    with pytest.raises(ValueError, match=r"num_attention_heads=3 does not divide "
                                         r"hidden_size=256"):
        ModelConfig.from_hf(d)


def test_from_hf_rejects_other_model_types_and_missing_fields():
    with pytest.raises(ValueError, match=r"model_type='llama' is not supported"):
        ModelConfig.from_hf(_hf_qwen3(model_type="llama"))
    for wrong in ([], {}):  # was TypeError: unhashable, looked up among the wrappers
        with pytest.raises(ValueError, match=re.escape(f"model_type={wrong!r} is not supp")):
            ModelConfig.from_hf(_hf_qwen3(model_type=wrong))
    d = _hf_qwen3()
    del d["intermediate_size"]
    with pytest.raises(ValueError, match=r"no field intermediate_size"):
        ModelConfig.from_hf(d)


def test_from_hf_rejects_what_the_reference_does_not_implement():
    for kind in ("rope_type", "type"):  # `type`: transformers' older spelling
        with pytest.raises(NotImplementedError, match="rope scaling 'yarn'"):
            ModelConfig.from_hf(_hf_qwen3(rope_parameters={"rope_theta": 1e6, kind: "yarn"}))


def _hf_gpt_oss(**rope) -> dict:
    return dict(model_type="gpt_oss", vocab_size=512, hidden_size=256, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=128, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                max_position_embeddings=4096, sliding_window=128,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"factor": 32.0, "original_max_position_embeddings": 4096,
                                 "rope_theta": 1.5e5, **rope})


def test_a_yarn_block_spelt_with_the_older_type_key_is_still_yarn():
    """transformers reads rope_parameters' `type` where `rope_type` is absent; mk read
    such a block as plain RoPE and dropped YaRN's scaling (issue 65)."""
    yarn = ModelConfig.from_hf(_hf_gpt_oss(rope_type="yarn")).yarn
    assert yarn is not None and yarn.factor == 32
    assert ModelConfig.from_hf(_hf_gpt_oss(type="yarn")).yarn == yarn
    assert ModelConfig.from_hf(_hf_gpt_oss()).yarn is None  # neither key: "default"


def _hf_kimi(**extra) -> dict:
    d = dict(model_type="kimi_linear", vocab_size=512, hidden_size=256, intermediate_size=512,
             moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
             num_experts=8, num_experts_per_token=2, rms_norm_eps=1e-6, model_max_length=4096)
    d.update(extra)
    return d


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads"])
@pytest.mark.parametrize("value", [0, "x", True, pytest.param(
    "<b>\n```{include} /etc/os-release\n```", id="markup")])
def test_from_hf_counts_the_readers_compute_with_are_checked_by_their_file_name(field, value):
    """Every family's layer count, width and heads: a ValueError naming config.json's field
    and its value, escaped (not a TypeError, a ZeroDivisionError or a raw echo later)."""
    for hf in (_hf_qwen3(), _hf_kimi()):
        with pytest.raises(ValueError, match=f"{field}=.* must be a positive integer") as err:
            ModelConfig.from_hf(hf | {field: value})
        assert "\n" not in str(err.value)


def test_from_hf_layer_types_name_the_layer_count_in_every_family():
    qwen3_5 = _hf_qwen3(model_type="qwen3_5_text", num_hidden_layers=3,
                        layer_types=["linear_attention", "full_attention"],
                        linear_num_key_heads=1, linear_num_value_heads=2,
                        linear_key_head_dim=64, linear_value_head_dim=64,
                        linear_conv_kernel_dim=4)
    for hf in (qwen3_5, _hf_kimi(num_hidden_layers=3)):
        with pytest.raises(ValueError, match=r"layer_types .* must hold num_hidden_layers=3 of "
                                             "'full_attention' / 'linear_attention'"):
            ModelConfig.from_hf(hf | {"layer_types": ["linear_attention", "full_attention"]})
    assert ModelConfig.from_hf(qwen3_5 | {"num_hidden_layers": 2}).layer_types == (
        "linear", "full")


def _hf_qwen3_5(**extra) -> dict:
    return _hf_qwen3(model_type="qwen3_5_text", linear_num_key_heads=1,
                     linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
                     linear_conv_kernel_dim=4, **extra)


MOE = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=128)
# (config.json, field, value): each raised a TypeError, AttributeError, IndexError or
# ZeroDivisionError naming no field before the readers checked their fields.
MALFORMED = {
    "rope_parameters": (_hf_qwen3(), "rope_parameters", 1),
    "rms_norm_eps": (_hf_qwen3(), "rms_norm_eps", []),
    "mlp_only_layers": (_hf_qwen3(**MOE), "mlp_only_layers", 1),
    "decoder_sparse_step": (_hf_qwen3(**MOE), "decoder_sparse_step", "x"),
    "full_attention_interval": (_hf_qwen3_5(), "full_attention_interval", 0),
    "partial_rotary_factor": (_hf_qwen3_5(), "partial_rotary_factor", [1]),
    "kimi layer_types": (_hf_kimi(), "layer_types", 1),
    "linear_attn_config": (_hf_kimi(), "linear_attn_config", "x"),
    "full_attn_layers": (_hf_kimi(), "linear_attn_config.full_attn_layers", [99]),
    "first_k_dense_replace": (_hf_kimi(), "first_k_dense_replace", "x"),
    "qk_rope_head_dim": (_hf_kimi(), "qk_rope_head_dim", "x"),
    "routed_scaling_factor": (_hf_kimi(), "routed_scaling_factor", {}),
    # and numbers float() took silently: true as 1.0, a string of digits
    "rms_norm_eps true": (_hf_qwen3(), "rms_norm_eps", True),
    "routed_scaling_factor string": (_hf_kimi(), "routed_scaling_factor", "2.5"),
    "yarn factor string": (_hf_gpt_oss(rope_type="yarn"), "rope_parameters.factor", "32"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_from_hf_names_a_malformed_field_instead_of_crashing(case):
    hf, field, value = MALFORMED[case]
    if field.startswith("linear_attn_config."):
        hf = hf | {"layer_types": None, "linear_attn_config": {
            "full_attn_layers": value, "kda_layers": [1, 2, 3]}}
    elif field.startswith("rope_parameters."):
        hf = hf | {"rope_parameters": hf["rope_parameters"] | {field.split(".")[1]: value}}
    else:
        hf = hf | {field: value}
    with pytest.raises(ValueError, match=re.escape(field)):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("full, kda", [([4], [1, 2, 3, 4]), ([4, 4], [1, 2, 3])])
def test_a_kimi_layer_listed_as_both_full_and_kda_or_twice_is_refused(full, kda):
    hf = _hf_kimi(linear_attn_config={"full_attn_layers": full, "kda_layers": kda})
    with pytest.raises(ValueError, match="linear_attn_config lists layer 4 more than once"):
        ModelConfig.from_hf(hf)
    hf["linear_attn_config"] = {"full_attn_layers": [4], "kda_layers": [1, 2, 3]}
    assert ModelConfig.from_hf(hf).layer_types == ("linear",) * 3 + ("full",)


def test_layer_types_that_contradict_another_field_are_refused_by_layer():
    kimi = _hf_kimi(layer_types=["linear_attention"] * 4,
                    linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"layer_types and linear_attn_config contradict "
                                         r"each other at layer 3 .*'linear' against 'full'"):
        ModelConfig.from_hf(kimi)
    kimi["layer_types"][3] = "full_attention"
    assert ModelConfig.from_hf(kimi).layer_types == ("linear",) * 3 + ("full",)
    with pytest.raises(ValueError, match=r"lists layers \[4\] in neither full_attn_layers"):
        ModelConfig.from_hf(_hf_kimi(linear_attn_config={"full_attn_layers": [],
                                                         "kda_layers": [1, 2, 3]}))
    qwen = _hf_qwen3_5(num_hidden_layers=4, full_attention_interval=2,
                       layer_types=["linear_attention", "full_attention"] * 2)
    assert ModelConfig.from_hf(qwen).layer_types == ("linear", "full") * 2
    with pytest.raises(ValueError, match="layer_types and full_attention_interval contradict "
                                         "each other at layer 1"):
        ModelConfig.from_hf(qwen | {"full_attention_interval": 4})


# -- Lane padding --------------------------------------------------------------------------
def test_lane_padding_holds_each_width_in_whole_lanes_and_undoes_exactly():
    """200 and 100 wide (as gpt-oss's 2880): held as 256 and 128, the norms over 200; the
    random weights are the unpadded model's in each slot's corner, zeros in the padding."""
    own = dataclasses.replace(preset("tiny-moe"), hidden=200, expert_ffn=100)
    held = own.lane_padded()
    assert (held.hidden, held.expert_ffn, held.ffn, held.norm_width) == (256, 128, 512, 200)
    assert dict(held.padding) == {"hidden": 56, "expert_ffn": 28}
    assert held.unpadded() == own and held.lane_padded() is held
    local = shard_config(held, 2)  # a split width's padding is the shard's own: 64 of 128
    assert (local.norm_width, local.expert_ffn, dict(local.padding)) == (
        200, 128, {"hidden": 56, "expert_ffn": 64})
    mine, theirs = init_params(held), init_params(own)
    for name, x in mine.items():
        x, want = np.asarray(x, np.float32), np.asarray(theirs[name], np.float32)
        corner = tuple(slice(0, n) for n in want.shape)
        np.testing.assert_array_equal(x[corner], want, name)
        x[corner] = 0
        assert not x.any(), f"{name}: its padding is not zero"


@pytest.mark.parametrize("padding, message", [
    ({"heads": 8}, r"padding field='heads' must be one of \('hidden'"),
    ({"hidden": 0}, r"padding hidden=0 must be a whole number of zero lanes in \[1, hidden=256\)"),
    ({"hidden": 256}, r"padding hidden=256 must be"),
    ({"hidden": 1.5}, r"padding hidden=1.5 must be"),
    ("lanes", r"padding='lanes' must be a dict")])
def test_bad_padding_is_refused_by_field_value_and_limit(padding, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(preset("tiny"), padding=padding)
