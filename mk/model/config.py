"""Model descriptions: `ModelConfig`, its storage formats, and the dimension legend.

Here: the frozen `ModelConfig` of every family the project runs (Qwen3, Qwen3-MoE,
Qwen3.5's hybrid, Kimi Linear, gpt-oss with `Yarn`, Kimi K3), its derived sizes, how its
weights are stored (`formats`, checked by `check_formats`: the one precision knob), lane
padding (`lane_padded`, `padding`, `norm_width`), `ModelConfig.from_hf` (the one entry
point for Hugging Face `config.json` files), the argument checks several modules share
(`positive_int`, `check_seed`, `check_rows`), and the dimension legend of every shape
comment in the project (the comment block below the imports). Not here: each layer kind's
checks of its fields (`mk.model.kind_checks`, run on construction) and its Hugging Face fields
(`mk.model.hf_config`), the named presets (`mk.model.presets`), weights (`mk.model.checkpoint`),
chips (`mk.model.chips`), notebook parameters (`mk.course.run`), kernel tiling (each kernel's
`BlockSizes`). Each family's layers, the derived sizes, the padding and the parameter layout:
docs/design/mk.model.config.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from mk.model.errors import brief, shown
from mk.model.kind_checks import FORMAT_LAYERS, KIND_CHECKS, UNSET, check_positive_ints
from mk.model.hf_config import fields_from_hf

# Dimension legend, used in every shape comment of the project:
#
#     B batch                 T query rows per sequence    S cached positions (capacity)
#     D model width (hidden)  N query heads                K kv heads
#     G = N / K               H head dim                   F dense FFN width
#     E experts               X experts per token          Fe expert FFN width
#     L layers                V vocab                      P prompt length
#     M = B * T activation rows of one step
#     La full-attention layers    Ll linear-attention (gated-DeltaNet) layers
#     Nk linear key heads         Nv linear value heads        Hk, Hv their head dims
#     C = 2*Nk*Hk + Nv*Hv conv channels                        W conv kernel width
#     Kimi Linear (MLA full layers, KDA linear layers): R latent rank (kv_lora_rank),
#     Rq query rank (q_lora_rank, 0: none), Hr shared rope-part dims, Hn = H - Hr, Ho MLA
#     value head dim, Fs shared-expert width
#     Kimi K3: Lt the latent MoE's width (moe_latent: its routed experts run on it)

# Bits per element of the dtypes weights, activations and caches are held in.
DTYPE_BITS = {"float32": 32, "bfloat16": 16}
# How weights may be stored instead: a `formats` dict {format group: scheme} (the one
# precision knob: a `ModelConfig`'s default, or a caller's) stores each weight of a group
# (`mk.model.weights.FORMAT_GROUPS`) packed in its `mk.model.quant` scheme, with scales; the others
# stay in `dtype`. Data bits per value of each scheme (its scales are `mk.model.quant`'s layouts).
SCHEME_BITS = {"int8": 8, "fp8": 8, "int4": 4, "fp4": 4}
FORMAT_GROUP_NAMES = ("dense", "experts", "lm_head")
# Token mixers a layer may have: full attention over a KV cache, or a gated DeltaNet.
LAYER_TYPES = ("full", "linear")
# Dtypes the reference and the kernels compute with.
COMPUTE_DTYPES = tuple(DTYPE_BITS)
# M = B * T activation rows of one decode step (decode and speculative verification).
MAX_ROWS = 64
LANES = 128  # the minor (lane) dimension of a vreg
# The widths `ModelConfig.lane_padded` rounds up to whole 128-lane tiles: the residual
# stream's and the MLPs' (every other width is whole heads, tiled as they are).
PADDED_FIELDS = ("hidden", "ffn", "expert_ffn", "shared_expert_ffn")


def padded_width(width: int) -> int:
    """A width rounded up to whole 128-lane tiles (a padded width of `PADDED_FIELDS`, a
    split MLP width: `Kind.shard_fields`)."""
    return -(-width // LANES) * LANES


def positive_int(field: str, value) -> int:
    """`value` as an int after checking it is a whole number >= 1 (a Python or numpy integer,
    never a bool or a float); raises ValueError naming `field`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"{field}={shown(value)} must be a positive integer")
    return int(value)


def finite_number(field: str, value, low: float = 0.0, high: float = math.inf, *,
                  open_low: bool = False) -> float:
    """`value` as a float after checking it is a real number (a Python or numpy int or
    float, never a bool or a string), finite and in [low, high] ((low, high] with
    `open_low`); raises ValueError naming `field`, the value and the range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)) or not math.isfinite(value) or not (
            (low < value if open_low else low <= value) and value <= high):
        span = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if high == math.inf else ']'}"
        raise ValueError(f"{field}={shown(value)} must be a finite number in {span}")
    return float(value)


def check_seed(seed) -> int:
    """A random seed as an int after checking it is a whole number >= 0 (numpy's seeding
    refuses negatives with "expected non-negative integer", naming no field)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or seed < 0:
        raise ValueError(f"seed={shown(seed)} must be a non-negative integer")
    return int(seed)


def check_rows(batch: int, rows: int = 1) -> int:
    """M = batch * rows activation rows of one kernel step, checked against [1, MAX_ROWS]."""
    batch, rows = positive_int("batch", batch), positive_int("rows", rows)
    if batch * rows > MAX_ROWS:
        raise ValueError(f"batch={batch} x rows={rows} = {batch * rows} activation rows "
                         f"exceed MAX_ROWS={MAX_ROWS} of one decode step")
    return batch * rows


def check_config(config) -> ModelConfig:
    """`config` after checking it is a ModelConfig (a preset's name is not one)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config={shown(config)} must be a ModelConfig (mk.preset(name), "
                         "mk.ModelConfig.from_hf)")
    return config


def check_formats(config: ModelConfig, formats) -> dict[str, str]:
    """A `formats` dict ({format group: scheme or None}, or its items) checked against
    `config` -> {group: scheme} of the groups stored quantised (None: left in `dtype`)."""
    check_config(config)
    try:
        items = dict(formats or {})
    except (TypeError, ValueError):
        raise ValueError(f"{config.name}: formats={brief(formats)} must be a dict "
                         "{format group: scheme}") from None
    chosen = {}
    for group, scheme in items.items():
        if group not in FORMAT_GROUP_NAMES:
            raise ValueError(f"{config.name}: formats group={shown(group)} must be one of "
                             f"{FORMAT_GROUP_NAMES} (mk.model.weights.FORMAT_GROUPS)")
        if scheme is None:
            continue
        if scheme not in SCHEME_BITS:
            raise ValueError(f"{config.name}: formats {group}={shown(scheme)} must be one of "
                             f"{tuple(SCHEME_BITS)} or None")
        needs = FORMAT_LAYERS.get(group)  # the layers holding the group's weights
        if needs and not getattr(config, needs):
            raise ValueError(f"{config.name}: formats {group}={scheme!r}: {config.name} has "
                             f"no {group} (no {needs})")
        if group == "lm_head" and config.tie_embeddings:
            raise ValueError(f"{config.name}: formats lm_head={scheme!r}: {config.name} ties "
                             "its lm_head to the embedding table, which stays in dtype")
        chosen[group] = scheme
    return chosen


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (transformers' rope_type "yarn", gpt-oss's): each rotated pair's
    frequency moves from theta's (pairs turning more than `beta_fast` times over the
    `original_max_position` the model was trained at: kept) to theta's / `factor` (pairs
    turning fewer than `beta_slow` times: interpolated) along a linear ramp of the pair
    index between the two (its ends floored and ceiled when `truncate`); cos and sin are
    scaled by `attention_factor` (None: 0.1 ln(factor) + 1). `mk.model.ops.rope_inv_freq`
    computes them."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        positive_int("yarn.original_max_position", self.original_max_position)
        for field in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, field)
            if value is None and field == "attention_factor":
                continue
            if not (isinstance(value, (int, float, np.floating))
                    and not isinstance(value, bool) and math.isfinite(value) and value > 0):
                raise ValueError(f"yarn.{field}={shown(value)} must be a finite number > 0")
        if self.factor < 1 or self.beta_fast <= self.beta_slow:
            raise ValueError(f"yarn: factor={self.factor} must be >= 1 and beta_fast="
                             f"{self.beta_fast} above beta_slow={self.beta_slow}")

    @property
    def scale(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-architecture decoder. Validates itself on construction."""

    name: str
    vocab: int  # V
    hidden: int  # D
    layers: int  # L
    heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H
    ffn: int  # F, the dense SwiGLU width
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = False
    dtype: str = "bfloat16"  # weights, activations between ops, KV cache
    max_position: int = 40_960  # longest position the model was trained for
    max_context: int = 4_096  # default KV-cache capacity S (<= max_position)
    # Mixture of experts (all zero/empty for a dense model).
    experts: int = 0  # E
    experts_per_token: int = 0  # X
    expert_ffn: int = 0  # Fe
    moe_layers: tuple[int, ...] = ()
    norm_topk: bool = False  # renormalise the top-k router weights to sum to 1
    # Hybrid linear attention (Qwen3.5). Empty layer_types: every layer is full attention.
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES
    linear_key_heads: int = 0  # Nk
    linear_value_heads: int = 0  # Nv (a multiple of Nk)
    linear_key_dim: int = 0  # Hk
    linear_value_dim: int = 0  # Hv
    conv_kernel: int = 0  # W, taps of the depthwise causal conv over q/k/v channels
    # full attention's output * sigmoid(h @ wq_gate); MLA's (Kimi K3's): * sigmoid(h @ wg)
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0  # RoPE rotates the first H * factor dims
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight); 1 in Qwen3.5
    # Kimi Linear (transformers' kimi_linear). latent_rank > 0: every full layer is MLA
    # (kv_heads = heads, head_dim = Hn + Hr, no RoPE: transformers' MLA is NoPE), caching
    # R + Hr values per token. channel_decay: every linear layer is KDA.
    latent_rank: int = 0  # R
    q_rank: int = 0  # Rq; 0: q is one [D, N*H] projection
    rope_dim: int = 0  # Hr, the key part all heads share (cached beside the latent)
    value_dim: int = 0  # Ho, MLA's value head dim
    channel_decay: bool = False  # KDA: the forget gate decays each key channel
    shared_expert_ffn: int = 0  # Fs; every MoE layer adds a dense SwiGLU of this width
    router_score: str = "softmax"  # one of mk.model.kind_checks.ROUTER_SCORES
    expert_groups: int = 1  # sigmoid router: experts come from the best topk_groups groups
    topk_groups: int = 1
    routed_scale: float = 1.0  # routed_scaling_factor: multiplies the routed weights
    # How tensor parallelism holds each MoE router (`mk.model.kind_checks.ROUTER_SPLITS`):
    # "whole" on every device, "experts" (a device computes the logits of its E/tp experts
    # and the devices all-gather them) or "auto" (the plan's choice where it pays:
    # `mk.kinds.mlp.routing.router_columns`). A shard records its router's columns in
    # router_columns (0: every expert's, the model's own).
    router_split: str = "auto"
    router_columns: int = 0
    # gpt-oss (transformers' gpt_oss). attention_sinks: every full layer is attention with
    # a learned sink logit per head (an extra term in each head's softmax denominator),
    # biases on q, k, v and o where attention_bias; the `sliding_layers` among them see
    # only their last `sliding_window` positions (their own included). swiglu_limit > 0:
    # every MoE layer's router adds a bias to its logits and takes the softmax of the
    # top-k, and its experts (with biases) are the clamped SwiGLU (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate), gate <= limit, |up| <= limit.
    attention_sinks: bool = False
    attention_bias: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    yarn: Yarn | None = None  # YaRN RoPE scaling (gpt-oss); None: plain RoPE
    # Kimi K3 (the release's `kimi/__init__.py` Config and equations; issue 66), each unset
    # at its default. situ_beta > 0: every MLP (dense, shared and routed experts) is SiTU,
    # (beta tanh(g / beta) sigmoid(g)) * (linear_beta tanh(u / linear_beta)) of its gate
    # and up projections g, u, instead of SwiGLU (`mk.model.ops.situ`). moe_latent > 0: a latent
    # MoE: the routed experts run on x @ latent_down [D, moe_latent], their weighted sum
    # is RMS-normed and projected back with latent_up (router and shared expert on x).
    # residual_block > 0: attention residuals: each mixer's and MLP's input is a softmax
    # mix of the completed blocks' residual sums and the current one's, a block every
    # residual_block layers (`mk.model.ops.attention_residual`). kda_gate_bound < 0 (with
    # kda_full_gate): KDA's log-decay is bound * sigmoid(exp(A_log) (g + dt_bias)), in
    # (bound, 0), and its output gate one full-rank projection [D, Nv*Hv]. MLA's output
    # gate is attn_output_gate. expert_fp8_block > 0: the release's loader re-stores the
    # experts' gate and up (MXFP4 in the checkpoint) losslessly as fp8 e4m3 with one bf16
    # scale per this many contraction rows; down stays MXFP4 (formats experts="fp4").
    situ_beta: float = 0.0
    situ_linear_beta: float = 0.0
    moe_latent: int = 0
    residual_block: int = 0
    kda_full_gate: bool = False
    kda_gate_bound: float = 0.0
    expert_fp8_block: int = 0
    # A latent MoE's shard at tp > 1 (`mk.step.plan.shard_config`) holds latent_down's
    # columns and latent_up's rows of its latent_columns (whole 128-lane tiles, the last
    # devices' zeros: `mk.kinds.mlp.latent_moe.latent_columns`), all-gathers the latent and
    # all-reduces the experts' sum over latent_shards devices; 0, 0: the model's own.
    latent_columns: int = 0
    latent_shards: int = 0
    # How the model's weights are stored (`check_formats`; a dict is kept as its sorted
    # items): the byte model (mk.cost.perf, mk.cost.sim, the plan) charges it wherever a caller
    # gives no formats of its own; () stores every weight in `dtype`.
    formats: tuple[tuple[str, str], ...] = ()
    # Zero lanes appended to widths that are not whole 128-lane tiles ({field of
    # PADDED_FIELDS: zeros}, kept as sorted items; `lane_padded` sets it): the kernels tile
    # whole lanes and fp4 packs 128 rows, so gpt-oss's 2880 is held as 2944. Exact: the
    # padded rows and columns are zeros, the residual stream's padding lanes stay zero, and
    # its RMSNorms average over the model's own width (`norm_width`).
    padding: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        check_positive_ints(self, ("vocab", "hidden", "layers", "heads", "kv_heads",
                                   "head_dim", "ffn", "max_position", "max_context"))
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads={self.heads} must be a multiple of "
                             f"kv_heads={self.kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim={self.head_dim} must be even (RoPE "
                             "rotates pairs of dimensions)")
        if self.max_context > self.max_position:
            raise ValueError(f"{self.name}: max_context={self.max_context} exceeds "
                             f"max_position={self.max_position}")
        for field in ("rope_theta", "rms_eps"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value)
                    and value > 0):
                raise ValueError(f"{self.name}: {field}={shown(value)} must be a finite "
                                 "number > 0")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{self.name}: dtype={shown(self.dtype)} must be one of "
                             f"{COMPUTE_DTYPES}")
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        if isinstance(self.yarn, dict):  # its fields (`mk.model.hf_config.yarn`)
            object.__setattr__(self, "yarn", Yarn(**self.yarn))
        if self.yarn is not None and not isinstance(self.yarn, Yarn):
            raise ValueError(f"{self.name}: yarn={shown(self.yarn)} must be a mk.model.config.Yarn")
        object.__setattr__(self, "formats", tuple(sorted(check_formats(self, self.formats)
                                                         .items())))
        object.__setattr__(self, "padding", tuple(sorted(self._checked_padding().items())))
        self._validate_layer_types()
        for check in KIND_CHECKS:  # each layer kind's own fields
            check(self)

    def _checked_padding(self) -> dict[str, int]:
        try:
            padding = dict(self.padding)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: padding={brief(self.padding)} must be a dict "
                             "{field: zero lanes}") from None
        for field, zeros in padding.items():
            if field not in PADDED_FIELDS:
                raise ValueError(f"{self.name}: padding field={shown(field)} must be one of "
                                 f"{PADDED_FIELDS}")
            width = getattr(self, field)
            if isinstance(zeros, bool) or not isinstance(zeros, int) or not 0 < zeros < width:
                raise ValueError(f"{self.name}: padding {field}={shown(zeros)} must be a "
                                 f"whole number of zero lanes in [1, {field}={width})")
        return padding

    def _validate_layer_types(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.layers:
            raise ValueError(f"{self.name}: layer_types has {len(self.layer_types)} entries, "
                             f"expected layers={self.layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"{self.name}: layer_types={brief(bad)} must each be one of "
                             f"{LAYER_TYPES}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or rotary % 2:
            raise ValueError(f"{self.name}: partial_rotary_factor={self.partial_rotary_factor}"
                             f" must be in (0, 1] and give an even number of rotated dims "
                             f"(head_dim={self.head_dim} * factor = {rotary})")

    # -- Lane padding ---------------------------------------------------------------------
    def own_width(self, field: str) -> int:
        """Width `field` (of PADDED_FIELDS) less its zero lanes: the columns holding
        values."""
        return getattr(self, field) - dict(self.padding).get(field, 0)

    @property
    def norm_width(self) -> int:
        """The width the residual stream's RMSNorms average over: D less its zero lanes."""
        return self.own_width("hidden")

    def lane_padded(self) -> ModelConfig:
        """This model with each width of PADDED_FIELDS rounded up to whole 128-lane tiles
        (`padding` records the zeros); itself when every width is whole already. The
        loader and `init_params` fill the padding with zeros (`mk.model.checkpoint`)."""
        widths = {f: getattr(self, f) for f in PADDED_FIELDS if getattr(self, f)}
        grown = {f: padded_width(w) for f, w in widths.items() if padded_width(w) != w}
        if not grown:
            return self
        padding = dict(self.padding)
        for field, width in grown.items():
            padding[field] = padding.get(field, 0) + width - widths[field]
        return dataclasses.replace(self, padding=padding, **grown)

    def unpadded(self) -> ModelConfig:
        """The model in its own widths (a checkpoint's shapes): `lane_padded` undone."""
        if not self.padding:
            return self
        return dataclasses.replace(self, padding=(), **{
            field: getattr(self, field) - zeros for field, zeros in self.padding})

    # -- Derived shapes -------------------------------------------------------------------
    @property
    def group(self) -> int:
        """G = N / K query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.layers) if i not in moe)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Layers whose token mixer is a gated DeltaNet (a fixed state, no KV cache)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers with full (softmax) attention over a KV cache."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.layers) if i not in linear)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def is_mla(self) -> bool:
        """Full layers are multi-head latent attention over a latent cache (Kimi Linear)."""
        return bool(self.latent_rank)

    @property
    def latent_width(self) -> int:
        """R + Hr: the values an MLA layer caches per token (one shared 'head')."""
        return self.latent_rank + self.rope_dim

    def mixer_index(self, layer: int) -> tuple[str, int]:
        """("full", i) or ("linear", i): which stacked token-mixer tensor row (and, for
        "full", which KV-cache layer) layer `layer` uses."""
        return self._layer_rows()[layer][0]

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_width(self) -> int:
        """Nk * Hk: the width of a gated-DeltaNet layer's queries, and of its keys."""
        return self.linear_key_heads * self.linear_key_dim

    @property
    def linear_value_width(self) -> int:
        """Nv * Hv: the width of a gated-DeltaNet layer's values and output."""
        return self.linear_value_heads * self.linear_value_dim

    @property
    def conv_channels(self) -> int:
        """C: the q, k and v channels the causal conv runs over."""
        return 2 * self.linear_key_width + self.linear_value_width

    def window(self, layer: int) -> int:
        """How many positions up to its own each row of layer `layer` attends to: its
        sliding window, or 0 for every cached position."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def mlp_index(self, layer: int) -> tuple[str, int]:
        """("dense", i) or ("moe", i): which stacked MLP tensor row layer `layer` uses."""
        return self._layer_rows()[layer][1]

    @functools.cache  # noqa: B019 (frozen and hashable: one table per config, built once)
    def _layer_rows(self) -> tuple[tuple[tuple[str, int], tuple[str, int]], ...]:
        """Every layer's (mixer_index, mlp_index), in one pass: per-layer lookups stay O(1)
        at any depth (a config.json may declare thousands of layers)."""
        moe, linear = set(self.moe_layers), set(self.linear_layers)
        rows, count = [], dict.fromkeys(("full", "linear", "dense", "moe"), 0)
        for layer in range(self.layers):
            kinds = ("linear" if layer in linear else "full",
                     "moe" if layer in moe else "dense")
            rows.append(tuple((kind, count[kind]) for kind in kinds))
            for kind in kinds:
                count[kind] += 1
        return tuple(rows)

    def first_layers(self, n: int) -> ModelConfig:
        """The same model cut to its first n layers (compile tests, self-drafting)."""
        if not 1 <= n <= self.layers:
            raise ValueError(f"{self.name}: first_layers(n={n}) needs 1 <= n <= "
                             f"layers={self.layers}")
        return self.pick_layers(range(n))

    def pick_layers(self, layers) -> ModelConfig:
        """A model of the given layers of this one, in order (indices; a repeat makes a
        deeper model like it): its layer i is this one's layers[i]. A layer kind none of
        them has leaves its fields unset (`mk.model.kind_checks.UNSET`) and its format groups
        (`FORMAT_LAYERS`)."""
        layers = tuple(int(i) for i in layers)

        def like(field):  # the new layers that are like this model's `field` layers
            old = set(getattr(self, field))
            return tuple(i for i, was in enumerate(layers) if was in old)

        gone = [field for field in UNSET if getattr(self, field) and not like(field)]
        types = tuple(self.layer_types[i] for i in layers) if self.layer_types else ()
        return dataclasses.replace(
            self, layers=len(layers), moe_layers=like("moe_layers"), layer_types=types,
            sliding_layers=like("sliding_layers"),
            formats=tuple((g, q) for g, q in self.formats if FORMAT_LAYERS.get(g) not in gone),
            **{f: v for field in gone for f, v in UNSET[field].items()})

    # -- Derived sizes --------------------------------------------------------------------
    @property
    def weight_bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def expert_bits(self) -> int:
        """Data bits of one stored expert value (its `formats` scheme's, scales aside)."""
        scheme = dict(self.formats).get("experts")
        return SCHEME_BITS[scheme] if scheme else self.weight_bits

    @property
    def expert_params(self) -> int:
        """Parameters of ONE expert (gate, up, down), on the latent MoE's latent if any."""
        return 3 * (self.moe_latent or self.hidden) * self.expert_ffn

    # -- Hugging Face ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict, *, name: str | None = None,
                dtype: str | None = None) -> ModelConfig:
        """Read a Qwen3, Qwen3-MoE, Qwen3.5, Kimi Linear, Kimi K3 or gpt-oss `config.json`
        (a path, a folder, or the parsed dict; `mk.model.hf_config.HF_MODEL_TYPES`), each layer
        kind's fields read by its reader in `mk.model.hf_config`, as the model mk holds:
        `lane_padded` (`unpadded()` is the file's own widths).

        Both spellings are accepted: older (`rope_theta`, `num_experts`) and newer
        (`rope_parameters`, `num_local_experts`). `dtype` overrides the file's dtype.
        The model is named `name`, else after `_name_or_path`
        (`mk.model.hf_config.check_hub_name`: a checkpoint is untrusted), else after the folder;
        errors echo the file's values `shown` (escaped, bounded).
        """
        return cls(**fields_from_hf(source, name=name, dtype=dtype)).lane_padded()
