"""The gated DeltaNet's math (Qwen3.5's linear attention and Kimi Delta Attention, its
per-channel-decay variant), in float32, for `mk.reference`.

Here: the depthwise causal conv with its state, the gated delta rule with its recurrent
state, and the gated RMSNorm, each returning the state after EVERY row so a speculative
verifier can restart from any accepted prefix. Not here: parameters and projections
(`mk.reference.linear_attention`), kernels (`mk.kernels`). Conventions follow transformers'
`modeling_qwen3_5.py` (`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`,
`Qwen3_5RMSNormGated`); the recurrence is run row by row, exact at any T.

For one value head with state S [Hk, Hv], a row's q, k (L2-normalised, q also / sqrt(Hk)),
v, decay g <= 0 and rate beta in (0, 1):

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   out = q^T S
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

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
