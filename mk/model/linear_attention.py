"""The gated DeltaNet's math (Qwen3.5's linear attention and Kimi Delta Attention, its
per-channel-decay variant), in float32, for `mk.model.reference`.

Here: the depthwise causal conv with its state, the gated delta rule with its recurrent
state, and the gated RMSNorm, each returning the state after EVERY row so a speculative
verifier can restart from any accepted prefix; and a linear layer's token mixer from its
parameters on normed rows: `conv_qkv` (the projection, the conv and the L2 norms both
kinds share), `linear_attention` (the gated DeltaNet), `kda_decay` (with
`kda_log_decay`, its formula, which the kernels share) and `kimi_delta_attention` (KDA;
Kimi K3's too: a full-rank output gate, a bounded decay). Not here: the layer around a
mixer (its norm, residual and MLP: `mk.model.reference.linear_decoder_layer`), kernels
(`mk.kernels`). Conventions follow transformers' `modeling_qwen3_5.py`
(`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`, `Qwen3_5RMSNormGated`); the
recurrence is run row by row, exact at any T.

For one value head with state S [Hk, Hv], a row's q, k (L2-normalised, q also / sqrt(Hk)),
v, decay g <= 0 and rate beta in (0, 1):

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   out = q^T S
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.model.config import ModelConfig
from mk.model.ops import matmul

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
L2_EPS = 1e-6  # transformers' (and the FLA library's) l2norm epsilon


def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array):
    """SiLU(depthwise causal conv) of T new rows after the W - 1 remembered ones.

    x [B, T, C]; conv_state [B, W-1, C] (the inputs of the last W - 1 rows); weight [W, C]
    (tap W - 1 multiplies the newest row). Returns (out [B, T, C] float32,
    states [B, T, W-1, C]: the conv state after each row, in conv_state's dtype).
    """
    W, T = weight.shape[0], x.shape[1]
    window = jnp.concatenate([conv_state.astype(F32), x.astype(F32)], axis=1)  # [B, W-1+T, C]
    out = sum(window[:, j:j + T] * weight[j].astype(F32) for j in range(W))
    states = jnp.stack([window[:, t + 1:t + W] for t in range(T)], axis=1)
    return jax.nn.silu(out), states.astype(conv_state.dtype)


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' `l2norm`)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def delta_rule(q, k, v, g, beta, state):
    """The gated delta rule over T rows, one row at a time.

    q, k [B, T, Nv, Hk] (already normalised and scaled, one per value head); v [B, T, Nv, Hv];
    beta [B, T, Nv]; g [B, T, Nv] (one decay per head, the gated DeltaNet) or [B, T, Nv, Hk]
    (one per key channel: Kimi Delta Attention, S <- diag(exp(g)) S); state [B, Nv, Hk, Hv]
    float32. Returns (out [B, T, Nv, Hv] float32,
    states [B, T, Nv, Hk, Hv] float32: the recurrent state after each row).
    """
    def row(s, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs
        s = s * jnp.exp(g_t)[..., None]
        remembered = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - remembered) * beta_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST), s)

    g = g[..., None] if g.ndim == 3 else g  # a head's decay is every channel's
    rows = tuple(jnp.moveaxis(a.astype(F32), 1, 0) for a in (q, k, v, g, beta))
    _, (out, states) = lax.scan(row, state.astype(F32), rows)
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float,
                   gate=jax.nn.silu) -> jax.Array:
    """RMSNorm(x) * weight * gate(z) over the last axis (norm before gate), float32; the
    gate is SiLU in Qwen3.5, sigmoid in Kimi Delta Attention."""
    x = x.astype(F32)
    h = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(F32)
    return h * gate(z.astype(F32))


# -- A linear layer's mixer, from its parameters -----------------------------------------
def conv_qkv(config: ModelConfig, params, i: int, h, conv_state):
    """The prologue of linear layer i (gated DeltaNet or KDA) on normed rows h [B, T, D]:
    q, k, v projected together, through the causal conv, q and k L2-normalised per head
    and q / sqrt(Hk). Returns (q, k [B, T, Nk, Hk], v [B, T, Nv, Hv] float32, conv states
    [B, T, W-1, C] after each row)."""
    B, T, _ = h.shape
    Nk, Nv, Hk, Hv = (config.linear_key_heads, config.linear_value_heads,
                      config.linear_key_dim, config.linear_value_dim)
    # The conv input is stored in the conv state, so it is rounded to the cache dtype.
    qkv = matmul(h, params["lin_qkv"][i]).astype(conv_state.dtype)
    mixed, conv_rows = causal_conv(qkv, conv_state, params["lin_conv"][i])
    kw = config.linear_key_width
    q = l2norm(mixed[..., :kw].reshape(B, T, Nk, Hk)) / np.float32(np.sqrt(Hk))
    k = l2norm(mixed[..., kw:2 * kw].reshape(B, T, Nk, Hk))
    return q, k, mixed[..., 2 * kw:].reshape(B, T, Nv, Hv), conv_rows


def linear_attention(config: ModelConfig, params, i: int, h, conv_state, state):
    """The gated DeltaNet of linear layer i on normed rows h [B, T, D].

    conv_state [B, W-1, C], state [B, Nv, Hk, Hv] float32. Returns (y [B, T, D] float32,
    conv states [B, T, W-1, C] and recurrent states [B, T, Nv, Hk, Hv] after each row).
    """
    B, T, _ = h.shape
    Nk, Nv, Hv = config.linear_key_heads, config.linear_value_heads, config.linear_value_dim
    q, k, v, conv_rows = conv_qkv(config, params, i, h, conv_state)
    # Key head j serves value heads j * Nv/Nk .. (j + 1) * Nv/Nk - 1.
    q, k = (jnp.repeat(a, Nv // Nk, axis=2) for a in (q, k))
    beta = jax.nn.sigmoid(matmul(h, params["lin_b"][i]))
    decay = jnp.exp(params["lin_a_log"][i].astype(F32))
    g = -decay * jax.nn.softplus(matmul(h, params["lin_a"][i])
                                 + params["lin_dt_bias"][i].astype(F32))
    o, state_rows = delta_rule(q, k, v, g, beta, state)
    z = matmul(h, params["lin_z"][i]).reshape(B, T, Nv, Hv)
    o = gated_rms_norm(o, z, params["lin_norm"][i], config.rms_eps).reshape(B, T, -1)
    return matmul(o, params["lin_out"][i]), conv_rows, state_rows


def kda_decay(config: ModelConfig, params, i: int, h):
    """KDA's log-decay g [..., Nv, Hk] of linear layer i's normed rows h [..., D]: one per
    key channel, with f = h f_a f_b + dt_bias, g = -exp(A_log[head]) softplus(f) (Kimi
    Linear's), or with Kimi K3's bound b = kda_gate_bound < 0, g = b sigmoid(exp(A_log
    [head]) f), in (b, 0) (the release's `kda_step`). The state decays by exp(g)."""
    N, Hk = config.linear_value_heads, config.linear_key_dim
    forget = matmul(matmul(h, params["kda_f_a"][i]), params["kda_f_b"][i])
    forget = (forget + params["lin_dt_bias"][i].astype(F32)).reshape(*h.shape[:-1], N, Hk)
    rate = jnp.exp(params["lin_a_log"][i].astype(F32))[:, None]
    return kda_log_decay(rate, forget, config.kda_gate_bound)


def kda_log_decay(rate, forget, bound: float = 0.0):
    """KDA's log-decay of a head's rate exp(A_log) and its channels' forget gate f (with
    dt_bias): -rate softplus(f) (Kimi Linear's; bound 0), or with Kimi K3's bound b < 0,
    b sigmoid(rate f), in (b, 0). `kda_decay` and the kernels' gates
    (`mk.kinds.linear.deltanet.kda_gates_body`) both compute it here."""
    if bound:
        return np.float32(bound) * jax.nn.sigmoid(rate * forget)
    return -rate * jax.nn.softplus(forget)


def kimi_delta_attention(config: ModelConfig, params, i: int, h, conv_state, state):
    """Kimi Delta Attention (KDA) of linear layer i on normed rows h [B, T, D]: the gated
    DeltaNet with a per-channel forget gate (low rank: D -> Hk -> Nv*Hk, `kda_decay`), one
    head count for q, k and v, and a sigmoid output gate: low rank (kda_g_a, kda_g_b:
    Kimi Linear's) or one full-rank projection (kda_g: Kimi K3's). Arguments and results
    as `linear_attention`'s (transformers' KimiLinearDeltaAttention; the release's
    `kda_step`)."""
    B, T, _ = h.shape
    N, Hv = config.linear_value_heads, config.linear_value_dim
    q, k, v, conv_rows = conv_qkv(config, params, i, h, conv_state)
    beta = jax.nn.sigmoid(matmul(h, params["lin_b"][i]))
    o, state_rows = delta_rule(q, k, v, kda_decay(config, params, i, h), beta, state)
    if "kda_g" in params:
        gate = matmul(h, params["kda_g"][i])
    else:
        gate = matmul(matmul(h, params["kda_g_a"][i]), params["kda_g_b"][i])
    o = gated_rms_norm(o, gate.reshape(B, T, N, Hv), params["lin_norm"][i], config.rms_eps,
                       jax.nn.sigmoid)
    return matmul(o.reshape(B, T, -1), params["lin_out"][i]), conv_rows, state_rows
