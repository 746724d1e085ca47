"""Kimi Linear (MLA + Kimi Delta Attention + shared-expert MoE) against transformers.

Tiny random float32 `kimi_linear` models are written by transformers' `save_pretrained`
(Moonshot's tensor names: block_sparse_moe, q/k/v_conv1d, per-expert w1/w2/w3), read back
with `mk.load_checkpoint` and run by `mk.reference`: prefill logits, 32 greedy tokens (batch
1 and 4, T = 1), and T = 4 decode steps fed transformers' own tokens must agree. Two layer
patterns (KDA first and last / MLA first; dense layer first / in the middle), q low-rank or
not, grouped routing with a choice bias, renormalised or not. Also: the per-channel decay
by hand, rollback of the KDA states (with a planted missing rollback), planted positional
encoding in MLA (transformers' MLA is NoPE), the config's sizes against transformers'
parameter count, presets, and the strict loader.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import mk
from mk import linear_attention as la
from mk import reference as R

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


def build_hf_kimi(overrides: dict, seed: int = 0):
    """A random float32 transformers Kimi Linear model, every parameter (and the router's
    choice bias) re-drawn at O(1) activation scale."""
    import transformers

    config = transformers.KimiLinearConfig(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
                param.copy_(0.5 * torch.randn_like(param))
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn_like(param))
            else:  # [out, in], experts [E, out, in], conv [C, 1, W]: N(0, 1/fan_in)
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model = build_hf_kimi(CASES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    config, params = mk.load_checkpoint(folder)
    config = dataclasses.replace(config, max_context=CONTEXT)
    prompt = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (4, PROMPT))
    return model, folder, config, params, prompt


def hf_greedy(model, prompt, steps):
    ids = torch.as_tensor(prompt)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


def test_loaded_config_and_sizes_match_the_transformers_model(case):
    model, _, config, params, _ = case
    hf = model.config
    assert config.is_mla and config.channel_decay and config.router_score == "sigmoid"
    kinds = tuple("linear" if t == LIN else "full" for t in hf.layer_types)
    assert config.layer_types == kinds
    assert config.moe_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types)
                                      if t == "sparse")
    assert config.shared_expert_ffn == hf.moe_intermediate_size * hf.n_shared_experts
    counted = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())  # + the routers' choice bias
    assert config.param_count == counted
    assert {k: v.shape for k, v in params.items()} == {
        k: shape for k, (shape, _) in config.param_shapes().items()}


def test_prefill_logits_match_transformers_forward(case):
    model, _, config, params, prompt = case
    with torch.no_grad():
        want = model(torch.as_tensor(prompt)).logits.numpy()
    got = np.asarray(R.prefill(config, params, prompt)[0])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_RTOL_OF_SCALE * scale)
