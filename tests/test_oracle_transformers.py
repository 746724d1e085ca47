"""The external oracle: Hugging Face transformers' own Qwen3 / Qwen3-MoE models.

Tiny random float32 models are saved with `save_pretrained`, read back with
`mk.load_checkpoint` and run by `mk.model.reference`; prefill logits must match transformers'
forward pass and greedy generation must pick the same tokens. This checks the loader's name
mapping and transposes, the config translation (both config.json spellings) and the
reference's numerics conventions (RoPE, QK-norm, GQA, router, tied embeddings) at once.

Every parameter, norm weights included, is re-drawn at a scale that keeps activations and
router logits O(1), so a swapped norm, a mistransposed square matrix or a wrong router
choice shows up in the logits (transformers' default init leaves norms at exactly 1).
"""

import json

import numpy as np
import pytest
import torch

import mk
from builders import build_hf_model

# Both sides compute in float32; the observed max |mk - hf| / max |hf| is below 5e-7
# (summation order of matmuls and softmaxes). Wrong conventions measured on these models
# (q/k norms swapped, rope_theta doubled, norm_topk flipped, expert gate/up swapped, an
# untransposed square wo) move it to 1.4e-2 .. 1.2, so 1e-4 separates the two by 100x.
LOGIT_RTOL_OF_SCALE = 1e-4
BATCH, PROMPT, STEPS = 2, 8, 16

COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_theta=10_000.0, attn_implementation="eager", eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
CASES = {
    "dense-untied": ("qwen3", dict(num_hidden_layers=2, head_dim=16,
                                   tie_word_embeddings=False)),
    "dense-tied": ("qwen3", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)),
    "moe-renormalised": ("qwen3_moe", dict(num_hidden_layers=3, head_dim=16,
                                           mlp_only_layers=[1], norm_topk_prob=True,
                                           tie_word_embeddings=False, **MOE)),
    "moe-unnormalised-tied-step2": ("qwen3_moe", dict(
        num_hidden_layers=4, head_dim=32, mlp_only_layers=[3], decoder_sparse_step=2,
        norm_topk_prob=False, tie_word_embeddings=True, **MOE)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, checkpoint folder, mk config, mk params, prompt)."""
    kind, overrides = CASES[request.param]
    model = build_hf_model(kind, {**COMMON, **overrides})
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    config, params = mk.load_checkpoint(folder)
    prompt = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (BATCH, PROMPT))
    return request.param, model, folder, config, params, prompt


def test_loaded_config_matches_the_transformers_config(case):
    _, model, _, config, _, _ = case
    hf = model.config
    assert config.dtype == "float32"
    own = config.unpadded()  # mk holds the widths lane-padded (64 -> 128)
    assert (own.vocab, own.hidden, own.layers) == (hf.vocab_size, hf.hidden_size,
                                                   hf.num_hidden_layers)
    assert (config.hidden, config.norm_width) == (128, hf.hidden_size)
    assert (config.heads, config.kv_heads, config.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert config.tie_embeddings == hf.tie_word_embeddings
    moe_layers = tuple(i for i, layer in enumerate(model.model.layers)
                       if hasattr(layer.mlp, "experts"))
    assert config.moe_layers == moe_layers


def test_prefill_logits_match_transformers_forward(case):
    _, model, _, config, params, prompt = case
    with torch.no_grad():
        want = model(torch.as_tensor(prompt)).logits.numpy()
    got, _ = mk.model.reference.prefill(config, params, prompt)
    got = np.asarray(got)
    assert got.shape == want.shape == (BATCH, PROMPT, config.vocab)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_RTOL_OF_SCALE * scale)


def test_greedy_generation_matches_transformers_generate(case):
    _, model, _, config, params, prompt = case
    ids = torch.as_tensor(prompt)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[:, PROMPT:].numpy()
    assert want.shape == (BATCH, STEPS)  # never stopped early
    got = np.asarray(mk.model.reference.generate(config, params, prompt, STEPS))
    np.testing.assert_array_equal(got, want)


def to_old_spelling(hf: dict) -> dict:
    """transformers 5 writes rope_parameters / num_local_experts; older files have
    top-level rope_theta and num_experts."""
    old = dict(hf)
    old["rope_theta"] = old.pop("rope_parameters")["rope_theta"]
    if "num_local_experts" in old:
        old["num_experts"] = old.pop("num_local_experts")
    return old


def test_older_config_spelling_loads_the_same_config(case):
    name, _, folder, config, params, _ = case
    path = folder / "config.json"
    new = json.loads(path.read_text())
    old = to_old_spelling(new)
    assert "rope_parameters" not in old and "num_local_experts" not in old
    path.write_text(json.dumps(old))
    try:
        old_config, old_params = mk.load_checkpoint(folder)
    finally:
        path.write_text(json.dumps(new))
    assert old_config == config
    assert set(old_params) == set(params)
    for key in params:
        np.testing.assert_array_equal(np.asarray(old_params[key]), np.asarray(params[key]))
