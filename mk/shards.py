"""How tensor parallelism lays weights and caches out over tp devices, each stacked on a
leading [tp] axis: `shard_params` (full params -> each device's) by each weight's split
rule in `mk.weights` (`mk.weights.SPLITS`; `_SPLIT` applies them), `shard_cache` and
`check_sharded_cache` by each cache field's rule in `mk.cache.FIELDS` (`_CACHE_SPLIT`), and
`split_channels` (a linear layer's conv channels, q | k | v, split by heads: its weights'
and its conv state's rule). Which device holds which heads and the padding to whole tiles
are `mk.kernels.plan`'s (`kv_heads_of`, `shard_config`). `mk.megakernel.prepare` calls
`shard_params` for a plan with tp > 1. Not here: the sharded step (`mk.tensor_parallel`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mk import quant
from mk.cache import FIELDS, check_cache_type
from mk.config import ModelConfig
from mk.kernels.common import padded_width
from mk.kernels.plan import check_tp, kv_heads_of
from mk.weights import weights_of


def _columns(w, tp: int, pad: bool = False):
    """[..., C] -> [tp, ..., C/tp]: device i holds columns [i C/tp, (i+1) C/tp); with pad,
    zero columns up to whole 128-lane tiles."""
    out = jnp.moveaxis(w.reshape(*w.shape[:-1], tp, w.shape[-1] // tp), -2, 0)
    extra = padded_width(out.shape[-1]) - out.shape[-1] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, extra)]) if extra else out


def _rows(w, tp: int, pad: bool = False):
    """[..., R, C] -> [tp, ..., R/tp, C]; with pad, zero rows up to whole 128-row tiles."""
    out = jnp.moveaxis(w.reshape(*w.shape[:-2], tp, w.shape[-2] // tp, w.shape[-1]), -3, 0)
    extra = padded_width(out.shape[-2]) - out.shape[-2] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 2) + [(0, extra), (0, 0)]) if extra else out


def _kv_columns(config: ModelConfig, w, tp: int):
    """wk / wv [L, D, K*H] -> [tp, L, D, K_local*H]."""
    heads = w.reshape(*w.shape[:-1], config.kv_heads, config.head_dim)
    picked = heads[..., np.array(kv_heads_of(config, tp)), :]  # [L, D, tp, K_local, H]
    width = picked.shape[-2] * picked.shape[-1]  # not -1: L = 0 in an all-linear hybrid
    return jnp.moveaxis(picked.reshape(*w.shape[:-1], tp, width), -2, 0)


def split_channels(config: ModelConfig, w, tp: int):
    """A gated-DeltaNet layer's conv channels [..., C] (q | k | v: Nk*Hk, Nk*Hk, Nv*Hv)
    -> [tp, ..., C/tp]: device i's q, k and v heads, in the same order."""
    kw = config.linear_key_width
    parts = [_columns(w[..., a:b], tp) for a, b in ((0, kw), (kw, 2 * kw), (2 * kw, None))]
    return jnp.concatenate(parts, axis=-1)


# How each split rule of `mk.weights.SPLITS` lays one weight out over tp devices.
_SPLIT = {
    "columns": lambda config, w, tp: _columns(w, tp),
    "vocab": lambda config, w, tp: _columns(w, tp),
    "rows": lambda config, w, tp: _rows(w, tp),
    "kv_heads": _kv_columns,
    "channels": split_channels,
    "ffn_columns": lambda config, w, tp: _columns(w, tp, pad=tp > 1),
    "ffn_rows": lambda config, w, tp: _rows(w, tp, pad=tp > 1),
}


def shard_params(config: ModelConfig, params, tp: int) -> dict:
    """Full params -> per-device params stacked on a leading [tp] axis, in the layout of
    `shard_config(config, tp)` (plus the whole `embed` [V, D], replicated): each weight
    split by its `mk.weights` split rule; a tied model's lm_head is embed.T's vocab
    columns."""
    check_tp(config, tp)
    if quant.formats_of(params):
        raise ValueError(f"params hold quantised weights {quant.formats_of(params)}; "
                         "mk.shards.shard_params splits plain weights (quantised "
                         "tensor parallelism: not yet): pass mk.quant.dequantize(params)")
    split = {w.name: _SPLIT[w.split](config, params[w.name], tp)
             for w in weights_of(config) if w.split != "whole"}
    if config.tie_embeddings:
        split["lm_head"] = _SPLIT["vocab"](config, params["embed"].T, tp)
    whole = {k: v for k, v in params.items() if k not in split}
    return split | {k: jnp.broadcast_to(v, (tp, *v.shape)) for k, v in whole.items()}


def check_sharded_cache(config: ModelConfig, cache, tp: int) -> None:
    """Refuse a cache that is not `shard_cache`'s layout: each field [tp, ...] of its
    unsharded dims, the split one local (the KV cache [tp, L, B, K_local, S, H])."""
    for name, a in zip(check_cache_type(config, cache)._fields, cache):
        field = FIELDS[name]
        if a.ndim != len(field.dims) + 1 or a.shape[0] != tp:
            dims = [d + "_local" if d == field.split_dim else d for d in field.dims]
            raise ValueError(f"cache shapes {[a.shape for a in cache]} must each be [tp={tp}, "
                             f"...] ({name}: [tp, {', '.join(dims)}]); shard a cache with "
                             "mk.shards.shard_cache(config, cache, tp)")


def _take(a, axis: int, index):
    """a's entries index[i] along `axis`, for each device i -> [tp, ...]."""
    return jnp.moveaxis(jnp.take(a, np.asarray(index), axis=axis), axis, 0)


# How each split rule of a cache field (`mk.cache.FIELDS`) lays it out over tp devices
# along the field's split axis: as the weights that write it are split.
_CACHE_SPLIT = {
    "whole": lambda config, a, axis, tp: jnp.broadcast_to(a, (tp, *a.shape)),
    "kv_heads": lambda config, a, axis, tp: _take(a, axis, kv_heads_of(config, tp)),
    "columns": lambda config, a, axis, tp: _take(
        a, axis, np.arange(a.shape[axis]).reshape(tp, a.shape[axis] // tp)),
    "channels": lambda config, a, axis, tp: split_channels(config, a, tp),  # C is last
}


def shard_cache(config: ModelConfig, cache, tp: int):
    """A cache of `config` -> each field stacked [tp, ...] by its split rule
    (`mk.cache.FIELDS`): K/V [tp, L, B, K_local, S, H] (each device's kv heads), MLA's
    latent whole on every device (every head reads it), the linear states by the heads
    their layer's weights are split by: conv [tp, Ll, B, W-1, C/tp] (`split_channels`),
    state [tp, Ll, B, Nv/tp, Hk, Hv]."""
    check_cache_type(config, cache)

    def shard(name, a):
        field = FIELDS[name]
        return _CACHE_SPLIT[field.split](config, a, field.split_axis, tp)
    return cache._replace(**{name: shard(name, a) for name, a in cache._asdict().items()})
