"""Kimi K3 as its release describes it (issue 66): the `kimi-k3` preset against the
release's `Config`, the config fields of its new layer features and their checks.

Not here: the Kimi-K2-shaped stand-in the kernels run (`kimi-k2-shaped`, tests/test_kimi.py).
"""

from __future__ import annotations

import dataclasses

import pytest

import mk
import mk.megakernel
from mk.config import ModelConfig
from mk.kernels.plan import DecodePlan
from mk.presets import GPT_OSS_PRESET_NAMES, K3_PRESET_NAMES, KIMI_PRESET_NAMES, PRESET_NAMES
from mk.weights import hf_scheme, kinds_of, param_shapes

# The release's Config (Inferact/tpu-megakernels, kimi/__init__.py), every field with its
# default, and what it is in mk: a function of the ModelConfig.
RELEASE_CONFIG = {
    "dim": (7168, lambda c: c.hidden),
    "latent": (3584, lambda c: c.moe_latent),
    "expert_hidden": (3072, lambda c: c.expert_ffn),
    "shared_hidden": (6144, lambda c: c.shared_expert_ffn),
    "dense_hidden": (33792, lambda c: c.ffn),
    "experts": (896, lambda c: c.experts),
    "top_k": (16, lambda c: c.experts_per_token),
    "layers": (93, lambda c: c.layers),
    "heads": (96, lambda c: c.heads),
    "head_dim": (128, lambda c: c.value_dim),
    "q_rank": (1536, lambda c: c.q_rank),
    "kv_rank": (512, lambda c: c.latent_rank),
    "qk_extra": (64, lambda c: c.rope_dim),
    "vocab": (163840, lambda c: c.vocab),
    "conv_size": (4, lambda c: c.conv_kernel),
    "residual_block": (12, lambda c: c.residual_block),
    "eps": (1e-5, lambda c: c.rms_eps),
    "situ_beta": (4.0, lambda c: c.situ_beta),
    "situ_linear_beta": (25.0, lambda c: c.situ_linear_beta),
    "gate_lower_bound": (-5.0, lambda c: c.kda_gate_bound),
    "full_attention": (tuple(range(3, 92, 4)) + (92,), lambda c: c.full_layers),
}
# The Config's head count and head dim are every attention's: MLA's and KDA's.
HEADS_EVERYWHERE = dict(kv_heads=96, linear_key_heads=96, linear_value_heads=96,
                        linear_key_dim=128, linear_value_dim=128, head_dim=128 + 64)
# What Config.from_checkpoint requires of a checkpoint (its `required` dict and the
# full-rank gate), and kimi/load.py's storage, in mk's fields.
REQUIRED = dict(attn_output_gate=True, norm_topk=True, router_score="sigmoid",
                moe_layers=tuple(range(1, 93)), expert_groups=1, topk_groups=1,
                routed_scale=1.0, kda_full_gate=True, channel_decay=True,
                formats=(("experts", "fp4"),), expert_fp8_block=256, tie_embeddings=False)
K3_FIELDS = dict(situ_beta=0.0, situ_linear_beta=0.0, moe_latent=0, residual_block=0,
                 kda_full_gate=False, kda_gate_bound=0.0, expert_fp8_block=0)


@pytest.mark.parametrize("field", RELEASE_CONFIG)
def test_kimi_k3_is_the_release_config_field_by_field(field):
    want, ours = RELEASE_CONFIG[field]
    assert ours(mk.preset("kimi-k3")) == want


def test_kimi_k3_has_the_settings_the_release_requires_of_its_checkpoint():
    k3 = mk.preset("kimi-k3")
    for field, want in {**HEADS_EVERYWHERE, **REQUIRED}.items():
        assert getattr(k3, field) == want, field
    assert len(k3.linear_layers) == 69 and k3.dense_layers == (0,)


@pytest.mark.parametrize("name", PRESET_NAMES + KIMI_PRESET_NAMES + GPT_OSS_PRESET_NAMES)
def test_every_other_preset_leaves_the_k3_fields_unset(name):
    config = mk.preset(name)
    assert {f: getattr(config, f) for f in K3_FIELDS} == K3_FIELDS
    assert not (config.is_mla and config.attn_output_gate)


def test_k3_presets_are_listed_apart():
    assert "kimi-k3" in K3_PRESET_NAMES
    assert not set(K3_PRESET_NAMES) & set(PRESET_NAMES + KIMI_PRESET_NAMES)


def _tiny_k3(**change) -> ModelConfig:
    return dataclasses.replace(mk.preset("kimi-k3").first_layers(5), **change)


@pytest.mark.parametrize("change, error, message", [
    (dict(situ_beta=-1.0), ValueError, "situ_beta=-1.0 must be a finite number >= 0"),
    (dict(situ_linear_beta=0.0), ValueError, "situ_linear_beta=0.0 must be > 0"),
    (dict(situ_beta=float("nan")), ValueError, "situ_beta=nan must be a finite number"),
    (dict(moe_latent=7169), ValueError, r"moe_latent=7169 must be an integer in \[0, "
                                        r"hidden=7168\]"),
    (dict(moe_latent=0), NotImplementedError, "SiTU experts are implemented in the latent"),
    (dict(residual_block=-12), ValueError, "residual_block=-12 must be a non-negative "
                                           "integer"),
    (dict(residual_block=True), ValueError, "residual_block=True must be a non-negative"),
    (dict(kda_gate_bound=1.0), ValueError, "kda_gate_bound=1.0 must be <= 0"),
    (dict(kda_gate_bound=0.0), NotImplementedError, "kda_full_gate=True with "
                                                    "kda_gate_bound=0.0"),
    (dict(expert_fp8_block=100), ValueError, "expert_fp8_block=100 must be a multiple of "
                                             "32"),
    (dict(expert_fp8_block=-32), ValueError, "expert_fp8_block=-32 must be a non-negative"),
    (dict(formats={}), ValueError, "with fp4 experts"),
])
def test_a_bad_k3_field_names_its_value_and_limit(change, error, message):
    with pytest.raises(error, match=message):
        _tiny_k3(**change)


def test_k3_fields_of_a_kind_go_with_its_layers():
    first = mk.preset("kimi-k3").pick_layers([0])  # KDA and the dense MLP: no MoE
    assert (first.moe_latent, first.expert_fp8_block, first.kda_gate_bound) == (0, 0, -5.0)
    with pytest.raises(ValueError, match="moe_latent.*are set but moe_layers is empty"):
        dataclasses.replace(first, moe_latent=128)
    mla = mk.preset("kimi-k3").pick_layers([3])  # MLA and MoE: no KDA
    assert (mla.kda_full_gate, mla.kda_gate_bound, mla.moe_latent) == (False, 0.0, 3584)
    with pytest.raises(ValueError, match="are KDA's"):
        dataclasses.replace(mla, kda_gate_bound=-5.0, kda_full_gate=True)


def test_the_k3_kinds_are_the_table_s_own_and_hold_the_release_s_shapes():
    k3 = mk.preset("kimi-k3")
    assert kinds_of(k3) == ("model", "res_layer", "gated_mla", "bounded_kda", "situ_dense",
                            "latent_moe")
    shapes = {name: shape for name, (shape, _) in param_shapes(k3).items()}
    # kimi/load.py's per-rank shapes x 32 ranks (selected_local_shapes, dense_selected)
    assert shapes["latent_down"] == (92, 7168, 3584) and shapes["latent_up"] == (92, 3584, 7168)
    assert shapes["we_gate"] == (92, 896, 3584, 3072) and shapes["we_down"] == (92, 896, 3072,
                                                                              3584)
    assert shapes["ws_gate"] == (92, 7168, 6144) and shapes["w_gate"] == (1, 7168, 33792)
    assert shapes["wq"] == (24, 1536, 96 * 192) and shapes["wkv_b"] == (24, 512, 96 * 256)
    assert shapes["wg"] == (24, 7168, 96 * 128) and shapes["kda_g"] == (69, 7168, 96 * 128)
    assert shapes["kda_f_b"] == (69, 128, 96 * 128) and shapes["lin_b"] == (69, 7168, 96)
    assert shapes["attn_res_proj"] == (93, 7168, 1) and shapes["output_res_proj"] == (7168, 1)
    assert "kda_g_a" not in shapes and hf_scheme(k3) == "kimi"


@pytest.mark.parametrize("name, feature", [
    ("kimi-k3", "attention residuals"),
    ("kimi-k3", "MLA's output gate"),
    ("kimi-k3", "KDA's full-rank output gate and bounded decay"),
    ("kimi-k3", "the latent MoE and its SiTU experts")])
def test_no_kernel_plan_is_made_for_a_k3_feature(name, feature):
    """The megakernel's plan (made first by every megakernel entry, before anything is
    traced) refuses each K3 kind by name and feature: the kernels cannot run them yet."""
    with pytest.raises(NotImplementedError, match=feature):
        DecodePlan.make(mk.preset(name), tp=32, context=1152, chip="tpu7x")
    with pytest.raises(NotImplementedError, match="have no kernel yet"):
        mk.megakernel.generate(mk.preset(name).first_layers(4), {}, [[1]], 1)
