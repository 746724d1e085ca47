"""The pure-JAX reference decoder: the oracle every kernel is checked against.

Here: the Qwen3 / Qwen3-MoE forward pass (RMSNorm, GQA with QK-norm, RoPE, SwiGLU, a softmax
top-k router with optional renormalisation, tied or untied lm_head) as `prefill`,
`decode_step` and greedy `generate`, plus the small pieces kernels reuse as their own
oracles (`rms_norm`, `rope`, `attention_inputs`, `attention`, `swiglu`, `moe`, `greedy`).
No Pallas, no sharding, no sampling (speculative decoding lives in `mk.spec`).

Numerics (kernels mirror these cast points, so their tolerances stay tight):
- the residual stream, norms, RoPE, softmax and router are float32;
- every matmul casts its activation input to the weight dtype and accumulates in float32;
- the KV cache is stored in `config.dtype`; attention probabilities are cast to it
  before multiplying V.

KV cache: `KVCache(k, v)`, each [L, B, K, S, H] with capacity S = `max_context`. A decode
step writes its T new rows at `positions[b] .. positions[b] + T - 1` and attends causally;
a row at or past S is an error, never a silent wrap (XLA would clamp the write).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.config import ModelConfig, positive_int

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, K, S, H] config.dtype
    v: jax.Array  # [L, B, K, S, H] config.dtype


# -- Building blocks (each is also the oracle of a stage kernel) ---------------------------
def dot(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """einsum of a and b rounded to `dtype`, multiplied and accumulated in float32.

    This is what the MXU does with bf16 inputs (products of bf16 values are exact in f32).
    The upcast is explicit because XLA:CPU has no bf16 x bf16 -> f32 dot.
    """
    a, b = (t.astype(dtype).astype(F32) for t in (a, b))
    return jnp.einsum(spec, a, b, precision=HIGHEST)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] with x rounded to w's dtype, accumulated in float32."""
    return dot("...i,io->...o", x, w, w.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in float32."""
    x = x.astype(F32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(F32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE (the Qwen/Llama convention) in float32.

    x [..., T, heads, H]; positions [..., T] integer absolute positions.
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, 2 * half, 2, dtype=F32) / (2 * half)))
    angles = positions.astype(F32)[..., None] * inv_freq  # [..., T, H/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x = x.astype(F32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
              positions: jax.Array) -> jax.Array:
    """Causal GQA of T new rows against a cache that already holds them.

    q [B, T, N, H] float32; k_cache, v_cache [B, K, S, H]; positions [B]: row t of
    sequence b sits at positions[b] + t and sees cache positions <= that.
    Returns [B, T, N, H] float32.
    """
    B, T, N, H = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    scores = dot("btkgh,bksh->bkgts", q, k_cache, k_cache.dtype) / np.float32(np.sqrt(H))
    row_pos = positions[:, None] + jnp.arange(T)  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= row_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = dot("bkgts,bksh->btkgh", probs, v_cache, v_cache.dtype)
    return out.reshape(B, T, N, H)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)); x [M, D] -> [M, D] float32."""
    h = jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up)
    return matmul(h, w_down)


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
    combine = jnp.zeros((x.shape[0], router.shape[-1]), F32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)  # [M, E]
    gate = dot("md,edf->mef", x, we_gate, we_gate.dtype)
    up = dot("md,edf->mef", x, we_up, we_up.dtype)
    out = dot("mef,efd->med", jax.nn.silu(gate) * up, we_down, we_down.dtype)
    return jnp.einsum("me,med->md", combine, out, precision=HIGHEST)


def greedy(logits: jax.Array) -> jax.Array:
    """Argmax over the vocab axis; ties go to the lowest token id.

    NaN contract (numpy's argmax, which every kernel's argmax follows): a NaN logit counts
    as larger than any number, so a row holding NaN gives the lowest id whose logit is NaN
    (0 when the whole row is NaN). Never an id outside [0, vocab)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def lm_head(config: ModelConfig, params, x: jax.Array) -> jax.Array:
    """Final norm and vocab projection: x [..., D] -> logits [..., V] float32."""
    h = rms_norm(x, params["final_norm"], config.rms_eps)
    w = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return matmul(h, w)


# -- One layer and one step ----------------------------------------------------------------
def _write_rows(cache_layer, new, positions):
    """cache_layer [B, K, S, H] <- new [B, T, K, H] at rows positions[b] ..."""
    def one(c, n, p):
        return lax.dynamic_update_slice(c, n.transpose(1, 0, 2).astype(c.dtype), (0, p, 0))
    return jax.vmap(one)(cache_layer, new, positions)


def attention_inputs(config: ModelConfig, params, layer: int, x, positions):
    """The attention prologue: x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H] float32,
    q and k QK-normed and RoPE'd at positions[b] + t."""
    B, T, _ = x.shape
    N, K, H, eps = config.heads, config.kv_heads, config.head_dim, config.rms_eps
    h = rms_norm(x, params["attn_norm"][layer], eps)
    q = matmul(h, params["wq"][layer]).reshape(B, T, N, H)
    k = matmul(h, params["wk"][layer]).reshape(B, T, K, H)
    v = matmul(h, params["wv"][layer]).reshape(B, T, K, H)
    if config.qk_norm:
        q = rms_norm(q, params["q_norm"][layer], eps)
        k = rms_norm(k, params["k_norm"][layer], eps)
    row_pos = positions[:, None] + jnp.arange(T)
    return rope(q, row_pos, config.rope_theta), rope(k, row_pos, config.rope_theta), v


def decoder_layer(config: ModelConfig, params, layer: int, x, k_cache, v_cache, positions):
    """One decoder layer (the stage-05 oracle); x [B, T, D] float32, caches [B, K, S, H]
    of this layer. Returns (x, k_cache, v_cache, x_after_attn)."""
    B, T, _ = x.shape
    eps = config.rms_eps
    q, k, v = attention_inputs(config, params, layer, x, positions)
    k_cache = _write_rows(k_cache, k, positions)
    v_cache = _write_rows(v_cache, v, positions)
    o = attention(q, k_cache, v_cache, positions).reshape(B, T, -1)
    x = x + matmul(o, params["wo"][layer])
    x_attn = x

    h = rms_norm(x, params["mlp_norm"][layer], eps).reshape(B * T, -1)
    kind, i = config.mlp_index(layer)
    if kind == "dense":
        y = swiglu(h, params["w_gate"][i], params["w_up"][i], params["w_down"][i])
    else:
        y = moe(h, params["router"][i], params["we_gate"][i], params["we_up"][i],
                params["we_down"][i], config.experts_per_token, config.norm_topk)
    return x + y.reshape(B, T, -1), k_cache, v_cache, x_attn


@functools.partial(jax.jit, static_argnames=("config", "taps"))
def _forward(config: ModelConfig, params, cache: KVCache, tokens, positions, taps=False):
    x = params["embed"][tokens].astype(F32)  # [B, T, D]
    ks, vs, after_attn, after_mlp = [], [], [], []
    for layer in range(config.layers):
        x, k, v, x_attn = decoder_layer(config, params, layer, x, cache.k[layer], cache.v[layer],
                                 positions)
        ks.append(k)
        vs.append(v)
        after_attn.append(x_attn)
        after_mlp.append(x)
    logits = lm_head(config, params, x)
    cache = KVCache(jnp.stack(ks), jnp.stack(vs))
    if taps:
        return logits, cache, {"attn": jnp.stack(after_attn), "mlp": jnp.stack(after_mlp)}
    return logits, cache


# -- Public API -----------------------------------------------------------------------------
def init_cache(config: ModelConfig, batch: int, max_context: int | None = None, *,
               spare: int = 0) -> KVCache:
    """An empty cache of capacity `max_context` (default `config.max_context`), plus `spare`
    rows past it that no real position uses (where a padded bucket's extra rows land)."""
    S = config.max_context if max_context is None else max_context
    if not 1 <= S <= config.max_position:
        raise ValueError(f"max_context={S} must be in [1, max_position={config.max_position}]")
    batch = positive_int("batch", batch)
    shape = (config.layers, batch, config.kv_heads, S + spare, config.head_dim)
    return KVCache(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))


def concrete(x):
    """x as a numpy array, or None when it is traced (inside jit nothing can be checked)."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def checked_int32(field: str, x, low: int, high: int, limit: str = "") -> jax.Array:
    """x as int32, after checking ITS OWN values (before any cast) are integers in
    [low, high) (`limit` names high): a float, a bool or an id past int32 is refused,
    never truncated or wrapped (int64 2**32 + 2 would become 2, position 3.9 would become
    3). Traced x (inside jit) is only checked for an integer dtype; callers validate
    before tracing."""
    if isinstance(x, jax.core.Tracer):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{field} has dtype {x.dtype}; it must be an integer type")
        return x.astype(jnp.int32)
    try:
        a = np.asarray(x)
    except (OverflowError, TypeError, ValueError) as err:
        raise ValueError(f"{field} is not an array of integers ({err})") from None
    if a.dtype.kind not in "iu":
        raise ValueError(f"{field} has dtype {a.dtype}; it must be an integer type (a float "
                         "or bool is never rounded to an id or a position)")
    if a.size:
        bad = np.argwhere((a < low) | (a >= high))
        if len(bad):
            where = ", ".join(map(str, bad[0]))
            raise ValueError(f"{field}[{where}]={a[tuple(bad[0])]} must be in [{low}, "
                             f"{limit + '=' if limit else ''}{high}) ({len(bad)} value"
                             f"{'s' * (len(bad) > 1)} outside; min={a.min()}, max={a.max()})")
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x  # already on the device as int32: no second copy (no extra launch)
    return jnp.asarray(a.astype(np.int32))


def check_params(config: ModelConfig, params) -> None:
    """Raise ValueError naming the first parameter whose name, shape or dtype is not what
    `config.param_shapes()` says (a missing or extra tensor, another model's params)."""
    want = config.param_shapes()
    if not hasattr(params, "keys"):
        raise ValueError(f"params is a {type(params).__name__}; expected a dict of "
                         f"{config.name}'s tensors {sorted(want)}")
    for name, (shape, dtype) in want.items():
        if name not in params:
            raise ValueError(f"params has no {name!r}, which {config.name} needs "
                             f"({dtype}{list(shape)})")
        got = params[name]
        got_shape, got_dtype = tuple(getattr(got, "shape", ())), str(getattr(got, "dtype", ""))
        if got_shape != shape or got_dtype != dtype:
            raise ValueError(f"params[{name!r}] is {got_dtype}{list(got_shape)}; "
                             f"{config.name} needs {dtype}{list(shape)}")
    for name in params:
        if name not in want:
            raise ValueError(f"params has {name!r}, which {config.name} has no place for "
                             f"(its tensors: {sorted(want)}); another model's params?")


def check_cache(config: ModelConfig, cache) -> None:
    """Raise ValueError if `cache` is not a KVCache of two equal [L, B, K, S, H] arrays of
    config.dtype fitting `config`."""
    k, v = cache
    if k.ndim != 5 or k.shape != v.shape:
        raise ValueError(f"cache k {k.shape} and v {v.shape} must both be [L, B, K, S, H]")
    L, B, K, S, H = k.shape
    if (L, K, H) != (config.layers, config.kv_heads, config.head_dim) or B < 1 or S < 1:
        raise ValueError(f"cache [L, B, K, S, H]={k.shape} does not fit {config.name} "
                         f"(L={config.layers}, K={config.kv_heads}, H={config.head_dim}, "
                         "B >= 1, S >= 1)")
    if k.dtype != config.dtype or v.dtype != config.dtype:
        raise ValueError(f"cache dtype k={k.dtype}, v={v.dtype} must be "
                         f"{config.name}'s dtype={config.dtype}")


def validate_step(config: ModelConfig, cache: KVCache, tokens, positions):
    """Check a decode step's inputs before anything is cast or traced -> (tokens [B, T],
    positions [B]) as int32. Raises ValueError for a cache that does not fit the config, a
    shape that does not fit the cache, a non-integer or out-of-range token id, and rows
    that would read or write outside the cache. The one check of reference, megakernel,
    tensor-parallel and speculative steps."""
    check_cache(config, cache)
    _, B, _, S, _ = cache.k.shape
    shape = np.shape(tokens)
    if len(shape) != 2 or shape[0] != B or shape[1] < 1:
        raise ValueError(f"tokens shape {shape} must be [B={B}, T >= 1]")
    if np.shape(positions) != (B,):
        raise ValueError(f"positions shape {np.shape(positions)} must be [B={B}]")
    tokens = checked_int32("tokens", tokens, 0, config.vocab, "vocab")
    positions = checked_int32("positions", positions, 0, S, "max_context")
    check_positions(positions, shape[1], S)
    return tokens, positions


def check_positions(positions, rows: int, capacity: int) -> None:
    """Raise ValueError if T=`rows` rows from any positions[b] leave [0, capacity).

    Traced positions (inside jit) cannot be checked; callers validate before tracing.
    """
    pos = concrete(positions)
    if pos is None:
        return
    for b, p in enumerate(pos):
        if p < 0 or p + rows > capacity:
            raise ValueError(f"positions[{b}]={p} with T={rows} rows writes up to position "
                             f"{p + rows - 1}, past the KV-cache capacity "
                             f"max_context={capacity}")


def check_prompt(config: ModelConfig, prompt) -> jax.Array:
    """A prompt [B, P] of token ids, checked before any cast (`checked_int32`) -> int32."""
    shape = np.shape(prompt)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"prompt shape {shape} must be [B, P] with B >= 1 and P >= 1")
    return checked_int32("prompt", prompt, 0, config.vocab, "vocab")


def decode_step(config: ModelConfig, params, cache: KVCache, tokens, positions, *,
                taps: bool = False):
    """T new tokens per sequence -> (logits [B, T, V] float32, updated cache).

    tokens [B, T] int; positions [B]: where each sequence's first new row goes. With
    `taps=True` also returns {"attn", "mlp"}: the residual stream [L, B, T, D] after each
    layer's attention and MLP blocks (for finding the first diverging op).
    """
    tokens, positions = validate_step(config, cache, tokens, positions)
    check_params(config, params)
    return _forward(config, params, cache, tokens, positions, taps=taps)


def prefill(config: ModelConfig, params, tokens, *, max_context: int | None = None):
    """The prompt tokens [B, P] -> (logits [B, P, V] float32, cache holding P positions)."""
    shape = np.shape(tokens)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"prompt shape {shape} must be [B, P] with B >= 1 and P >= 1")
    cache = init_cache(config, shape[0], max_context)
    return decode_step(config, params, cache, tokens, jnp.zeros(shape[0], jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "steps"))
def _greedy_loop(config: ModelConfig, params, cache: KVCache, first, start, steps: int):
    def step(carry, _):
        cache, token, pos = carry
        logits, cache = _forward(config, params, cache, token[:, None], pos)
        nxt = greedy(logits[:, -1])
        return (cache, nxt, pos + 1), nxt

    _, rest = lax.scan(step, (cache, first, start), None, length=steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(config: ModelConfig, params, prompt, steps: int, *,
             max_context: int | None = None) -> jax.Array:
    """Greedy decoding: prompt [B, P] -> the next `steps` tokens [B, steps] int32."""
    prompt = check_prompt(config, prompt)
    S = config.max_context if max_context is None else max_context
    steps = positive_int("steps", steps)
    # The last generated token is returned, never fed back, so it needs no cache row.
    if prompt.shape[1] + steps - 1 > S:
        raise ValueError(f"prompt length P={prompt.shape[1]} + steps={steps} - 1 exceeds "
                         f"the KV-cache capacity max_context={S}")
    logits, cache = prefill(config, params, prompt, max_context=S)
    first = greedy(logits[:, -1])
    start = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    return _greedy_loop(config, params, cache, first, start, steps)
