"""The layer kinds' own checks of a `mk.model.config.ModelConfig`: each kind (MoE layers, linear
layers, MLA, KDA, the router, gpt-oss's attention with sinks and its clamped experts)
checks the fields that describe it, and that they are unset when the model has no layer of
that kind. `ModelConfig` runs every one (`KIND_CHECKS`) on construction; a check reads the
config's fields by name, so this module imports nothing of mk but its error texts
(`mk.model.errors`). Also here: `UNSET` and `FORMAT_LAYERS` (what a model without a kind's
layers has; `check_unset`), `check_routing` (a router's settings, the config's and the MoE
kernel's `Routing`), `check_positive_ints` (ModelConfig's too), `ROUTER_SCORES` and
`UNCLAMPED` (the clamped experts' fields unset). Not here: the kind objects (`mk.kinds`),
their weights (`mk.model.weights`), their kernels (`mk.kernels`).
"""

from __future__ import annotations

import math

import numpy as np

from mk.model.errors import brief, shown

# Each layer kind's config fields at their values in a model with none of its layers, by
# the ModelConfig property that lists those layers: `ModelConfig.pick_layers` sets them
# when a kind's layers are all cut away, and check_moe, check_linear and check_router
# refuse any other value of theirs (`check_unset`); check_kda refuses channel_decay.
UNSET = {
    "moe_layers": dict(experts=0, experts_per_token=0, expert_ffn=0, norm_topk=False,
                       shared_expert_ffn=0, router_score="softmax", expert_groups=1,
                       topk_groups=1, routed_scale=1.0, router_split="auto",
                       router_columns=0, moe_latent=0, expert_fp8_block=0),
    "linear_layers": dict(linear_key_heads=0, linear_value_heads=0, linear_key_dim=0,
                          linear_value_dim=0, conv_kernel=0, channel_decay=False,
                          kda_full_gate=False, kda_gate_bound=0.0),
    "sliding_layers": dict(sliding_window=0),
}
# The clamped-SwiGLU experts' fields unset (a model without them, `check_clamped`).
UNCLAMPED = dict(swiglu_limit=0.0, swiglu_alpha=1.0)
UNSET["moe_layers"] |= UNCLAMPED
# A format group (`mk.model.config.check_formats`) -> the layers that hold its weights.
FORMAT_LAYERS = {"experts": "moe_layers"}

# How a router scores experts: Qwen's softmax, or DeepSeek/Kimi's sigmoid (+ choice bias).
ROUTER_SCORES = ("softmax", "sigmoid")
# How tensor parallelism holds a router (ModelConfig.router_split).
ROUTER_SPLITS = ("auto", "whole", "experts")


def check_positive_ints(c, fields, context: str = "") -> None:
    """Each of config `c`'s `fields` a whole number >= 1; raises ValueError naming the
    field, its value and `context` (why it must be)."""
    for field in fields:
        value = getattr(c, field)
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{c.name}: {field}={shown(value)} must be a positive "
                             f"integer{context}")


def check_routing(where: str, *, router_score, expert_groups, topk_groups, routed_scale,
                  experts: int | None = None, top_k: int | None = None) -> None:
    """A MoE router's settings (ModelConfig's fields, and `mk.kinds.mlp.routing.Routing`'s):
    raises ValueError naming the field, prefixed by `where`. Without `experts` only each
    field's own type and value are checked; with it (and top_k), their agreement: the
    softmax router has no groups or scale, the sigmoid router's groups split the experts
    into groups of at least 2 (a group scores by its top 2) and the kept groups hold top_k
    experts."""
    if router_score not in ROUTER_SCORES:
        raise ValueError(f"{where}: router_score={shown(router_score)} must be one of "
                         f"{ROUTER_SCORES}")
    if not (isinstance(routed_scale, (int, float, np.floating)) and math.isfinite(routed_scale)
            and routed_scale > 0):
        raise ValueError(f"{where}: routed_scale={shown(routed_scale)} must be a finite "
                         "number > 0")
    if experts is None:
        return
    if router_score == "softmax":
        if (expert_groups, topk_groups, routed_scale) != (1, 1, 1.0):
            raise ValueError(f"{where}: expert_groups={expert_groups}, topk_groups="
                             f"{topk_groups} and routed_scale={routed_scale}: the softmax "
                             "router has no groups or scale (the sigmoid router has)")
        return
    if isinstance(expert_groups, bool) or not isinstance(expert_groups, (int, np.integer)) \
            or expert_groups < 1 or experts % expert_groups or experts // expert_groups < 2:
        raise ValueError(f"{where}: expert_groups={shown(expert_groups)} must divide experts="
                         f"{experts} into groups of at least 2 (a group scores by its top 2 "
                         "experts)")
    if isinstance(topk_groups, bool) or not isinstance(topk_groups, (int, np.integer)) \
            or not 1 <= topk_groups <= expert_groups \
            or topk_groups * experts // expert_groups < top_k:
        raise ValueError(f"{where}: topk_groups={shown(topk_groups)} must be in [1, "
                         f"expert_groups={expert_groups}] and its groups must hold top_k="
                         f"{top_k} experts")


def check_unset(c, layers: str, fields, why: str) -> None:
    """Config `c`'s `fields` at their `UNSET[layers]` values (it has none of those layers:
    `why`); raises ValueError naming every field set."""
    found = {f: getattr(c, f) for f in fields if getattr(c, f) != UNSET[layers][f]}
    if found:
        raise ValueError(f"{c.name}: {shown(found, 400)} are set but {why}")


def check_moe(c) -> None:
    """MoE layers: experts, top-k and width set exactly when there are MoE layers, which
    are distinct sorted layer indices; the router's split one of ROUTER_SPLITS, a shard's
    router columns whole experts' shares."""
    if not c.moe_layers:
        check_unset(c, "moe_layers", ("experts", "experts_per_token", "expert_ffn",
                                      "router_split", "router_columns"),
                    "moe_layers is empty")
        return
    if min(c.experts, c.experts_per_token, c.expert_ffn) < 1:
        raise ValueError(f"{c.name}: an MoE model needs experts={c.experts}, "
                         f"experts_per_token={c.experts_per_token} and expert_ffn="
                         f"{c.expert_ffn} all >= 1")
    if c.experts_per_token > c.experts:
        raise ValueError(f"{c.name}: experts_per_token={c.experts_per_token} "
                         f"exceeds experts={c.experts}")
    bad = [i for i in c.moe_layers if not 0 <= i < c.layers]
    if bad or len(set(c.moe_layers)) != len(c.moe_layers):
        raise ValueError(f"{c.name}: moe_layers={brief(c.moe_layers)} must be "
                         f"distinct layer indices in [0, {c.layers})")
    if list(c.moe_layers) != sorted(c.moe_layers):
        raise ValueError(f"{c.name}: moe_layers={brief(c.moe_layers)} must be "
                         "sorted")
    if c.router_split not in ROUTER_SPLITS:
        raise ValueError(f"{c.name}: router_split={shown(c.router_split)} must be one of "
                         f"{ROUTER_SPLITS}")
    columns = c.router_columns
    if isinstance(columns, bool) or not isinstance(columns, (int, np.integer)) \
            or not 0 <= columns <= c.experts or (columns and c.experts % columns):
        raise ValueError(f"{c.name}: router_columns={shown(columns)} must be 0 (every "
                         f"expert) or a divisor of experts={c.experts}")


def check_linear(c) -> None:
    """Linear layers (gated DeltaNet or KDA): their head counts, head dims and conv width
    set exactly when layer_types has a linear layer; value heads a multiple of key heads."""
    linear = ("linear_key_heads", "linear_value_heads", "linear_key_dim",
              "linear_value_dim", "conv_kernel")
    if not c.linear_layers:
        check_unset(c, "linear_layers", linear, "layer_types has no 'linear' layer")
        return
    check_positive_ints(c, linear, " in a model with linear layers")
    if c.linear_value_heads % c.linear_key_heads:
        raise ValueError(f"{c.name}: linear_value_heads={c.linear_value_heads} "
                         f"must be a multiple of linear_key_heads={c.linear_key_heads}")


def check_mla(c) -> None:
    """MLA full layers (latent_rank > 0): its ranks and dims set only then; kv_heads =
    heads, no QK-norm (an output gate, attn_output_gate, is Kimi K3's)."""
    mla = dict(q_rank=c.q_rank, rope_dim=c.rope_dim, value_dim=c.value_dim)
    if not c.latent_rank and any(mla.values()):
        raise ValueError(f"{c.name}: {shown(mla, 300)} are set but latent_rank=0 (no MLA)")
    if c.latent_rank:
        for field, value in dict(latent_rank=c.latent_rank, **mla).items():
            if not isinstance(value, (int, np.integer)) or value < (field != "q_rank"):
                raise ValueError(f"{c.name}: {field}={shown(value)} must be a "
                                 f"{'non-negative' if field == 'q_rank' else 'positive'}"
                                 " integer in an MLA model")
        if not c.rope_dim < c.head_dim:
            raise ValueError(f"{c.name}: rope_dim={c.rope_dim} must be below "
                             f"head_dim={c.head_dim} (H = Hn + Hr, Hn >= 1)")
        if c.kv_heads != c.heads or c.qk_norm:
            raise ValueError(f"{c.name}: MLA needs kv_heads=heads (got {c.kv_heads}"
                             f", {c.heads}) and qk_norm=False (got {c.qk_norm})")


def check_kda(c) -> None:
    """KDA linear layers (channel_decay): linear layers with as many key as value heads."""
    if c.channel_decay and (not c.linear_layers
                            or c.linear_key_heads != c.linear_value_heads):
        raise ValueError(f"{c.name}: channel_decay (KDA) needs linear layers with "
                         f"linear_key_heads={c.linear_key_heads} equal to "
                         f"linear_value_heads={c.linear_value_heads}")


def check_router(c) -> None:
    """The router (`check_routing`) and the shared expert: set only with MoE layers."""
    routing = dict(router_score=c.router_score, expert_groups=c.expert_groups,
                   topk_groups=c.topk_groups, routed_scale=c.routed_scale)
    if not c.moe_layers:
        check_routing(c.name, **routing)  # the fields' own types and values
        check_unset(c, "moe_layers", (*routing, "shared_expert_ffn"), "moe_layers is empty")
        return
    if not isinstance(c.shared_expert_ffn, (int, np.integer)) \
            or c.shared_expert_ffn < 0:
        raise ValueError(f"{c.name}: shared_expert_ffn={shown(c.shared_expert_ffn)} "
                         "must be a non-negative integer")
    check_routing(c.name, experts=c.experts, top_k=c.experts_per_token, **routing)


def _finite(c, field: str, low: float) -> float:
    value = getattr(c, field)
    if isinstance(value, bool) or not (isinstance(value, (int, float, np.floating))
                                       and math.isfinite(value) and value >= low):
        raise ValueError(f"{c.name}: {field}={shown(value)} must be a finite number >= {low}")
    return value


def check_sinks(c) -> None:
    """gpt-oss's attention (attention_sinks): its biases and sliding layers come with it
    (the only attention kind that has them); the sliding layers are distinct sorted full
    layers, with a window >= 1 exactly when there are some; not MLA, no output gate."""
    if not c.attention_sinks:
        found = {f: getattr(c, f) for f in ("attention_bias", "sliding_window",
                                           "sliding_layers") if getattr(c, f)}
        if found:
            raise ValueError(f"{c.name}: {shown(found, 300)} are set but attention_sinks="
                             "False: attention biases and sliding windows are implemented "
                             "in gpt-oss's attention kind (attention_sinks=True) only")
        return
    if c.latent_rank or c.attn_output_gate or not c.full_layers:
        raise ValueError(f"{c.name}: attention_sinks needs full GQA layers (latent_rank="
                         f"{c.latent_rank}, attn_output_gate={c.attn_output_gate}, "
                         f"{len(c.full_layers)} full layers)")
    layers = c.sliding_layers
    if not set(layers) <= set(c.full_layers) or len(set(layers)) != len(layers) \
            or list(layers) != sorted(layers):
        raise ValueError(f"{c.name}: sliding_layers={brief(layers)} must be distinct sorted "
                         f"full-attention layers (of {brief(c.full_layers)})")
    window = c.sliding_window
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) \
            or window < 0 or bool(window) != bool(layers):
        raise ValueError(f"{c.name}: sliding_window={shown(window)} must be a positive "
                         f"integer when sliding_layers={brief(layers)} is set, else 0")
    if window > c.max_position:  # it would never cut: a mistaken config
        raise ValueError(f"{c.name}: sliding_window={window} exceeds max_position="
                         f"{c.max_position}, the longest context the model sees")


def check_clamped(c) -> None:
    """gpt-oss's experts (swiglu_limit > 0): MoE layers under the softmax router over the
    selected logits (norm_topk), no shared expert; swiglu_alpha > 0. Without them both
    fields keep their UNCLAMPED values."""
    if not c.swiglu_limit or not c.moe_layers:
        check_unset(c, "moe_layers", tuple(UNCLAMPED), "the model has no clamped-SwiGLU "
                    "experts (swiglu_limit=0 or no moe_layers)")
        return
    _finite(c, "swiglu_limit", 0.0)
    if _finite(c, "swiglu_alpha", 0.0) <= 0:
        raise ValueError(f"{c.name}: swiglu_alpha={c.swiglu_alpha} must be > 0")
    if c.router_score != "softmax" or not c.norm_topk or c.shared_expert_ffn:
        raise ValueError(f"{c.name}: clamped-SwiGLU experts (swiglu_limit={c.swiglu_limit}) "
                         "come with the softmax over the selected logits (router_score="
                         f"'softmax', norm_topk=True; got {c.router_score!r}, "
                         f"{c.norm_topk}) and no shared expert (shared_expert_ffn="
                         f"{c.shared_expert_ffn})")


def check_situ(c) -> None:
    """SiTU MLPs (situ_beta > 0, Kimi K3's): both betas finite and > 0, or both 0
    (SwiGLU); not with the clamped experts; in an MoE model only with a latent MoE (the
    kind mk implements SiTU experts in)."""
    betas = dict(situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta)
    if betas == dict(situ_beta=0.0, situ_linear_beta=0.0):
        return
    for field, value in betas.items():
        if _finite(c, field, 0.0) <= 0:
            raise ValueError(f"{c.name}: {field}={value} must be > 0 with "
                             f"{shown(betas, 200)} (both 0: SwiGLU)")
    if c.swiglu_limit:
        raise ValueError(f"{c.name}: situ_beta={c.situ_beta} and swiglu_limit="
                         f"{c.swiglu_limit}: an MLP has one activation")
    if c.moe_layers and not c.moe_latent:
        raise NotImplementedError(f"{c.name}: situ_beta={c.situ_beta} with moe_latent=0: "
                                  "SiTU experts are implemented in the latent MoE only")


def check_latent_moe(c) -> None:
    """The latent MoE (moe_latent > 0, Kimi K3's): MoE layers whose routed SiTU experts run
    on a latent of width in [1, hidden]; not the clamped experts. Its experts' fp8 re-storing
    (expert_fp8_block > 0) needs fp4 experts and whole blocks of 32-row MXFP4 scales
    dividing the latent."""
    latent, block = c.moe_latent, c.expert_fp8_block
    if not c.moe_layers:
        check_unset(c, "moe_layers", ("moe_latent", "expert_fp8_block"), "moe_layers is empty")
        return
    if isinstance(latent, bool) or not isinstance(latent, (int, np.integer)) \
            or not 0 <= latent <= c.hidden:
        raise ValueError(f"{c.name}: moe_latent={shown(latent)} must be an integer in "
                         f"[0, hidden={c.hidden}] (0: experts on the hidden width)")
    if latent and c.swiglu_limit:
        raise ValueError(f"{c.name}: moe_latent={latent} and swiglu_limit="
                         f"{c.swiglu_limit}: the latent MoE has no clamped experts")
    if latent and not c.situ_beta:  # SiTU at beta 0 would divide by zero: NaN experts
        raise NotImplementedError(f"{c.name}: moe_latent={latent} with situ_beta=0: the "
                                  "latent MoE's experts are SiTU's (Kimi K3's); SwiGLU "
                                  "experts on a latent are not implemented")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
        raise ValueError(f"{c.name}: expert_fp8_block={shown(block)} must be a "
                         "non-negative integer")
    if block:
        width = latent or c.hidden
        if block % 32 or width % block or dict(c.formats).get("experts") != "fp4":
            raise ValueError(f"{c.name}: expert_fp8_block={block} must be a multiple of "
                             f"32 (an MXFP4 scale block) dividing the experts' input width "
                             f"{width}, with fp4 experts (formats={dict(c.formats)})")


def check_residuals(c) -> None:
    """Attention residuals (residual_block > 0, Kimi K3's): a block begins every
    residual_block layers (at or past `layers`: one block, as in a cut of the model)."""
    block = c.residual_block
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
        raise ValueError(f"{c.name}: residual_block={shown(block)} must be a non-negative "
                         "integer (0: a plain residual stream)")


def check_bounded_kda(c) -> None:
    """Kimi K3's KDA (kda_full_gate with kda_gate_bound < 0): the bound finite and
    <= 0, both set only on KDA layers (channel_decay) and together (the release's
    combination, the one mk implements)."""
    bound = _finite(c, "kda_gate_bound", -math.inf)
    if bound > 0:
        raise ValueError(f"{c.name}: kda_gate_bound={bound} must be <= 0 (the log-decay "
                         "lies in (bound, 0); 0: Kimi Linear's unbounded decay)")
    if not isinstance(c.kda_full_gate, (bool, np.bool_)):
        raise ValueError(f"{c.name}: kda_full_gate={shown(c.kda_full_gate)} must be a bool")
    if not (c.kda_full_gate or bound):
        return
    if not c.channel_decay:
        raise ValueError(f"{c.name}: kda_full_gate={c.kda_full_gate} and kda_gate_bound="
                         f"{bound} are KDA's (channel_decay=False)")
    if not (c.kda_full_gate and bound):
        raise NotImplementedError(f"{c.name}: kda_full_gate={c.kda_full_gate} with "
                                  f"kda_gate_bound={bound}: mk implements Kimi K3's KDA, "
                                  "which has both")


# Every kind's check, in the order ModelConfig runs them.
KIND_CHECKS = (check_moe, check_linear, check_mla, check_kda, check_router, check_sinks,
               check_clamped, check_situ, check_latent_moe, check_residuals,
               check_bounded_kda)
