"""The checks every decode driver runs on its inputs before anything is cast or traced.

The reference's `decode_step` and `generate`, the megakernel's, the tensor-parallel and
speculative drivers and the stage kernels share them: `validate_step` (a step's cache,
tokens and positions), `check_params` (every tensor's name, shape and dtype against
`mk.model.weights.param_shapes`), `check_generate` and `check_prompt` (a greedy run's prompt,
steps and cache capacity), `check_positions` (rows that stay inside the cache),
`checked_int32` (ids and positions checked before the cast, never truncated or wrapped)
and `concrete` (an array's values, or None when traced). A check raises ValueError naming
the field, the value and the limit.

Not here: the cache's own fields and types (`mk.model.cache.check_cache`), the config's checks
(`mk.model.config`, `mk.model.kind_checks`), a kernel's block sizes (`mk.kernels.common`), what a
model computes (`mk.model.reference`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.cache import KVCache, check_cache
from mk.model.config import ModelConfig, positive_int
from mk.model.weights import param_shapes


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


def check_params(config: ModelConfig, params, entry: str = "mk.model.reference", *,
                 quantised: bool = False) -> None:
    """Raise ValueError naming the first parameter whose name, shape or dtype is not what
    `param_shapes(config)` says (a missing or extra tensor, another model's params, a
    quantised weight: `entry`, the caller, takes plain weights unless `quantised`, then
    a `mk.model.quant.QuantWeight`'s logical shape is checked, its dtypes being its scheme's)."""
    want = param_shapes(config)
    if not hasattr(params, "keys"):
        raise ValueError(f"params is a {type(params).__name__}; expected a dict of "
                         f"{config.name}'s tensors {sorted(want)}")
    missing = [name for name in want if name not in params]
    if missing:
        shape, dtype = want[missing[0]]
        raise ValueError(f"params has no {missing[0]!r}, which {config.name} needs "
                         f"({dtype}{list(shape)}); {len(missing)} of its {len(want)} "
                         "tensors are missing")
    for name, (shape, dtype) in want.items():
        got = params[name]
        if hasattr(got, "scheme") and quantised:  # dtypes: its layout's (check_layout)
            if tuple(got.shape) != shape:
                raise ValueError(f"params[{name!r}] is {got.scheme}{list(got.shape)}; "
                                 f"{config.name} needs {list(shape)}")
            continue
        if hasattr(got,
                   "scheme"):  # an mk.model.quant.QuantWeight (mk.model.quant imports this module)
            raise ValueError(f"params[{name!r}] is quantised ({got.scheme}); {entry} takes "
                             f"plain {dtype} weights: pass mk.model.quant.dequantize(params), or "
                             "decode with mk.step.megakernel.generate, which streams quantised "
                             "weights")
        if not (hasattr(got, "shape") and hasattr(got, "dtype")):
            raise ValueError(f"params[{name!r}] is a {type(got).__name__}, not an array; "
                             f"{config.name} needs {dtype}{list(shape)}")
        got_shape, got_dtype = tuple(got.shape), str(got.dtype)
        if got_shape != shape or got_dtype != dtype:
            raise ValueError(f"params[{name!r}] is {got_dtype}{list(got_shape)}; "
                             f"{config.name} needs {dtype}{list(shape)}")
    for name in params:
        if name not in want:
            raise ValueError(f"params has {name!r}, which {config.name} has no place for "
                             f"(its tensors: {sorted(want)}); another model's params?")


def validate_step(config: ModelConfig, cache: KVCache, tokens, positions):
    """Check a decode step's inputs before anything is cast or traced -> (tokens [B, T],
    positions [B]) as int32. Raises ValueError for a cache that does not fit the config, a
    shape that does not fit the cache, a non-integer or out-of-range token id, and rows
    that would read or write outside the cache. The one check of reference, megakernel,
    tensor-parallel and speculative steps."""
    check_cache(config, cache)
    B, S = cache.batch, cache.capacity
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


def check_generate(config: ModelConfig, prompt, steps: int, max_context: int | None, *,
                   gamma: int = 0) -> tuple[jax.Array, int, int]:
    """The arguments every generate driver takes (this one, the megakernel's, the
    tensor-parallel one, speculative decoding's), checked before anything is traced ->
    (prompt [B, P] int32, the cache capacity S, steps as an int). The cache must hold
    P + steps + gamma - 1 positions (the last token is returned, never fed back; a
    speculative step verifies gamma drafted rows past it)."""
    prompt = check_prompt(config, prompt)
    S = config.max_context if max_context is None else positive_int("max_context", max_context)
    steps = positive_int("steps", steps)
    if prompt.shape[1] + steps + gamma - 1 > S:
        drafted = f" + gamma={gamma}" if gamma else ""
        raise ValueError(f"prompt length P={prompt.shape[1]} + steps={steps}{drafted} - 1 "
                         f"exceeds the KV-cache capacity max_context={S}")
    return prompt, S, steps
