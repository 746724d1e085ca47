"""The pure-JAX reference decoder: the oracle every kernel is checked against.

Here: the forward pass as `prefill`, `decode_step` and greedy `generate`, built from the
array-level blocks of `mk.model.ops`, one oracle per layer kind by its `mk.model.weights` kind name
(`MIXER_LAYERS`, `MLPS`, the tables `forward` dispatches on): `decoder_layer` (gqa,
sink_gqa), `mla_decoder_layer` with its absorbed form `mla_absorbed` / `mla_output` (mla),
`linear_decoder_layer` around `LINEAR_MIXERS` (deltanet, kda), `mlp_block` (dense, moe,
clamped_moe); Kimi K3's kinds (gated_mla, bounded_kda, situ_dense, latent_moe,
res_layer: `residual_layers`); a variant inside a kind follows the weights the model
has. Also here: `lm_head`, `greedy`, `routes`; `KVCache`, `LinearRows` and `init_cache`
are `mk.model.cache`'s, imported here for this module's callers.

Numerics: a float32 residual stream, the KV cache in `config.dtype`, every block's cast
points `mk.model.ops`'s. A decode step's row at or past the cache's capacity is an error, never
a silent wrap. Not here: the checks every decode driver runs (`mk.model.decode_checks`), Pallas,
sharding, sampling (speculative decoding: `mk.speculative.spec`).
Each kind's oracle, the numerics and why the oracle runs on the CPU:
docs/design/mk.model.reference.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.model import linear_attention as la
from mk.model.cache import KVCache, LinearRows, has_states, init_cache  # noqa: F401 - callers'
from mk.model.config import ModelConfig
from mk.model.decode_checks import check_generate, check_params, validate_step
from mk.model.ops import (attention, attention_residual, biased_expert_outputs, combine_experts,
                    expert_outputs, gated_mlp, matmul, rms_norm, rope, route, route_grouped,
                    route_logits, situ, swiglu, write_rows)
from mk.model.layer_values import LayerValues, experts_of
from mk.model.weights import kind_of

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


# -- Logits and the greedy token -----------------------------------------------------------
def greedy(logits: jax.Array) -> jax.Array:
    """Argmax over the vocab axis; ties go to the lowest token id.

    NaN contract (numpy's argmax, which every kernel's argmax follows): a NaN logit counts
    as larger than any number, so a row holding NaN gives the lowest id whose logit is NaN
    (0 when the whole row is NaN). Never an id outside [0, vocab)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def lm_head(config: ModelConfig, params, x: jax.Array) -> jax.Array:
    """Final norm and vocab projection: x [..., D] -> logits [..., V] float32."""
    h = rms_norm(x, params["final_norm"], config.rms_eps, config.norm_offset,
                 config.norm_width)
    w = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return matmul(h, w)


# -- One layer and one step ----------------------------------------------------------------
def attention_inputs(config: ModelConfig, params, layer: int, x, positions):
    """The attention prologue: x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H] float32,
    q and k QK-normed and RoPE'd at positions[b] + t."""
    B, T, _ = x.shape
    N, K, H, eps = config.heads, config.kv_heads, config.head_dim, config.rms_eps
    off, (_, a) = config.norm_offset, config.mixer_index(layer)
    h = rms_norm(x, params["attn_norm"][layer], eps, off, config.norm_width)
    q, k, v = (_projection(params, w, a, h) for w in ("q", "k", "v"))
    q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
    if "q_norm" in params:  # Qwen3's QK norm (no such weights: no norm)
        q = rms_norm(q, params["q_norm"][a], eps, off)
        k = rms_norm(k, params["k_norm"][a], eps, off)
    row_pos = positions[:, None] + jnp.arange(T)
    theta, dims, yarn = config.rope_theta, config.rotary_dim, config.yarn
    return rope(q, row_pos, theta, dims, yarn), rope(k, row_pos, theta, dims, yarn), v


def _projection(params, w: str, a: int, h) -> jax.Array:
    """h @ w{w} of full layer a, plus its bias b{w} where the model has one (gpt-oss)."""
    y = matmul(h, params[f"w{w}"][a])
    return y + params[f"b{w}"][a].astype(F32) if f"b{w}" in params else y


def decoder_layer(config: ModelConfig, params, layer: int, x, k_cache, v_cache, positions):
    """One decoder layer (the stage-05 oracle); x [B, T, D] float32, caches [B, K, S, H]
    of this layer. Returns (x, k_cache, v_cache, x_after_attn)."""
    B, T, _ = x.shape
    _, a = config.mixer_index(layer)
    q, k, v = attention_inputs(config, params, layer, x, positions)
    k_cache = write_rows(k_cache, k, positions)
    v_cache = write_rows(v_cache, v, positions)
    sinks = params["sinks"][a] if "sinks" in params else None  # gpt-oss's
    o = attention(q, k_cache, v_cache, positions, window=config.window(layer),
                  sinks=sinks).reshape(B, T, -1)
    if "wq_gate" in params:  # Qwen3.5's gated output
        h = rms_norm(x, params["attn_norm"][layer], config.rms_eps, config.norm_offset,
                     config.norm_width)
        o = o * jax.nn.sigmoid(matmul(h, params["wq_gate"][a]))
    x = x + _projection(params, "o", a, o)
    return mlp_block(config, params, layer, x), k_cache, v_cache, x


def mlp_block(config: ModelConfig, params, layer: int, x) -> jax.Array:
    """x + MLP(RMSNorm(x)) of layer `layer` (its MLP kind's oracle, `MLPS`); x [B, T, D]
    float32."""
    B, T, _ = x.shape
    role, i = config.mlp_index(layer)
    y = MLPS[kind_of(config, f"{role}_layers")](config, params, i,
                                                 mlp_input(config, params, layer, x))
    return x + y.reshape(B, T, -1)


def mlp_input(config: ModelConfig, params, layer: int, x) -> jax.Array:
    """Layer `layer`'s MLP input: RMSNorm(x) of its residual stream x [B, T, D] as rows
    [B*T, D] float32."""
    return rms_norm(x, params["mlp_norm"][layer], config.rms_eps, config.norm_offset,
                    config.norm_width).reshape(x.shape[0] * x.shape[1], -1)


def dense_mlp(config: ModelConfig, params, i: int, h) -> jax.Array:
    """Dense layer i's SwiGLU of its normed rows h [M, D] -> [M, D] float32."""
    return swiglu(h, params["w_gate"][i], params["w_up"][i], params["w_down"][i])


def routes(config: ModelConfig, params, i: int, h):
    """MoE layer i's router on its normed rows h [M, D] -> (weights [M, X] float32, experts
    [M, X] int32), the one its weights say: gpt-oss's biased logits (`router_logit_bias`,
    `route_logits`), the grouped sigmoid router (`router_bias`, `route_grouped`), else the
    softmax top-k (`route`). `mk.cost.routing_trace` records its choices."""
    router, top_k = params["router"][i], config.experts_per_token
    if "router_logit_bias" in params:
        return route_logits(h, router, params["router_logit_bias"][i], top_k)
    if "router_bias" in params:
        return route_grouped(h, router, params["router_bias"][i], top_k,
                             config.expert_groups, config.topk_groups, config.norm_topk,
                             config.routed_scale)
    return route(h, router, top_k, config.norm_topk)


def moe_mlp(config: ModelConfig, params, i: int, h) -> jax.Array:
    """MoE layer i's routed experts (plus its shared expert, when the model has one) of
    its normed rows h [M, D] -> [M, D] float32, under its router (`routes`)."""
    y = combine_experts(*routes(config, params, i, h), experts_of(
        expert_outputs, params, ("we_gate", "we_up", "we_down"), i, h))
    if "ws_gate" in params:  # the shared expert every token passes through
        y = y + swiglu(h, params["ws_gate"][i], params["ws_up"][i], params["ws_down"][i])
    return y


def clamped_moe_mlp(config: ModelConfig, params, i: int, h) -> jax.Array:
    """gpt-oss's MoE layer i of its normed rows h [M, D] -> [M, D] float32: the softmax of
    the top-k biased router logits (`routes`), the biased clamped-SwiGLU experts."""
    return combine_experts(*routes(config, params, i, h), experts_of(
        biased_expert_outputs, params,
        ("we_gate", "we_up", "we_down", "be_gate", "be_up", "be_down"), i, h,
        config.swiglu_limit, config.swiglu_alpha))


def situ_of(config: ModelConfig):
    """Kimi K3's activation of an MLP's gate and up projections (`mk.model.ops.situ`) at the
    config's betas."""
    return functools.partial(situ, beta=config.situ_beta, linear_beta=config.situ_linear_beta)


def situ_dense_mlp(config: ModelConfig, params, i: int, h) -> jax.Array:
    """Kimi K3's dense layer i: SiTU of its normed rows h [M, D] -> [M, D] float32."""
    return gated_mlp(h, params["w_gate"][i], params["w_up"][i], params["w_down"][i],
                     situ_of(config))


def latent_moe_mlp(config: ModelConfig, params, i: int, h) -> jax.Array:
    """Kimi K3's latent MoE layer i of its normed rows h [M, D] -> [M, D] float32: the
    router (`routes`) scores h; the chosen SiTU experts run on the latent z = h @
    latent_down [M, Lt]; their weighted sum is RMS-normed (latent_norm) and projected back
    with latent_up; the SiTU shared expert runs on h (the release's `moe`)."""
    activation = situ_of(config)
    z = matmul(h, params["latent_down"][i])
    y = combine_experts(*routes(config, params, i, h), experts_of(
        expert_outputs, params, ("we_gate", "we_up", "we_down"), i, z, activation))
    y = matmul(rms_norm(y, params["latent_norm"][i], config.rms_eps),
               params["latent_up"][i])
    return y + gated_mlp(h, params["ws_gate"][i], params["ws_up"][i], params["ws_down"][i],
                         activation)


# Each MLP kind's oracle, by its `mk.model.weights` kind name: (config, params, its row i in the
# kind's stack, normed rows h [M, D]) -> [M, D] float32.
MLPS = {"dense": dense_mlp, "moe": moe_mlp, "clamped_moe": clamped_moe_mlp,
        "situ_dense": situ_dense_mlp, "latent_moe": latent_moe_mlp}


def linear_decoder_layer(config: ModelConfig, params, layer: int, x, conv_state, state):
    """A linear-attention decoder layer (its kind's mixer, `LINEAR_MIXERS`: gated
    DeltaNet or KDA); x [B, T, D] float32. Returns (x, conv states, recurrent states after
    each row, x_after_mixer)."""
    role, i = config.mixer_index(layer)
    h = rms_norm(x, params["attn_norm"][layer], config.rms_eps, config.norm_offset,
                 config.norm_width)
    mixer = LINEAR_MIXERS[kind_of(config, f"{role}_layers")]
    y, conv_rows, state_rows = mixer(config, params, i, h, conv_state, state)
    x = x + y
    return mlp_block(config, params, layer, x), conv_rows, state_rows, x


# Each linear kind's token mixer, by its `mk.model.weights` kind name (`mk.model.linear_attention`).
LINEAR_MIXERS = {"deltanet": la.linear_attention, "kda": la.kimi_delta_attention,
                 "bounded_kda": la.kimi_delta_attention}


def mla_decoder_layer(config: ModelConfig, params, layer: int, x, latent_cache, positions):
    """A multi-head latent attention decoder layer (Kimi Linear's full layers, NoPE as in
    transformers); x [B, T, D] float32, latent_cache [B, S, R + Hr] of this layer. The
    mixer is `mla_mixer`. Returns (x, latent_cache, x_after_attn).
    """
    _, a = config.mixer_index(layer)
    h = rms_norm(x, params["attn_norm"][layer], config.rms_eps, width=config.norm_width)
    y, latent_cache = mla_mixer(config, params, a, h, latent_cache, positions)
    x = x + y
    return mlp_block(config, params, layer, x), latent_cache, x


def mla_mixer(config: ModelConfig, params, a: int, h, latent_cache, positions):
    """MLA layer a's token mixer on its normed rows h [B, T, D] -> (y [B, T, D] float32,
    latent_cache [B, S, R + Hr]).

    The cache holds RMSNorm(h @ wkv_a[:R]) and the shared key part h @ wkv_a[R:]; every
    step expands it to per-head keys [nope | shared part] and values with wkv_b (the
    oracle's plain form; a kernel absorbs wkv_b into q and the output instead). Kimi K3's
    ("gated_mla", its weight wg) gates each head's output by sigmoid(h @ wg) before wo.
    """
    B, T, _ = h.shape
    N, H, R, Hr = config.heads, config.head_dim, config.latent_rank, config.rope_dim
    q, latent = mla_projections(config, params, a, h)
    latent_cache = write_rows(latent_cache[:, None], latent[:, :, None], positions)[:, 0]
    S = latent_cache.shape[1]
    kv = matmul(latent_cache[..., :R], params["wkv_b"][a]).reshape(B, S, N, -1)
    shared = jnp.broadcast_to(latent_cache[:, :, None, R:].astype(F32), (B, S, N, Hr))
    k = jnp.concatenate([kv[..., :H - Hr], shared], axis=-1).transpose(0, 2, 1, 3)
    v = kv[..., H - Hr:].transpose(0, 2, 1, 3)
    dtype = latent_cache.dtype
    o = attention(q, k.astype(dtype), v.astype(dtype), positions).reshape(B, T, -1)
    if "wg" in params:  # Kimi K3's output gate
        o = output_gate(o, h, params["wg"][a])
    return matmul(o, params["wo"][a]), latent_cache


def output_gate(o, h, wg) -> jax.Array:
    """Kimi K3's MLA output gate: the heads' outputs o [..., N*Ho] times sigmoid(h @ wg)
    of the layer's normed rows h [..., D] (the release's `mla`), float32."""
    return o.astype(F32) * jax.nn.sigmoid(matmul(h, wg))


def mla_projections(config: ModelConfig, params, a: int, h):
    """MLA layer a's projections of its normed rows h [..., D]: (q [..., N, H] float32, the
    latent rows [..., R + Hr] float32: RMSNorm(h wkv_a[:R]), then the shared key part
    h wkv_a[R:])."""
    R, eps = config.latent_rank, config.rms_eps
    q_in = h  # with a q low rank (its weights wq_a, q_a_norm) q goes through it
    if "wq_a" in params:
        q_in = rms_norm(matmul(h, params["wq_a"][a]), params["q_a_norm"][a], eps)
    q = matmul(q_in, params["wq"][a]).reshape(*h.shape[:-1], config.heads, config.head_dim)
    kv = matmul(h, params["wkv_a"][a])
    return q, jnp.concatenate([rms_norm(kv[..., :R], params["kv_a_norm"][a], eps),
                               kv[..., R:]], axis=-1)


def mla_absorbed(config: ModelConfig, params, a: int, h):
    """MLA layer a's attention inputs in the absorbed form a decode kernel runs
    (`mk.kinds.attention.decode_attention.latent_attention`), from its normed rows h [M, D]:
    (queries [M, N*W], the latent rows [M, W], the value up-projection [R, N, Ho]);
    W = R + Hr. A head's key for cached latent c and shared part r is [c wkv_b_k, r], so
    q . key = (wkv_b_k q_nope) . c + q_rope . r: each head's query becomes [wkv_b_k
    q_nope, q_rope] and attends over the latent rows themselves; its output P @ c times
    wkv_b_v is the head's P @ values (`mla_output`). Float32."""
    N, R, Hn = config.heads, config.latent_rank, config.head_dim - config.rope_dim
    q, latent = mla_projections(config, params, a, h)
    up = params["wkv_b"][a].astype(F32).reshape(R, N, -1)  # [R, N, Hn + Ho]
    q_latent = jnp.einsum("mnh,rnh->mnr", q[..., :Hn], up[..., :Hn], precision=HIGHEST)
    queries = jnp.concatenate([q_latent, q[..., Hn:]], axis=-1)
    return queries.reshape(h.shape[0], -1), latent, up[..., Hn:]


def mla_output(config: ModelConfig, o, up_v):
    """The heads' outputs [M, N*Ho] of absorbed attention's o [M, N*W] (each head's P @
    latent rows) and the value up-projection up_v [R, N, Ho] (`mla_absorbed`)."""
    R = config.latent_rank
    o = o.reshape(o.shape[0], config.heads, -1)[..., :R]
    return jnp.einsum("mnr,rnv->mnv", o, up_v, precision=HIGHEST).reshape(o.shape[0], -1)


def _full(config: ModelConfig, params, layer: int, x, cache, i: int, positions):
    x, k, v, x_attn = decoder_layer(config, params, layer, x, cache.k[i], cache.v[i],
                                    positions)
    return x, dict(k=k, v=v), x_attn


def _latent(config: ModelConfig, params, layer: int, x, cache, i: int, positions):
    x, latent, x_attn = mla_decoder_layer(config, params, layer, x, cache.latent[i],
                                          positions)
    return x, dict(latent=latent), x_attn  # an MLA layer's "keys" are its latent rows


def _linear(config: ModelConfig, params, layer: int, x, cache, i: int, positions):
    x, conv, state, x_attn = linear_decoder_layer(config, params, layer, x, cache.conv[i],
                                                  cache.state[i])
    return x, dict(conv=conv, state=state), x_attn  # the states after each row


# Each token-mixer kind's layer, by its `mk.model.weights` kind name: (config, params, layer, x,
# cache, its row i in the kind's stack, positions) -> (x, the new values of the cache
# fields it owns at row i, x after the mixer).
MIXER_LAYERS = {"gqa": _full, "sink_gqa": _full, "mla": _latent, "deltanet": _linear,
                "kda": _linear, "gated_mla": _latent, "bounded_kda": _linear}


def _latent_mixer(config: ModelConfig, params, h, cache, i: int, positions):
    y, latent = mla_mixer(config, params, i, h, cache.latent[i], positions)
    return y, dict(latent=latent)


def _linear_mixer(mixer):
    def run(config: ModelConfig, params, h, cache, i: int, positions):
        y, conv, state = mixer(config, params, i, h, cache.conv[i], cache.state[i])
        return y, dict(conv=conv, state=state)  # the states after each row
    return run


# The token mixers attention residuals run (`residual_layers`), by kind name: (config,
# params, normed rows h [B, T, D], cache, the layer's row i in its kind's stack, positions)
# -> (y [B, T, D] float32, the new values of the cache fields it owns at row i).
MIXERS = {"mla": _latent_mixer, "gated_mla": _latent_mixer} | {
    kind: _linear_mixer(mixer) for kind, mixer in LINEAR_MIXERS.items()}


def residual_layers(config: ModelConfig, params, cache, x, positions):
    """Every layer of a model with attention residuals (Kimi K3's "res_layer" kind: the
    release's `stack`) from the embedding x [B, T, D] -> (the final mix [B, T, D], the
    cache fields' new values per layer, the residual sums after each layer's mixer and
    MLP: the taps).

    The residual stream is a list of blocks: the embedding, then the sum of each
    completed block's outputs (a block begins every `residual_block` layers, at layer 0
    first), and the current block's partial sum. A mixer's and an MLP's input is their
    softmax mix (`mk.model.ops.attention_residual`, scored by the layer's attn_res_* or
    mlp_res_* weights), RMS-normed as in any layer; a block's first mixer output replaces
    the partial sum, every other output adds to it; the lm_head reads the mix scored by
    output_res_*.
    """
    B, T, _ = x.shape
    eps, offset, width = config.rms_eps, config.norm_offset, config.norm_width
    blocks, partial, fields, after_attn, after_mlp = [], x, {}, [], []

    def mixed(norm, proj):
        return attention_residual(jnp.stack([*blocks, partial]), norm, proj, eps)

    for layer in range(config.layers):
        starts = layer % config.residual_block == 0
        h = rms_norm(mixed(params["attn_res_norm"][layer], params["attn_res_proj"][layer]),
                     params["attn_norm"][layer], eps, offset, width)
        if starts:
            blocks.append(partial)
        role, i = config.mixer_index(layer)
        y, new = MIXERS[kind_of(config, f"{role}_layers")](config, params, h, cache, i,
                                                           positions)
        for field, value in new.items():
            fields.setdefault(field, []).append(value)
        partial = y if starts else partial + y
        after_attn.append(partial)
        role, i = config.mlp_index(layer)
        h = mlp_input(config, params, layer,
                      mixed(params["mlp_res_norm"][layer], params["mlp_res_proj"][layer]))
        partial = partial + MLPS[kind_of(config, f"{role}_layers")](
            config, params, i, h).reshape(B, T, -1)
        after_mlp.append(partial)
    out = mixed(params["output_res_norm"], params["output_res_proj"])
    return out, fields, after_attn, after_mlp


@functools.partial(jax.jit, static_argnames=("config", "taps", "row_states"))
def forward(config: ModelConfig, params, cache, tokens, positions, taps=False,
            row_states=False):
    """`decode_step` as traced, with no host-side checks (callers validate first; the
    compile-time benchmark lowers it)."""
    x = params["embed"][tokens].astype(F32)  # [B, T, D]
    fields, after_attn, after_mlp = {}, [], []
    if kind_of(config, "layers") == "res_layer":  # attention residuals: Kimi K3's layers
        x, fields, after_attn, after_mlp = residual_layers(config, LayerValues(params, x),
                                                           cache, x, positions)
    else:
        for layer in range(config.layers):
            role, i = config.mixer_index(layer)
            kind = kind_of(config, f"{role}_layers")
            x, new, x_attn = MIXER_LAYERS[kind](config, LayerValues(params, x), layer, x,
                                                cache, i, positions)
            for field, value in new.items():
                fields.setdefault(field, []).append(value)
            after_attn.append(x_attn)
            after_mlp.append(x)
    logits = lm_head(config, LayerValues(params, x), x)
    # the fields of the kinds the model has (an all-linear model keeps its empty KV cache)
    fields = {field: jnp.stack(values) for field, values in fields.items()}
    rows = None
    if set(LinearRows._fields) <= set(fields):  # the states after each row; the cache keeps
        rows = LinearRows(**{f: fields[f] for f in LinearRows._fields})  # the last row's
        fields |= {f: a[:, :, -1] for f, a in rows._asdict().items()}
    out = [logits, cache._replace(**fields)]
    if row_states and rows is not None:
        out.append(rows)
    if taps:
        out.append({"attn": jnp.stack(after_attn), "mlp": jnp.stack(after_mlp)})
    return tuple(out)


# -- Public API -----------------------------------------------------------------------------
def decode_step(config: ModelConfig, params, cache, tokens, positions, *,
                taps: bool = False, row_states: bool = False, quantised: bool = False):
    """T new tokens per sequence -> (logits [B, T, V] float32, updated cache).

    tokens [B, T] int; positions [B]: where each sequence's first new row goes. With
    `row_states=True` (hybrids) also returns `LinearRows`, the linear layers' states after
    each row (for `rollback`). With `taps=True` also returns {"attn", "mlp"}: the residual
    stream [L, B, T, D] after each layer's attention and MLP blocks (for finding the first
    diverging op).
    """
    tokens, positions = validate_step(config, cache, tokens, positions)
    if row_states and not has_states(cache):
        raise ValueError(f"row_states=True needs a hybrid model; {config.name} has no "
                         "linear layers")
    check_params(config, params, quantised=quantised)
    return forward(config, params, cache, tokens, positions, taps=taps,
                    row_states=row_states)


def prefill(config: ModelConfig, params, tokens, *, max_context: int | None = None,
            quantised: bool = False):
    """The prompt tokens [B, P] -> (logits [B, P, V] float32, cache holding P positions).
    quantised=True also takes `mk.model.quant.QuantWeight`s, dequantised as they are read
    (`mk.model.layer_values.LayerValues`): `mk.model.quant.dequantize(params)`'s values, never all
    at once."""
    shape = np.shape(tokens)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"prompt shape {shape} must be [B, P] with B >= 1 and P >= 1")
    cache = init_cache(config, shape[0], max_context)
    return decode_step(config, params, cache, tokens, jnp.zeros(shape[0], jnp.int32),
                       quantised=quantised)


def generate(config: ModelConfig, params, prompt, steps: int, *,
             max_context: int | None = None, quantised: bool = False) -> jax.Array:
    """Greedy decoding: prompt [B, P] -> the next `steps` tokens [B, steps] int32;
    quantised=True also takes `mk.model.quant.QuantWeight`s (`prefill`'s).

    One compiled step a call, not a compiled loop: in a loop XLA:CPU widened every
    layer's bf16 weights to float32 once, before it (loop-invariant), so the oracle held
    3.5x a model's bytes (qwen3-1.7b's `mk.measure.exactness.expect`: 11.2 GiB of host memory;
    6.0 a step a call, issue 60)."""
    prompt, S, steps = check_generate(config, prompt, steps, max_context)
    logits, cache = prefill(config, params, prompt, max_context=S, quantised=quantised)
    tokens = [greedy(logits[:, -1])]
    position = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    for _ in range(steps - 1):
        # the static arguments spelled as decode_step spells them: jit keys a call on the
        # keywords given, so a bare call would compile decode_step's T=1 program again
        logits, cache = forward(config, params, cache, tokens[-1][:, None], position,
                                taps=False, row_states=False)
        tokens.append(greedy(logits[:, -1]))
        position = position + 1
    return jnp.stack(tokens, axis=1)
