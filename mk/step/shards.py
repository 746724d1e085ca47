"""How tensor parallelism lays weights and caches out over tp devices, each stacked on a
leading [tp] axis: `shard_params` (full params -> each device's) by each weight's split
rule in `mk.model.weights.SPLITS` (`split_of`, `split_axis`, `split_index`; a tied model's
lm_head: `tied_lm_head`), `shard_cache` and `check_sharded_cache` by each cache field's
rule in `mk.model.cache.FIELDS`, `split_channels` (a linear layer's conv channels, split by
heads). Also here: `check_tp` (the widths tp must split), `kv_heads_of` (which kv heads
each device holds) and `check_quantised_splits` (a quantised weight splits only into
whole packing units and scale blocks; the plan runs it before anything is traced).

Not here: the padding to whole tiles (`mk.step.plan.shard_config`), the sharded step
(`mk.step.tensor_parallel`), reading each device's shards from a checkpoint
(`mk.step.distributed.load_shards`). How quantised weights split exactly:
docs/design/mk.step.shards.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mk.model import quant, unpack
from mk.model.cache import FIELDS, check_cache_type
from mk.model.config import ModelConfig, padded_width
from mk.kernels.collectives import MAX_INDEX, check_devices
from mk.kinds.mlp.latent_moe import latent_columns
from mk.kinds.mlp.routing import router_columns
from mk.kinds.layers import layer_kinds
from mk.model.weights import weights_of


def check_tp(config: ModelConfig, tp: int) -> int:
    """tp as an int after checking every width it splits splits evenly; raises ValueError
    naming the field."""
    check_devices(tp)
    need = dict(heads=config.heads, vocab=config.vocab, hidden=config.hidden)
    for kind in layer_kinds(config):  # the widths each layer kind splits
        need |= kind.split_widths()
    for field, value in need.items():
        if value % tp:
            raise ValueError(f"{config.name}: {field}={value} is not a multiple of tp={tp}")
    K = config.kv_heads
    if K % tp and tp % K:
        raise ValueError(f"{config.name}: kv_heads={K} and tp={tp}: one must divide the "
                         "other (kv heads are split, or replicated on tp/K devices)")
    if tp > 1 and config.vocab > MAX_INDEX:
        raise ValueError(f"{config.name}: vocab={config.vocab} over {MAX_INDEX} (token ids "
                         "travel as float32 in the cross-shard argmax)")
    return int(tp)


def kv_heads_of(config: ModelConfig, tp: int) -> list[list[int]]:
    """[tp][K_local]: the global kv heads each device holds (replicated when tp > K)."""
    K = config.kv_heads
    local, copies = max(K // tp, 1), max(tp // K, 1)
    return [[(i // copies) * local + j for j in range(local)] for i in range(tp)]


def _split_axis(a, axis: int, tp: int):
    """a's `axis` (>= 0) cut into tp equal runs -> [tp, ...], device i's run i (a reshape,
    so a cache field of no layers, [0, ...], is [tp, 0, ...] too)."""
    n = a.shape[axis] // tp
    return jnp.moveaxis(a.reshape(*a.shape[:axis], tp, n, *a.shape[axis + 1:]), axis, 0)


def _columns(w, tp: int, pad: bool = False):
    """[..., C] -> [tp, ..., C/tp]: device i holds columns [i C/tp, (i+1) C/tp); with pad,
    zero columns up to whole 128-lane tiles."""
    out = _split_axis(w, w.ndim - 1, tp)
    extra = padded_width(out.shape[-1]) - out.shape[-1] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, extra)]) if extra else out


def _rows(w, tp: int, pad: bool = False):
    """[..., R, C] -> [tp, ..., R/tp, C]; with pad, zero rows up to whole 128-row tiles."""
    out = _split_axis(w, w.ndim - 2, tp)
    extra = padded_width(out.shape[-2]) - out.shape[-2] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 2) + [(0, extra), (0, 0)]) if extra else out


def _latent_tiles(config: ModelConfig, w, axis: int, tp: int):
    """The latent axis of w (`axis`: -1 or -2) dealt in whole lane tiles, `latent_columns`
    a device in device order, zeros past the latent -> [tp, ...]."""
    held = latent_columns(config.moe_latent, tp)
    axis %= w.ndim
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, tp * held - w.shape[axis])
    return _split_axis(jnp.pad(w, pad), axis, tp)


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


# How each split rule of `mk.model.weights.SPLITS` lays one weight out over tp devices: the axis
# it cuts (-1 columns, -2 rows) and the function doing it.
_SPLIT = {
    "columns": (-1, lambda config, w, tp: _columns(w, tp)),
    "vocab": (-1, lambda config, w, tp: _columns(w, tp)),
    "rows": (-2, lambda config, w, tp: _rows(w, tp)),
    "kv_heads": (-1, _kv_columns),
    "channels": (-1, split_channels),
    "ffn_columns": (-1, lambda config, w, tp: _columns(w, tp, pad=tp > 1)),
    "ffn_rows": (-2, lambda config, w, tp: _rows(w, tp, pad=tp > 1)),
    "experts": (-1, lambda config, w, tp: _columns(w, tp)),  # where `split_of` keeps it
    "latent_columns": (-1, lambda config, w, tp: _latent_tiles(config, w, -1, tp)),
    "latent_rows": (-2, lambda config, w, tp: _latent_tiles(config, w, -2, tp)),
}


def split_of(config: ModelConfig, weight, tp: int) -> str:
    """The split rule `weight` (a `mk.model.weights.Weight`) is cut by at tp: its row's, but
    "whole" for a router the plan keeps whole (`mk.kinds.mlp.routing.router_columns`)."""
    if weight.split == "experts" and router_columns(config, tp) == config.experts:
        return "whole"
    return weight.split


# (rows of I, columns of O) sharing one scale of each scheme (None: all of I, int8's
# per-channel scale): `mk.model.quant`'s layouts.
_SCALE_BLOCK = {"int8": (None, 1), "fp8": (unpack.GROUP["fp8"], unpack.GROUP["fp8"]),
                "int4": (unpack.GROUP["int4"], 1), "fp4": (unpack.GROUP["fp4"], 1)}
_NIBBLES = ("int4", "fp4")  # two codes a byte


def split_axis(split: str) -> int:
    """The axis a split rule of `mk.model.weights.SPLITS` cuts (-1 columns, -2 rows); ValueError
    for "whole" (nothing is cut) or an unknown rule."""
    if split not in _SPLIT:
        raise ValueError(f"split={split!r} cuts no axis; the rules that cut one are "
                         f"{tuple(_SPLIT)}")
    return _SPLIT[split][0]


def split_index(config: ModelConfig, split: str, n: int, tp: int) -> np.ndarray:
    """Which of a weight's `n` rows (columns) along `split`'s axis each device holds:
    int [tp, n_local], -1 where the device holds padding. The split's own function applied
    to the indices, so a quantised weight is cut exactly as its plain one."""
    axis, cut = _SPLIT[split]
    probe = np.arange(1, n + 1, dtype=np.int32).reshape((n, 1) if axis == -2 else (1, n))
    with jax.ensure_compile_time_eval():  # static even inside a trace (mk.measure.tpu's eval_shape)
        held = np.asarray(cut(config, jnp.asarray(probe), tp))
    return held.reshape(tp, -1) - 1


def _scale_sources(name: str, split: str, scheme: str, index: np.ndarray, axis: int,
                   tp: int) -> np.ndarray | None:
    """Each device's scale blocks along `axis` -> the full weight's block each one copies
    (int [tp, n_local / block], -1 for padding only), or None when the scales are not cut
    along `axis` (int8's per-channel scale, rows); raises ValueError where a device's
    share is not whole blocks (scale blocks, or int4/fp4's 128-row packing units) or one
    of its blocks would mix values of two scale blocks of the full weight."""
    block = _SCALE_BLOCK[scheme][axis]
    packed = scheme in _NIBBLES and axis == -2
    unit = math.lcm(block or 1, unpack.PACK_ROWS if packed else 1)
    what = "rows" if axis == -2 else "columns"
    n = index.shape[1]
    if n % unit:
        raise ValueError(f"{name} ({scheme}): its {split} split at tp={tp} gives each "
                         f"device {n} {what}, not a multiple of {unit} ({scheme} "
                         f"{'packs and ' if packed else ''}scales whole blocks of {unit} "
                         f"{what})")
    if block is None:
        return None
    groups = index.reshape(tp, n // block, block)
    source = np.where(groups >= 0, groups // block, -1)
    first = source.max(axis=-1)
    mixed = np.argwhere(((source != first[..., None]) & (source >= 0)).any(-1))
    if len(mixed):
        device, k = map(int, mixed[0])
        held = sorted(set(source[device, k][source[device, k] >= 0].tolist()))
        raise ValueError(f"{name} ({scheme}): its {split} split at tp={tp} cuts a scale "
                         f"block of {block} {what}: device {device}'s local {what} "
                         f"[{k * block}, {(k + 1) * block}) hold values of the full "
                         f"weight's blocks {held}, which have different scales (shard "
                         f"it in plain weights, or choose a tp or a scheme whose blocks "
                         "the split keeps whole)")
    return first


def _codes(q: quant.QuantWeight) -> jax.Array:
    """`q`'s element codes [..., I, O], one per value (int4/fp4 unpacked)."""
    return unpack.unpack_codes(q.scheme, q.data) if q.scheme in _NIBBLES else q.data


def _from_codes(scheme: str, codes, scale) -> quant.QuantWeight:
    data = (unpack.pack_codes(scheme, codes) if scheme in _NIBBLES
            else codes.astype(quant.STORED[scheme][0]))
    return quant.QuantWeight(data, scale, scheme)


def _split_quantised(config: ModelConfig, name: str, split: str, q: quant.QuantWeight,
                     tp: int) -> quant.QuantWeight:
    """A `QuantWeight` cut by `split` as its plain weight would be: each device's element
    codes and scale blocks gathered by `split_index` (padding: `quant.ZERO_CODE` values
    under `quant.UNIT_SCALE` scales), packed again; stacked on a leading [tp] axis.
    `quant.dequantize` of a device's shard equals that device's shard of the dequantised
    weight, exactly."""
    if split == "whole":
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (tp, *a.shape)), q)
    axis = split_axis(split)
    index = split_index(config, split, q.shape[axis], tp)
    sources = _scale_sources(name, split, q.scheme, index, axis, tp)
    codes, shards = _codes(q), []
    for device in range(tp):
        held = index[device]
        kept = jnp.take(codes, jnp.asarray(np.maximum(held, 0)), axis=axis)
        mask = (held >= 0).reshape((-1, 1) if axis == -2 else (-1,))
        kept = jnp.where(mask, kept, jnp.asarray(quant.ZERO_CODE[q.scheme], kept.dtype))
        scale = q.scale
        if sources is not None:
            src = sources[device]
            scale = jnp.take(scale, jnp.asarray(np.maximum(src, 0)), axis=axis)
            smask = (src >= 0).reshape((-1, 1) if axis == -2 else (-1,))
            scale = jnp.where(smask, scale,
                              jnp.asarray(quant.UNIT_SCALE[q.scheme], scale.dtype))
        shards.append(_from_codes(q.scheme, kept, scale))
    return jax.tree.map(lambda *a: jnp.stack(a), *shards)


def check_quantised_splits(config: ModelConfig, formats, tp: int) -> None:
    """Raise ValueError (`_scale_sources`: the weight, its split, tp and the block) if any
    weight of `formats`' groups ({group: mk.model.quant scheme}) would not split into whole
    packed bytes and scale blocks at `tp`; from the config alone, before any tracing."""
    schemes = quant.schemes_of(formats)
    for w in weights_of(config):
        split = split_of(config, w, tp)
        if w.name in schemes and split != "whole" and tp > 1:
            axis = split_axis(split)
            _scale_sources(w.name, split, schemes[w.name],
                           split_index(config, split, w.stacked(config)[axis], tp),
                           axis, tp)


def shard_params(config: ModelConfig, params, tp: int) -> dict:
    """Full params -> per-device params stacked on a leading [tp] axis, in the layout of
    `shard_config(config, tp)` (plus the whole `embed` [V, D], replicated): each weight
    split by its `mk.model.weights` split rule (`split_of`; a `mk.model.quant.QuantWeight` too, its
    codes and scales: `_split_quantised`); a tied model's lm_head is embed.T's vocab
    columns."""
    check_tp(config, tp)
    check_quantised_splits(config, quant.formats_of(params), tp)  # every problem first
    split = {}
    for w in weights_of(config):
        rule = split_of(config, w, tp)
        if isinstance(params.get(w.name), quant.QuantWeight):
            split[w.name] = _split_quantised(config, w.name, rule, params[w.name], tp)
        elif rule != "whole":
            split[w.name] = _SPLIT[rule][1](config, params[w.name], tp)
    if config.tie_embeddings:
        split["lm_head"] = tied_lm_head(config, params["embed"], tp)
    whole = {k: v for k, v in params.items() if k not in split}
    return split | {k: jnp.broadcast_to(v, (tp, *v.shape)) for k, v in whole.items()}


def tied_lm_head(config: ModelConfig, embed, tp: int):
    """A tied model's lm_head shards [tp, D, V/tp]: the vocab columns of embed.T."""
    return _SPLIT["vocab"][1](config, embed.T, tp)


def check_sharded_cache(config: ModelConfig, cache, tp: int) -> None:
    """Refuse a cache that is not `shard_cache`'s layout: each field [tp, ...] of its
    unsharded dims, the split one local (the KV cache [tp, L, B, K_local, S, H])."""
    for name, a in zip(check_cache_type(config, cache)._fields, cache):
        field = FIELDS[name]
        if a.ndim != len(field.dims) + 1 or a.shape[0] != tp:
            dims = [d + "_local" if d == field.split_dim else d for d in field.dims]
            raise ValueError(f"cache shapes {[a.shape for a in cache]} must each be [tp={tp}, "
                             f"...] ({name}: [tp, {', '.join(dims)}]); shard a cache with "
                             "mk.step.shards.shard_cache(config, cache, tp)")


def _take(a, axis: int, index):
    """a's entries index[i] along `axis`, for each device i -> [tp, ...]."""
    return jnp.moveaxis(jnp.take(a, np.asarray(index), axis=axis), axis, 0)


# How each split rule of a cache field (`mk.model.cache.FIELDS`) lays it out over tp devices
# along the field's split axis: as the weights that write it are split.
_CACHE_SPLIT = {
    "whole": lambda config, a, axis, tp: jnp.broadcast_to(a, (tp, *a.shape)),
    "kv_heads": lambda config, a, axis, tp: _take(a, axis, kv_heads_of(config, tp)),
    "columns": lambda config, a, axis, tp: _split_axis(a, axis, tp),
    "channels": lambda config, a, axis, tp: split_channels(config, a, tp),  # C is last
}


def shard_cache(config: ModelConfig, cache, tp: int):
    """A cache of `config` -> each field stacked [tp, ...] by its split rule
    (`mk.model.cache.FIELDS`): K/V [tp, L, B, K_local, S, H] (each device's kv heads), MLA's
    latent whole on every device (every head reads it), the linear states by the heads
    their layer's weights are split by: conv [tp, Ll, B, W-1, C/tp] (`split_channels`),
    state [tp, Ll, B, Nv/tp, Hk, Hv]."""
    check_cache_type(config, cache)

    def shard(name, a):
        field = FIELDS[name]
        return _CACHE_SPLIT[field.split](config, a, field.split_axis, tp)
    return cache._replace(**{name: shard(name, a) for name, a in cache._asdict().items()})
