"""Shared test inputs: tiny configs (`tiny_situ`, `tiny_gated_mla`, `tiny_bounded_kda`,
`tiny_latent_moe`, `tiny_res_layer`: one Kimi K3 kind each on an existing family) and
Hugging Face checkpoint folders written without torch; `bar_count` reads what a text
progress bar drew; `tiny_moe_in_ci` picks the preset CI runs; `quantised_cases` and
`plant_double_scale` for the tests of kernels on quantised weights; `assert_verify_steps`
feeds a perfect draft to the megakernel, T rows per step; `replay_tile_by_tile` switches
the simulator's fast-forward off; `simulated_step` replays the plan of a config's step at a
position.

The HF names below are spelled out by hand, independently of `mk.model.hf_layout.hf_layout`, so
a round trip through them tests the loader's mapping rather than repeating it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import mk
from mk.model import quant
from mk.cost import sim
from mk.model.config import ModelConfig
from mk.step.plan import DecodePlan


def kimi_gqa() -> ModelConfig:
    """tiny-kimi with its MLA layer made a GQA layer (head dim 128): KDA, the grouped sigmoid
    router, the routed scale and the shared expert, all the megakernel builds of Kimi
    Linear until it builds MLA (issue 18)."""
    return dataclasses.replace(mk.preset("tiny-kimi"), name="tiny-kimi-gqa", latent_rank=0,
                               rope_dim=0, value_dim=0, head_dim=128)


# Kimi K3's betas (the release's Config): SiTU's soft caps of the gate and up projections
K3_SITU = dict(situ_beta=4.0, situ_linear_beta=25.0)
# Kimi K3's KDA (the release's Config): a full-rank output gate, the log-decay's bound
K3_KDA = dict(kda_full_gate=True, kda_gate_bound=-5.0)
NO_MOE = dict(moe_layers=(), experts=0, experts_per_token=0, expert_ffn=0,
              shared_expert_ffn=0, router_score="softmax", expert_groups=1, topk_groups=1,
              routed_scale=1.0, norm_topk=False)
NO_LINEAR = dict(linear_key_heads=0, linear_value_heads=0, linear_key_dim=0,
                 linear_value_dim=0, conv_kernel=0, channel_decay=False)


def tiny_situ(**change) -> ModelConfig:
    """tiny (Qwen3's dense GQA model) under Kimi K3's SiTU activation: the situ_dense
    kind alone of K3's kinds."""
    return dataclasses.replace(mk.preset("tiny"), **dict(name="tiny-situ", **K3_SITU)
                               | change)


def tiny_gated_mla(**change) -> ModelConfig:
    """tiny-kimi cut to two MLA layers (a q low rank, as K3's) with Kimi K3's output gate,
    a dense layer then an MoE one: the gated_mla kind alone of K3's kinds."""
    return dataclasses.replace(mk.preset("tiny-kimi"), **dict(
        name="tiny-gated-mla", layers=2, layer_types=("full", "full"), moe_layers=(1,),
        q_rank=128, attn_output_gate=True, **NO_LINEAR) | change)


def tiny_bounded_kda(**change) -> ModelConfig:
    """tiny-kimi cut to two KDA layers (a dense layer then an MoE one; no full layer) with
    Kimi K3's KDA: the bounded_kda kind alone of K3's kinds."""
    return dataclasses.replace(mk.preset("tiny-kimi"), **dict(
        name="tiny-bounded-kda", layers=2, layer_types=("linear", "linear"),
        moe_layers=(1,), **K3_KDA) | change)


def tiny_latent_moe(**change) -> ModelConfig:
    """tiny-kimi cut to two MLA layers (a dense layer then an MoE one) with Kimi K3's
    latent MoE: its experts on a latent of 128 (half of D) under SiTU at K3's betas, one
    expert group (K3's router). SiTU is the model's (situ_beta), so the dense layer is
    situ_dense (a kind the kernel runs already): the latent_moe kind alone of K3's
    others."""
    return dataclasses.replace(mk.preset("tiny-kimi"), **dict(
        name="tiny-latent-moe", layers=2, layer_types=("full", "full"), moe_layers=(1,),
        expert_groups=1, topk_groups=1, moe_latent=128, **K3_SITU, **NO_LINEAR) | change)


def tiny_moe_in_ci(fixture: str):
    """Parametrize `fixture` (conftest's tiny_model or tiny_model_f32) with tiny-moe in CI and
    tiny in make test-slow only: tiny-moe has tiny's shapes and a dense layer 0 besides its
    MoE layers, so it runs every code path tiny does."""
    return pytest.mark.parametrize(
        fixture, [pytest.param("tiny", marks=pytest.mark.slow), "tiny-moe"], indirect=True)


def hf_config_dict(config: ModelConfig) -> dict:
    """`config.json` contents (newer spelling) that `ModelConfig.from_hf` reads back."""
    hf = {
        "_name_or_path": config.name,
        "architectures": ["Qwen3MoeForCausalLM" if config.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if config.is_moe else "qwen3",
        "vocab_size": config.vocab, "hidden_size": config.hidden,
        "num_hidden_layers": config.layers, "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.ffn, "rms_norm_eps": config.rms_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": config.tie_embeddings, "dtype": config.dtype,
        "max_position_embeddings": config.max_position, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False,
    }
    if config.is_moe:
        hf.update(num_local_experts=config.experts,
                  num_experts_per_tok=config.experts_per_token,
                  moe_intermediate_size=config.expert_ffn, norm_topk_prob=config.norm_topk,
                  decoder_sparse_step=1, mlp_only_layers=list(config.dense_layers))
    return hf


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """mk params -> HF-named numpy tensors, matrices back in HF's [out, in] order."""
    p = {name: np.asarray(value) for name, value in params.items()}
    tensors = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = p["lm_head"].T
    dense, moe = 0, 0
    for i in range(config.layers):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.input_layernorm.weight"] = p["attn_norm"][i]
        tensors[f"{layer}.post_attention_layernorm.weight"] = p["mlp_norm"][i]
        tensors[f"{layer}.self_attn.q_proj.weight"] = p["wq"][i].T
        tensors[f"{layer}.self_attn.k_proj.weight"] = p["wk"][i].T
        tensors[f"{layer}.self_attn.v_proj.weight"] = p["wv"][i].T
        tensors[f"{layer}.self_attn.o_proj.weight"] = p["wo"][i].T
        if config.qk_norm:
            tensors[f"{layer}.self_attn.q_norm.weight"] = p["q_norm"][i]
            tensors[f"{layer}.self_attn.k_norm.weight"] = p["k_norm"][i]
        if i in config.moe_layers:
            tensors[f"{layer}.mlp.gate.weight"] = p["router"][moe].T
            for e in range(config.experts):
                expert = f"{layer}.mlp.experts.{e}"
                tensors[f"{expert}.gate_proj.weight"] = p["we_gate"][moe, e].T
                tensors[f"{expert}.up_proj.weight"] = p["we_up"][moe, e].T
                tensors[f"{expert}.down_proj.weight"] = p["we_down"][moe, e].T
            moe += 1
        else:
            tensors[f"{layer}.mlp.gate_proj.weight"] = p["w_gate"][dense].T
            tensors[f"{layer}.mlp.up_proj.weight"] = p["w_up"][dense].T
            tensors[f"{layer}.mlp.down_proj.weight"] = p["w_down"][dense].T
            dense += 1
    return tensors


def write_hf_folder(hf_config: dict, tensors: dict[str, np.ndarray], folder: str | Path,
                    shards: int = 1) -> Path:
    """Write `config.json` and the tensors: one `model.safetensors`, or `shards` files
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = list(tensors)
    weight_map = {}
    for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[k]: tensors[names[k]] for k in part}, folder / file,
                  metadata={"format": "pt"})
        weight_map.update({names[k]: file for k in part})
    total = sum(value.nbytes for value in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def save_hf_checkpoint(config: ModelConfig, params: dict, folder: str | Path,
                       shards: int = 1) -> Path:
    """A Hugging Face Qwen3 / Qwen3-MoE folder holding `params` under `config`."""
    return write_hf_folder(hf_config_dict(config), hf_tensors(config, params), folder, shards)


def build_hf_model(kind: str, config_kwargs: dict, seed: int = 0):
    """A random float32 transformers Qwen3 ("qwen3"), Qwen3-MoE ("qwen3_moe"), Kimi
    Linear ("kimi_linear") or gpt-oss ("gpt_oss") model.

    Every parameter, norm weights included, is re-drawn at a scale that keeps activations
    and router logits O(1), so a swapped norm, a mistransposed square matrix or a wrong
    router choice shows up in the logits (transformers' default init leaves norms at 1).
    Kimi's decay parameters and its routers' choice bias (a buffer) are re-drawn too, and
    so are gpt-oss's biases and sinks (transformers zeroes the experts' biases).
    """
    import torch
    import transformers

    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config_kwargs)).float().eval()
    bias = [(name, b) for name, b in model.named_buffers()
            if name.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *bias]:
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith(("bias", "sinks")):  # gpt-oss's
                param.copy_(0.5 * torch.randn_like(param))
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn_like(param))
            elif kind == "gpt_oss" and name.endswith(("gate_up_proj", "down_proj")):
                param.copy_(torch.randn_like(param) / param.shape[-2] ** 0.5)  # [E, in, out]
            else:  # [.., out, in] (experts fused as [E, out, in]), conv [C, 1, W]:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)  # 1/fan_in
    return model


def hf_greedy(model, prompt, steps: int) -> np.ndarray:
    """transformers' greedy tokens after `prompt` [B, P] (no EOS stop): [B, steps]."""
    import torch

    ids = torch.as_tensor(prompt)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


def hf_logits(model, prompt) -> np.ndarray:
    """transformers' forward logits of `prompt` [B, P]: [B, P, V] float32."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(prompt)).logits.numpy()


def assert_prefill_matches_hf(model, config, params, prompt, rtol_of_scale: float):
    """mk's prefill logits within rtol_of_scale x max |logit| of transformers' forward."""
    from mk.model import reference as R

    want = hf_logits(model, prompt)
    got = np.asarray(R.prefill(config, params, prompt)[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol_of_scale * np.abs(want).max())


def assert_greedy_matches_hf(model, config, params, prompt, steps: int, generate=None):
    """mk's `steps` greedy tokens after `prompt` equal transformers' generate. generate:
    (config, params, prompt, steps) -> tokens [B, steps], default `mk.model.reference.generate`
    (the megakernel's `generate` is another)."""
    from mk.model import reference as R

    want = hf_greedy(model, prompt, steps)
    assert want.shape == (prompt.shape[0], steps)
    got = (generate or R.generate)(config, params, prompt, steps)
    np.testing.assert_array_equal(np.asarray(got), want)


def assert_t4_steps_predict_hf_tokens(model, config, params, prompt, steps: int = 3,
                                      step=None):
    """Prefill, then feed transformers' greedy tokens 4 rows per step: every row's argmax
    is transformers' next token (so the caches carry across steps). step: (cache, tokens
    [B, 4], positions [B]) -> (logits [B, 4, V], cache), default `mk.model.reference.decode_step`
    of `params` (the megakernel's is another)."""
    import jax.numpy as jnp

    from mk.model import reference as R

    B, P = prompt.shape
    want = hf_greedy(model, prompt, 4 * steps + 1)  # token 0 from prefill, then 4 per step
    logits, cache = R.prefill(config, params, prompt)
    np.testing.assert_array_equal(np.asarray(R.greedy(logits[:, -1])), want[:, 0])
    step = step or (lambda cache, rows, pos: R.decode_step(config, params, cache, rows, pos))
    for i in range(steps):
        rows = want[:, 4 * i:4 * i + 4]
        logits, cache = step(cache, rows, jnp.full((B,), P + 4 * i, jnp.int32))
        np.testing.assert_array_equal(np.asarray(R.greedy(logits)),
                                      want[:, 4 * i + 1:4 * i + 5])


def assert_rollback_exact(config, params, *, rows: int, accepted):
    """Three sequences take a T=`rows` step with per-row states, are rolled back to
    `accepted` rows each, and continue exactly like a step of that many rows (checked per
    k among the sequences that accepted k); the planted bug (no rollback: keep the states
    after all rows) differs for sequence 0, which must accept fewer than `rows`. Returns
    (the cache after all rows, the row states)."""
    import jax.numpy as jnp

    from mk.model import reference as R
    from mk.model.cache import rollback

    accepted = np.asarray(accepted)
    assert accepted[0] < rows, "sequence 0 is the planted bug's witness"
    prompt = np.random.default_rng(2).integers(0, config.vocab, (3, 5))
    draft = np.random.default_rng(3).integers(0, config.vocab, (3, rows))
    _, cache = R.prefill(config, params, prompt)
    pos = jnp.full((3,), 5, jnp.int32)
    _, after, states = R.decode_step(config, params, cache, draft, pos, row_states=True)

    def next_logits(c, shift):
        return np.asarray(R.decode_step(config, params, c, draft[:, :1], pos + shift)[0])

    got = next_logits(rollback(after, states, accepted), jnp.asarray(accepted))
    for k in sorted(set(accepted.tolist())):
        _, exact = R.decode_step(config, params, cache, draft[:, :k], pos)
        want = next_logits(exact, k)[accepted == k]
        np.testing.assert_allclose(got[accepted == k], want, rtol=0, atol=1e-4)
    planted = next_logits(after, jnp.asarray(accepted))
    assert np.abs(planted[0] - got[0]).max() > 1e-2
    return after, states


def assert_verify_steps(config, params, values, prompt, want, rows: int, tokens: int,
                        want_logits=None, rtol_of_scale: float = 0.0, block=None,
                        detect_races: bool = True):
    """Feed the reference's (or transformers') greedy tokens `want` [B, >= tokens] `rows`
    at a time (a perfect draft): each megakernel step (race detector on) must predict the
    next `rows`. values: what the reference's prefill runs on (the dequantised params, or
    params). want_logits [B, P + tokens, V] (the logits of the whole sequence, e.g.
    transformers' forward): each step's logits within rtol_of_scale x their max |.|.
    block: the tiling (default `default_block`'s, KV tiles of a 128-position cache).
    detect_races=False: a planted bug's check, whose kernel's tokens alone are asked."""
    import jax.numpy as jnp

    from mk.kernels import backend
    from mk.step import megakernel
    from mk.model import quant, reference
    from mk.step.plan import DecodePlan, default_block

    formats = quant.formats_of(params)
    if block is None:
        block = default_block(config, 128, formats=formats)
    plan = DecodePlan.make(config, batch=prompt.shape[0], rows=rows, context=128, block=block,
                           formats=formats)
    weights = megakernel.prepare(plan, params)
    _, cache = reference.prefill(config, values, prompt[:, :-1], max_context=128)
    fed = jnp.concatenate([prompt[:, -1:], want], axis=1)
    P = prompt.shape[1]
    with backend.use("interpret", detect_races=detect_races):
        for i in range(0, tokens, rows):
            got, logits, cache = megakernel.decode_step(
                plan, weights, cache, fed[:, i:i + rows],
                jnp.full((prompt.shape[0],), P - 1 + i, jnp.int32))
            np.testing.assert_array_equal(got, want[:, i:i + rows], err_msg=f"tokens {i}..")
            if want_logits is not None:
                ref = want_logits[:, P - 1 + i:P - 1 + i + rows]
                np.testing.assert_allclose(logits, ref, rtol=0,
                                           atol=rtol_of_scale * np.abs(ref).max())
    assert not backend.races_found()


def bar_count(text: str) -> tuple[int, int] | None:
    """(n, total) of the last state a text tqdm bar drew into `text` (its "n/total [" field),
    None if it drew none."""
    drawn = re.findall(r"(\d+)/(\d+) \[", text)
    return (int(drawn[-1][0]), int(drawn[-1][1])) if drawn else None


def quantised_cases(fast: str) -> list:
    """(scheme, dtype) of every mk.model.quant scheme in float32 and bfloat16: `fast` in float32
    in the default run (kernel and reference multiply the same dequantised values, so
    they differ by summation order only), the others `slow`."""
    return [pytest.param(scheme, dtype, marks=() if (scheme, dtype) == (fast, "float32")
                         else pytest.mark.slow)
            for scheme in quant.SCHEMES for dtype in ("float32", "bfloat16")]


def plant_double_scale(q: quant.QuantWeight, at: tuple[int, ...] | None = None
                       ) -> quant.QuantWeight:
    """The scales q.scale[at] twice what they should be (default: one group's, the first)."""
    scale = np.array(q.scale)
    at = (0,) * scale.ndim if at is None else at
    scale[at] = scale[at] + 1 if q.scheme == "fp4" else scale[at] * 2  # e8m0: +1
    return dataclasses.replace(q, scale=jnp.asarray(scale))


def replay_tile_by_tile(monkeypatch) -> None:
    """Switch the simulator's fast-forward off: every tile is replayed one by one."""
    monkeypatch.setattr(sim, "FAST_FORWARD", False)



def tiny_res_layer(**change) -> ModelConfig:
    """tiny-kimi grown to five layers (KDA, MLA, MLA, KDA, MLA), its MLPs all dense (no
    MoE: a cheaper trace), with Kimi K3's attention residuals, a block every 2 layers:
    blocks begin at 0, 2 and 4 (two edges crossed; layers 1 and 3 add to a block's sum):
    the res_layer kind alone of K3's kinds."""
    return dataclasses.replace(mk.preset("tiny-kimi"), **dict(
        name="tiny-res-layer", layers=5,
        layer_types=("linear", "full", "full", "linear", "full"), residual_block=2,
        **NO_MOE) | change)


REPLAY_ARGS = ("cross_layer_prefetch", "routing", "experts_active", "assumptions")


def simulated_step(config: ModelConfig, chip, *, context: int = 0, **kw) -> sim.Simulation:
    """`mk.cost.sim.simulate` of the plan of `config` for `chip`, every sequence at `context`
    (`DecodePlan.make(config, chip=, position=context, kernel=False, **plan knobs)`);
    `simulate`'s own arguments (REPLAY_ARGS) go to it."""
    replay = {k: kw.pop(k) for k in REPLAY_ARGS if k in kw}
    return sim.simulate(DecodePlan.make(config, chip=chip, position=context, kernel=False,
                                        **kw), **replay)
