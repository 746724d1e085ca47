"""Kimi K3 as its release describes it (issue 66): the `kimi-k3` preset against the
release's `Config`, the config fields of its new layer features and their checks.

Not here: the Kimi-K2-shaped stand-in the kernels run (`kimi-k2-shaped`, tests/test_kimi.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import mk
import mk.step.megakernel
from mk.model import linear_attention as la
from mk.model import ops, reference
from mk.step import shards
from mk.model.checkpoint import init_params
from mk.model.config import ModelConfig
from mk.kinds.mlp.latent_moe import latent_columns
from mk.step.plan import DecodePlan
from mk.model.presets import GPT_OSS_PRESET_NAMES, K3_PRESET_NAMES, KIMI_PRESET_NAMES, PRESET_NAMES
from mk.model.ops import matmul
from mk.model.weights import hf_scheme, kinds_of, param_shapes

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
    assert K3_PRESET_NAMES == ("tiny-k3", "kimi-k3")
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
    (dict(situ_beta=0.0, situ_linear_beta=0.0), NotImplementedError,
     "moe_latent=3584 with situ_beta=0: the latent MoE's experts are SiTU's"),
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


def test_the_latent_moe_at_tp32_deals_its_latent_in_whole_tiles():
    """Kimi K3's latent (3584 columns, 28 lane tiles) at TP32: a tile a device in device
    order, so devices 28-31 hold zeros, and the all-gather's first 3584 columns are the
    latent as it is; latent_down's columns and latent_up's rows are cut alike; a latent
    that is not whole tiles is refused at tp > 1 (its gather would scatter it)."""
    k3 = mk.preset("kimi-k3")
    plan = DecodePlan.make(k3, tp=32, context=1152, chip="tpu7x")
    assert (plan.local.latent_columns, plan.local.latent_shards) == (128, 32)
    held = {s: shards.split_index(k3, s, k3.moe_latent, 32)
            for s in ("latent_columns", "latent_rows")}
    np.testing.assert_array_equal(held["latent_columns"], held["latent_rows"])
    want = np.arange(32 * 128).reshape(32, 128)
    np.testing.assert_array_equal(held["latent_columns"], np.where(want < 3584, want, -1))
    shapes = param_shapes(plan.local)
    assert shapes["latent_down"][0] == (92, 7168, 128)
    assert shapes["latent_up"][0] == (92, 128, 7168)
    with pytest.raises(ValueError, match="moe_latent=96 must be a multiple of 128"):
        latent_columns(96, 2)
    assert latent_columns(96, 1) == 96 and latent_columns(384, 2) == 256


# -- The reference: each K3 piece against a hand-written numpy computation ----------------
def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _f32_tiny_k3(**change) -> ModelConfig:
    return dataclasses.replace(mk.preset("tiny-k3"), dtype="float32", **change)


def test_situ_is_a_soft_capped_silu_times_a_soft_capped_up():
    gate = np.linspace(-30, 30, 61, dtype=np.float32)
    up = np.linspace(40, -40, 61, dtype=np.float32)
    want = 4 * np.tanh(gate / 4) * _sigmoid(gate) * 25 * np.tanh(up / 25)
    got = np.asarray(ops.situ(jnp.asarray(gate), jnp.asarray(up), 4.0, 25.0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() < 4 * 25  # both factors capped


def test_attention_residual_mixes_sources_by_the_softmax_of_their_normed_scores():
    """The release's own check (tests/test_kimi_reference.py) with its numbers, the fold
    of norm and projection undone: norm 2 x, projection 0.5 x."""
    sources = np.array([[1.0, 2.0, 3.0], [3.0, 0.0, -1.0], [2.0, -1.0, 1.0]], np.float32)
    folded = np.array([0.2, -0.3, 0.4], np.float32)
    scores = sources @ folded / np.sqrt(np.mean(sources * sources, axis=1) + 1e-5)
    p = np.exp(scores - scores.max())
    want = p @ sources / p.sum()
    got = ops.attention_residual(jnp.asarray(sources), jnp.asarray(2 * folded),
                                 jnp.full((3, 1), 0.5, jnp.float32), 1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def _params(config, seed=0):
    return {name: np.asarray(value, np.float32)
            for name, value in init_params(config, seed).items()}


def test_bounded_kda_decays_by_the_bound_times_a_sigmoid():
    config = _f32_tiny_k3()
    params, h = _params(config), np.random.default_rng(1).normal(size=(3, 256))
    f = h @ params["kda_f_a"][1] @ params["kda_f_b"][1] + params["lin_dt_bias"][1]
    rate = np.exp(params["lin_a_log"][1])[:, None]
    want = -5.0 * _sigmoid(rate * f.reshape(3, 2, 128))
    got = np.asarray(la.kda_decay(config, params, 1, jnp.asarray(h, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert ((got > -5) & (got < 0)).all()


def test_kda_full_rank_gate_is_the_low_rank_one_it_factors():
    config = _f32_tiny_k3()
    params = _params(config)
    g_a, g_b = (np.random.default_rng(s).normal(size=shape).astype(np.float32) * 0.1
                for s, shape in ((2, (3, 256, 128)), (3, (3, 128, 256))))
    h = jnp.asarray(np.random.default_rng(4).normal(size=(1, 2, 256)), jnp.float32)
    conv = jnp.zeros((1, 3, config.conv_channels), jnp.float32)
    state = jnp.zeros((1, 2, 128, 128), jnp.float32)
    full = la.kimi_delta_attention(config, params | {"kda_g": g_a @ g_b}, 0, h, conv, state)
    low = dict(params, kda_g_a=g_a, kda_g_b=g_b)
    del low["kda_g"]
    low_rank = la.kimi_delta_attention(config, low, 0, h, conv, state)
    np.testing.assert_allclose(np.asarray(full[0]), np.asarray(low_rank[0]), rtol=1e-4,
                               atol=1e-5)


def test_mla_output_gate_scales_each_head_output_by_a_sigmoid():
    o, h = (np.random.default_rng(s).normal(size=(3, n)).astype(np.float32)
            for s, n in ((5, 256), (6, 64)))
    wg = np.random.default_rng(7).normal(size=(64, 256)).astype(np.float32) / 8
    got = reference.output_gate(jnp.asarray(o), jnp.asarray(h), jnp.asarray(wg))
    np.testing.assert_allclose(np.asarray(got), o * _sigmoid(h @ wg), rtol=1e-5, atol=1e-6)
    # gated_mla's mixer applies it: a zero wg halves the heads' outputs, so the layer's
    config = _f32_tiny_k3()
    params = _params(config)
    h = jnp.asarray(np.random.default_rng(8).normal(size=(1, 2, 256)), jnp.float32)
    cache = jnp.zeros((1, 8, config.latent_width), jnp.float32)
    at = jnp.array([3])
    gated, _ = reference.mla_mixer(config, params | {"wg": 0 * params["wg"]}, 0, h, cache,
                                   at)
    plain = dict(params)
    del plain["wg"]
    ungated, _ = reference.mla_mixer(config, plain, 0, h, cache, at)
    np.testing.assert_allclose(np.asarray(gated), 0.5 * np.asarray(ungated), rtol=1e-5,
                               atol=1e-6)


def test_latent_moe_routes_on_x_runs_experts_on_the_latent_norms_and_projects_back():
    config = _f32_tiny_k3()
    p = {name: value[2] for name, value in _params(config).items()
         if name in ("router", "router_bias", "latent_down", "we_gate", "we_up", "we_down",
                     "latent_norm", "latent_up", "ws_gate", "ws_up", "ws_down")}
    h = np.random.default_rng(9).normal(size=(3, 256)).astype(np.float32)

    def situ(g, u):
        return 4 * np.tanh(g / 4) * _sigmoid(g) * 25 * np.tanh(u / 25)

    want = []
    for x in h:  # one token at a time, as the release's kernel routes
        scores = _sigmoid(x @ p["router"])
        chosen = np.argsort(-(scores + p["router_bias"]), kind="stable")[:2]
        weights = scores[chosen] / scores[chosen].sum()
        z = x @ p["latent_down"]
        y = sum(w * situ(z @ p["we_gate"][e], z @ p["we_up"][e]) @ p["we_down"][e]
                for w, e in zip(weights, chosen))
        y = y / np.sqrt(np.mean(y * y) + 1e-5) * p["latent_norm"]
        shared = situ(x @ p["ws_gate"], x @ p["ws_up"]) @ p["ws_down"]
        want.append(y @ p["latent_up"] + shared)
    stacked = {name: jnp.asarray(value)[None] for name, value in p.items()}
    got = reference.latent_moe_mlp(config, stacked, 0, jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(got), np.array(want), rtol=2e-4, atol=2e-4)


def test_attention_residuals_keep_the_release_s_blocks(monkeypatch):
    """`residual_layers` against the release's bookkeeping, written as its `stack` writes
    it (the mixer mixes (i - 1) // block + 1 blocks, the MLP i // block + 1, block i //
    block starts at i % block == 0, the output (L - 1) // block + 1), with stand-in mixers
    and MLPs (a fixed matrix, a tanh): a block boundary misplaced moves the output."""
    config = _f32_tiny_k3()
    params = _params(config)
    mats = np.random.default_rng(10).normal(size=(5, 256, 256)).astype(np.float32) / 16

    layer = iter(range(5))  # the mixers run in layer order: each its layer's matrix

    def mixer(config, params, h, cache, i, positions):
        return matmul(h, jnp.asarray(mats[next(layer)])), {}

    def mlp(config, params, i, h):
        return jnp.tanh(h)

    monkeypatch.setattr(reference, "MIXERS", {kind: mixer for kind in reference.MIXERS})
    monkeypatch.setattr(reference, "MLPS", {kind: mlp for kind in reference.MLPS})
    x = np.random.default_rng(11).normal(size=(1, 1, 256)).astype(np.float32)
    got, _, _, _ = reference.residual_layers(config, params, None, jnp.asarray(x), None)

    def rms(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-5) * w

    def mix(values, norm, proj):
        scores = (values * norm * proj[:, 0]).sum(-1) / np.sqrt(np.mean(values * values, -1)
                                                                 + 1e-5)
        p = np.exp(scores - scores.max())
        return (p[:, None] * values).sum(0) / p.sum()

    blocks, prefix = np.zeros((8, 256), np.float32), x[0, 0]
    for i in range(5):
        h = mix(np.concatenate([blocks[:(i - 1) // 2 + 1], prefix[None]]),
                params["attn_res_norm"][i], params["attn_res_proj"][i])
        attended = rms(h, params["attn_norm"][i]) @ mats[i]
        if i % 2 == 0:
            blocks[i // 2] = prefix
        prefix = attended if i % 2 == 0 else prefix + attended
        h = mix(np.concatenate([blocks[:i // 2 + 1], prefix[None]]),
                params["mlp_res_norm"][i], params["mlp_res_proj"][i])
        prefix = prefix + np.tanh(rms(h, params["mlp_norm"][i]))
    want = mix(np.concatenate([blocks[:(5 - 1) // 2 + 1], prefix[None]]),
               params["output_res_norm"], params["output_res_proj"])
    np.testing.assert_allclose(np.asarray(got)[0, 0], want, rtol=1e-4, atol=1e-5)


# -- tiny-k3 through the reference --------------------------------------------------------
def test_tiny_k3_decodes_what_its_prefill_predicts():
    """tiny-k3 (every K3 kind) through mk.model.reference: a decode step of T = 2 after a
    prefill gives the logits a prefill of the whole prompt gives at those positions, for
    two sequences."""
    config = mk.preset("tiny-k3")
    params = init_params(config, 0)
    prompt = jnp.array([[1, 5, 9, 33, 7, 100, 4], [3, 2, 1, 4, 5, 6, 500]], jnp.int32)
    _, cache = reference.prefill(config, params, prompt[:, :5])
    step, _ = reference.decode_step(config, params, cache, prompt[:, 5:], jnp.array([5, 5]))
    whole, _ = reference.prefill(config, params, prompt)
    np.testing.assert_allclose(np.asarray(step), np.asarray(whole[:, 5:]), rtol=1e-5,
                               atol=1e-4)
    assert np.isfinite(np.asarray(whole)).all() and np.asarray(whole).std() > 0.1
