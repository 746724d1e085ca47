"""The weight table: every weight mk knows, one row each, and the layer kinds that own them.

A model is a stack of layers; each layer has one token mixer kind and one MLP kind
(`KIND_LAYERS`: which config field says a kind's layers; `kinds_of(config)`: the kinds a
model has), and the model has a few weights of its own. A row (`Weight`) says everything
one weight's consumers need: its name, owning kind, shape rule, byte family (`FAMILIES`),
path ("ring", "dma", "vector" or "gather": `PATHS`), tensor-parallel split (`SPLITS`),
format group (`FORMAT_GROUPS`), Hugging Face names per scheme (`hf_scheme`, `hf_names`)
and when it is present.

Everything that needs a weight's facts reads its row: `param_shapes` (the params layout;
`put_corner` fills a lane-padded one), `weights_of`, `names_of`, `layer_rows`, the
checkpoint loader (`mk.model.hf_layout`), the plan's byte families, tensor-parallel sharding
(`mk.step.shards`), the quantised formats (`mk.model.quant`); a weight moved by whole DMA is held in
VMEM as `dma_layout` says (`dma_laid_out` lays a stacked one out). Not here: how a kind's
kernel runs (`mk.kernels.*`, `mk.kinds`), the model's shape and its checks
(`mk.model.config`). The table of kinds and of a row's fields: docs/design/mk.model.weights.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

from mk.model.config import FORMAT_GROUP_NAMES, ModelConfig

# Which layers stack a kind's weights: a ModelConfig field (a count or a list of layers),
# or "" for the model's own weights.
KIND_LAYERS = {"model": "", "layer": "layers", "gqa": "full_layers", "mla": "full_layers",
               "sink_gqa": "full_layers", "deltanet": "linear_layers",
               "kda": "linear_layers", "dense": "dense_layers", "moe": "moe_layers",
               "clamped_moe": "moe_layers", "res_layer": "layers", "gated_mla": "full_layers",
               "bounded_kda": "linear_layers", "situ_dense": "dense_layers",
               "latent_moe": "moe_layers"}
# Byte families: what one step moves, by family (the plan, the simulator and mk.cost.perf count
# each; "embed" is gathered, never streamed).
FAMILIES = ("embed", "attention", "norms", "linear", "dense_mlp", "router", "experts",
            "lm_head")
PATHS = ("ring", "dma", "vector", "gather")
# How tensor parallelism cuts a weight over tp devices (`mk.step.tensor_parallel`):
#   whole     replicated on every device
#   columns   its last axis (heads, value heads, channels of a head), C/tp each
#   rows      its second-to-last axis (the partial sums are all-reduced)
#   kv_heads  columns by kv head, a head replicated on tp/K devices when tp > K
#   channels  a linear layer's q | k | v conv channels, each part by heads
#   ffn_columns, ffn_rows   columns / rows, padded with zeros to whole 128-lane tiles
#   vocab     the lm_head's vocab columns (from the embedding when tied)
#   experts   a router's expert columns, E/tp each, where the plan splits it
#             (`mk.kinds.mlp.routing.router_columns`), else whole
#   latent_columns, latent_rows   the latent MoE's latent: whole 128-lane tiles of it a
#             device, in device order, the last devices' zeros
#             (`mk.kinds.mlp.latent_moe.latent_columns`)
SPLITS = ("whole", "columns", "rows", "kv_heads", "channels", "ffn_columns", "ffn_rows",
          "vocab", "experts", "latent_columns", "latent_rows")
# Hugging Face naming schemes: "qwen" (qwen3, qwen3_moe, qwen3_5), "kimi" (kimi_linear,
# as transformers' save_pretrained writes it) and "gpt_oss".
HF_SCHEMES = ("qwen", "kimi", "gpt_oss")


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight: its row of the table (module docstring)."""

    name: str
    kind: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    family: str
    path: str | Callable[[ModelConfig], str]
    split: str
    quant: str | None = None
    hf: dict = dataclasses.field(default_factory=dict)
    when: Callable[[ModelConfig], object] | None = None

    def __post_init__(self):
        for field, value, allowed in (("kind", self.kind, KIND_LAYERS),
                                      ("family", self.family, FAMILIES),
                                      ("split", self.split, SPLITS)):
            if value not in allowed:
                raise ValueError(f"weight {self.name}: {field}={value!r} must be one of "
                                 f"{tuple(allowed)}")
        unknown = set(self.hf) - set(HF_SCHEMES)
        if unknown:
            raise ValueError(f"weight {self.name}: hf schemes {sorted(unknown)} must be in "
                             f"{HF_SCHEMES}")

    def path_of(self, config: ModelConfig) -> str:
        """How the megakernel moves this weight in `config` (`PATHS`)."""
        path = self.path(config) if callable(self.path) else self.path
        if path not in PATHS:
            raise ValueError(f"weight {self.name}: path={path!r} must be one of {PATHS}")
        return path

    def present(self, config: ModelConfig) -> bool:
        """Whether `config` has this weight (its kind's layers exist and its switch is on)."""
        if not _layer_count(config, self.kind) and KIND_LAYERS[self.kind]:
            return False
        return self.when is None or bool(self.when(config))

    def stacked(self, config: ModelConfig) -> tuple[int, ...]:
        """Its params shape: the kind's layer count, then one layer's shape."""
        lead = (_layer_count(config, self.kind),) if KIND_LAYERS[self.kind] else ()
        return lead + self.shape(config)


def _layer_count(config: ModelConfig, kind: str) -> int:
    """How many layers stack `kind`'s weights in `config` (0 for the model's own)."""
    layers = getattr(config, KIND_LAYERS[kind]) if KIND_LAYERS[kind] else 0
    return layers if isinstance(layers, int) else len(layers)


def _w(name, kind, shape, family, path, split, quant=None, hf=None, when=None):
    return Weight(name, kind, shape, family, path, split, quant, hf or {}, when)


def _everywhere(name: str) -> dict[str, str]:
    """A tensor every naming scheme spells alike."""
    return dict.fromkeys(HF_SCHEMES, name)


def _gqa_projections(kind: str, scheme: str) -> tuple[Weight, ...]:
    """wq, wk, wv and wo of a grouped-query attention kind, named in HF `scheme`."""
    return tuple(_w(f"w{p}", kind, shape, "attention", "ring", split, quant="dense",
                    hf={scheme: f"self_attn.{p}_proj.weight"})
                 for p, shape, split in (
                     ("q", lambda c: (c.hidden, c.q_width), "columns"),
                     ("k", lambda c: (c.hidden, c.kv_width), "kv_heads"),
                     ("v", lambda c: (c.hidden, c.kv_width), "kv_heads"),
                     ("o", lambda c: (c.q_width, c.hidden), "rows")))


def _router_shape(c: ModelConfig) -> tuple[int, int]:
    """A router's [D, E], or on a shard that splits it its [D, E/tp] (`router_columns`)."""
    return c.hidden, c.router_columns or c.experts


def _qkv_parts(prefix, suffix):
    return {part: f"{prefix}{part}{suffix}" for part in "qkv"}


def _mla(kind: str) -> tuple[Weight, ...]:
    """Multi-head latent attention's rows; Kimi K3's ("gated_mla") adds its output gate,
    sigmoid(x @ wg) times each head's output before wo (the release's g_proj)."""
    gate = (_w("wg", kind, lambda c: (c.hidden, c.heads * c.value_dim), "attention", "ring",
               "columns", quant="dense", hf={"kimi": "self_attn.g_proj.weight"}),)
    return (
        _w("wq_a", kind, lambda c: (c.hidden, c.q_rank), "attention", "ring", "whole",
           hf={"kimi": "self_attn.q_a_proj.weight"}, when=lambda c: c.q_rank),
        _w("q_a_norm", kind, lambda c: (c.q_rank,), "norms", "dma", "whole",
           hf={"kimi": "self_attn.q_a_layernorm.weight"}, when=lambda c: c.q_rank),
        _w("wq", kind, lambda c: (c.q_rank or c.hidden, c.q_width), "attention",
           lambda c: "dma" if c.q_rank else "ring", "columns", quant="dense",
           hf={"kimi": lambda c: f"self_attn.{'q_b_proj' if c.q_rank else 'q_proj'}.weight"}),
        _w("wkv_a", kind, lambda c: (c.hidden, c.latent_width), "attention", "ring", "whole",
           hf={"kimi": "self_attn.kv_a_proj_with_mqa.weight"}),
        _w("kv_a_norm", kind, lambda c: (c.latent_rank,), "norms", "dma", "whole",
           hf={"kimi": "self_attn.kv_a_layernorm.weight"}),
        _w("wkv_b", kind, lambda c: (c.latent_rank,
                                     c.heads * (c.head_dim - c.rope_dim + c.value_dim)),
           "attention", "dma", "columns", hf={"kimi": "self_attn.kv_b_proj.weight"}),
        *(gate if kind == "gated_mla" else ()),
        _w("wo", kind, lambda c: (c.heads * c.value_dim, c.hidden), "attention", "ring",
           "rows", quant="dense", hf={"kimi": "self_attn.o_proj.weight"}),
    )


def _kda(kind: str) -> tuple[Weight, ...]:
    """Kimi Delta Attention's rows (Nk = Nv); Kimi K3's ("bounded_kda") has one full-rank
    output gate kda_g [D, Nv*Hv] (the release's g_proj) for Kimi Linear's low-rank
    kda_g_a, kda_g_b."""
    if kind == "bounded_kda":
        gate = (_w("kda_g", kind, lambda c: (c.hidden, c.linear_value_width), "linear",
                   "ring", "columns", hf={"kimi": "self_attn.g_proj.weight"}),)
    else:
        gate = (_w("kda_g_a", kind, lambda c: (c.hidden, c.linear_value_dim), "linear",
                   "dma", "whole", hf={"kimi": "self_attn.g_a_proj.weight"}),
                _w("kda_g_b", kind, lambda c: (c.linear_value_dim, c.linear_value_width),
                   "linear", "dma", "columns", hf={"kimi": "self_attn.g_b_proj.weight"}))
    return (
        _w("lin_qkv", kind, lambda c: (c.hidden, c.conv_channels), "linear", "ring",
           "channels", hf={"kimi": _qkv_parts("self_attn.", "_proj.weight")}),
        _w("lin_b", kind, lambda c: (c.hidden, c.linear_value_heads), "linear", "dma",
           "columns", hf={"kimi": "self_attn.b_proj.weight"}),
        _w("kda_f_a", kind, lambda c: (c.hidden, c.linear_key_dim), "linear", "dma", "whole",
           hf={"kimi": "self_attn.f_a_proj.weight"}),
        _w("kda_f_b", kind, lambda c: (c.linear_key_dim, c.linear_value_heads
                                       * c.linear_key_dim), "linear", "dma", "columns",
           hf={"kimi": "self_attn.f_b_proj.weight"}),
        *gate,
        _w("lin_conv", kind, lambda c: (c.conv_kernel, c.conv_channels), "linear", "dma",
           "channels", hf={"kimi": _qkv_parts("self_attn.", "_conv1d.weight")}),
        # Kimi Linear stores it [1, 1, Nv, 1]: the part "kda" (`mk.model.hf_layout.parts_of`).
        # Kimi K3's is read as [Nv]: the release's kimi/load.py slices its heads from its
        # leading axis and reshapes them to [heads, 1] (any other axis is 1, and entries
        # past Nv are never read); the release states no shape. Third-party ports differ
        # (one reads [H], one strips zero padding past H): a padded one is refused by
        # shape, naming the tensor, until a public source settles it.
        _w("lin_a_log", kind, lambda c: (c.linear_value_heads,), "linear", "dma", "columns",
           hf={"kimi": "self_attn.A_log" if kind == "bounded_kda"
               else {"kda": "self_attn.A_log"}}),
        _w("lin_dt_bias", kind, lambda c: (c.linear_value_heads * c.linear_key_dim,),
           "linear", "dma", "columns", hf={"kimi": "self_attn.dt_bias"}),
        _w("lin_norm", kind, lambda c: (c.linear_value_dim,), "linear", "dma", "whole",
           hf={"kimi": "self_attn.o_norm.weight"}),
        _w("lin_out", kind, lambda c: (c.linear_value_width, c.hidden), "linear", "ring",
           "rows", hf={"kimi": "self_attn.o_proj.weight"}),
    )


def _dense(kind: str) -> tuple[Weight, ...]:
    """A dense MLP's rows: SwiGLU's, or Kimi K3's SiTU ("situ_dense") of the same weights.
    Kimi's is `block_sparse_moe.` in transformers, `mlp.` in Moonshot's checkpoints
    (`mk.model.checkpoint.hf_aliases`)."""
    return (
        _w("w_gate", kind, lambda c: (c.hidden, c.ffn), "dense_mlp", "ring", "ffn_columns",
           quant="dense", hf={"qwen": "mlp.gate_proj.weight",
                              "kimi": "block_sparse_moe.gate_proj.weight"}),
        _w("w_up", kind, lambda c: (c.hidden, c.ffn), "dense_mlp", "ring", "ffn_columns",
           quant="dense", hf={"qwen": "mlp.up_proj.weight",
                              "kimi": "block_sparse_moe.up_proj.weight"}),
        _w("w_down", kind, lambda c: (c.ffn, c.hidden), "dense_mlp", "ring", "ffn_rows",
           quant="dense", hf={"qwen": "mlp.down_proj.weight",
                              "kimi": "block_sparse_moe.down_proj.weight"}),
    )


def _experts_in(c: ModelConfig) -> int:
    """The width the routed experts read and write: the latent MoE's latent, else D."""
    return c.moe_latent or c.hidden


def latent_held(c: ModelConfig) -> int:
    """The latent columns latent_down holds (latent_up's rows): a shard's
    `latent_columns`, else the latent's."""
    return c.latent_columns or c.moe_latent


def _moe(kind: str) -> tuple[Weight, ...]:
    """A mixture of experts' rows ("{e}" is the expert's index). Kimi K3's latent MoE
    ("latent_moe") routes on x as the others do, but its experts run on x @ latent_down
    [D, Lt]; their weighted sum is RMS-normed (latent_norm) and projected back with
    latent_up [Lt, D] (the release's routed_expert_down_proj, routed_expert_norm,
    routed_expert_up_proj); the shared expert runs on x."""
    latent = kind == "latent_moe"
    stem = "block_sparse_moe.routed_expert_"
    return (
        _w("router", kind, _router_shape, "router", "dma", "experts",
           hf={"qwen": "mlp.gate.weight", "kimi": "block_sparse_moe.gate.weight"}),
        _w("router_bias", kind, lambda c: (c.experts,), "router", "dma", "whole",
           hf={"kimi": "block_sparse_moe.gate.e_score_correction_bias"},
           when=lambda c: c.router_score == "sigmoid"),
        # the shared expert streams before routing, the expert slots after (stream order)
        _w("ws_gate", kind, lambda c: (c.hidden, c.shared_expert_ffn), "dense_mlp", "ring",
           "ffn_columns", quant="dense", when=lambda c: c.shared_expert_ffn,
           hf={"kimi": "block_sparse_moe.shared_experts.gate_proj.weight"}),
        _w("ws_up", kind, lambda c: (c.hidden, c.shared_expert_ffn), "dense_mlp", "ring",
           "ffn_columns", quant="dense", when=lambda c: c.shared_expert_ffn,
           hf={"kimi": "block_sparse_moe.shared_experts.up_proj.weight"}),
        _w("ws_down", kind, lambda c: (c.shared_expert_ffn, c.hidden), "dense_mlp", "ring",
           "ffn_rows", quant="dense", when=lambda c: c.shared_expert_ffn,
           hf={"kimi": "block_sparse_moe.shared_experts.down_proj.weight"}),
        *((_w("latent_down", kind, lambda c: (c.hidden, latent_held(c)), "dense_mlp",
              "ring", "latent_columns", hf={"kimi": f"{stem}down_proj.weight"}),)
          if latent else ()),
        _w("we_gate", kind, lambda c: (c.experts, _experts_in(c), c.expert_ffn), "experts",
           "ring", "ffn_columns", quant="experts",
           hf={"qwen": "mlp.experts.{e}.gate_proj.weight",
               "kimi": "block_sparse_moe.experts.{e}.w1.weight"}),
        _w("we_up", kind, lambda c: (c.experts, _experts_in(c), c.expert_ffn), "experts",
           "ring", "ffn_columns", quant="experts",
           hf={"qwen": "mlp.experts.{e}.up_proj.weight",
               "kimi": "block_sparse_moe.experts.{e}.w3.weight"}),
        _w("we_down", kind, lambda c: (c.experts, c.expert_ffn, _experts_in(c)), "experts",
           "ring", "ffn_rows", quant="experts",
           hf={"qwen": "mlp.experts.{e}.down_proj.weight",
               "kimi": "block_sparse_moe.experts.{e}.w2.weight"}),
        *((_w("latent_norm", kind, lambda c: (c.moe_latent,), "norms", "dma", "whole",
              hf={"kimi": f"{stem}norm.weight"}),
           _w("latent_up", kind, lambda c: (latent_held(c), c.hidden), "dense_mlp",
              "ring", "latent_rows", hf={"kimi": f"{stem}up_proj.weight"}))
          if latent else ()),
    )


def _layer(kind: str) -> tuple[Weight, ...]:
    """Every layer's two RMSNorms; Kimi K3's layers with attention residuals ("res_layer")
    add, for the mixer's and the MLP's input, the RMSNorm weight and the [D, 1] projection
    that score each residual source (the release's self_attention_res_* and
    mlp_res_*)."""
    residual = tuple(_w(f"{part}_res_{what}", kind, shape, "norms", "vector", "whole",
                        hf={"kimi": f"{stem}_res_{what}.weight"})
                     for part, stem in (("attn", "self_attention"), ("mlp", "mlp"))
                     for what, shape in (("norm", lambda c: (c.hidden,)),
                                         ("proj", lambda c: (c.hidden, 1))))
    return (
        _w("attn_norm", kind, lambda c: (c.hidden,), "norms", "vector", "whole",
           hf=_everywhere("input_layernorm.weight")),
        _w("mlp_norm", kind, lambda c: (c.hidden,), "norms", "vector", "whole",
           hf=_everywhere("post_attention_layernorm.weight")),
        *(residual if kind == "res_layer" else ()),
    )


WEIGHTS = (
    # -- the model's own, and every layer's two norms --------------------------------------
    _w("embed", "model", lambda c: (c.vocab, c.hidden), "embed", "gather", "whole",
       hf=_everywhere("{model}embed_tokens.weight")),
    _w("final_norm", "model", lambda c: (c.hidden,), "norms", "vector", "whole",
       hf=_everywhere("{model}norm.weight")),
    _w("lm_head", "model", lambda c: (c.hidden, c.vocab), "lm_head", "ring", "vocab",
       quant="lm_head", hf=_everywhere("{head}lm_head.weight"),
       when=lambda c: not c.tie_embeddings),
    *_layer("layer"),
    # -- grouped-query attention (Qwen3; Qwen3.5's q_proj also holds the output gate) ----
    *_gqa_projections("gqa", "qwen")[:3],
    _w("wq_gate", "gqa", lambda c: (c.hidden, c.q_width), "attention", "ring", "columns",
       quant="dense", hf={"qwen": "self_attn.q_proj.weight"},
       when=lambda c: c.attn_output_gate),
    _gqa_projections("gqa", "qwen")[3],
    _w("q_norm", "gqa", lambda c: (c.head_dim,), "norms", "vector", "whole",
       hf={"qwen": "self_attn.q_norm.weight"}, when=lambda c: c.qk_norm),
    _w("k_norm", "gqa", lambda c: (c.head_dim,), "norms", "vector", "whole",
       hf={"qwen": "self_attn.k_norm.weight"}, when=lambda c: c.qk_norm),
    # -- gpt-oss's attention: GQA with a learned sink logit per head, biases, and a
    #    sliding window on some layers (`ModelConfig.window`) ---------------------------------
    *_gqa_projections("sink_gqa", "gpt_oss"),
    _w("bq", "sink_gqa", lambda c: (c.q_width,), "attention", "dma", "columns",
       hf={"gpt_oss": "self_attn.q_proj.bias"}, when=lambda c: c.attention_bias),
    _w("bk", "sink_gqa", lambda c: (c.kv_width,), "attention", "dma", "kv_heads",
       hf={"gpt_oss": "self_attn.k_proj.bias"}, when=lambda c: c.attention_bias),
    _w("bv", "sink_gqa", lambda c: (c.kv_width,), "attention", "dma", "kv_heads",
       hf={"gpt_oss": "self_attn.v_proj.bias"}, when=lambda c: c.attention_bias),
    # added once, after the all-reduce of wo's partial sums
    _w("bo", "sink_gqa", lambda c: (c.hidden,), "attention", "dma", "whole",
       hf={"gpt_oss": "self_attn.o_proj.bias"}, when=lambda c: c.attention_bias),
    _w("sinks", "sink_gqa", lambda c: (c.heads,), "attention", "dma", "columns",
       hf={"gpt_oss": "self_attn.sinks"}),
    # -- multi-head latent attention (Kimi Linear's full layers; Kimi K3's, gated) --------
    *_mla("mla"),
    *_mla("gated_mla"),
    # -- gated DeltaNet (Qwen3.5's linear layers) -------------------------------------------
    _w("lin_qkv", "deltanet", lambda c: (c.hidden, c.conv_channels), "linear", "ring",
       "channels", hf={"qwen": "linear_attn.in_proj_qkv.weight"}),
    _w("lin_z", "deltanet", lambda c: (c.hidden, c.linear_value_width), "linear", "ring",
       "columns", hf={"qwen": "linear_attn.in_proj_z.weight"}),
    _w("lin_b", "deltanet", lambda c: (c.hidden, c.linear_value_heads), "linear", "dma",
       "columns", hf={"qwen": "linear_attn.in_proj_b.weight"}),
    _w("lin_a", "deltanet", lambda c: (c.hidden, c.linear_value_heads), "linear", "dma",
       "columns", hf={"qwen": "linear_attn.in_proj_a.weight"}),
    _w("lin_conv", "deltanet", lambda c: (c.conv_kernel, c.conv_channels), "linear", "dma",
       "channels", hf={"qwen": "linear_attn.conv1d.weight"}),
    _w("lin_a_log", "deltanet", lambda c: (c.linear_value_heads,), "linear", "dma",
       "columns", hf={"qwen": "linear_attn.A_log"}),
    _w("lin_dt_bias", "deltanet", lambda c: (c.linear_value_heads,), "linear", "dma",
       "columns", hf={"qwen": "linear_attn.dt_bias"}),
    _w("lin_norm", "deltanet", lambda c: (c.linear_value_dim,), "linear", "dma", "whole",
       hf={"qwen": "linear_attn.norm.weight"}),
    _w("lin_out", "deltanet", lambda c: (c.linear_value_width, c.hidden), "linear", "ring",
       "rows", hf={"qwen": "linear_attn.out_proj.weight"}),
    # -- Kimi Delta Attention (Kimi Linear's linear layers; Kimi K3's, bounded) ---------
    *_kda("kda"),
    *_kda("bounded_kda"),
    # -- dense SwiGLU (Kimi K3's: SiTU) --------------------------------------------------
    *_dense("dense"),
    *_dense("situ_dense"),
    # -- mixture of experts (Kimi K3's: on a latent, SiTU experts) -------------------------
    *_moe("moe"),
    *_moe("latent_moe"),
    # -- gpt-oss's experts: a router with a bias on its logits, experts with biases (the
    #    clamped SwiGLU: `ModelConfig.swiglu_limit`). gate_up_proj and its bias interleave
    #    gate (even columns) and up (odd); the experts are stored [E, in, out] ------------
    _w("router", "clamped_moe", _router_shape, "router", "dma", "experts",
       hf={"gpt_oss": "mlp.router.weight"}),
    _w("router_logit_bias", "clamped_moe", lambda c: (c.experts,), "router", "dma", "whole",
       hf={"gpt_oss": "mlp.router.bias"}),
    _w("we_gate", "clamped_moe", lambda c: (c.experts, c.hidden, c.expert_ffn), "experts",
       "ring", "ffn_columns", quant="experts", hf={"gpt_oss": "mlp.experts.gate_up_proj"}),
    _w("we_up", "clamped_moe", lambda c: (c.experts, c.hidden, c.expert_ffn), "experts",
       "ring", "ffn_columns", quant="experts", hf={"gpt_oss": "mlp.experts.gate_up_proj"}),
    _w("we_down", "clamped_moe", lambda c: (c.experts, c.expert_ffn, c.hidden), "experts",
       "ring", "ffn_rows", quant="experts", hf={"gpt_oss": "mlp.experts.down_proj"}),
    _w("be_gate", "clamped_moe", lambda c: (c.experts, c.expert_ffn), "experts", "dma",
       "ffn_columns", hf={"gpt_oss": "mlp.experts.gate_up_proj_bias"}),
    _w("be_up", "clamped_moe", lambda c: (c.experts, c.expert_ffn), "experts", "dma",
       "ffn_columns", hf={"gpt_oss": "mlp.experts.gate_up_proj_bias"}),
    _w("be_down", "clamped_moe", lambda c: (c.experts, c.hidden), "experts", "dma", "whole",
       hf={"gpt_oss": "mlp.experts.down_proj_bias"}),
    # -- Kimi K3's attention residuals, last so that every other weight keeps its colour
    #    (`mk.colours`: a family's palette in table order): the mix of the residual
    #    sources before the final norm, and each layer's ----------------------------------
    _w("output_res_norm", "model", lambda c: (c.hidden,), "norms", "vector", "whole",
       hf={"kimi": "{model}output_attn_res_norm.weight"}, when=lambda c: c.residual_block),
    _w("output_res_proj", "model", lambda c: (c.hidden, 1), "norms", "vector", "whole",
       hf={"kimi": "{model}output_attn_res_proj.weight"}, when=lambda c: c.residual_block),
    *_layer("res_layer"),
)


def kinds_of(config: ModelConfig) -> tuple[str, ...]:
    """The layer kinds `config` has: "model", "layer", its token mixers, its MLPs."""
    full = "mla" if config.is_mla else "sink_gqa" if config.attention_sinks else "gqa"
    if config.is_mla and config.attn_output_gate:
        full = "gated_mla"
    linear = "bounded_kda" if config.kda_full_gate else "kda" if config.channel_decay \
        else "deltanet"
    mixers = {"full_layers": full, "linear_layers": linear}
    mlps = {"dense_layers": "situ_dense" if config.situ_beta else "dense",
            "moe_layers": "clamped_moe" if config.swiglu_limit
            else "latent_moe" if config.moe_latent else "moe"}
    layer = "res_layer" if config.residual_block else "layer"
    return ("model", layer) + tuple(kind for layers, kind in (mixers | mlps).items()
                              if getattr(config, layers))


def weights_of(config: ModelConfig) -> tuple[Weight, ...]:
    """The rows of the weights `config` has, in table order (one per name)."""
    kinds = kinds_of(config)
    return tuple(w for w in WEIGHTS if w.kind in kinds and w.present(config))


def kind_of(config: ModelConfig, layers: str) -> str | None:
    """The kind `config`'s `layers` hold ("full_layers", "linear_layers", "dense_layers"
    or "moe_layers": a `KIND_LAYERS` field), or None when it has none of them."""
    return next((k for k in kinds_of(config) if KIND_LAYERS[k] == layers), None)


def names_of(config: ModelConfig, kind: str | None, *paths: str) -> tuple[str, ...]:
    """The names of `config`'s weights of `kind` (None: none) that the megakernel moves
    by one of `paths` (all when none is given), in table order: the order a kind's
    kernel streams its segments and issues its DMAs in."""
    return tuple(w.name for w in weights_of(config)
                 if w.kind == kind and (not paths or w.path_of(config) in paths))


def weight(config: ModelConfig, name: str) -> Weight:
    """`config`'s row of weight `name`."""
    for w in weights_of(config):
        if w.name == name:
            return w
    raise KeyError(f"{config.name} has no weight {name!r}")


def param_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every parameter of `config` (the layout of `mk.model.config`'s
    docstring: per-layer tensors stacked on a leading layer axis of their kind's layers)."""
    return {w.name: (w.stacked(config), config.dtype) for w in weights_of(config)}


def put_corner(target, values) -> None:
    """Write `values` into the leading corner of `target` (a numpy array or view of its
    own rank): a weight of a lane-padded model (`ModelConfig.lane_padded`) from the
    values of its own widths, the rest of `target` left as it is (zeros, or zero codes
    under unit scales)."""
    values = np.asarray(values)
    if values.ndim != target.ndim or any(v > t for v, t in zip(values.shape, target.shape)):
        raise ValueError(f"values {values.shape} do not fit in the corner of {target.shape}")
    target[tuple(slice(0, n) for n in values.shape)] = values


def _by_name(field: str) -> dict[str, object]:
    """Weight name -> `field` of its rows (the same for every kind that names it)."""
    out: dict[str, object] = {}
    for w in WEIGHTS:
        value = getattr(w, field)
        if out.setdefault(w.name, value) != value:
            raise ValueError(f"weight {w.name}: kinds disagree on its {field}")
    return out


# Weights moved by whole DMA that the kernels hold transposed, [C, R] a layer: their few
# columns (a router's experts, a linear layer's per-head gates) then fill the sublanes of
# a tile or two instead of padding each of R rows to 128 lanes (in VMEM, and in a TPU's
# tiled HBM layout). Their consumers multiply by w.T (`mk.kernels.common.transposed_dot`).
TRANSPOSED = ("router", "lin_a", "lin_b")


def dma_layout(name: str, shape: tuple, dtype) -> tuple[tuple, object]:
    """One layer's VMEM layout of a weight moved by whole DMA (its stored `shape` and
    `dtype` a layer): a vector [n] as a [1, n] row, one DMA each; a `TRANSPOSED` matrix
    [R, C] as [C, R]; float32 if a norm (`mk.kinds.base.Kind.prepare` lays it out so)."""
    layout = ((1, *shape) if len(shape) == 1 else tuple(reversed(shape))
              if name in TRANSPOSED else tuple(shape))
    return layout, "float32" if FAMILY[name] == "norms" else dtype


def dma_laid_out(name: str, w):
    """Weight `name`'s stacked values w [L, ...] with each layer as `dma_layout` lays it
    out (transposed if `TRANSPOSED`); anything but a `jax.Array` (a `mk.model.quant.QuantWeight`)
    as it is."""
    if not isinstance(w, jax.Array):
        return w
    shape, dtype = dma_layout(name, w.shape[1:], w.dtype)
    w = w.swapaxes(-1, -2) if name in TRANSPOSED else w
    return w.reshape(w.shape[:1] + shape).astype(dtype)


# Weights of the kernel's layout, not parameters: two of the table's weights a kind lays
# side by side in one ring segment (`mk.kinds.mlp.kinds.MoE.prepare`: an expert's gate and up
# where both fit one lane tile, `mk.kinds.mlp.joined_experts.gate_up_width`), each of its
# parts' byte family and format group.
JOINED = {"we_gate_up": ("we_gate", "we_up")}
FAMILY = _by_name("family")  # weight name -> byte family
FAMILY |= {joined: FAMILY[parts[0]] for joined, parts in JOINED.items()}
FORMAT_GROUP = {name: group for name, group in _by_name("quant").items() if group}
FORMAT_GROUP |= {joined: FORMAT_GROUP[parts[0]] for joined, parts in JOINED.items()}
# The format groups a `formats` dict names ({group: mk.model.quant scheme}): group -> the weights
# stored in its scheme. Only these weights may be quantised.
FORMAT_GROUPS = {group: tuple(n for n, g in FORMAT_GROUP.items()
                             if g == group and n not in JOINED)
                 for group in FORMAT_GROUP_NAMES}


def names(kind: str | None = None, *, family: str | None = None, path: str | None = None,
          split: str | None = None) -> tuple[str, ...]:
    """The weight names of the table's rows matching every given field (in table order,
    each name once)."""
    picked = (w.name for w in WEIGHTS
              if (kind is None or w.kind == kind) and (family is None or w.family == family)
              and (path is None or w.path == path) and (split is None or w.split == split))
    return tuple(dict.fromkeys(picked))


def hf_scheme(config: ModelConfig) -> str:
    """The Hugging Face naming scheme of `config`'s checkpoints: the first of HF_SCHEMES
    naming every weight it has (Kimi's MLA and KDA are named only in "kimi", gpt-oss's
    kinds only in "gpt_oss")."""
    have = weights_of(config)
    for scheme in HF_SCHEMES:
        if all(scheme in w.hf for w in have):
            return scheme
    raise ValueError(f"{config.name}: no Hugging Face naming scheme of {HF_SCHEMES} names "
                     f"all of its weights")


def hf_names(w: Weight, config: ModelConfig) -> dict[str, str] | str | None:
    """Weight `w`'s Hugging Face name(s) in `config`'s scheme: a name, a dict of parts
    (part -> name), or None (the scheme does not store it)."""
    name = w.hf.get(hf_scheme(config))
    return name(config) if callable(name) else name


def abstract_params(config: ModelConfig) -> dict:
    """`param_shapes` as `jax.ShapeDtypeStruct`s: params to trace or compile with."""
    return {name: jax.ShapeDtypeStruct(shape, dtype)
            for name, (shape, dtype) in param_shapes(config).items()}


def layer_rows(config: ModelConfig, kind: str) -> tuple[tuple[int, int], ...]:
    """(model layer, row of the stacked tensors) of every layer holding `kind`'s weights
    (none for the model's own)."""
    field = KIND_LAYERS[kind]
    if not field:
        return ()
    layers = getattr(config, field)
    layers = range(layers) if isinstance(layers, int) else layers
    return tuple((layer, row) for row, layer in enumerate(layers))


def param_count(config: ModelConfig) -> int:
    """Every parameter of `config` (each expert, the embedding, an untied lm_head)."""
    return sum(math.prod(shape) for shape, _ in param_shapes(config).values())
