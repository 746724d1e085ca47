"""Quantised weight storage: int8, fp8, int4 and fp4 (MXFP4), packed, checked and counted.

Here: the four storage schemes (`SCHEMES`, `STORED`, `SCALES`), `QuantWeight` (checked on
construction: `check_layout`, `check_values`), `quantize` (`check_quantisable`,
`unstreamed`), `dequantize` and `dequantize_weight` (the oracle's weights for `mk.model.reference`),
`check_error`, `accuracy` (against the bf16 model), the bytes (`storage_bytes`,
`group_bytes`, `stored_bytes`, `abstract_weight`, `abstract_params`), the kernel's tile
layout (`tile_shapes`, `tile_bytes`, `tile_major`, `column_block`, `pad_columns`,
`side_by_side`, `ZERO_CODE`, `UNIT_SCALE`), `formats_of` and `schemes_of`.

Not here: what a kernel does to one packed tile, the element decoders, the packing order
and the MXU feeds (`mk.model.unpack`), random weights drawn as codes (`mk.model.random_codes`),
quantised Hugging Face checkpoints (`mk.model.hf_quant`), the ring (`mk.kernels.ring`),
tensor-parallel splits (`mk.step.shards`). Which weights, each layout, what `dequantize` returns
per scheme: docs/design/mk.model.quant.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mk.model import decode_checks, reference
from mk.model.config import DTYPE_BITS, SCHEME_BITS, ModelConfig, check_formats
from mk.model.errors import shown
from mk.model.unpack import (E8M0_BIAS, GROUP, INT_SCHEMES, PACK_ROWS, block_scale_rows,
                       dequantize_tile, grouped, oracle_dtype, pack_codes, pow2,
                       scaled_weight)
from mk.model.weights import FORMAT_GROUP, FORMAT_GROUPS, param_shapes, weights_of
from mk.model.weights import abstract_params as weights_abstract_params

SCHEMES = tuple(SCHEME_BITS)  # each laid out as docs/design/mk.model.quant.md says
FP8_MAX, INT8_MAX, INT4_MAX, FP4_MAX = 448.0, 127, 7, 6.0
F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"],
                   meta_fields=["scheme"])
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """One quantised weight: packed `data` and its `scale`s, in the layout of `scheme`
    (docs/design/mk.model.quant.md)."""

    data: jax.Array
    scale: jax.Array
    scheme: str

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"QuantWeight scheme={shown(self.scheme)} must be one of "
                             f"{SCHEMES}")
        if all(hasattr(a, "dtype") and hasattr(a, "shape") for a in (self.data, self.scale)):
            check_layout(self.scheme, self.data, self.scale)  # not a pytree of specs

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., I, O] shape of the weight."""
        rows = self.data.shape[-2] * (2 if self.scheme in ("int4", "fp4") else 1)
        return (*self.data.shape[:-2], rows, self.data.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def at(self) -> _At:
        """`q.at[index]` of a `QuantWeight` of kernel refs: the weight at leading index
        `index`, as `ref.at[index]` is for a plain weight (a ring's Fetch)."""
        return _At(self)


# Each scheme's stored dtypes (docs/design/mk.model.quant.md): {scheme: (data, scale)}, and its
# scales.
STORED = {"int8": ("int8", "float32"), "fp8": ("uint8", "float32"),
          "int4": ("uint8", "bfloat16"), "fp4": ("uint8", "uint8")}
SCALES = {"int8": "one per output column", "fp8": "one per 128 x 128 block",
          "int4": "one per 128 rows of a column", "fp4": "one per 32 rows of a column"}


def check_layout(scheme: str, data, scale) -> None:
    """Raise ValueError unless `data` and `scale` (arrays, refs or shape-dtype structs:
    anything with .shape and .dtype) are laid out as `scheme` stores them (module
    docstring): their dtypes, the data's rows, and the scales of data [..., R, O]: int8
    [..., 1, O], fp8 [..., R/128, O/128], int4 [..., R/64, O], fp4 [..., R/16, O] (int4 and
    fp4 pack two rows a byte). A tile-major weight (`tile_major`: that per tile) passes."""
    for field, array, want in (("data", data, STORED[scheme][0]),
                               ("scale", scale, STORED[scheme][1])):
        if str(array.dtype) != want:
            raise ValueError(f"QuantWeight({scheme}): {field} dtype {array.dtype} must be "
                             f"{want}")
    shape = tuple(data.shape)
    step = {"int8": 1, "fp8": GROUP["fp8"]}.get(scheme, PACK_ROWS // 2)
    if len(shape) < 2 or shape[-2] % step or (scheme == "fp8" and shape[-1] % GROUP["fp8"]):
        raise ValueError(f"QuantWeight({scheme}): data shape {shape} must be [..., R, O] "
                         f"with R a multiple of {step}"
                         + (f" and O of {GROUP['fp8']}" if scheme == "fp8" else ""))
    *lead, R, O = shape
    block = {"int8": (1, O), "fp8": (R // GROUP["fp8"], O // GROUP["fp8"]),
             "int4": (2 * R // GROUP["int4"], O), "fp4": (2 * R // GROUP["fp4"], O)}[scheme]
    if tuple(scale.shape) != (*lead, *block):
        raise ValueError(f"QuantWeight({scheme}): scale shape {tuple(scale.shape)} must be "
                         f"{(*lead, *block)} for data {shape} ({SCALES[scheme]})")


# The codes a scheme's layout holds that decode to NaN, by (scheme, field); `quantize`
# never writes them (the layouts of docs/design/mk.model.quant.md).
NAN_CODES = {("fp8", "data"): (0x7F, 0xFF), ("fp4", "scale"): (255,)}


def check_values(name: str, q: QuantWeight) -> None:
    """Raise ValueError naming the weight, the field, how many values and the first one's
    index if the concrete arrays of `q` hold a NaN or inf scale (int8, fp8 and int4 store
    float scales) or a code that decodes to NaN (`NAN_CODES`: fp8 data 0x7f / 0xff, fp4's
    e8m0 scale 255): either would spoil a whole group of weights. Arrays with nothing to
    read (tracers, shape structs) pass."""
    for field in ("data", "scale"):
        a = getattr(q, field)
        if isinstance(a, jax.core.Tracer) or not isinstance(a, (np.ndarray, jax.Array)):
            continue
        codes = NAN_CODES.get((q.scheme, field))
        if codes:
            bad, what = jnp.isin(a, jnp.asarray(codes, a.dtype)), "codes " + " / ".join(
                f"{c:#04x}" for c in codes) + " (NaN)"
        elif jnp.issubdtype(a.dtype, jnp.floating):
            bad, what = ~jnp.isfinite(a), "NaN or inf"
        else:
            continue
        count = int(bad.sum())
        if count:
            first = tuple(int(i) for i in np.argwhere(np.asarray(bad))[0])
            raise ValueError(f"{name} ({q.scheme}): {count} of {a.size} {field} values are "
                             f"{what}, the first at {first}; a quantised weight's "
                             f"{field} must decode to finite numbers")


class _At:
    def __init__(self, q: QuantWeight):
        self.q = q

    def __getitem__(self, index) -> QuantWeight:
        return QuantWeight(self.q.data.at[index], self.q.scale.at[index], self.q.scheme)


# -- Quantising ---------------------------------------------------------------------------
def check_shape(name: str, scheme: str, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless a [..., I, O] weight `name` fits `scheme`'s groups."""
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: scheme={scheme!r} must be one of {SCHEMES}")
    I, O = shape[-2:]
    rows = PACK_ROWS if scheme in ("int4", "fp4") else GROUP.get(scheme, 1)
    if I % rows:
        raise ValueError(f"{name}: in dim I={I} must be a multiple of {rows} for {scheme}")
    if scheme == "fp8" and O % GROUP["fp8"]:
        raise ValueError(f"{name}: out dim O={O} must be a multiple of {GROUP['fp8']} "
                         "for fp8 (128x128 blocks)")


def _absmax(w: np.ndarray, rows: int, cols: int = 0) -> np.ndarray:
    *lead, I, O = w.shape
    if cols:
        return np.abs(w.reshape(*lead, I // rows, rows, O // cols, cols)).max(axis=(-3, -1))
    return np.abs(w.reshape(*lead, I // rows, rows, O)).max(axis=-2)


def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)  # all-zero group


def quantize_weight(w, scheme: str, name: str = "weight") -> QuantWeight:
    """One weight [..., I, O] (any float dtype, finite) -> its `QuantWeight` in `scheme`."""
    if isinstance(w, (str, bytes)):  # jnp.asarray would parse "1.5"
        raise ValueError(f"{name}: a weight is an array [..., I, O] of numbers, not a "
                         f"{type(w).__name__}")
    try:
        w = np.asarray(jnp.asarray(w, F32))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: a weight is an array [..., I, O] of numbers; got "
                         f"{type(w).__name__} ({err})") from None
    if w.ndim < 2:
        raise ValueError(f"{name}: shape {w.shape} has no [I, O] matrix (ndim {w.ndim} < 2)")
    check_shape(name, scheme, w.shape)
    bad = w.size - int(np.isfinite(w).sum())
    if bad:  # a scale is its group's absmax: an inf or NaN spoils the group, silently
        raise ValueError(f"{name}: {bad} of {w.size} values are NaN or inf; quantize needs "
                         "finite weights")
    rep = functools.partial(np.repeat, axis=-2)
    if scheme == "int8":
        scale = _safe(np.abs(w).max(axis=-2, keepdims=True) / np.float32(INT8_MAX))
        q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
        return QuantWeight(jnp.asarray(q), jnp.asarray(scale), scheme)
    if scheme == "fp8":
        g = GROUP["fp8"]
        scale = _safe(_absmax(w, g, g) / np.float32(FP8_MAX))
        full = np.repeat(rep(scale, g), g, axis=-1)
        q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return QuantWeight(jnp.asarray(q.view(np.uint8)), jnp.asarray(scale), scheme)
    if scheme == "int4":
        g = GROUP["int4"]
        scale = _safe(_absmax(w, g) / np.float32(INT4_MAX)).astype(jnp.bfloat16)
        q = np.clip(np.rint(w / rep(scale.astype(np.float32), g)), -INT4_MAX, INT4_MAX)
        return QuantWeight(pack_codes(scheme, q.astype(np.int32) + 8), jnp.asarray(scale),
                           scheme)
    g = GROUP["fp4"]  # fp4: the smallest power of two 2^e with absmax / 2^e <= 6
    mant, exp = np.frexp(_absmax(w, g) / np.float32(FP4_MAX))  # x = mant * 2^exp, mant in [.5, 1)
    e = np.where(mant == 0.5, exp - 1, exp)
    code = np.where(mant == 0, E8M0_BIAS, np.clip(e + E8M0_BIAS, 1, 254)).astype(np.uint8)
    step = rep(np.ldexp(np.float32(1), code.astype(np.int32) - E8M0_BIAS), g)
    q = (w / step).astype(jnp.float4_e2m1fn).view(np.uint8) & 15
    return QuantWeight(pack_codes(scheme, q), jnp.asarray(code), scheme)


def unstreamed(config: ModelConfig, names) -> tuple[str, ...]:
    """The weights of `names` (stored quantised) that `config` has and the megakernel does
    not stream as ring tiles (path not "ring": MLA's wq under a q low rank, Kimi K3's, is
    DMA'd whole and multiplied plain), so they cannot be stored packed."""
    return tuple(f"{w.name} ({w.kind}, path {w.path_of(config)!r})" for w in
                 weights_of(config) if w.name in set(names) and w.path_of(config) != "ring")


def check_streamed(config: ModelConfig, names) -> None:
    """Raise NotImplementedError naming the `unstreamed` weights of `names`, if any."""
    if unstreamed(config, names):
        raise NotImplementedError(f"{config.name}: {', '.join(unstreamed(config, names))} "
                                  "would be stored quantised, but the megakernel moves it "
                                  "whole, not as ring tiles it dequantises; keep it plain")


def check_quantisable(config: ModelConfig, formats) -> dict[str, str]:
    """`formats` checked (`mk.model.config.check_formats`) and quantisable here -> {group:
    scheme}: every weight of the chosen groups is streamed through the ring
    (`check_streamed`), so neither `quantize` nor the megakernel's plan takes formats
    that would quantise another (the byte model charges them:
    `mk.step.plan.DecodePlan.make(kernel=False)`). A model's linear-attention weights
    are in no format group: a hybrid's dense, expert and lm_head groups quantise."""
    chosen = check_formats(config, formats)
    check_streamed(config, schemes_of(chosen))
    return chosen


def quantize(config: ModelConfig, params: dict, *, dense: str | None = None,
             experts: str | None = None, lm_head: str | None = None) -> dict:
    """bf16 (or float32) params -> the same dict with each weight of a chosen group
    replaced by a `QuantWeight` in that group's scheme (None: left as it is). A weight of
    another group may be a `QuantWeight` already (kept, its values checked:
    `check_values`); one of a chosen group may not."""
    chosen = check_quantisable(config, dict(dense=dense, experts=experts, lm_head=lm_head))
    # The model's tensors, each of its shape and dtype (a list or None is no weight):
    # named here, not a bare KeyError half-way through or a weight quantised as it came.
    decode_checks.check_params(config, params, "mk.quantize", quantised=True)
    shapes = param_shapes(config)
    for group, scheme in chosen.items():  # every problem before any work
        for name in FORMAT_GROUPS[group]:
            if name in shapes:
                check_shape(name, scheme, shapes[name][0])
    chosen_names = {name for group in chosen for name in FORMAT_GROUPS[group]}
    for name, p in params.items():  # quantised already: kept as it is, if finite
        if isinstance(p, QuantWeight):
            if name in chosen_names:
                raise ValueError(f"params[{name!r}] is quantised already ({p.scheme}); "
                                 "quantize takes plain weights (mk.model.quant.dequantize)")
            check_values(name, p)
    out = dict(params)
    for group, scheme in chosen.items():
        for name in FORMAT_GROUPS[group]:
            if name in shapes:
                out[name] = quantize_weight(params[name], scheme, name)
    return out


def dequantize(params: dict, dtype=None, feeds=None) -> dict:
    """Params holding `QuantWeight`s -> the weights the reference multiplies by to compute
    what the kernel does. Without `dtype`: int8 and int4 weights, whose kernels feed their
    codes to the dot and scale its product, as codes and scales (`mk.model.ops.Scaled`,
    `mk.model.unpack.scaled_weight`: multiplied as the kernel does, activations rounded to the
    embedding's dtype, config.dtype); the others' float32 values rounded once to that dtype
    or, for a group of `feeds` ({group: feed}, a plan's `feeds`), to its `oracle_dtype`
    (fp8 fed fp8: float32; the reference rounds a matmul's activations to its weight's
    dtype, so in a bf16 model it leaves them unrounded where the kernel rounds them: exact
    in a float32 model). With `dtype`: plain arrays, int8's and int4's values too rounded
    once to `dtype` (or their `oracle_dtype`, float32, for a group of `feeds`)."""
    codes = dtype is None  # the reference's int8 and int4 weights: codes and scales
    dtype = dtype or params["embed"].dtype
    into = {name: oracle_dtype(p.scheme, feed, dtype) for name, feed in
            schemes_of(feeds).items() if isinstance(p := params.get(name), QuantWeight)}
    return {name: dequantize_weight(p, dtype, into.get(name, dtype), codes=codes)
            if isinstance(p, QuantWeight) else p for name, p in params.items()}


def dequantize_weight(q: QuantWeight, dtype, into=None, *, codes: bool = True):
    """One weight as `dequantize` gives it: int8 and int4 as codes and scales multiplied
    like the kernel (`scaled_weight`, activations rounded to `dtype`; with codes=False
    their values in `into`), fp8 and fp4 dequantised and rounded to `into` (default
    `dtype`)."""
    into = into or dtype
    if q.scheme in INT_SCHEMES:  # the reference's decoder (`scaled_weight`)
        w = scaled_weight(q.scheme, q.data, q.scale, dtype)
        return w if codes else w.astype(into)
    return dequantize_tile(q.scheme, q.data, q.scale).astype(into)


# -- The kernel's tile layout (docs/design/mk.model.quant.md) ------------------------------------
def tile_shapes(scheme: str, tile_rows: int, tile_cols: int) -> dict[str, tuple]:
    """{"data": (shape, dtype), "scale": (shape, dtype)} of one streamed tile_rows x
    tile_cols tile of a `scheme` weight."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} must be one of {SCHEMES}")
    if tile_rows % PACK_ROWS or tile_cols % GROUP["fp8"]:
        raise ValueError(f"tile {tile_rows} x {tile_cols}: quantised tiles hold whole "
                         f"groups, tile_rows and tile_cols multiples of {PACK_ROWS}")
    data = {"int8": ((tile_rows, tile_cols), "int8"),
            "fp8": ((tile_rows, tile_cols), "uint8"),
            "int4": ((tile_rows // 2, tile_cols), "uint8"),
            "fp4": ((tile_rows // 2, tile_cols), "uint8")}
    scale = {"int8": ((1, tile_cols), "float32"),
             "fp8": ((tile_rows // GROUP["fp8"], tile_cols // GROUP["fp8"]), "float32"),
             "int4": ((tile_rows // GROUP["int4"], tile_cols), "bfloat16"),
             "fp4": ((tile_rows // GROUP["fp4"], tile_cols), "uint8")}
    return {"data": data[scheme], "scale": scale[scheme]}


def tile_bytes(scheme: str, tile_rows: int, tile_cols: int) -> int:
    """Bytes one streamed tile moves: its data and its scale block."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize
               for shape, dtype in tile_shapes(scheme, tile_rows, tile_cols).values())


def tile_major(q: QuantWeight, tile_rows: int, tile_cols: int) -> QuantWeight:
    """`q` in the kernel's layout for tile_rows x tile_cols tiles (docs/design/mk.model.quant.md):
    the data [..., tiles, data rows, tile_cols] and the scales [..., tiles, r, c], tile t the
    ring's t-th (column panel t // (I / tile_rows), row tile t % (I / tile_rows))."""
    *lead, I, O = q.shape
    (r, c), _ = tile_shapes(q.scheme, tile_rows, tile_cols)["scale"]
    if I % tile_rows or O % tile_cols:
        raise ValueError(f"{q.scheme} weight [{I}, {O}] is not a whole number of "
                         f"{tile_rows} x {tile_cols} tiles")
    rows, cols = I // tile_rows, O // tile_cols
    scale = q.scale
    if q.scheme == "int8":  # per channel: each row tile streams its own copy
        scale = jnp.broadcast_to(scale, (*lead, rows, O))
    data = q.data.reshape(*lead, rows, q.data.shape[-2] // rows, cols, tile_cols)
    data = jnp.moveaxis(data, -2, -4).reshape(*lead, rows * cols, -1, tile_cols)
    scale = jnp.moveaxis(scale.reshape(*lead, rows, r, cols, c), -2, -4)
    return QuantWeight(data, scale.reshape(*lead, rows * cols, r, c), q.scheme)


# Each scheme's code of the value zero (int4: offset binary) and its scale of one (fp4:
# e8m0 code 127): what padding holds, so a padded value dequantises to zero.
ZERO_CODE = {"int8": 0, "fp8": 0, "int4": 8, "fp4": 0}
UNIT_SCALE = {"int8": 1, "fp8": 1, "int4": 1, "fp4": E8M0_BIAS}


def column_block(scheme: str | None) -> int:
    """Output columns one scale covers, so the columns a weight is cut, padded or joined
    by are whole blocks of them: fp8's 128 (its 128 x 128 blocks), else 1 (a scale a
    column, or a plain weight: None)."""
    return GROUP["fp8"] if scheme == "fp8" else 1


def pad_columns(q: QuantWeight, columns: int) -> QuantWeight:
    """`q` (mk.model.quant's layout) with `columns` more output columns of value zero
    (`ZERO_CODE`, both codes of a packed byte) and scale one (`UNIT_SCALE`)."""
    data_zero = ZERO_CODE[q.scheme] * (17 if q.scheme == "int4" else 1)
    scale_one, block = UNIT_SCALE[q.scheme], column_block(q.scheme)
    if columns % block:
        raise ValueError(f"columns={columns}: {q.scheme} pads whole {block}-column blocks")
    pad = [(0, 0)] * (q.data.ndim - 1)
    return QuantWeight(jnp.pad(q.data, pad + [(0, columns)], constant_values=data_zero),
                       jnp.pad(q.scale, pad + [(0, columns // block)],
                               constant_values=scale_one), q.scheme)


def side_by_side(parts, used: int, width: int):
    """The first `used` columns of each of `parts` (plain arrays, or `QuantWeight`s of one
    scheme, each [..., I, O]) side by side, then zero columns up to `width` (zero codes
    under unit scales: `pad_columns`): e.g. an expert's gate and up as one matrix. Scale
    blocks stay whole (`used` a multiple of `column_block`: fp8's 128)."""
    if len(parts) * used > width:
        raise ValueError(f"{len(parts)} parts of used={used} columns exceed width={width}")
    if not isinstance(parts[0], QuantWeight):
        joined = jnp.concatenate([p[..., :used] for p in parts], axis=-1)
        pad = [(0, 0)] * (joined.ndim - 1) + [(0, width - joined.shape[-1])]
        return jnp.pad(joined, pad)
    schemes = {p.scheme for p in parts if isinstance(p, QuantWeight)}
    if len(schemes) != 1 or not all(isinstance(p, QuantWeight) for p in parts):
        raise ValueError(f"parts must be QuantWeights of one scheme (got {sorted(schemes)})")
    scheme = schemes.pop()
    block = column_block(scheme)
    if used % block:
        raise ValueError(f"used={used}: {scheme} keeps whole blocks of {block} columns")
    joined = QuantWeight(jnp.concatenate([p.data[..., :used] for p in parts], axis=-1),
                         jnp.concatenate([p.scale[..., :used // block] for p in parts],
                                         axis=-1), scheme)
    return pad_columns(joined, width - len(parts) * used)


def schemes_of(formats) -> dict[str, str]:
    """{group: scheme} -> {weight name: scheme} of every weight of those groups
    (`FORMAT_GROUP`, a joined one of the kernel's layout too): the ring's segments stored
    quantised (any per-group value maps the same way: {group: feed} -> each weight's
    feed)."""
    formats = dict(formats or {})
    return {name: formats[group] for name, group in FORMAT_GROUP.items() if group in formats}


def formats_of(params: dict) -> dict[str, str]:
    """{group: scheme} of the quantised groups of `params` (those holding
    `QuantWeight`s); raises ValueError if one group mixes schemes or plain weights."""
    if not isinstance(params, Mapping):
        raise ValueError(f"params is a {type(params).__name__}; expected a dict of weights "
                         "(mk.init_params, mk.load_checkpoint)")
    formats = {}
    for group, names in FORMAT_GROUPS.items():
        found = {name: p.scheme if isinstance(p, QuantWeight) else None
                 for name, p in params.items() if name in names}
        schemes = set(found.values())
        if len(schemes) > 1:
            raise ValueError(f"{group} weights mix storage formats {found}; the ring "
                             "streams one format per group")
        if schemes - {None}:
            formats[group] = schemes.pop()
    return formats


# -- Checks -------------------------------------------------------------------------------
def error_bound(scheme: str, w: jax.Array, step: jax.Array) -> jax.Array:
    """The largest |w - dequantised w| a correct quantisation leaves, per element, given the
    element's scale `step` (float32, broadcast to w): half an integer step; for fp8 half a
    unit of e4m3's last place (2^-4 relative, 2^-10 * step below the normals); for fp4 a
    quarter of max(|w|, step) (e2m1 has one mantissa bit)."""
    slack = 1 + 2.0 ** -7  # the bf16 rounding of int4's stored scale, and float32 sums
    if scheme in ("int8", "int4"):
        return 0.5 * step * slack
    if scheme == "fp8":
        return (2.0 ** -4 * jnp.abs(w) + 2.0 ** -10 * step) * slack
    return 0.25 * jnp.maximum(jnp.abs(w), step) * slack


@jax.jit
def element_steps(q: QuantWeight) -> jax.Array:
    """Each element's scale (float32, [..., I, O]): the dequantisation of all-ones codes."""
    shape = q.shape
    ones = jnp.ones(shape, F32)
    if q.scheme == "int8":
        return ones * q.scale
    if q.scheme == "fp8":
        return grouped(ones, block_scale_rows(q.scale), GROUP["fp8"])
    scale = (q.scale.astype(F32) if q.scheme == "int4"
             else pow2(q.scale.astype(jnp.int32) - E8M0_BIAS))
    return grouped(ones, scale, GROUP[q.scheme])


@jax.jit
def _excess(w: jax.Array, q: QuantWeight) -> jax.Array:
    """|w - dequantised q| / error_bound, per element."""
    err = jnp.abs(dequantize_tile(q.scheme, q.data, q.scale) - w)
    return err / error_bound(q.scheme, w, element_steps(q))


def check_error(name: str, w, q: QuantWeight) -> None:
    """Raise ValueError if any element of the dequantised `q` is further from the original
    `w` than its scheme's `error_bound` (a wrong scale, code or packing order); the message
    names the weight, the worst element and how many elements are out."""
    w = jnp.asarray(w, F32)
    if tuple(w.shape) != q.shape:
        raise ValueError(f"{name}: original shape {tuple(w.shape)} != quantised {q.shape}")
    excess = np.asarray(_excess(w, q))
    bad = int((~(excess <= 1)).sum())  # NaN counts as out
    if bad:
        where = np.unravel_index(int(np.nanargmax(np.where(np.isnan(excess), np.inf,
                                                            excess))), excess.shape)
        raise ValueError(f"{name} ({q.scheme}): {bad} of {excess.size} elements exceed the "
                         f"quantisation error bound; worst at {tuple(map(int, where))}: "
                         f"{float(excess[where]):.3g} x the bound (a wrong scale?)")


class Accuracy(NamedTuple):
    rel_rms: float  # RMS(logits - bf16 logits) / RMS(bf16 logits), teacher-forced
    agreement: float  # fraction of teacher-forced steps whose argmax is the bf16 model's
    prefix: tuple[int, ...]  # per sequence: free-running tokens equal to the bf16 model's


def accuracy(config: ModelConfig, params: dict, qparams: dict, prompt, steps: int
             ) -> Accuracy:
    """The dequantised `qparams` against `params` over the `steps` greedy tokens the
    `params` model decodes after `prompt` [B, P]: both models read the same tokens (teacher
    forcing, one prefill of P + steps - 1 positions) and are compared at the `steps`
    positions that chose them; then each decodes freely and the common prefix is counted
    (once one token differs the sequences part, so that is not a rate)."""
    prompt = np.asarray(prompt)
    context = prompt.shape[1] + steps
    want = np.asarray(reference.generate(config, params, prompt, steps, max_context=context))
    sequence = np.concatenate([prompt, want[:, :-1]], axis=1)
    chose = slice(prompt.shape[1] - 1, None)

    def logits(p):
        out, _ = reference.prefill(config, p, sequence, max_context=sequence.shape[1])
        return np.asarray(out, np.float64)[:, chose]

    deq = dequantize(qparams)
    base, got = logits(params), logits(deq)
    rel_rms = float(np.sqrt(((got - base) ** 2).mean() / (base ** 2).mean()))
    free = np.asarray(reference.generate(config, deq, prompt, steps, max_context=context))
    prefix = tuple(int(np.argmin(np.append(f == w, False))) for f, w in zip(free, want))
    return Accuracy(rel_rms, float((got.argmax(-1) == base.argmax(-1)).mean()), prefix)


# -- Bytes --------------------------------------------------------------------------------
def abstract_weight(shape: tuple[int, ...], scheme: str) -> QuantWeight:
    """The `QuantWeight` of `jax.ShapeDtypeStruct`s that `quantize_weight` makes of a
    [..., I, O] weight in `scheme` (the layouts of docs/design/mk.model.quant.md): what an
    ahead-of-time compile traces with, and what `storage_bytes` counts."""
    check_shape("weight", scheme, shape)
    *lead, I, O = shape
    data = {"int8": ((I, O), jnp.int8), "fp8": ((I, O), jnp.uint8),
            "int4": ((I // 2, O), jnp.uint8), "fp4": ((I // 2, O), jnp.uint8)}[scheme]
    scale = {"int8": ((1, O), F32), "fp8": ((I // 128, O // 128), F32),
             "int4": ((I // 128, O), jnp.bfloat16), "fp4": ((I // 32, O), jnp.uint8)}[scheme]
    return QuantWeight(*(jax.ShapeDtypeStruct((*lead, *s), d) for s, d in (data, scale)),
                       scheme)


def abstract_params(config: ModelConfig, formats: Mapping[str, str] | None = None) -> dict:
    """`mk.model.weights.abstract_params` with every weight of the groups of `formats`
    ({group: scheme}, checked by whoever chose them) an `abstract_weight`: the params
    `mk.init_params(config, seed, formats)` makes, as shapes to trace or compile with."""
    params = weights_abstract_params(config)
    return params | {name: abstract_weight(params[name].shape, scheme)
                     for group, scheme in dict(formats or {}).items()
                     for name in FORMAT_GROUPS[group] if name in params}


def storage_bytes(shape: tuple[int, ...], scheme: str | None, dtype: str = "bfloat16"
                  ) -> dict[str, int]:
    """{"data": packed bytes, "scales": scale bytes} of one [..., I, O] weight stored in
    `scheme` (None: unquantised `dtype`, no scales)."""
    if scheme is None:
        return {"data": math.prod(shape) * DTYPE_BITS[dtype] // 8, "scales": 0}
    q = abstract_weight(shape, scheme)
    return {part: math.prod(a.shape) * a.dtype.itemsize
            for part, a in (("data", q.data), ("scales", q.scale))}


def group_bytes(config: ModelConfig, formats=None) -> dict[str, dict[str, int]]:
    """Stored bytes of each weight group ("dense", "experts", "lm_head" and "other": the
    embedding, router and norms), {"data": ..., "scales": ...} each, with the groups of
    `formats` ({group: scheme}; default `config.formats`) in their schemes;
    `quantize(config, ..., same schemes)` gives arrays of exactly these sizes."""
    chosen = check_formats(config, config.formats if formats is None else formats)
    group_of = {name: group for group, names in FORMAT_GROUPS.items() for name in names}
    totals = {group: {"data": 0, "scales": 0} for group in (*FORMAT_GROUPS, "other")}
    for name, (shape, dtype) in param_shapes(config).items():
        group = group_of.get(name, "other")
        counted = storage_bytes(shape, chosen.get(group), dtype)
        for part in ("data", "scales"):
            totals[group][part] += counted[part]
    return totals


def stored_bytes(config: ModelConfig, kind: str | None = None) -> int:
    """The bytes `config`'s weights take stored as its `formats` say (FP4: half a byte a
    value plus a byte of scale per 32, `storage_bytes`), the rest in `config.dtype`; of
    every kind or of `kind`'s weights only (`mk.model.weights.WEIGHTS`' kinds)."""
    schemes = schemes_of(config.formats)
    return sum(sum(storage_bytes(w.stacked(config), schemes.get(w.name), config.dtype)
                   .values()) for w in weights_of(config) if kind is None or w.kind == kind)
