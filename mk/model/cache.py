"""The decode caches: what a model keeps between steps, described once.

A cache is a NamedTuple of fields; each field is one row of `FIELDS` (its dims, dtype,
layers and tensor-parallel split): k and v [L, B, K, S, H], MLA's latent [L, B, S, R + Hr],
a linear layer's conv [L, B, W-1, C] and state [L, B, Nv, Hk, Hv] float32. A field with S
holds one row per position; a field without S is a state that every row fed advances, so
a step can return the states after each row (`LinearRows`) and a verifier rolls back
(`rollback`). The cache types are `KVCache`, `HybridCache` and `LatentCache`; a model's
(`cache_type`) is the first that serves all of its token mixers.

Here too: `init_cache`, `check_cache` (the one check of a cache against a config),
`state_fields`, `has_states`, `bytes_per_position` and `state_bytes_per_sequence`. Not
here: what a layer does with its fields (`mk.model.reference`, `mk.kinds`), the sharding itself
(`mk.step.shards`). The table of fields and of which kinds each cache type serves:
docs/design/mk.model.cache.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import ModelConfig, positive_int
from mk.model.weights import kind_of

FREE = ("B", "S")  # the dims a cache chooses (batch, capacity); the rest the config fixes


@dataclasses.dataclass(frozen=True)
class Field:
    """One cache field: its row of the table (module docstring)."""

    name: str
    dims: tuple[str, ...]
    dtype: str  # "config": config.dtype; else a dtype name
    layers: str  # the ModelConfig field listing its layers (`mk.model.weights.KIND_LAYERS`)
    split: str  # its tensor-parallel rule (`mk.model.weights.SPLITS`)
    split_dim: str | None = None  # the dim it splits (None when whole)

    @property
    def is_state(self) -> bool:
        """A state (no capacity dim): advanced by every row, rolled back by `rollback`."""
        return "S" not in self.dims

    @property
    def split_axis(self) -> int | None:
        """The axis `split` cuts (None when the field is whole on every device)."""
        return self.dims.index(self.split_dim) if self.split_dim else None

    def sizes(self, config: ModelConfig) -> dict[str, int]:
        """The dims `config` fixes (all but B and S)."""
        return {"L": len(getattr(config, self.layers)), "K": config.kv_heads,
                "H": config.head_dim, "R + Hr": config.latent_width,
                "W-1": max(config.conv_kernel - 1, 0), "C": config.conv_channels,
                "Nv": config.linear_value_heads, "Hk": config.linear_key_dim,
                "Hv": config.linear_value_dim}

    def shape(self, config: ModelConfig, batch: int, capacity: int) -> tuple[int, ...]:
        sizes = self.sizes(config) | {"B": batch, "S": capacity}
        return tuple(sizes[d] for d in self.dims)

    def dtype_of(self, config: ModelConfig) -> str:
        return config.dtype if self.dtype == "config" else self.dtype


FIELDS = {f.name: f for f in (
    Field("k", ("L", "B", "K", "S", "H"), "config", "full_layers", "kv_heads", "K"),
    Field("v", ("L", "B", "K", "S", "H"), "config", "full_layers", "kv_heads", "K"),
    Field("latent", ("L", "B", "S", "R + Hr"), "config", "full_layers", "whole"),
    Field("conv", ("L", "B", "W-1", "C"), "config", "linear_layers", "channels", "C"),
    Field("state", ("L", "B", "Nv", "Hk", "Hv"), "float32", "linear_layers", "columns",
          "Nv"),
)}


def _axis(cache, dim: str) -> int:
    """The size of `dim` in the first of the cache's fields that has it."""
    name = next(n for n in cache._fields if dim in FIELDS[n].dims)
    return getattr(cache, name).shape[FIELDS[name].dims.index(dim)]


def _cache_type(*serves: str):
    """Give a cache NamedTuple its mixer kinds (`serves`) and `batch` / `capacity`."""
    def mark(cls):
        cls.serves = frozenset(serves)
        cls.batch = property(lambda self: _axis(self, "B"), doc="B: sequences held")
        cls.capacity = property(lambda self: _axis(self, "S"),
                                doc="S: positions held per sequence")
        return cls
    return mark


@_cache_type("gqa", "sink_gqa")
class KVCache(NamedTuple):
    k: jax.Array  # [L, B, K, S, H] config.dtype
    v: jax.Array  # [L, B, K, S, H] config.dtype


@_cache_type("gqa", "deltanet")
class HybridCache(NamedTuple):
    k: jax.Array  # [La, B, K, S, H] config.dtype
    v: jax.Array  # [La, B, K, S, H] config.dtype
    conv: jax.Array  # [Ll, B, W-1, C] config.dtype
    state: jax.Array  # [Ll, B, Nv, Hk, Hv] float32


@_cache_type("mla", "kda", "gated_mla", "bounded_kda")
class LatentCache(NamedTuple):
    latent: jax.Array  # [La, B, S, R + Hr] config.dtype
    conv: jax.Array  # [Ll, B, W-1, C] config.dtype
    state: jax.Array  # [Ll, B, Nv, Hk, Hv] float32


CACHE_TYPES = (KVCache, HybridCache, LatentCache)  # the first serving a model's mixers wins


class LinearRows(NamedTuple):
    """The state fields after each of a step's T rows (a row axis after B)."""
    conv: jax.Array  # [Ll, B, T, W-1, C] config.dtype
    state: jax.Array  # [Ll, B, T, Nv, Hk, Hv] float32


def mixers_of(config: ModelConfig) -> frozenset[str]:
    """The token-mixer kinds of `config`'s layers (`mk.model.weights.kind_of` of each layer's
    mixer role)."""
    roles = {config.mixer_index(layer)[0] for layer in range(config.layers)}
    return frozenset(kind_of(config, f"{role}_layers") for role in roles)


def cache_type(config: ModelConfig) -> type:
    """The first of `CACHE_TYPES` serving every token-mixer kind `config` has."""
    mixers = mixers_of(config)
    for kind in CACHE_TYPES:
        if mixers <= kind.serves:
            return kind
    raise NotImplementedError(f"{config.name}: no cache type serves its token mixers "
                              f"{sorted(mixers)} (mk.model.cache.CACHE_TYPES)")


def init_cache(config: ModelConfig, batch: int, max_context: int | None = None, *,
               spare: int = 0):
    """An empty cache of `config`'s type (`cache_type`) of capacity `max_context`
    (default `config.max_context`), plus `spare` rows past it that no real position uses
    (where a padded bucket's extra rows land); states zero."""
    S = config.max_context if max_context is None else max_context
    if not 1 <= S <= config.max_position:
        raise ValueError(f"max_context={S} must be in [1, max_position={config.max_position}]")
    batch, kind = positive_int("batch", batch), cache_type(config)
    return kind(*(jnp.zeros(FIELDS[n].shape(config, batch, S + spare),
                            FIELDS[n].dtype_of(config)) for n in kind._fields))


def check_cache_type(config: ModelConfig, cache) -> type:
    """Raise ValueError unless `cache` is of `config`'s cache type; returns the type."""
    kind = cache_type(config)
    if not isinstance(cache, kind):
        raise ValueError(f"{config.name} needs a {kind.__name__}, got a "
                         f"{type(cache).__name__} (use init_cache)")
    return kind


def check_cache(config: ModelConfig, cache) -> None:
    """Raise ValueError naming the field, its value and the limit unless `cache` is of
    `config`'s type and every field fits its row of `FIELDS`: the dims the config fixes,
    B >= 1 and S >= 1 the same in every field that has them, its dtype."""
    kind, chosen = check_cache_type(config, cache), {}
    for name in kind._fields:
        field, a = FIELDS[name], getattr(cache, name)
        shape, want = tuple(a.shape), field.sizes(config)
        fits = len(shape) == len(field.dims) and all(
            got >= 1 if dim in FREE else got == want[dim]
            for dim, got in zip(field.dims, shape))
        if not fits:
            fixed = ", ".join(f"{d}={want[d]}" + (f" {field.layers}" if d == "L" else "")
                              for d in field.dims if d not in FREE)
            raise ValueError(f"cache {name} [{', '.join(field.dims)}]={shape} does not fit "
                             f"{config.name} ({fixed}, B >= 1, S >= 1)")
        for dim in FREE:
            if dim in field.dims:
                got = shape[field.dims.index(dim)]
                first, value = chosen.setdefault(dim, (name, got))
                if got != value:
                    raise ValueError(f"cache {name} has {dim}={got}; cache {first} has "
                                     f"{dim}={value}: every field must hold the same {dim}")
        dtype = field.dtype_of(config)
        if a.dtype != dtype:
            owner = f"{config.name}'s dtype=" if field.dtype == "config" else ""
            raise ValueError(f"cache dtype {name}={a.dtype} must be {owner}{dtype}")


def state_fields(cache) -> tuple[str, ...]:
    """The names of `cache`'s state fields (`Field.is_state`; none for anything not a
    cache)."""
    return tuple(n for n in getattr(cache, "_fields", ()) if n in FIELDS and FIELDS[n].is_state)


def has_states(cache) -> bool:
    """Whether `cache` carries states of at least one layer (its linear layers'): what a
    step's `LinearRows` hold and `rollback` picks from."""
    return any(getattr(cache, n).shape[0] for n in state_fields(cache))


def rollback(cache, rows: LinearRows, accepted):
    """`cache` with each sequence's states after its first accepted[b] rows of the step
    whose `rows` they are.

    accepted [B] ints in [1, T]. Rows of a field with S need no rollback: rows past the
    accepted prefix are overwritten by the next step and never attended before that.
    """
    accepted = jnp.asarray(accepted, jnp.int32)
    B, T = rows.state.shape[1:3]
    if not isinstance(accepted, jax.core.Tracer):  # inside jit nothing can be checked
        got = np.asarray(accepted)
        if got.shape != (B,) or got.min() < 1 or got.max() > T:
            raise ValueError(f"accepted={got.tolist()} must be [B={B}] counts in "
                             f"[1, T={T}]")
    pick = jax.vmap(lambda a, r: a[:, r - 1], in_axes=(1, 0), out_axes=1)
    return cache._replace(**{name: pick(a, accepted) for name, a in rows._asdict().items()})


def _bytes(config: ModelConfig, states: bool) -> int:
    """Bytes of one sequence's fields of `config`'s cache that are states (`states`), or of
    one position of its fields that are not."""
    total = 0
    for name in cache_type(config)._fields:
        field = FIELDS[name]
        if field.is_state == states:
            total += math.prod(field.shape(config, 1, 1)) * jnp.dtype(
                field.dtype_of(config)).itemsize
    return total


def bytes_per_position(config: ModelConfig) -> int:
    """Bytes one cached position of one sequence takes, all layers: K and V of the full
    layers in the cache dtype (MLA: the latent and the shared rope part, R + Hr values a
    layer)."""
    return _bytes(config, states=False)


def state_bytes_per_sequence(config: ModelConfig) -> int:
    """Bytes of one sequence's states, all linear layers: the conv state [W-1, C] (cache
    dtype) and the recurrent state [Nv, Hk, Hv] (float32). Fixed: they do not grow with
    the context."""
    return _bytes(config, states=True)
