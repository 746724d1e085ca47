"""The reference's building blocks: functions of arrays (no config, no parameter dict),
each the oracle of a stage kernel's piece and a piece `mk.model.reference` builds from.

Here: the matmul numerics (`dot`, `matmul`; `exact`, a kernel dot's precision; `Scaled`
and `scaled_dot`, a weight multiplied as codes with its scales on the product),
`rms_norm`, `rope` (`rope_inv_freq`), causal GQA `attention` over a cache and
`write_rows`, `swiglu`, the routers (`route`, `route_grouped`, `route_logits`), the MoE
block (`moe`; `mix_experts` = `combine_experts` of `expert_outputs`; gpt-oss's
`clamped_swiglu`, `mix_biased_experts`, `biased_expert_outputs`), Kimi K3's `situ`,
`gated_mlp` and `attention_residual`. Not here: anything that reads a config or a
parameter dict (`mk.model.reference`), the gated DeltaNet's math (`mk.model.linear_attention`),
kernels (`mk.kernels`).

Numerics (kernels mirror these cast points, so their tolerances stay tight): norms, RoPE,
softmax and routers are float32; every matmul casts its activation input to the weight
dtype and accumulates in float32; attention rounds q and k to the cache dtype, and its
probabilities to it before multiplying V.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def dot(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """einsum of a and b rounded to `dtype`, multiplied and accumulated in float32.

    This is what the MXU does with bf16 inputs (products of bf16 values are exact in f32).
    The upcast is explicit because XLA:CPU has no bf16 x bf16 -> f32 dot. A `Scaled` b
    (an int8 or int4 weight's codes and scales) is multiplied by `scaled_dot`.
    """
    if isinstance(b, Scaled):  # codes and scales: multiplied as the kernel does
        return scaled_dot(spec, a, b, dtype)
    a, b = (t.astype(dtype).astype(F32) for t in (a, b))
    return jnp.einsum(spec, a, b, precision=HIGHEST)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales"],
                   meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Scaled:
    """A weight [..., I, O] as its kernel multiplies it: exact code values and the scales
    of blocks of rows along I (`scaled_dot`), an int8 or int4 weight's reference value
    (`mk.model.unpack.scaled_weight`). `dtype` is what the activations are rounded to (the
    compute dtype), so `dot(..., w, w.dtype)` and `matmul` take it as a weight's dtype."""

    codes: jax.Array  # [..., I, O] int8
    scales: jax.Array  # [..., G, O] float32: rows g * I/G .. (g + 1) * I/G share one
    dtype: jnp.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def __getitem__(self, index) -> Scaled:
        """The weight at a leading-axes index (a layer's row, some experts)."""
        return Scaled(self.codes[index], self.scales[index], self.dtype)

    def astype(self, dtype) -> jax.Array:
        """The weight's values, code x scale in float32, rounded once to `dtype`."""
        G, I = self.scales.shape[-2], self.codes.shape[-2]
        return (self.codes * jnp.repeat(self.scales, I // G, axis=-2)).astype(dtype)


def scaled_dot(spec: str, a: jax.Array, w: Scaled, dtype) -> jax.Array:
    """einsum `spec` of activations `a` (contracted on their last axis) and a `Scaled`
    weight (on its I), as its kernel computes it: `a` rounded to `dtype`, times the exact
    codes, each block of rows sharing a scale summed in float32 and then scaled, the
    blocks' scaled sums summed (`mk.model.unpack.scaled_product`, the kernel's, per tile)."""
    inputs, out = spec.split("->")
    a_spec, w_spec = inputs.split(",")
    c = w_spec[-2]
    if a_spec[-1] != c:
        raise NotImplementedError(f"scaled_dot {spec!r}: contract a's last axis")
    g = next(x for x in "ghjklnpqrsuvwxyz" if x not in spec)  # the block axis
    G, I = w.scales.shape[-2], w.codes.shape[-2]
    a = a.astype(dtype).astype(F32)
    a = a.reshape(*a.shape[:-1], G, I // G)
    codes = w.codes.astype(F32).reshape(*w.codes.shape[:-2], G, I // G, w.codes.shape[-1])
    blocks = jnp.einsum(f"{a_spec[:-1]}{g}{c},{w_spec[:-2]}{g}{c}{w_spec[-1]}->{g}{out}",
                        a, codes, precision=HIGHEST)
    return jnp.einsum(f"{g}{out},{w_spec[:-2]}{g}{w_spec[-1]}->{out}", blocks,
                      w.scales.astype(F32), precision=HIGHEST)


def exact(*operands):
    """The precision of an in-kernel dot of `operands`: HIGHEST when one is float32, else
    the default. Mosaic multiplies float32 at default precision in one bf16 pass of the MXU
    where interpret mode (and `mk.model.ops`) multiply in float32, so the same kernel would
    compute two things (`mk.measure.exactness.default_precision_f32_dots` finds such dots)."""
    return (HIGHEST
            if any(jnp.dtype(x.dtype) == F32 for x in operands) else None)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] with x rounded to w's dtype, accumulated in float32."""
    return dot("...i,io->...o", x, w, w.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0,
             width: int | None = None) -> jax.Array:
    """RMSNorm over the last axis, in float32, scaled by (offset + weight). `width`: the
    count the mean of squares divides by, where the last axis ends in zero lanes (the
    residual stream of a lane-padded model: `ModelConfig.norm_width`); None: all of it."""
    x = x.astype(F32)
    scale = weight.astype(F32) + offset
    squares = jnp.sum(x * x, axis=-1, keepdims=True) / (width or x.shape[-1])
    return x * lax.rsqrt(squares + eps) * scale


def rope_inv_freq(pairs: jax.Array, dims: int, theta: float, yarn=None) -> jax.Array:
    """RoPE's frequency of rotated pair `pairs` (a float32 array of pair indices < dims / 2):
    theta^(-2i / dims), or under YaRN scaling (`yarn`, a `mk.model.config.Yarn`) moved toward
    theta's / factor along transformers' "yarn" ramp of the pair index. The reference
    (`rope`) and the kernels' RoPE (`mk.kinds.attention.attention_prologue.rope_rows`) both call
    it, on an arange and on a lane iota."""
    inv = 1.0 / (theta ** (2 * pairs / dims))
    if yarn is None:
        return inv

    def pair(turns):  # the pair index turning `turns` times over the original context
        return dims * math.log(yarn.original_max_position / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = pair(yarn.beta_fast), pair(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = jnp.clip((pairs - np.float32(low)) / np.float32((high - low) or 0.001), 0, 1)
    return inv / np.float32(yarn.factor) * ramp + inv * (1 - ramp)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         dims: int | None = None, yarn=None) -> jax.Array:
    """Rotate-half RoPE (the Qwen/Llama convention) in float32 on the first `dims` (default
    all) dims of each head; the rest pass through (partial RoPE); frequencies from
    `rope_inv_freq`, cos and sin scaled by YaRN's attention factor (with `yarn`).

    x [..., T, heads, H]; positions [..., T] integer absolute positions.
    """
    if dims is not None and dims < x.shape[-1]:
        rotated = rope(x[..., :dims], positions, theta, yarn=yarn)
        return jnp.concatenate([rotated, x[..., dims:].astype(F32)], axis=-1)
    half = x.shape[-1] // 2
    inv_freq = rope_inv_freq(jnp.arange(half, dtype=F32), 2 * half, theta, yarn)
    scale = 1.0 if yarn is None else yarn.scale
    angles = positions.astype(F32)[..., None] * inv_freq  # [..., T, H/2]
    cos = jnp.cos(angles)[..., None, :] * np.float32(scale)
    sin = jnp.sin(angles)[..., None, :] * np.float32(scale)
    x = x.astype(F32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
              positions: jax.Array, *, window: int = 0, sinks=None) -> jax.Array:
    """Causal GQA of T new rows against a cache that already holds them.

    q [B, T, N, H] float32; k_cache [B, K, S, H], v_cache [B, K, S, Hv]; positions [B]: row t
    of sequence b sits at positions[b] + t and sees cache positions <= that, only its last
    `window` ones when window > 0 (a sliding window, its own position included). sinks [N]
    (gpt-oss): a learned logit per head, one more term of each row's softmax denominator
    that weighs no value. Returns [B, T, N, Hv] float32.
    """
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    scores = dot("btkgh,bksh->bkgts", q, k_cache, k_cache.dtype) / np.float32(np.sqrt(H))
    row_pos = positions[:, None] + jnp.arange(T)  # [B, T]
    cached = jnp.arange(S)[None, None, :]
    visible = cached <= row_pos[:, :, None]  # [B, T, S]
    if window:
        visible &= cached > row_pos[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink as one more logit, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(F32).reshape(1, K, N // K, 1, 1),
                                (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = dot("bkgts,bksh->btkgh", probs, v_cache, v_cache.dtype)
    return out.reshape(B, T, N, -1)  # v's head dim (MLA's differs from q's)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)); x [M, D] -> [M, D] float32."""
    h = jax.nn.silu(matmul(x, gate)) * matmul(x, up)
    return matmul(h, down)


def silu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's activation of the projections gate and up: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def situ(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """Kimi K3's SiTU of the projections gate and up (float32): SiLU with its input
    soft-capped, beta tanh(gate / beta) sigmoid(gate), times up soft-capped,
    linear_beta tanh(up / linear_beta) (the release's `_gated_activation`, beta 4 and
    25)."""
    gate, up = gate.astype(F32), up.astype(F32)
    beta, linear_beta = np.float32(beta), np.float32(linear_beta)
    return (beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
            * linear_beta * jnp.tanh(up / linear_beta))


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
              activation=silu_product) -> jax.Array:
    """down(activation(x @ gate, x @ up)); x [M, D] -> [M, D] float32 (`swiglu` with the
    activation given: SiTU's, `situ`, in Kimi K3)."""
    return matmul(activation(matmul(x, gate), matmul(x, up)), down)


def attention_residual(sources: jax.Array, norm: jax.Array, proj: jax.Array,
                       eps: float) -> jax.Array:
    """Kimi K3's attention residuals: a softmax mix of the residual sources [S, ..., D]
    (the completed blocks' sums, then the current block's) -> [..., D] float32. Source s
    scores (RMSNorm(v_s) * norm) @ proj (proj [D, 1]: a learned query), the sources
    weighted by the softmax of their scores over s, unnormed (the release's
    `attention_residual`, its norm and projection folded there)."""
    values = sources.astype(F32)
    query = norm.astype(F32) * proj.astype(F32)[:, 0]
    scores = jnp.sum(values * query, axis=-1) * lax.rsqrt(
        jnp.mean(values * values, axis=-1) + eps)
    return jnp.einsum("s...,s...d->...d", jax.nn.softmax(scores, axis=0), values,
                      precision=HIGHEST)


def route(x: jax.Array, router: jax.Array, top_k: int, renormalise: bool):
    """Softmax router: x [M, D] -> (weights [M, X] float32, experts [M, X] int32).

    Top-k ties go to the lower expert id (lax.top_k is stable).
    """
    probs = jax.nn.softmax(matmul(x, router), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def moe(x: jax.Array, router, we_gate, we_up, we_down, top_k: int,
        renormalise: bool) -> jax.Array:
    """Qwen3-MoE sparse block; x [M, D] -> [M, D] float32.

    Every expert is evaluated on every row and the unselected ones get weight zero: clear,
    and exact, at the cost of E/X times the FLOPs (fine for an oracle).
    """
    weights, experts = route(x, router, top_k, renormalise)
    return mix_experts(x, weights, experts, we_gate, we_up, we_down)


def route_grouped(x: jax.Array, router, bias, top_k: int, groups: int, topk_groups: int,
                  renormalise: bool, scale: float):
    """DeepSeek-V3 / Kimi's sigmoid router: x [M, D] -> (weights [M, X], experts [M, X]).

    Scores sigmoid(x @ router); the choice adds `bias` [E] to them, keeps the `topk_groups`
    of `groups` expert groups whose two best biased scores sum highest, and takes the top_k
    experts there; the weights are the unbiased scores, renormalised (+1e-20) if asked, then
    times `scale` (transformers' KimiLinearTopkRouter).
    """
    M, E = x.shape[0], router.shape[-1]
    scores = jax.nn.sigmoid(matmul(x, router))
    choice = scores + bias.astype(F32)
    group_scores = lax.top_k(choice.reshape(M, groups, E // groups), 2)[0].sum(-1)
    _, best = lax.top_k(group_scores, topk_groups)
    keep = jnp.zeros((M, groups), bool).at[jnp.arange(M)[:, None], best].set(True)
    choice = jnp.where(jnp.repeat(keep, E // groups, axis=1), choice, -jnp.inf)
    _, experts = lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * np.float32(scale), experts


def mix_experts(x: jax.Array, weights, experts, we_gate, we_up, we_down,
                activation=silu_product) -> jax.Array:
    """sum_j weights[:, j] * expert_{experts[:, j]}(x) for x [M, D] -> [M, D] float32, each
    expert down(activation(x @ gate, x @ up)) (SwiGLU's unless given)."""
    return combine_experts(weights, experts,
                           expert_outputs(x, we_gate, we_up, we_down, activation))


def expert_outputs(x: jax.Array, we_gate, we_up, we_down, activation=silu_product
                   ) -> jax.Array:
    """Every expert's down(activation(x @ gate, x @ up)) of every row: x [M, D], weights
    [E, D, F] / [E, F, D] -> [M, E, D] float32. Each expert's rows are its own batch of the
    dots, so a slice of the experts gives the same bits as the whole (what `mk.model.reference`
    relies on to make a quantised layer's values a slice of experts at a time)."""
    gate = dot("md,edf->mef", x, we_gate, we_gate.dtype)
    up = dot("md,edf->mef", x, we_up, we_up.dtype)
    return dot("mef,efd->med", activation(gate, up), we_down, we_down.dtype)


def combine_experts(weights, experts, outputs) -> jax.Array:
    """The routed sum of the experts' outputs [M, E, D]: weights and experts [M, X] ->
    [M, D] float32."""
    M, E = outputs.shape[:2]
    combine = jnp.zeros((M, E), F32).at[jnp.arange(M)[:, None], experts].add(weights)
    return jnp.einsum("me,med->md", combine, outputs, precision=HIGHEST)


def route_logits(x: jax.Array, router, bias, top_k: int):
    """gpt-oss's router: x [M, D] -> (weights [M, X] float32, experts [M, X] int32), the
    softmax of the top_k of the logits x @ router + bias (ties to the lower expert id)."""
    logits, experts = lax.top_k(matmul(x, router) + bias.astype(F32), top_k)
    return jax.nn.softmax(logits, axis=-1), experts


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation of the projections gate and up (float32): gate clamped
    to <= limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, np.float32(limit))
    up = jnp.clip(up, -np.float32(limit), np.float32(limit))
    return (up + 1) * gate * jax.nn.sigmoid(np.float32(alpha) * gate)


def mix_biased_experts(x: jax.Array, weights, experts, we_gate, we_up, we_down, be_gate,
                       be_up, be_down, limit: float, alpha: float) -> jax.Array:
    """`mix_experts` of gpt-oss's experts: each x @ we_gate + be_gate and x @ we_up + be_up
    through `clamped_swiglu`, then @ we_down + be_down; x [M, D] -> [M, D] float32."""
    return combine_experts(weights, experts, biased_expert_outputs(
        x, we_gate, we_up, we_down, be_gate, be_up, be_down, limit, alpha))


def biased_expert_outputs(x: jax.Array, we_gate, we_up, we_down, be_gate, be_up, be_down,
                          limit: float, alpha: float) -> jax.Array:
    """`expert_outputs` of gpt-oss's biased clamped-SwiGLU experts -> [M, E, D] float32."""
    gate = dot("md,edf->mef", x, we_gate, we_gate.dtype) + be_gate.astype(F32)
    up = dot("md,edf->mef", x, we_up, we_up.dtype) + be_up.astype(F32)
    h = clamped_swiglu(gate, up, limit, alpha)
    return dot("mef,efd->med", h, we_down, we_down.dtype) + be_down.astype(F32)


def write_rows(cache_layer, new, positions):
    """cache_layer [B, K, S, H] <- new [B, T, K, H] at rows positions[b] ..."""
    def one(c, n, p):
        return lax.dynamic_update_slice(c, n.transpose(1, 0, 2).astype(c.dtype), (0, p, 0))
    return jax.vmap(one)(cache_layer, new, positions)
