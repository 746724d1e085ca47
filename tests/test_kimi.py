"""Kimi Linear (MLA + Kimi Delta Attention + shared-expert MoE) against transformers.

Tiny random float32 `kimi_linear` models are written by transformers' `save_pretrained`
(Moonshot's tensor names: block_sparse_moe, q/k/v_conv1d, per-expert w1/w2/w3), read back
with `mk.load_checkpoint` and run by `mk.model.reference`: prefill logits, 32 greedy tokens (batch
1 and 4, T = 1), and T = 4 decode steps fed transformers' own tokens must agree. Two layer
patterns (KDA first and last / MLA first; dense layer first / in the middle), q low-rank or
not, grouped routing with a choice bias, renormalised or not. Also: the per-channel decay
by hand, rollback of the KDA states (with a planted missing rollback), planted positional
encoding in MLA (transformers' MLA is NoPE), the config's sizes against transformers'
parameter count, presets, and the strict loader.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import mk
from mk.kernels import backend
from mk.step import megakernel
from builders import (assert_greedy_matches_hf, assert_prefill_matches_hf, assert_rollback_exact,
                      assert_t4_steps_predict_hf_tokens, build_hf_model, hf_greedy, hf_logits,
                      kimi_gqa)
from mk.model import linear_attention as la
from mk.model import ops
from mk.model import reference as R
from mk.model.cache import LatentCache
from mk.step.plan import DecodePlan
from mk.model.weights import param_count, param_shapes

LOGIT_RTOL_OF_SCALE = 1e-4  # both sides float32
PROMPT, STEPS, CONTEXT = 8, 32, 64
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8,
              num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=2,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-5, attn_implementation="eager",
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
LIN, FULL = "linear_attention", "full_attention"
CASES = {
    "kda-mla-kda-groups": dict(
        num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
        mlp_layer_types=["dense", "sparse", "sparse"], n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    "mla-kda-kda-qlora": dict(
        num_hidden_layers=3, layer_types=[FULL, LIN, LIN],
        mlp_layer_types=["sparse", "dense", "sparse"], q_lora_rank=24, n_group=1,
        topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False),
}


def written_by_transformers(name: str, fields: dict, folder, seed: int):
    """(transformers model, its folder, mk config (max_context CONTEXT), mk params, a
    prompt [4, PROMPT]) of a random kimi_linear model saved by transformers and loaded."""
    model = build_hf_model("kimi_linear", fields)
    model.save_pretrained(folder)
    config, params = mk.load_checkpoint(folder)
    config = dataclasses.replace(config, max_context=CONTEXT)
    prompt = np.random.default_rng(seed).integers(0, fields["vocab_size"], (4, PROMPT))
    return model, folder, config, params, prompt


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return written_by_transformers(request.param, {**COMMON, **CASES[request.param]},
                                   tmp_path_factory.mktemp(request.param), seed=1)


def test_loaded_config_and_sizes_match_the_transformers_model(case):
    model, _, config, params, _ = case
    hf = model.config
    assert config.is_mla and config.channel_decay and config.router_score == "sigmoid"
    kinds = tuple("linear" if t == LIN else "full" for t in hf.layer_types)
    assert config.layer_types == kinds
    assert config.moe_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types)
                                      if t == "sparse")
    assert config.unpadded().shared_expert_ffn == hf.moe_intermediate_size * hf.n_shared_experts
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())  # + the routers' choice bias
    assert param_count(config.unpadded()) == counted
    assert {k: v.shape for k, v in params.items()} == {
        k: shape for k, (shape, _) in param_shapes(config).items()}


def test_prefill_logits_match_transformers_forward(case):
    model, _, config, params, prompt = case
    assert_prefill_matches_hf(model, config, params, prompt, LOGIT_RTOL_OF_SCALE)


# Batch 1 is slow only for CI's CPU budget (two more compiles per case); batch 4 is not.
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_32_greedy_tokens_match_transformers_generate(case, batch):
    model, _, config, params, prompt = case
    assert_greedy_matches_hf(model, config, params, prompt[:batch], STEPS)


# One pattern in the default run (CI's CPU budget; the rollback test also decodes T > 1
# rows on the other), both in the slow run.
@pytest.mark.parametrize("case", [pytest.param("kda-mla-kda-groups", marks=pytest.mark.slow),
                                  "mla-kda-kda-qlora"], indirect=True)
def test_t4_decode_steps_predict_transformers_tokens(case):
    model, _, config, params, prompt = case
    assert_t4_steps_predict_hf_tokens(model, config, params, prompt)


def test_planted_positional_encoding_in_mla_diverges(case, monkeypatch):
    """transformers' MLA is NoPE: the same run with RoPE on every head of q and k (keys
    at their cache positions) must miss the tolerance the real run meets."""
    model, _, config, params, prompt = case
    want = hf_logits(model, prompt)
    attention = ops.attention

    def rotated(q, k_cache, v_cache, positions):
        rows = positions[:, None] + jnp.arange(q.shape[1])
        k = ops.rope(k_cache.transpose(0, 2, 1, 3), jnp.arange(k_cache.shape[2])[None], 1e4)
        return attention(ops.rope(q, rows, 1e4), k.transpose(0, 2, 1, 3).astype(k_cache.dtype),
                         v_cache, positions)

    monkeypatch.setattr(R, "attention", rotated)  # the name mla_decoder_layer looks up
    planted = dataclasses.replace(config, name="planted-rope")  # a new trace of forward
    got = np.asarray(R.prefill(planted, params, prompt)[0])
    assert np.abs(got - want).max() > 100 * LOGIT_RTOL_OF_SCALE * np.abs(want).max()


# -- The reference itself ------------------------------------------------------------------
def test_per_channel_decay_by_hand():
    """One head, Hk = 2, Hv = 1, state [[2], [2]]: channel decays (1/2, 1) give [[1], [2]];
    k = (1, 0), v = 5, beta = 1 -> delta 4, state [[5], [2]]; out (q = (1, 1)) = 7. One
    decay of 1/2 for the head would give [[5], [1]] and 6."""
    state = jnp.full((1, 1, 2, 1), 2.0)
    q, k = jnp.array([1.0, 1.0]).reshape(1, 1, 1, 2), jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    v, beta = jnp.full((1, 1, 1, 1), 5.0), jnp.ones((1, 1, 1))
    g = jnp.log(jnp.array([0.5, 1.0])).reshape(1, 1, 1, 2)
    out, states = la.delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out).ravel(), [7.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(states).ravel(), [5.0, 2.0], rtol=1e-6)
    head, _ = la.delta_rule(q, k, v, g[..., 0], beta, state)
    np.testing.assert_allclose(np.asarray(head).ravel(), [6.0], rtol=1e-6)


def test_grouped_router_by_hand():
    """8 experts in 2 groups, top 2 from the best group. Biased scores pick group 1 (its top
    two sum highest) although expert 0 scores highest unbiased; weights are the unbiased
    scores, renormalised, times the scale."""
    logits = jnp.array([[3.0, 0, 0, 0, 1, 1, 0, 0]])
    bias = jnp.array([0, 0, 0, 0, 1.0, 1.0, 0, 0])
    w, e = ops.route_grouped(logits, jnp.eye(8), bias, top_k=2, groups=2, topk_groups=1,
                             renormalise=True, scale=2.0)
    assert sorted(np.asarray(e)[0].tolist()) == [4, 5]
    np.testing.assert_allclose(np.asarray(w)[0], [1.0, 1.0], rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_kimi():
    """The first case's config with mk's random weights (cheaper to compile than the
    TPU-shaped tiny-kimi preset)."""
    import transformers

    hf = transformers.KimiLinearConfig(**{**COMMON, **CASES["kda-mla-kda-groups"]})
    config = mk.ModelConfig.from_hf(hf.to_dict(), name="small-kimi", dtype="float32")
    config = dataclasses.replace(config, max_context=16)
    return config, mk.init_params(config, seed=0)


@pytest.mark.slow  # ~20 CPU-seconds; test_hybrid checks the same rollback in CI
def test_rollback_restores_the_kda_states_of_the_accepted_prefix(tiny_kimi):
    """A T = 2 step rolled back to k accepted rows continues exactly like a k-row step;
    the planted bug (no rollback: keep the KDA states after both rows) does not. (T = 2
    keeps the compiles few; test_hybrid checks the shared rollback at T = 4.)"""
    after2, rows = assert_rollback_exact(*tiny_kimi, rows=2, accepted=[1, 2, 1])
    assert isinstance(after2, LatentCache) and rows.state.shape[2] == 2


def test_kimi_calls_are_checked(tiny_kimi):
    config, params = tiny_kimi
    with pytest.raises(ValueError, match="LatentCache"):
        R.decode_step(config, params, R.init_cache(mk.preset("tiny-hybrid"), 1), [[1]], [0])
    bad = R.init_cache(config, 1)._replace(latent=jnp.zeros((1, 1, 8, 7), jnp.float32))
    with pytest.raises(ValueError, match="R \\+ Hr=40"):
        R.decode_step(config, params, bad, [[1]], [0])
    with pytest.raises(ValueError, match="max_context=16"):
        R.decode_step(config, params, R.init_cache(config, 1), [[1, 2]], [15])


# -- The megakernel: MLA, KDA and Kimi's MoE against transformers ---------------------------
# TPU-shaped tiny kimi_linear models written by transformers (head dims 128, a latent of
# 128 + 64, hidden 256: the tiles a TPU lowers), float32 on both sides: the megakernel's
# greedy tokens must be transformers' own.
TPU_COMMON = {**COMMON, **dict(
    vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=128, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, linear_head_dim=128, linear_num_heads=2)}
TPU_CASES = {
    "kda-mla-kda": CASES["kda-mla-kda-groups"],  # the same pattern at TPU shapes
    "mla-kda-qlora": dict(
        num_hidden_layers=2, layer_types=[FULL, LIN], mlp_layer_types=["sparse", "dense"],
        q_lora_rank=128, n_group=1, topk_group=1, n_shared_experts=2,
        routed_scaling_factor=1.5, norm_topk_prob=False),
}
SLOW = pytest.mark.slow


@pytest.fixture(scope="module", params=list(TPU_CASES))
def tpu_case(request, tmp_path_factory):
    """(transformers model, mk config, mk params, prompt [4, PROMPT]) of a TPU-shaped case."""
    model, _, config, params, prompt = written_by_transformers(
        request.param, {**TPU_COMMON, **TPU_CASES[request.param]},
        tmp_path_factory.mktemp(request.param), seed=4)
    return model, config, params, prompt


def megakernel_generate(config, params, prompt, steps):
    return megakernel.generate(config, params, prompt, steps, backend="interpret",
                               steps_per_call=steps - 1)


# CI's budget (~60 s each): CI checks the megakernel's tokens against transformers' by the
# T = 4 steps below (B = 4) and the kda-mla-kda pattern's by speculative decoding
@pytest.mark.parametrize("tpu_case, batch", [
    pytest.param("kda-mla-kda", 4, marks=SLOW), pytest.param("kda-mla-kda", 1, marks=SLOW),
    pytest.param("mla-kda-qlora", 4, marks=SLOW), pytest.param("mla-kda-qlora", 1, marks=SLOW)],
    indirect=["tpu_case"])
def test_megakernel_32_greedy_tokens_match_transformers_generate(tpu_case, batch):
    model, config, params, prompt = tpu_case
    assert config.is_mla
    assert_greedy_matches_hf(model, config, params, prompt[:batch], STEPS,
                             megakernel_generate)


@pytest.mark.parametrize("tpu_case, batch", [
    ("mla-kda-qlora", 4), pytest.param("mla-kda-qlora", 1, marks=SLOW),
    pytest.param("kda-mla-kda", 4, marks=SLOW), pytest.param("kda-mla-kda", 1, marks=SLOW)],
    indirect=["tpu_case"])
def test_megakernel_t4_steps_predict_transformers_tokens_race_free(tpu_case, batch):
    """8 megakernel steps of T = 4 rows (32 tokens) fed transformers' tokens predict its
    next ones; every step runs under the race detector (one trace serves all eight: a
    step without it would trace the kernel again, ~15 s)."""
    model, config, params, prompt = tpu_case
    plan = DecodePlan.make(config, batch=batch, rows=4, context=CONTEXT)
    weights = megakernel.prepare(plan, params)
    races = []

    def step(cache, rows, positions):
        with backend.use("interpret", detect_races=True):
            _, logits, cache = megakernel.decode_step(plan, weights, cache, rows, positions)
            races.append(backend.races_found())
        return logits, cache

    assert_t4_steps_predict_hf_tokens(model, config, params, prompt[:batch], STEPS // 4, step)
    assert len(races) == STEPS // 4 and not any(races)


@pytest.mark.parametrize("tpu_case", ["kda-mla-kda"], indirect=True)
def test_planted_wrong_head_in_mla_value_projection_diverges(tpu_case, monkeypatch):
    """The guard of the two checks above, in the same run: each head's attention output
    multiplied by the other head's value up-projection must change the tokens."""
    from mk.kinds.attention import mla
    from mk.kinds.attention import kinds as attention

    model, config, params, prompt = tpu_case
    right = mla.mla_epilogue

    def swapped_heads(config, s):
        N, R, W = config.heads, config.latent_rank, config.latent_width
        Hn, Ho = config.head_dim - config.rope_dim, config.value_dim
        right(config, s)
        for n in range(N):
            m = (n + 1) % N
            w_uv = s.wkv_b[:, m * (Hn + Ho) + Hn:(m + 1) * (Hn + Ho)].astype(jnp.float32)
            s.o[:, n * Ho:(n + 1) * Ho] = jnp.dot(s.o_latent[:, n * W:n * W + R], w_uv)

    monkeypatch.setattr(attention, "mla_epilogue", swapped_heads)
    planted = dataclasses.replace(config, name="planted-heads")  # a new trace
    with pytest.raises(AssertionError):
        assert_greedy_matches_hf(model, planted, params, prompt[:1], 8, megakernel_generate)


@pytest.mark.parametrize("tpu_case, drafter", [
    ("kda-mla-kda", "self"), *(pytest.param("kda-mla-kda", d, marks=SLOW)
                               for d in ("model", "ngram", "forced"))], indirect=["tpu_case"])
def test_speculative_decoding_on_the_megakernel_verifier_is_lossless(tpu_case, drafter):
    """Greedy speculative decoding with the megakernel verifying gamma + 1 = 4 rows a step
    (MLA's latent rows of rejected drafts overwritten, KDA's states rolled back to the last
    kept row) gives transformers' own greedy tokens, with every drafter."""
    from mk.speculative import spec
    model, config, params, prompt = tpu_case
    want = hf_greedy(model, prompt[:2], 12)
    options = dict(acceptance_length=3) if drafter == "forced" else {}
    got, stats = spec.generate(config, params, prompt[:2], 12, drafter=drafter, gamma=3,
                               verifier="megakernel", backend="interpret", **options)
    np.testing.assert_array_equal(got, want)
    assert sum(stats.histogram[:-1]) > 0  # some steps kept fewer rows than they fed


# -- The megakernel on tiny-kimi with its MLA layer made GQA -------------------------------
@pytest.fixture(scope="module")
def tiny_kimi_gqa():
    """tiny-kimi with its MLA layer made a GQA layer (head dim 128): KDA, the grouped
    sigmoid router with its bias (random: init_params' zero bias would hide a lost one),
    the routed scale and the shared expert, through the megakernel. A synthetic model: its
    oracle is mk.model.reference, itself checked against transformers above."""
    config = kimi_gqa()
    params = mk.init_params(config, seed=0)
    bias = np.random.default_rng(0).normal(0, 0.5, params["router_bias"].shape)
    return config, params | {"router_bias": jnp.asarray(bias, params["router_bias"].dtype)}


@pytest.mark.slow  # ~60 CPU-seconds
def test_megakernel_greedy_tokens_of_kda_and_kimis_moe_equal_the_reference(tiny_kimi_gqa):
    config, params = tiny_kimi_gqa
    prompt = np.random.default_rng(2).integers(0, config.vocab, (2, 5))
    got = megakernel.generate(config, params, prompt, 8, backend="interpret", max_context=64,
                              steps_per_call=7)
    np.testing.assert_array_equal(got, R.generate(config, params, prompt, 8, max_context=64))


@pytest.mark.slow  # ~40 CPU-seconds; CI runs the KDA and MoE bodies in their stage tests
def test_megakernel_t2_step_gives_the_reference_kda_row_states_race_free(tiny_kimi_gqa):
    """One T = 2 step from a prefilled cache, in float32 (bf16 rounding would blur the
    tolerances): the tokens, the logits, and each KDA layer's conv and recurrent states
    after every row (what a verifier's rollback restarts from). RMSNorm of q and k in a
    model without QK-norm (a bug this test found) moved the logits by ~2 %."""
    config, params = tiny_kimi_gqa
    config = dataclasses.replace(config, dtype="float32")
    params = {n: p.astype(jnp.float32) for n, p in params.items()}
    prompt = np.random.default_rng(3).integers(0, config.vocab, (2, 6))
    _, cache = R.prefill(config, params, prompt[:, :4], max_context=64)
    tokens, positions = prompt[:, 4:], jnp.full((2,), 4, jnp.int32)
    want_logits, _, want_rows = R.decode_step(config, params, cache, tokens, positions,
                                              row_states=True)
    plan = DecodePlan.make(config, batch=2, rows=2, context=64)
    weights = megakernel.prepare(plan, params)
    with backend.use("interpret", detect_races=True):
        got_tokens, got_logits, _, got_rows = megakernel.decode_step(
            plan, weights, cache, tokens, positions, row_states=True)
        races = backend.races_found()
    np.testing.assert_array_equal(got_tokens, R.greedy(want_logits))
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_rows.state, want_rows.state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_rows.conv, want_rows.conv, rtol=1e-5, atol=1e-5)
    assert not races


# -- Config ---------------------------------------------------------------------------------
def test_kimi_presets_build_beside_their_gqa_stand_in():
    for name in mk.model.presets.KIMI_PRESET_NAMES:
        assert mk.preset(name).name == name
    assert "kimi-k3-like" in mk.model.presets.PRESET_NAMES  # the GQA stand-in stays for the kernel


def test_kimi_k2_shaped_sizes():
    k3 = mk.preset("kimi-k2-shaped")
    assert (k3.layers, k3.hidden, k3.vocab, k3.experts, k3.experts_per_token) == \
        (93, 7168, 163_840, 896, 16)
    assert k3.full_layers == tuple(range(3, 93, 4)) and len(k3.linear_layers) == 70
    # MLA caches R + Hr = 576 bf16 values per token and MLA layer; the GQA stand-in caches
    # K and V of 8 heads x 128 in all 93 layers: 14x more.
    assert mk.model.cache.bytes_per_position(k3) == 23 * 576 * 2
    assert mk.model.cache.bytes_per_position(mk.preset("kimi-k3-like")) == 2 * 93 * 8 * 128 * 2
    # Per sequence and KDA layer: conv 3 x (3 * 64 * 128) bf16 + state 64 x 128 x 128 f32.
    assert mk.model.cache.state_bytes_per_sequence(k3) == 70 * (3 * 3 * 64 * 128 * 2 + 64 * 128 *
                                                                128 * 4)
    # At 64K context one sequence's caches: 1.7 GB of latent rows + 0.3 GB of KDA state,
    # against 25 GB of K and V for the GQA stand-in.
    got = mk.cost.perf.cache_bytes(k3, context=65_536)
    assert got == {"kv": 65_536 * 26_496, "linear": mk.model.cache.state_bytes_per_sequence(k3)}
    assert mk.cost.perf.cache_bytes(mk.preset("kimi-k3-like"), context=65_536) == {
        "kv": 65_536 * 380_928, "linear": 0}
    cut = mk.preset("tiny-kimi").first_layers(1)  # one KDA layer, dense MLP
    assert not cut.is_moe and cut.router_score == "softmax" and cut.channel_decay


@pytest.mark.parametrize("change, message", [
    (dict(kv_heads=1), "MLA needs kv_heads=heads"),
    (dict(rope_dim=192), "rope_dim=192 must be below head_dim=192"),
    (dict(value_dim=0), "value_dim=0"),
    (dict(latent_rank=0), "latent_rank=0"),
    (dict(linear_value_heads=4), "channel_decay"),
    (dict(expert_groups=3), "expert_groups=3"),
    (dict(topk_groups=3), "topk_groups=3"),
    (dict(routed_scale=-1.0), "routed_scale=-1.0"),
    (dict(router_score="tanh"), "router_score='tanh'"),
])
def test_bad_kimi_config_is_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(mk.preset("tiny-kimi"), **change)


# -- Loader ---------------------------------------------------------------------------------
def test_loader_reports_every_problem_at_once(case, tmp_path):
    _, folder, _, _, _ = case
    tensors = load_file(folder / "model.safetensors")
    conv = next(k for k in tensors if k.endswith("k_conv1d.weight"))
    del tensors[next(k for k in tensors if k.endswith("kv_b_proj.weight"))]
    del tensors[next(k for k in tensors if k.endswith("e_score_correction_bias"))]
    tensors[conv] = tensors[conv][:, :, :3].copy()  # wrong kernel width
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros(2, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="4 problems") as err:
        mk.load_checkpoint(tmp_path)
    for part in ("missing tensor", "kv_b_proj", "mk router_bias", conv, "unexpected tensor"):
        assert part in str(err.value)


def test_moonshot_spelling_of_the_dense_mlp_loads_the_same(case, tmp_path):
    """Moonshot's checkpoints name the dense MLP `mlp.`, transformers writes
    `block_sparse_moe.`: either loads the same weights; both at once is an error."""
    _, folder, config, params, _ = case
    tensors = load_file(folder / "model.safetensors")
    dense = [k for k in tensors if ".block_sparse_moe." in k and "_proj" in k
             and "experts" not in k]
    assert len(dense) == 3
    moved = {k.replace(".block_sparse_moe.", ".mlp.") if k in dense else k: v
             for k, v in tensors.items()}
    save_file(moved, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    _, got = mk.load_checkpoint(tmp_path)
    for key in params:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(params[key]))
    save_file({**moved, dense[0]: tensors[dense[0]]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="two spellings"):
        mk.load_checkpoint(tmp_path)


def test_moonshot_config_json_is_read_as_transformers_reads_it():
    """Kimi-Linear-48B-A3B's config.json spelling (linear_attn_config with 1-indexed layer
    lists, first_k_dense_replace, num_experts, moe_renormalize): mk's fields equal
    transformers' KimiLinearConfig reading of the same dict."""
    import transformers

    kda = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
    moonshot = dict(
        model_type="kimi_linear", vocab_size=163_840, hidden_size=2304,
        intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts=256,
        num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
        moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=1, topk_group=1,
        rms_norm_eps=1e-5, model_max_length=1_048_576, torch_dtype="bfloat16",
        linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27], kda_layers=kda,
                                head_dim=128, num_heads=32, short_conv_kernel_size=4))
    hf = transformers.KimiLinearConfig(**moonshot)
    config = mk.ModelConfig.from_hf(moonshot, name="kimi-linear-48b")
    assert config.layer_types == tuple("full" if t == FULL else "linear"
                                       for t in hf.layer_types)
    assert config.moe_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types)
                                      if t == "sparse") == tuple(range(1, 27))
    assert (config.experts, config.experts_per_token, config.norm_topk, config.routed_scale,
            config.expert_groups, config.shared_expert_ffn, config.max_position) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.norm_topk_prob,
        hf.routed_scaling_factor, hf.n_group, hf.moe_intermediate_size, 1_048_576)
    assert (config.linear_value_heads, config.linear_key_dim, config.conv_kernel) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim)
    with torch.device("meta"):  # shapes only: the 48B model's 49.1e9 parameters, exactly
        model = transformers.KimiLinearForCausalLM(hf)
    assert param_count(config.unpadded()) == sum(t.numel() for t in [*model.parameters(),
                                                          *model.buffers()])


@pytest.mark.slow  # ~75 CPU-seconds; tests/test_hybrid.py runs the same machinery in CI
def test_speculative_decoding_is_lossless_with_every_drafter(tiny_kimi):
    """Greedy speculative decoding of Kimi Linear (the reference verifier) equals the
    reference's greedy tokens with every drafter: the KDA states rolled back to the last
    kept row as the gated DeltaNet's are (`mk.speculative.runners.Runner.keep`)."""
    from mk.speculative import spec
    config, params = tiny_kimi
    prompt = np.random.default_rng(2).integers(0, config.vocab, (2, 6))
    want = np.asarray(R.generate(config, params, prompt, 12, max_context=64))
    for drafter in spec.DRAFTERS:
        options = dict(acceptance_length=3) if drafter == "forced" else {}
        got, _ = spec.generate(config, params, prompt, 12, drafter=drafter, gamma=3,
                               verifier="reference", bucket=4, max_context=64, **options)
        np.testing.assert_array_equal(got, want, err_msg=drafter)
