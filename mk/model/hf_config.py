"""Hugging Face `config.json` -> the fields of a `mk.model.config.ModelConfig`, kind by kind.

`fields_from_hf(source, name=, dtype=)` reads a config.json (a path, a folder or the
parsed dict) and returns a `ModelConfig`'s keyword arguments; `ModelConfig.from_hf` is the
entry point. A model type (`HF_MODEL_TYPES`, the keys of `FAMILIES`) is the list of
readers its model is made of (`decoder`, then its MLP and layer kinds); a reader returns
the fields its kind owns, read from the file (`HfConfig`: `need`, `count`, `whole`,
`number`, `flag`, `table`, `listed` check a value's type first) and from the fields read before
it. Its errors name the file's field, its value (`shown`: a checkpoint is untrusted) and
what was expected. Also here: `check_hub_name`; the model types that wrap their text
model in text_config and where their checkpoints keep its tensors (`WRAPPERS`,
`tensor_prefixes`: Qwen3.5's full checkpoint, Kimi K3's) and the tensors mk does not run
(`not_run`).

This module imports nothing of mk but the error texts (`mk.model.errors`): `mk.model.config` imports
it. Not here: the checks of the fields read (`mk.model.config.ModelConfig`, `mk.model.kind_checks`),
the weights' Hugging Face names (`mk.model.weights`), reading tensors (`mk.model.checkpoint`). Each
reader by kind: docs/design/mk.model.hf_config.md.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
from pathlib import Path

from mk.model import untrusted
from mk.model.errors import brief, shown

MAX_LAYERS = 100_000  # per-layer tuples: 10**5 take ms, 10**9 exhaust memory
# transformers' names of the token mixers -> mk's (`mk.model.config.LAYER_TYPES`).
MIXERS = {"full_attention": "full", "linear_attention": "linear"}
# A model name as config.json's `_name_or_path` may give it: a name or a hub-style
# "org/name" of letters, digits, "_", "." and "-" (at most 96 each), no "..".
HUB_NAME = re.compile(r"(?!.*\.\.)[\w][\w.-]{0,95}(/[\w][\w.-]{0,95})?", re.ASCII)


@dataclasses.dataclass(frozen=True)
class HfConfig:
    """A config.json's fields, and what errors call it (`where`)."""

    fields: dict
    where: str

    def get(self, key, default=None):
        return self.fields.get(key, default)

    def need(self, *keys):
        """The value of the first of `keys` the file sets (not null); raises ValueError
        naming them all when it sets none."""
        return self._first(keys)[1]

    def count(self, *keys):
        """`need(*keys)`, a whole number >= 1 (`whole`)."""
        return self.whole(*self._first(keys))

    def whole(self, key: str, value, positive: bool = True):
        """`value` (the file's `key`) after checking it is a whole number >= 1 (>= 0 unless
        `positive`): the sizes and layer counts readers and checks compute with."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                or value < positive:
            raise ValueError(f"{self.where}: {key}={shown(value)} must be a "
                             f"{'positive' if positive else 'non-negative'} integer")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """The file's true/false `key` (`default` when absent or null); raises ValueError
        naming it otherwise (bool("false") is True)."""
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}: {key}={shown(value)} must be true or false")
        return value

    def number(self, key: str, value) -> float:
        """`value` (the file's `key`) as a float; raises ValueError naming it when it is
        not a JSON number (float() would take true and "32")."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{self.where}: {key}={shown(value)} must be a number")
        return float(value)

    def table(self, key: str) -> dict:
        """The file's `key`, a JSON object ({} when absent or null)."""
        value = self.fields.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{self.where}: {key}={shown(value)} must be a JSON object")
        return value

    def listed(self, key: str, value):
        """`value` (the file's `key`) after checking it is a list."""
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{self.where}: {key}={shown(value)} must be a list")
        return value

    def _first(self, keys) -> tuple:
        for key in keys:
            if self.fields.get(key) is not None:
                return key, self.fields[key]
        raise ValueError(f"{self.where}: config.json has no field {' or '.join(keys)}")


# -- The fields every model has -------------------------------------------------------------
def decoder(hf: HfConfig, got: dict, *, max_position=("max_position_embeddings",),
            ties: bool = True, norm_offset: float = 0.0, act: str = "silu") -> dict:
    """Vocabulary, width, depth, query heads, RMSNorm (its eps; `norm_offset` 1 scales by
    1 + weight, Qwen3.5), the longest position (the first of `max_position` the file
    sets) and the default context (min(4096, it)), tied embeddings (`ties`: read from
    tie_word_embeddings; False: transformers never ties, as Kimi Linear's lm_head). Every
    MLP (dense, expert, shared) has the family's activation: hidden_act must be `act`
    ("silu": SwiGLU; "situ": Kimi K3's, read by `situ`)."""
    if hf.get("hidden_act", "silu") != act:
        raise NotImplementedError(f"{hf.where}: hidden_act={shown(hf.get('hidden_act'))} is "
                                  f"not implemented for this model type (expected "
                                  f"{act!r})")
    layers = hf.count("num_hidden_layers")
    if layers > MAX_LAYERS:  # readers build per-layer tuples: 10**9 layers exhaust memory
        raise ValueError(f"{hf.where}: num_hidden_layers={layers} is over the limit of "
                         f"{MAX_LAYERS}")
    fields = dict(vocab=hf.count("vocab_size"), hidden=hf.count("hidden_size"),
                  layers=layers, heads=hf.count("num_attention_heads"),
                  rms_eps=hf.number("rms_norm_eps", hf.need("rms_norm_eps")),
                  max_position=hf.count(*max_position),
                  tie_embeddings=hf.flag("tie_word_embeddings", False) and ties)
    if norm_offset:
        fields["norm_offset"] = norm_offset
    return fields | dict(max_context=min(4096, fields["max_position"]))


def dense(hf: HfConfig, got: dict) -> dict:
    """The dense SwiGLU MLP's width (every family's; its dense layers are the ones
    `moe_layers` leaves)."""
    return dict(ffn=hf.count("intermediate_size"))


def no_experts(hf: HfConfig, got: dict) -> dict:
    """Qwen3.5's text model: every MLP is dense (its MoE variant is qwen3_5_moe)."""
    if hf.get("mlp_only_layers") or hf.get("num_experts"):
        raise NotImplementedError(f"{hf.where}: an MoE Qwen3.5 text config (qwen3_5_moe) is "
                                  "not implemented")
    return {}


# -- Full attention ---------------------------------------------------------------------------
def _refuse_attention_bias(hf: HfConfig) -> None:
    if hf.get("attention_bias"):
        raise NotImplementedError(f"{hf.where}: attention_bias="
                                  f"{shown(hf.get('attention_bias'))} is not implemented")


def gqa(hf: HfConfig, got: dict) -> dict:
    """Grouped-query attention (Qwen3): kv heads, head dim (else hidden / heads), RoPE of
    the default type (rope_parameters.rope_theta or rope_theta), QK-norm; no sliding
    window, no bias."""
    hidden, heads = got["hidden"], got["heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        hf.whole("head_dim", head_dim)
    else:
        if hidden % heads:
            raise ValueError(f"{hf.where}: num_attention_heads={heads} does not divide "
                             f"hidden_size={hidden} and no head_dim is given")
        head_dim = hidden // heads
    rope = hf.table("rope_parameters")
    rope_type = rope_kind(rope)
    if rope_type != "default" or hf.get("rope_scaling"):
        raise NotImplementedError(f"{hf.where}: rope scaling {shown(rope_type)} / "
                                  f"{shown(hf.get('rope_scaling'))} is not implemented")
    if hf.get("use_sliding_window"):
        raise NotImplementedError(f"{hf.where}: use_sliding_window=True is not implemented")
    _refuse_attention_bias(hf)
    rope_theta = rope.get("rope_theta", hf.get("rope_theta"))
    if rope_theta is None:
        raise ValueError(f"{hf.where}: config.json has no rope_parameters.rope_theta or "
                         "rope_theta")
    kv_heads = hf.whole("num_key_value_heads", hf.get("num_key_value_heads") or heads)
    return dict(kv_heads=kv_heads, head_dim=head_dim, qk_norm=True,
                rope_theta=hf.number("rope_theta", rope_theta))


def full_attention_only(hf: HfConfig, got: dict) -> dict:
    """Qwen3's mixer: every layer full attention. A layer_types given must say so for
    each of num_hidden_layers (transformers would slide a "sliding_attention" layer's
    window; mk would not)."""
    kinds, layers = hf.get("layer_types"), got["layers"]
    if kinds is None:
        return {}
    if len(hf.listed("layer_types", kinds)) != layers:
        raise ValueError(f"{hf.where}: layer_types {brief(kinds)} must hold num_hidden_layers="
                         f"{layers} entries")
    for i, kind in enumerate(kinds):
        if kind != "full_attention":
            raise ValueError(f"{hf.where}: layer_types[{i}]={shown(kind)}, but every layer "
                             "of this model type is 'full_attention'")
    return {}


def gated_gqa(hf: HfConfig, got: dict) -> dict:
    """Qwen3.5's full attention, as transformers' Qwen3_5TextConfig reads it: `gqa`, its
    output times sigmoid(h @ wq_gate) (always: attn_output_gate=False is refused), RoPE
    on the first partial_rotary_factor of each head (default 0.25)."""
    if hf.get("attn_output_gate") is False:
        raise NotImplementedError(f"{hf.where}: attn_output_gate=False (transformers' Qwen3.5 "
                                  "always gates full attention)")
    factor = hf.table("rope_parameters").get("partial_rotary_factor",
                                             hf.get("partial_rotary_factor", 0.25))
    return gqa(hf, got) | dict(attn_output_gate=True, partial_rotary_factor=hf.number(
        "partial_rotary_factor", factor))


def mla(hf: HfConfig, got: dict) -> dict:
    """Multi-head latent attention (Kimi Linear; transformers' MLA has no RoPE and no
    QK-norm): kv heads = heads (the latent expands to every head), H = Hn + Hr, the
    latent rank R, the query rank Rq (0: none), Ho."""
    _refuse_attention_bias(hf)
    heads = got["heads"]
    if hf.get("num_key_value_heads", heads) not in (None, heads):
        raise NotImplementedError(f"{hf.where}: num_key_value_heads="
                                  f"{shown(hf.get('num_key_value_heads'))}"
                                  f" != num_attention_heads={heads} (transformers' MLA "
                                  "expands the latent to every head)")
    rope, nope = hf.count("qk_rope_head_dim"), hf.count("qk_nope_head_dim")
    return dict(kv_heads=heads, head_dim=nope + rope, qk_norm=False,
                latent_rank=hf.count("kv_lora_rank"), q_rank=hf.get("q_lora_rank") or 0,
                rope_dim=rope, value_dim=hf.count("v_head_dim"))


def sink_gqa(hf: HfConfig, got: dict) -> dict:
    """gpt-oss's attention, as transformers' GptOssConfig reads it: grouped-query heads
    (head_dim), a learned sink per head (always), q/k/v/o biases (attention_bias, default
    on), the sliding window (sliding_window positions) on the layers layer_types names
    "sliding_attention" (else every other layer from the first), RoPE of theta
    rope_parameters.rope_theta (else rope_theta) with YaRN scaling when rope_type is
    "yarn" (`yarn`; rope_scaling in the older spelling, the published config.json's); no
    QK-norm."""
    layers, heads = got["layers"], got["heads"]
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(layers)]
    unknown = sorted({str(k) for k in hf.listed("layer_types", kinds)
                      if k not in ("sliding_attention", "full_attention")})
    if unknown or len(kinds) != layers:
        raise ValueError(f"{hf.where}: layer_types {brief(kinds)} must hold num_hidden_layers="
                         f"{layers} of 'sliding_attention' / 'full_attention' (got "
                         f"{brief(unknown)})")
    sliding = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    window = hf.whole("sliding_window", hf.get("sliding_window")) if sliding else 0
    rope = hf.table("rope_parameters") or hf.table("rope_scaling")  # newer, older spelling
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{hf.where}: config.json has no rope_parameters.rope_theta or "
                         "rope_theta")
    return dict(kv_heads=hf.whole("num_key_value_heads", hf.get("num_key_value_heads") or heads),
                head_dim=hf.count("head_dim"), qk_norm=False, attention_sinks=True,
                attention_bias=hf.flag("attention_bias", True), sliding_layers=sliding,
                sliding_window=window, rope_theta=hf.number("rope_theta", theta),
                yarn=yarn(hf, rope))


def rope_kind(rope: dict) -> str:
    """rope_parameters' rope_type, else its older spelling `type`, else "default", as
    transformers reads them (a YaRN block spelt `type` is still YaRN)."""
    return rope.get("rope_type", rope.get("type", "default"))


def yarn(hf: HfConfig, rope: dict) -> dict | None:
    """rope_parameters' YaRN scaling (`mk.model.config.Yarn`'s fields, which check them), or
    None for rope_type "default"; another type, or DeepSeek's mscale / mscale_all_dim, is
    refused."""
    kind = rope_kind(rope)
    if kind == "default":
        return None
    if kind != "yarn" or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise NotImplementedError(f"{hf.where}: rope_parameters {shown(rope, 300)}: mk reads "
                                  "rope_type 'default' and 'yarn' without mscale")
    number = {key: hf.number(f"rope_parameters.{key}", rope[key])
              for key in ("factor", "beta_fast", "beta_slow", "attention_factor")
              if rope.get(key) is not None}
    for key in ("factor", "original_max_position_embeddings"):
        if rope.get(key) is None:
            raise ValueError(f"{hf.where}: YaRN rope_parameters without {key} (rope_type "
                             "'yarn' needs factor and original_max_position_embeddings)")
    original = rope["original_max_position_embeddings"]
    return dict(original_max_position=hf.whole(
        "rope_parameters.original_max_position_embeddings", original),
        truncate=HfConfig(rope, f"{hf.where}: rope_parameters").flag("truncate", True),
        **number)


# -- Linear attention -------------------------------------------------------------------------
def _mixers(hf: HfConfig, kinds, layers: int) -> tuple[str, ...]:
    """transformers' per-layer mixer names -> `layer_types`."""
    unknown = sorted({str(kind) for kind in hf.listed("layer_types", kinds)
                      if not isinstance(kind, str) or kind not in MIXERS})
    if unknown or len(kinds) != layers:
        raise ValueError(f"{hf.where}: layer_types {brief(kinds)} must hold num_hidden_layers="
                         f"{layers} of 'full_attention' / 'linear_attention' (got "
                         f"{brief(unknown)})")
    return tuple(MIXERS[kind] for kind in kinds)


def _agreed(hf: HfConfig, layers: int, *sources) -> tuple[str, ...]:
    """`layer_types` from the (field, per-layer mixer names or None) `sources` that give
    them: all that are given must agree layer by layer (a config saying one layer is full
    attention in one field and linear in another is refused, naming the first layer);
    at least one must be given."""
    given = [(field, _mixers(hf, kinds, layers)) for field, kinds in sources
             if kinds is not None]
    (first, mine), *others = given
    for field, theirs in others:
        if theirs != mine:
            i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            raise ValueError(f"{hf.where}: {first} and {field} contradict each other at "
                             f"layer {i} (counting from 0): {mine[i]!r} against "
                             f"{theirs[i]!r}; give one, or make them agree")
    return mine


def deltanet(hf: HfConfig, got: dict) -> dict:
    """Qwen3.5's gated DeltaNet: which layers are linear (layer_types, else all but every
    full_attention_interval-th, default 4; both given must agree) and their heads, head
    dims and conv width."""
    layers, kinds = got["layers"], hf.get("layer_types")
    by_interval = None
    if kinds is None or hf.get("full_attention_interval") is not None:
        every = hf.whole("full_attention_interval", hf.get("full_attention_interval", 4))
        by_interval = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                       for i in range(layers)]
    return dict(layer_types=_agreed(hf, layers, ("layer_types", kinds),
                                    ("full_attention_interval", by_interval)),
                linear_key_heads=hf.count("linear_num_key_heads"),
                linear_value_heads=hf.count("linear_num_value_heads"),
                linear_key_dim=hf.count("linear_key_head_dim"),
                linear_value_dim=hf.count("linear_value_head_dim"),
                conv_kernel=hf.count("linear_conv_kernel_dim"))


def kda(hf: HfConfig, got: dict) -> dict:
    """Kimi Delta Attention, as transformers' KimiLinearConfig reads it (its attribute
    names or the saved Moonshot ones): which layers are linear (layer_types, else
    linear_attn_config's 1-indexed full_attn_layers / kda_layers, each layer in one of
    them once, else all but layer 0 and every 4th; both given must agree), and their
    heads (as many key as value heads), head dim and conv width."""
    layers, kinds = got["layers"], hf.get("layer_types")
    linear = hf.table("linear_attn_config")
    listed = None
    if {"full_attn_layers", "kda_layers"} <= set(linear):
        listed = [None] * layers
        for kind, key in (("full_attention", "full_attn_layers"),
                          ("linear_attention", "kda_layers")):
            for i in hf.listed(f"linear_attn_config.{key}", linear[key]):
                if hf.whole(f"linear_attn_config.{key}", i) > layers:
                    raise ValueError(f"{hf.where}: linear_attn_config.{key} holds layer {i}; "
                                     f"layers count from 1 to num_hidden_layers={layers}")
                if listed[i - 1] is not None:  # both lists, or one twice: no silent winner
                    raise ValueError(f"{hf.where}: linear_attn_config lists layer {i} more "
                                     "than once in full_attn_layers and kda_layers; each "
                                     "layer is full or KDA, listed once")
                listed[i - 1] = kind
        missing = [i + 1 for i, kind in enumerate(listed) if kind is None]
        if missing:
            raise ValueError(f"{hf.where}: linear_attn_config lists layers {brief(missing)} "
                             "in neither full_attn_layers nor kda_layers (layers count from "
                             f"1 to num_hidden_layers={layers})")
    if kinds is None and listed is None:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(layers)]
    layer_types = _agreed(hf, layers, ("layer_types", kinds), ("linear_attn_config", listed))
    if "linear" not in layer_types:
        return dict(layer_types=layer_types)

    def size(key, flat_key, default):  # linear_attn_config's, else the flat attribute's
        if key in linear:
            return hf.whole(f"linear_attn_config.{key}", linear[key])
        return hf.whole(flat_key, hf.get(flat_key, default))

    heads = size("num_heads", "linear_num_heads", 32)
    dim = size("head_dim", "linear_head_dim", 128)
    return dict(layer_types=layer_types, linear_key_heads=heads, linear_value_heads=heads,
                linear_key_dim=dim, linear_value_dim=dim, channel_decay=True,
                conv_kernel=size("short_conv_kernel_size", "linear_conv_kernel_dim", 4))


# -- Mixture of experts -----------------------------------------------------------------------
def softmax_moe(hf: HfConfig, got: dict) -> dict:
    """Qwen3-MoE's experts and softmax router: MoE layers every decoder_sparse_step-th
    but mlp_only_layers, E, X, Fe, top-k renormalisation (norm_topk_prob, default off)."""
    step = hf.whole("decoder_sparse_step", hf.get("decoder_sparse_step", 1) or 1)
    mlp_only = {hf.whole("mlp_only_layers", i, positive=False)
                for i in hf.listed("mlp_only_layers", hf.get("mlp_only_layers") or [])}
    return dict(experts=hf.count("num_local_experts", "num_experts"),
                experts_per_token=hf.count("num_experts_per_tok"),
                expert_ffn=hf.count("moe_intermediate_size"),
                norm_topk=hf.flag("norm_topk_prob", False),
                moe_layers=tuple(i for i in range(got["layers"])
                                 if i not in mlp_only and (i + 1) % step == 0))


def sigmoid_moe(hf: HfConfig, got: dict) -> dict:
    """Kimi Linear's experts, as transformers' KimiLinearConfig reads them: MoE layers
    from mlp_layer_types ("sparse"; else all but the first_k_dense_replace first), E, X,
    Fe, the shared expert (num_shared_experts x Fe), the grouped sigmoid router (groups,
    kept groups, routed scale, renormalisation: default on)."""
    layers, mlp = got["layers"], hf.get("mlp_layer_types")
    if not mlp:
        first = hf.whole("first_k_dense_replace", hf.get("first_k_dense_replace", 1),
                         positive=False)
        mlp = ["dense" if i < first else "sparse" for i in range(layers)]
    unknown = sorted({str(kind) for kind in hf.listed("mlp_layer_types", mlp)
                      if kind not in ("dense", "sparse")})
    if unknown or len(mlp) != layers:  # transformers reads any other word as "dense"
        raise ValueError(f"{hf.where}: mlp_layer_types {brief(mlp)} must hold "
                         f"num_hidden_layers={layers} of 'dense' / 'sparse' (got "
                         f"{brief(unknown)})")
    moe_layers = tuple(i for i, kind in enumerate(mlp) if kind == "sparse")
    if not moe_layers:
        return {}
    expert_ffn = hf.count("moe_intermediate_size")
    shared_key = "num_shared_experts" if "num_shared_experts" in hf.fields else "n_shared_experts"
    shared = hf.whole(shared_key, hf.get(shared_key, 1), positive=False)
    return dict(
        moe_layers=moe_layers, experts=hf.count("num_experts", "num_local_experts"),
        experts_per_token=hf.count("num_experts_per_token", "num_experts_per_tok"),
        expert_ffn=expert_ffn, shared_expert_ffn=expert_ffn * shared,
        norm_topk=hf.flag("moe_renormalize", hf.flag("norm_topk_prob", True)),
        router_score="sigmoid", expert_groups=hf.get("num_expert_group", hf.get("n_group", 1)),
        topk_groups=1 if hf.get("topk_group") is None else hf.whole(  # 0 was read as 1
            "topk_group", hf.get("topk_group")), routed_scale=hf.number(
            "routed_scaling_factor", hf.get("routed_scaling_factor", 2.446)))


# -- Kimi K3 (issue 66): what it adds to Kimi Linear's kinds --------------------------------
# Read as the release's loader reads them (Inferact/tpu-megakernels, kimi/__init__.py's
# Config.from_checkpoint: the fields of config.json's text_config, the settings it
# requires). The model type "kimi_k3" (a wrapper whose text_config holds the text model)
# is not in the release, which reads text_config when there is one; it is the model_type
# third-party K3 ports write (mlx-vlm's and exo's test configs, found by search).
def _required(hf: HfConfig, key: str, want, default=None) -> None:
    """Refuse a setting the release's Config.from_checkpoint requires, naming it."""
    value = hf.get(key, default)
    if value != want:
        raise NotImplementedError(f"{hf.where}: {key}={shown(value)} is not implemented "
                                  f"(Kimi K3 has {want!r})")


def situ(hf: HfConfig, got: dict) -> dict:
    """SiTU MLPs (hidden_act "situ": `decoder`): activation_situ_beta and
    activation_situ_linear_beta."""
    return dict(situ_beta=hf.number("activation_situ_beta", hf.need("activation_situ_beta")),
                situ_linear_beta=hf.number("activation_situ_linear_beta",
                                           hf.need("activation_situ_linear_beta")))


def gated_mla(hf: HfConfig, got: dict) -> dict:
    """K3's MLA: NoPE (mla_use_nope, required) with an output gate
    (mla_use_output_gate, required)."""
    _required(hf, "mla_use_nope", True)
    _required(hf, "mla_use_output_gate", True)
    return dict(attn_output_gate=True)


def bounded_kda(hf: HfConfig, got: dict) -> dict:
    """K3's KDA: linear_attn_config's use_full_rank_gate (required) and gate_lower_bound."""
    linear = hf.table("linear_attn_config")
    if linear.get("use_full_rank_gate") is not True:
        raise NotImplementedError(f"{hf.where}: linear_attn_config.use_full_rank_gate="
                                  f"{shown(linear.get('use_full_rank_gate'))} is not "
                                  "implemented (Kimi K3 has True)")
    if linear.get("gate_lower_bound") is None:
        raise ValueError(f"{hf.where}: config.json has no linear_attn_config.gate_lower_bound")
    return dict(kda_full_gate=True, kda_gate_bound=hf.number(
        "linear_attn_config.gate_lower_bound", linear["gate_lower_bound"]))


def latent_moe(hf: HfConfig, got: dict) -> dict:
    """K3's experts: `sigmoid_moe`'s, on a latent of routed_expert_hidden_size with its
    norm (latent_moe_use_norm, required); the release also requires every layer past the
    first sparse (moe_layer_freq 1), the sigmoid router and one expert group."""
    _required(hf, "latent_moe_use_norm", True)
    _required(hf, "moe_layer_freq", 1, 1)
    _required(hf, "moe_router_activation_func", "sigmoid", "sigmoid")
    _required(hf, "num_expert_group", 1, 1)
    return dict(moe_latent=hf.count("routed_expert_hidden_size"))


def attention_residuals(hf: HfConfig, got: dict) -> dict:
    """K3's attention residuals: a block every attn_res_block_size layers."""
    return dict(residual_block=hf.count("attn_res_block_size"))


def clamped_moe(hf: HfConfig, got: dict) -> dict:
    """gpt-oss's experts: every layer MoE, E (num_local_experts), X, Fe (intermediate_size),
    the router's softmax over the selected logits (norm_topk), the clamped SwiGLU's
    swiglu_limit (default 7) and swiglu_alpha (transformers' default 1.702)."""
    return dict(experts=hf.count("num_local_experts", "num_experts"),
                experts_per_token=hf.count("num_experts_per_tok", "experts_per_token"),
                expert_ffn=hf.count("intermediate_size"), norm_topk=True,
                moe_layers=tuple(range(got["layers"])),
                swiglu_limit=hf.number("swiglu_limit", hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=hf.number("swiglu_alpha", hf.get("swiglu_alpha", 1.702)))


# Each model type: its readers, in order (a reader may read the fields of those before it).
FAMILIES = {
    "qwen3": (decoder, dense, gqa, full_attention_only),
    "qwen3_moe": (decoder, dense, gqa, full_attention_only, softmax_moe),
    "qwen3_5_text": (functools.partial(decoder, norm_offset=1.0), dense, no_experts,
                     gated_gqa, deltanet),
    "kimi_linear": (functools.partial(decoder, ties=False, max_position=(
        "model_max_length", "max_position_embeddings")), dense, mla, kda, sigmoid_moe),
    "gpt_oss": (decoder, dense, sink_gqa, clamped_moe),
    "kimi_k3": (functools.partial(decoder, ties=False, act="situ"), dense, situ, mla,
                gated_mla, kda, bounded_kda, sigmoid_moe, latent_moe, attention_residuals),
}
HF_MODEL_TYPES = tuple(FAMILIES)
# Model types whose config.json wraps its text model's fields in text_config (the rest of
# the file describes other towers: vision), and where their checkpoints keep its tensors:
# (the decoder's prefix, lm_head.weight's prefix). Qwen3.5's full checkpoint: its
# language model under model.language_model.; Kimi K3's under language_model. (the
# release's kimi/load.py: PREFIX "language_model.model.", "language_model.lm_head.weight").
WRAPPERS = {"qwen3_5": ("model.language_model.", ""),
            "kimi_k3": ("language_model.model.", "language_model.")}
# A wrapper's text_config has a model type of its own (when it names one: K3's may say
# kimi_linear) but is read by the wrapper's readers: these.
WRAPPED_TEXT = {"qwen3_5": None, "kimi_k3": "kimi_k3"}
# Tensors mk does not run, by model type: Qwen3.5's multi-token prediction and vision
# tower (by prefix); every tensor outside Kimi K3's language model (its other towers: the
# release's kimi/load.py reads only language_model.*).
SKIPPED = dict.fromkeys(("qwen3_5", "qwen3_5_text"), ("mtp.", "model.visual."))
KEPT_ONLY = {"kimi_k3": "language_model."}


def tensor_prefixes(model_type) -> tuple[str, str]:
    """(the decoder's tensor prefix, lm_head's) in a checkpoint of `model_type`."""
    return WRAPPERS.get(model_type, ("model.", ""))


def not_run(model_type, name: str) -> bool:
    """Whether tensor `name` of a `model_type` checkpoint is one mk does not run (the
    loader skips it: `SKIPPED`, `KEPT_ONLY`)."""
    return name.startswith(SKIPPED.get(model_type, ())) \
        or not name.startswith(KEPT_ONLY.get(model_type, ""))


def fields_from_hf(source, *, name: str | None = None, dtype: str | None = None) -> dict:
    """`ModelConfig.from_hf`'s fields: read `source` (a config.json path, its folder or
    the parsed dict), name the model (`name`, else `_name_or_path` checked by
    `check_hub_name`, else the file's folder), unwrap a wrapper's (`WRAPPERS`: a full
    qwen3_5 or kimi_k3, vision-language) config to its text model, run the model type's
    readers; `dtype` overrides the file's."""
    raw = _read_json(source)
    if name is None and raw.get("_name_or_path"):
        check_hub_name(raw["_name_or_path"])
    where = name or raw.get("_name_or_path") or str(source if not isinstance(source, dict)
                                                    else "config.json")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in WRAPPERS:  # a full (vision-language)
        # checkpoint: its text model (a list or a dict here is no model type: refused below)
        if not isinstance(raw.get("text_config"), dict):
            raise ValueError(f"{where}: model_type={model_type!r} without a text_config")
        raw = {"dtype": raw.get("dtype") or raw.get("torch_dtype"), **raw["text_config"]}
        model_type = WRAPPED_TEXT[model_type] or raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={shown(model_type)} is not supported; "
                         f"expected one of {HF_MODEL_TYPES} or 'qwen3_5'")
    hf = HfConfig(raw, where)
    fields = dict(name=name or Path(str(where)).name,
                  dtype=dtype or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    for reader in FAMILIES[model_type]:
        fields |= reader(hf, fields)
    return fields


def check_hub_name(value) -> str:
    """config.json's `_name_or_path`, which names the model (`ModelConfig.name`, shown in
    notebooks, plots and errors): raises ValueError unless it matches HUB_NAME (a
    checkpoint is untrusted: no markup, newline, backtick or local path gets through)."""
    if not (isinstance(value, str) and HUB_NAME.fullmatch(value)):
        raise ValueError(f"config.json: _name_or_path={shown(value)} must be a model name "
                         "or a hub-style 'org/name' of letters, digits, '_', '.' and '-' (at "
                         "most 96 each); mk names the model after it: fix it or remove it")
    return value


def _read_json(source) -> dict:
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no Hugging Face config.json at {path}")
    hf = untrusted.load_json(path, "Hugging Face config")  # a regular file, bounded
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: config.json holds a {type(hf).__name__}; expected a JSON "
                         "object of model fields")
    return hf
