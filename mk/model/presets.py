"""The named models: `preset(name)` -> a `mk.model.config.ModelConfig`, and the lists of names.
Here: tiny TPU-legal models every test and notebook default uses, and real shapes from
each family's published config.json (Qwen3 dense and MoE, Qwen3.5 hybrids, Kimi Linear and
its GQA stand-in), each with its sources; a preset stored quantised says so with `formats`
(the release's FP4 experts: `formats={"experts": "fp4"}`). `PRESET_NAMES` lists the GQA
and Qwen3.5 models, `HYBRID_PRESET_NAMES` the Qwen3.5 hybrids, `KIMI_PRESET_NAMES` the
Kimi Linear ones, `K3_PRESET_NAMES` Kimi K3 as its release describes it (the reference
runs it, no kernel yet), `GPT_OSS_PRESET_NAMES` gpt-oss (tiny, 20b, 120b). Not here: what a
config means and its checks (`mk.model.config`), reading a Hugging Face config.json
(`mk.model.config.ModelConfig.from_hf`).
"""

from __future__ import annotations

from mk.model.config import ModelConfig, Yarn
from mk.model.errors import shown


def _qwen3(name, *, hidden, layers, heads, kv_heads, ffn, tie, **extra):
    return ModelConfig(name=name, vocab=151_936, hidden=hidden, layers=layers, heads=heads,
                       kv_heads=kv_heads, head_dim=128, ffn=ffn, rope_theta=1_000_000.0,
                       tie_embeddings=tie, **extra)


def _every_fourth_full(layers: int) -> tuple[str, ...]:
    """layer_types of 3 linear layers for every full-attention layer (the 4th, 8th, ...)."""
    return tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(layers))


def _qwen3_5(name, *, hidden, layers, heads, kv_heads, ffn, linear_value_heads, **extra):
    """A Qwen3.5 text model: 3 gated-DeltaNet layers for every full-attention layer."""
    kinds = _every_fourth_full(layers)
    return ModelConfig(name=name, vocab=248_320, hidden=hidden, layers=layers, heads=heads,
                       kv_heads=kv_heads, head_dim=256, ffn=ffn, layer_types=kinds,
                       linear_key_heads=16, linear_value_heads=linear_value_heads,
                       linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
                       attn_output_gate=True, partial_rotary_factor=0.25, norm_offset=1.0,
                       **extra)


_PRESETS = {
    # Tiny TPU-legal shapes (head dim 128, widths multiples of 128) that run on CPU in
    # seconds; every test and notebook default uses them.
    "tiny": lambda: ModelConfig(
        name="tiny", vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=128,
        ffn=512, rope_theta=10_000.0, dtype="bfloat16", max_position=4096, max_context=256),
    "tiny-moe": lambda: ModelConfig(
        name="tiny-moe", vocab=512, hidden=256, layers=3, heads=4, kv_heads=2, head_dim=128,
        ffn=512, rope_theta=10_000.0, dtype="bfloat16", max_position=4096, max_context=256,
        experts=8, experts_per_token=2, expert_ffn=128, moe_layers=(1, 2), norm_topk=True),
    # Real shapes, from each model's config.json on the Hugging Face hub (Qwen/Qwen3-*).
    "qwen3-0.6b": lambda: _qwen3("qwen3-0.6b", hidden=1024, layers=28, heads=16,
                                 kv_heads=8, ffn=3072, tie=True),
    "qwen3-1.7b": lambda: _qwen3("qwen3-1.7b", hidden=2048, layers=28, heads=16,
                                 kv_heads=8, ffn=6144, tie=True),
    "qwen3-4b": lambda: _qwen3("qwen3-4b", hidden=2560, layers=36, heads=32, kv_heads=8,
                               ffn=9728, tie=True),
    "qwen3-8b": lambda: _qwen3("qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8,
                               ffn=12288, tie=False),
    # Qwen/Qwen3-30B-A3B: 48 layers, all MoE, 128 experts, top-8 renormalised, no shared
    # expert.
    "qwen3-30b-a3b": lambda: _qwen3(
        "qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4, ffn=6144, tie=False,
        experts=128, experts_per_token=8, expert_ffn=768, moe_layers=tuple(range(48)),
        norm_topk=True),
    # Seed-scale stand-in for the release's "Kimi K3": 93 layers, hidden 7168, 896 experts,
    # 16 per token, FP4 experts. The published model uses MLA / linear attention and a
    # shared expert; it is modelled here as GQA (64 heads, 8 kv heads, head dim 128) with
    # Kimi K2's first dense layer (FFN 18432), expert width 2048 and vocab 163840, no
    # shared expert.
    "kimi-k3-like": lambda: ModelConfig(
        name="kimi-k3-like", vocab=163_840, hidden=7168, layers=93, heads=64, kv_heads=8,
        head_dim=128, ffn=18_432, rope_theta=50_000.0, max_position=131_072,
        experts=896, experts_per_token=16, expert_ffn=2048, moe_layers=tuple(range(1, 93)),
        norm_topk=True, formats={"experts": "fp4"}),
}

# Qwen3.5 hybrids (gated DeltaNet + gated full attention): every module runs them (the
# megakernel on one device or tensor parallel), so PRESET_NAMES holds them too.
_HYBRID_PRESETS = {
    # Tiny Qwen3.5 hybrid: linear, linear, full, linear (a linear layer last), TPU-legal.
    "tiny-hybrid": lambda: ModelConfig(
        name="tiny-hybrid", vocab=512, hidden=256, layers=4, heads=2, kv_heads=1,
        head_dim=128, ffn=512, rope_theta=10_000.0, dtype="bfloat16", max_position=4096,
        max_context=256, layer_types=("linear", "linear", "full", "linear"),
        linear_key_heads=1, linear_value_heads=2, linear_key_dim=128, linear_value_dim=128,
        conv_kernel=4, attn_output_gate=True, partial_rotary_factor=0.25, norm_offset=1.0),
    # Qwen/Qwen3.5-27B (the hybrid the release's "Qwen3.8-27B" numbers are of), text model:
    # shapes from its config.json as quoted by several public projects (not read from the
    # hub here): 64 layers, hidden 5120, every 4th layer full attention (24 heads, 4 kv
    # heads, head dim 256, output gate, RoPE on 1/4 of each head, theta 1e7), the others
    # gated DeltaNet (16 key heads, 48 value heads, head dims 128, conv width 4), FFN 17408,
    # vocab 248320, untied, context 262144.
    "qwen3.5-27b": lambda: _qwen3_5("qwen3.5-27b", hidden=5120, layers=64, heads=24,
                                    kv_heads=4, ffn=17_408, linear_value_heads=48,
                                    rope_theta=10_000_000.0, max_position=262_144),
    # A 9B Qwen3.5: transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style" in its
    # docstring): 32 layers, hidden 4096, 16 heads, 4 kv heads, 32 linear value heads,
    # FFN 12288. 17.9 GB of bf16 weights: fits one v6e-1 chip (32 GB), not a v5e-1.
    # rope_theta 1e7 is assumed (the 27B's; the defaults say 1e4).
    "qwen3.5-9b": lambda: _qwen3_5("qwen3.5-9b", hidden=4096, layers=32, heads=16,
                                   kv_heads=4, ffn=12_288, linear_value_heads=32,
                                   rope_theta=10_000_000.0, max_position=262_144),
}

# Kimi Linear models (MLA + KDA + shared-expert MoE): the reference, the loader, the
# megakernel (tensor-parallel too), mk.cost.sim and mk.cost.perf run them. They are listed apart
# (KIMI_PRESET_NAMES), as "kimi-k3-like", their GQA stand-in, is in PRESET_NAMES.
_KIMI_PRESETS = {
    # Tiny Kimi Linear: KDA, KDA, MLA, KDA (a KDA layer last), a dense first layer, then
    # MoE with a shared expert and two expert groups. Head dims 128 (MLA: nope 128 + 64).
    "tiny-kimi": lambda: ModelConfig(
        name="tiny-kimi", vocab=512, hidden=256, layers=4, heads=2, kv_heads=2,
        head_dim=192, ffn=512, qk_norm=False, rope_theta=10_000.0, dtype="bfloat16",
        max_position=4096, max_context=256, layer_types=("linear", "linear", "full", "linear"),
        latent_rank=128, rope_dim=64, value_dim=128, linear_key_heads=2,
        linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
        channel_decay=True, experts=8, experts_per_token=2, expert_ffn=128,
        moe_layers=(1, 2, 3), norm_topk=True, shared_expert_ffn=128, router_score="sigmoid",
        expert_groups=2, topk_groups=1, routed_scale=2.5),
    # A Kimi-K2-shaped stand-in for the release's "Kimi K3" on Kimi Linear's layers (what
    # mk called "kimi-k3" before issue 66; the release's own Config is `kimi-k3` below,
    # which the ledger's Kimi K3 rows use). Published (the issue): 93 layers, hidden 7168,
    # MLA every 4th layer (here layers 3, 7, ..., 91, Kimi-Linear-48B's 1-indexed
    # full_attn_layers convention; the rest KDA), 896 experts, 16 per token, vocab 163840,
    # FP4 experts. From Kimi K2's config.json (moonshotai/Kimi-K2-Instruct, as quoted
    # publicly, not read here): 64 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
    # qk_rope 64, v_head_dim 128, expert FFN 2048, one shared expert, one first dense layer
    # of FFN 18432, routed_scaling_factor 2.827, renormalised top-k, rms eps 1e-6, 128K
    # context. From Kimi-Linear-48B-A3B (transformers' KimiLinearConfig defaults): KDA head
    # dim 128, conv width 4, n_group = topk_group = 1. ASSUMED: 64 KDA heads (K2's head
    # count; Kimi-Linear-48B has 32 at hidden 2304), MLA without RoPE as in Kimi Linear.
    "kimi-k2-shaped": lambda: ModelConfig(
        name="kimi-k2-shaped", vocab=163_840, hidden=7168, layers=93, heads=64, kv_heads=64,
        head_dim=192, ffn=18_432, qk_norm=False, rms_eps=1e-6, max_position=131_072,
        layer_types=_every_fourth_full(93),
        latent_rank=512, q_rank=1536, rope_dim=64, value_dim=128, linear_key_heads=64,
        linear_value_heads=64, linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
        channel_decay=True, experts=896, experts_per_token=16, expert_ffn=2048,
        moe_layers=tuple(range(1, 93)), norm_topk=True, formats={"experts": "fp4"},
        shared_expert_ffn=2048, router_score="sigmoid", routed_scale=2.827),
}

# Kimi K3 as the release describes it (issue 66): MLA with an output gate, KDA with a
# full-rank output gate and a bounded decay, a latent MoE, SiTU MLPs and attention
# residuals. `mk.model.reference` runs them, and the megakernel at any tp (its latent MoE
# all-gathers the latent and all-reduces its sum: `mk.kinds.mlp.latent`); the ledger's Kimi K3
# rows are this model at TP32. Listed apart (K3_PRESET_NAMES).
#
# "kimi-k3" is the release's `Config` (Inferact/tpu-megakernels, kimi/__init__.py), field by
# field (`release field` -> mk field):
#   dim 7168 -> hidden; latent 3584 -> moe_latent; expert_hidden 3072 -> expert_ffn;
#   shared_hidden 6144 -> shared_expert_ffn (moe_intermediate_size x num_shared_experts);
#   dense_hidden 33792 -> ffn; experts 896; top_k 16 -> experts_per_token; layers 93;
#   heads 96 -> heads = kv_heads (MLA) and linear_key_heads = linear_value_heads (KDA:
#   kimi/load.py slices 3 heads of 128 per rank of 32); head_dim 128 -> value_dim,
#   linear_key_dim, linear_value_dim; q_rank 1536; kv_rank 512 -> latent_rank; qk_extra 64
#   -> rope_dim (MLA's head_dim = 128 + 64: the megakernel's 192**-0.5 score scale);
#   vocab 163840; conv_size 4 -> conv_kernel; residual_block 12; eps 1e-5 -> rms_eps;
#   situ_beta 4; situ_linear_beta 25; gate_lower_bound -5 -> kda_gate_bound;
#   full_attention (3, 7, ..., 91, 92) -> layer_types "full" there, "linear" elsewhere.
# What `Config.from_checkpoint` requires (its `required` dict): mla_use_nope (mk's MLA is
# NoPE), mla_use_output_gate -> attn_output_gate, latent_moe_use_norm (the latent MoE's
# norm, always there in mk's), moe_renormalize -> norm_topk, the sigmoid router ->
# router_score, first_k_dense_replace 1 and moe_layer_freq 1 -> moe_layers 1..92,
# num_expert_group 1 -> expert_groups = topk_groups = 1, routed_scaling_factor 1.0 ->
# routed_scale; use_full_rank_gate -> kda_full_gate. Storage (kimi/load.py): experts MXFP4
# (w1/w2/w3 weight_packed + E8M0 weight_scale) -> formats experts "fp4"; gate/up re-stored
# at load as fp8 e4m3 with a bf16 scale per FP8_BLOCK = 256 rows -> expert_fp8_block.
# Not in the Config: its lm_head is untied (load.py reads language_model.lm_head.weight);
# rope_theta is unused (NoPE); ASSUMED: max_position 131072 (not stated; the release's
# benchmarks cache 1152 positions).
_K3_PRESETS = {
    # Tiny Kimi K3: every K3 feature at TPU-legal shapes (head dims 128, MLA's 128 + 64,
    # widths multiples of 128): KDA, KDA, KDA, MLA, MLA (the release's pattern: full at 3
    # and the last layer), a dense first layer then latent MoE (a latent of 128, half of
    # D as in K3), residual blocks of 2 layers (three blocks begin: at 0, 2 and 4).
    "tiny-k3": lambda: ModelConfig(
        name="tiny-k3", vocab=512, hidden=256, layers=5, heads=2, kv_heads=2, head_dim=192,
        ffn=512, qk_norm=False, rms_eps=1e-5, dtype="bfloat16", max_position=4096,
        max_context=256, layer_types=("linear", "linear", "linear", "full", "full"),
        latent_rank=128, q_rank=128, rope_dim=64, value_dim=128, attn_output_gate=True,
        linear_key_heads=2, linear_value_heads=2, linear_key_dim=128, linear_value_dim=128,
        conv_kernel=4, channel_decay=True, kda_full_gate=True, kda_gate_bound=-5.0,
        experts=8, experts_per_token=2, expert_ffn=128, moe_layers=(1, 2, 3, 4),
        norm_topk=True, shared_expert_ffn=128, router_score="sigmoid", routed_scale=1.0,
        moe_latent=128, situ_beta=4.0, situ_linear_beta=25.0, residual_block=2),
    "kimi-k3": lambda: ModelConfig(
        name="kimi-k3", vocab=163_840, hidden=7168, layers=93, heads=96, kv_heads=96,
        head_dim=192, ffn=33_792, qk_norm=False, rms_eps=1e-5, max_position=131_072,
        layer_types=tuple("full" if i in (*range(3, 92, 4), 92) else "linear"
                          for i in range(93)),
        latent_rank=512, q_rank=1536, rope_dim=64, value_dim=128, attn_output_gate=True,
        linear_key_heads=96, linear_value_heads=96, linear_key_dim=128,
        linear_value_dim=128, conv_kernel=4, channel_decay=True, kda_full_gate=True,
        kda_gate_bound=-5.0, experts=896, experts_per_token=16, expert_ffn=3072,
        moe_layers=tuple(range(1, 93)), norm_topk=True, shared_expert_ffn=6144,
        router_score="sigmoid", routed_scale=1.0, moe_latent=3584, situ_beta=4.0,
        situ_linear_beta=25.0, residual_block=12, formats={"experts": "fp4"},
        expert_fp8_block=256),
}

# gpt-oss (attention with sinks on alternating sliding-window and full layers, YaRN RoPE,
# clamped-SwiGLU experts stored MXFP4): the reference, the loader, the megakernel
# (tensor-parallel too), mk.cost.sim and mk.cost.perf run them. They are listed apart
# (GPT_OSS_PRESET_NAMES), as Kimi's are.
def _gpt_oss(name, *, layers, experts, **extra):
    """openai/gpt-oss-20b's and -120b's config.json (as quoted publicly, not read from the
    hub here; transformers' GptOssConfig defaults are the 120b's): hidden 2880, 64 heads
    of 64, 8 kv heads, a 128-position window on the even layers (the first sliding),
    biases, sinks, rope_theta 150000 with YaRN (factor 32 over 4096 positions, beta
    32 / 1, not truncated), 131072 positions, top-4 experts of width 2880 (swiglu_limit 7,
    transformers' alpha 1.702), vocab 201088, untied, rms eps 1e-5, MXFP4 experts; held
    lane-padded as the loader holds the checkpoint (2880 -> 2944: `lane_padded`)."""
    return ModelConfig(
        name=name, vocab=201_088, hidden=2880, layers=layers, heads=64, kv_heads=8,
        head_dim=64, ffn=2880, qk_norm=False, rope_theta=150_000.0, rms_eps=1e-5,
        max_position=131_072, attention_sinks=True, attention_bias=True,
        sliding_window=128, sliding_layers=tuple(range(0, layers, 2)),
        yarn=Yarn(factor=32.0, original_max_position=4096, truncate=False),
        experts=experts, experts_per_token=4, expert_ffn=2880,
        moe_layers=tuple(range(layers)), norm_topk=True, swiglu_limit=7.0,
        swiglu_alpha=1.702, formats={"experts": "fp4"}, **extra).lane_padded()


_GPT_OSS_PRESETS = {
    # Tiny gpt-oss: sliding, full, sliding, full; a 16-position window (below the tests'
    # contexts, so it matters), gpt-oss's head dim 64, its RoPE and SwiGLU constants.
    "tiny-gpt-oss": lambda: ModelConfig(
        name="tiny-gpt-oss", vocab=512, hidden=256, layers=4, heads=4, kv_heads=2,
        head_dim=64, ffn=128, qk_norm=False, rope_theta=150_000.0, rms_eps=1e-5,
        dtype="bfloat16", max_position=4096, max_context=256, attention_sinks=True,
        attention_bias=True, sliding_window=16, sliding_layers=(0, 2),
        yarn=Yarn(factor=32.0, original_max_position=4096, truncate=False), experts=8,
        experts_per_token=2, expert_ffn=128, moe_layers=(0, 1, 2, 3), norm_topk=True,
        swiglu_limit=7.0, swiglu_alpha=1.702),
    "gpt-oss-20b": lambda: _gpt_oss("gpt-oss-20b", layers=24, experts=32),
    "gpt-oss-120b": lambda: _gpt_oss("gpt-oss-120b", layers=36, experts=128),
}

PRESET_NAMES = tuple(_PRESETS) + tuple(_HYBRID_PRESETS)
HYBRID_PRESET_NAMES = tuple(_HYBRID_PRESETS)
KIMI_PRESET_NAMES = tuple(_KIMI_PRESETS)
K3_PRESET_NAMES = tuple(_K3_PRESETS)
GPT_OSS_PRESET_NAMES = tuple(_GPT_OSS_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named `ModelConfig`; `PRESET_NAMES`, `HYBRID_PRESET_NAMES`, `KIMI_PRESET_NAMES`,
    `K3_PRESET_NAMES` and `GPT_OSS_PRESET_NAMES` list them."""
    presets = {**_PRESETS, **_HYBRID_PRESETS, **_KIMI_PRESETS, **_K3_PRESETS,
               **_GPT_OSS_PRESETS}
    if not isinstance(name, str) or name not in presets:  # a list: unhashable, not a name
        names = PRESET_NAMES + KIMI_PRESET_NAMES + K3_PRESET_NAMES + GPT_OSS_PRESET_NAMES
        raise ValueError(f"preset={shown(name)} does not exist; choose one of {names}")
    return presets[name]()
