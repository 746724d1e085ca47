"""Unpacking a packed weight tile in VMEM: the element decoders and the MXU feeds.

`mk.model.quant` stores a weight packed; this module is what a kernel does to one streamed tile
of it, pure jnp that lowers for v5e, v6e and tpu7x and runs in TPU interpret mode. Here:
the packing units (`PACK_ROWS`, `GROUP`, `E8M0_BIAS`); the element decoders (`int4_codes`,
`nibble_bytes`, `fp4_words_to_e4m3`, `e2m1_to_e4m3`, `e4m3_values`, `pow2`, `grouped`,
`dequantize_tile`; one code an element: `unpack_codes`, `e2m1_values`; the packings'
inverses `pack_codes`, `pack_nibbles` / `unpack_nibbles`); a tile's products with its
scales on the product (`int_feed_tile`, `fp8_feed_tile`, `scaled_product`, `int_product`,
`fp8_product`); the feeds (`FEEDS`, `FEEDABLE`, `INT_SCHEMES`, `choose_feeds`: what each
packed group reaches the MXU as, per chip); what the reference multiplies to compute what
the kernel does (`scaled_weight`, int8's and int4's codes and scales; `oracle_dtype`).

Packing order: int4's byte row b holds rows 2b (low nibble) and 2b + 1 (high), so its
words viewed as int4 are the rows in order; fp4's byte row 64u + j holds rows 128u + j
and 128u + 64 + j, placed where their e4m3 bytes have the bits. Not here: the layouts,
quantising, checks and byte counts (`mk.model.quant`), the ring that streams the tiles
(`mk.kernels.ring`). Why these decoders and feeds, what each costs in bundles and what
was tried: docs/design/mk.model.unpack.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from mk.model.chips import MXU_FEEDS, ChipSpec
from mk.model.config import SCHEME_BITS
from mk.model.ops import Scaled, exact

PACK_ROWS = 128  # rows of I packed together (low nibbles: first 64, high: last 64)
# Rows of I sharing one scale (int8: all of I; fp8 also 128 columns of O).
GROUP = {"int4": 128, "fp4": 32, "fp8": 128}
E8M0_BIAS = 127
F32 = jnp.float32


def pow2(exponent: jax.Array) -> jax.Array:
    """2.0 ** exponent in float32 for integer exponents in [-126, 127], built by placing
    exponent + 127 in float32's exponent field (a bitcast: exact, no transcendental)."""
    return jax.lax.bitcast_convert_type((exponent.astype(jnp.int32) + 127) << 23, F32)


def e4m3_values(code: jax.Array) -> jax.Array:
    """float8_e4m3fn bit patterns (uint8) -> float32 values; 0x7f and 0xff are NaN. The
    bytes reinterpreted as float8_e4m3fn and converted (exact: every e4m3 value is a
    float32 value), which lowers on v5e, v6e and tpu7x and costs 2.1-2.6x fewer bundles per
    tile than decoding the fields with integer ops (docs/design/mk.model.unpack.md)."""
    return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn
                                        ).astype(F32)


def e2m1_values(code: jax.Array) -> jax.Array:
    """float4_e2m1fn codes (low 4 bits of an integer array) -> float32 values: their e4m3
    patterns (`e2m1_to_e4m3`) decoded (`e4m3_values`) and scaled back by `E2M1_GAIN`, as
    `dequantize_tile` does."""
    return e4m3_values(e2m1_to_e4m3(code)) * E2M1_GAIN


@functools.partial(jax.jit, static_argnames="dtype")
def nibble_bytes(lo: jax.Array, hi: jax.Array, dtype=jnp.uint8) -> jax.Array:
    """Words of bytes [..., R/4, O] (`fp4_words_to_e4m3`'s) -> [..., 2R, O] bytes of
    `dtype` (8-bit) in fp4's row order (docs/design/mk.model.unpack.md): per unit of 64 byte rows,
    the first rows' 64 then the second rows'."""
    lo, hi = pltpu.bitcast(lo, dtype), pltpu.bitcast(hi, dtype)
    *lead, half, cols = lo.shape
    lo = lo.reshape(*lead, half // 64, 64, cols)
    hi = hi.reshape(*lead, half // 64, 64, cols)
    return jnp.concatenate([lo, hi], axis=-2).reshape(*lead, 2 * half, cols)


INT4_FLIP = -0x77777778  # 0x88888888: bit 3 of each nibble (offset binary <-> two's complement)


@jax.jit  # pltpu.bitcast has no eager rule: traced, it runs anywhere
def int4_codes(packed: jax.Array) -> jax.Array:
    """int4 bytes uint8 [..., I/2, O] (byte row b: row 2b's code in the low nibble, row
    2b + 1's in the high, each q + 8) -> q as int4 [..., I, O]: one xor a word of eight
    codes flips each code's bit 3 (offset binary -> two's complement), and the words
    viewed as int4 are the rows in order (`pltpu.bitcast`: nibble k of word r is row
    8r + k). No shift or mask a code: the dot converts int4 natively
    (docs/design/mk.model.unpack.md)."""
    return pltpu.bitcast(pltpu.bitcast(packed, jnp.int32) ^ INT4_FLIP, jnp.int4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., I/2, O] -> int32 codes [..., I, O] in int4's order (row 2b low, 2b + 1
    high), by shifts and masks (no `pltpu.bitcast`: the reference's decoder,
    `scaled_weight`, independent of the kernel's `int4_codes`)."""
    p = jnp.asarray(packed).astype(jnp.int32)
    *lead, half, cols = p.shape
    return jnp.stack([p & 15, p >> 4], axis=-2).reshape(*lead, 2 * half, cols)


@jax.jit
def pack_nibbles(codes: jax.Array) -> jax.Array:
    """int codes in [0, 16) [..., I, O] -> uint8 [..., I/2, O] (row 2b low, 2b + 1 high);
    inverse of unpack_nibbles."""
    c = jnp.asarray(codes).astype(jnp.uint8)
    *lead, rows, cols = c.shape
    c = c.reshape(*lead, rows // 2, 2, cols)
    return c[..., 0, :] | (c[..., 1, :] << 4)


def block_scale_rows(scale: jax.Array) -> jax.Array:
    """fp8's block scales [..., I/128, O/128] -> one row per block of rows [..., I/128, O]:
    each block's scale repeated over its 128 columns (a lane broadcast; a [.., I/128, 128,
    O/128, 128] view of the values instead costs a relayout per tile)."""
    *lead, r, c = scale.shape
    per = GROUP["fp8"]
    return jnp.broadcast_to(scale[..., None], (*lead, r, c, per)).reshape(*lead, r, c * per)


def grouped(values, scale, rows: int):
    """values [..., I, O] * scale [..., I/rows, O] repeated over groups of `rows` along
    I, in float32."""
    *lead, I, O = values.shape
    v = values.reshape(*lead, I // rows, rows, O)
    return (v * scale[..., :, None, :].astype(F32)).reshape(values.shape)


@functools.partial(jax.jit, static_argnames="scheme")
def dequantize_tile(scheme: str, data: jax.Array, scale: jax.Array) -> jax.Array:
    """Float32 values of a weight (or a tile of whole groups of one) in `scheme`'s layout."""
    if scheme == "int8":
        return data.astype(F32) * scale
    if scheme == "fp8":
        return grouped(e4m3_values(data), block_scale_rows(scale), GROUP["fp8"])
    if scheme == "int4":
        return grouped(int4_codes(data).astype(F32), scale, GROUP["int4"])
    if scheme == "fp4":
        e4m3 = nibble_bytes(*fp4_words_to_e4m3(pltpu.bitcast(data, jnp.int32)))
        return grouped(e4m3_values(e4m3) * E2M1_GAIN,
                       pow2(scale.astype(jnp.int32) - E8M0_BIAS), GROUP["fp4"])
    raise ValueError(f"scheme={scheme!r} must be one of {tuple(SCHEME_BITS)}")


def scaled_weight(scheme: str, data: jax.Array, scale: jax.Array, dtype) -> Scaled:
    """An int8 or int4 weight (or stacked weights) as the reference multiplies it: its
    codes and float32 scales (`mk.model.ops.Scaled`, activations rounded to `dtype`), so that
    `mk.model.ops.dot` sums each block's codes x activations in float32 and then scales them, as
    `int_product` does a tile's, where `dequantize_tile`'s values rounded to a bf16 `dtype`
    would round q x scale, which the kernel never does. int4's codes are unpacked by
    shifts and masks (`unpack_nibbles`), not by the kernel's `int4_codes`: the oracle
    shares no decoder with the kernel it judges, and outside a kernel (XLA, on any
    backend) it needs no `pltpu.bitcast`."""
    if scheme == "int8":
        return Scaled(data, scale.astype(F32), jnp.dtype(dtype))
    if scheme == "int4":  # shifts and masks, not the kernel's `int4_codes` (docstring)
        return Scaled((unpack_nibbles(data) - 8).astype(jnp.int8), scale.astype(F32),
                      jnp.dtype(dtype))
    raise ValueError(f"scheme={scheme!r} has no integer feed; {INT_SCHEMES}")


E2M1_GAIN = 64.0  # 2 ** (e4m3's exponent bias 7 - e2m1's 1): `e2m1_to_e4m3`'s factor


def e2m1_to_e4m3(code: jax.Array) -> jax.Array:
    """float4_e2m1fn codes in the low nibble of each byte of an int32 array (one code an
    element, four a word; the high nibbles are ignored) -> in the same bytes, the
    float8_e4m3fn bit patterns of each value / `E2M1_GAIN`, exactly: the code's magnitude
    bits (2 exponent, 1 mantissa) move up two places to the bottom of e4m3's exponent and
    the top of its mantissa, its sign up four. The two formats' exponent biases (1, 7)
    differ by 6, so every normal code lands on the e4m3 of its value / 64, and the
    subnormal 0.5 on e4m3's subnormal 2^-7 (both formats' subnormal mantissas count the
    same halves): no code needs a special case. Five 32-bit ops a word (two masks, two
    shifts, an or): the exact-value decoder it replaced (bias 6 added to the normal
    codes, 0.5 and 0 mapped apart) took fifteen and cost tpu7x 1.6-1.9x the bundles a
    tile (docs/design/mk.model.unpack.md). Fed to the MXU, the small values are e4m3 subnormals, as
    fp8's own small codes are."""
    c = code.astype(jnp.int32)
    return ((c & 0x07070707) << 2) | ((c & 0x08080808) << 4)


def fp4_words_to_e4m3(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed fp4 bytes as int32 words [..., R/4, O] (`pltpu.bitcast`) -> the e4m3 patterns
    (`e2m1_to_e4m3`: value / `E2M1_GAIN`) of their first and second rows' codes (module
    docstring), words of four bytes each, for `nibble_bytes`: the first rows' bits are in
    place (one mask), the second rows' sign and e0 m move up two places and e1 down two
    (the masks drop what a shift brings from the next byte)."""
    return words & FIRST_E4M3, ((words << 2) & SECOND_UP) | ((words >> 2) & 0x10101010)


FIRST_E4M3 = -0x63636364  # 0x9c9c9c9c: bits 7, 4, 3, 2 of each byte (a first row's code)
SECOND_UP = -0x73737374  # 0x8c8c8c8c: bits 7, 3, 2 (a second row's s, e0, m moved up two)


@functools.partial(jax.jit, static_argnames="scheme")
def pack_codes(scheme: str, codes: jax.Array) -> jax.Array:
    """int4 or fp4 codes in [0, 16) [..., I, O] -> uint8 [..., I/2, O] in the module
    docstring's order (fp4: the first row of a byte at its e4m3 bits 7, 4..2; the second's
    s at 5, e1 at 6, e0 m at 1..0); inverse of `unpack_codes`."""
    if scheme == "int4":
        return pack_nibbles(codes)
    if scheme != "fp4":
        raise ValueError(f"scheme={scheme!r}: only int4 and fp4 pack two codes a byte")
    c = jnp.asarray(codes).astype(jnp.uint8)
    *lead, rows, cols = c.shape
    c = c.reshape(*lead, rows // PACK_ROWS, 2, PACK_ROWS // 2, cols)
    first, second = c[..., 0, :, :], c[..., 1, :, :]
    packed = (e2m1_to_e4m3(first).astype(jnp.uint8) | ((second & 8) << 2)
              | ((second & 4) << 4) | (second & 3))
    return packed.reshape(*lead, rows // 2, cols)


def unpack_codes(scheme: str, packed: jax.Array) -> jax.Array:
    """uint8 [..., I/2, O] -> int32 codes [..., I, O] of an int4 or fp4 weight (module
    docstring's order, I/2 a multiple of 64); inverse of `pack_codes`."""
    if scheme == "int4":
        return unpack_nibbles(packed)
    if scheme != "fp4":
        raise ValueError(f"scheme={scheme!r}: only int4 and fp4 pack two codes a byte")
    return nibble_bytes(*_fp4_code_words(packed)).astype(jnp.int32)


@jax.jit  # pltpu.bitcast has no eager rule: traced, it runs anywhere
def _fp4_code_words(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed fp4 bytes -> words of the (first, second) rows' codes, one a byte."""
    w = pltpu.bitcast(packed, jnp.int32)
    first = ((w >> 4) & 0x08080808) | ((w >> 2) & 0x07070707)
    return first, ((w >> 2) & 0x08080808) | ((w >> 4) & 0x04040404) | (w & 0x03030303)


# -- Feeds (mk.model.chips' `mxu_feeds`: TPU7x takes bf16 x float8_e4m3fn) -----------------------
FEEDS = MXU_FEEDS  # what a packed tile is turned into for the MXU (docs/design/mk.model.unpack.md)
# The feeds each scheme (None: a plain weight) reaches exactly: int8 and int4 values are
# not e4m3 values.
FEEDABLE = {None: ("bf16",), "int8": ("bf16",), "int4": ("bf16",), "fp8": FEEDS,
            "fp4": FEEDS}
# Fed bf16, their codes go straight into the dot and the scales onto its product
# (`int_product`): no weight is dequantised on the vector unit.
INT_SCHEMES = ("int8", "int4")


def fp8_feed_tile(scheme: str, data: jax.Array, scale: jax.Array
                  ) -> tuple[jax.Array, jax.Array, float]:
    """A tile of an fp8 or fp4 weight as the MXU's fp8 feed takes it: (its codes as
    float8_e4m3fn [tile_rows, tile_cols], float32 scales [s, tile_cols], a gain), the
    weight being e4m3 x the scale of its row's block of tile_rows / s rows and its column
    x the gain, exactly: fp8's codes as they are with each 128 x 128 block's scale repeated
    over its columns (s = tile_rows / 128), gain 1; fp4's codes turned into the e4m3 of
    value / `E2M1_GAIN` (`e2m1_to_e4m3`) with each 32-row group's power of two (s =
    tile_rows / 32), gain `E2M1_GAIN` (one multiply of the tile's float32 product: powers
    of two, so the product rounds as the unscaled one would)."""
    if scheme == "fp8":
        return (jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn),
                block_scale_rows(scale), 1.0)
    if scheme == "fp4":
        codes = nibble_bytes(*fp4_words_to_e4m3(pltpu.bitcast(data, jnp.int32)),
                             jnp.float8_e4m3fn)
        return codes, pow2(scale.astype(jnp.int32) - E8M0_BIAS), E2M1_GAIN
    raise ValueError(f"scheme={scheme!r} has no fp8 feed; {FEEDABLE}")


def int_feed_tile(scheme: str, data: jax.Array, scale: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """A tile of an int8 or int4 weight as the MXU takes it: (its codes q [tile_rows,
    tile_cols], int8 as stored, int4 as int4 (`int4_codes`); float32 scales [s,
    tile_cols]), the weight being q x the scale of its row's block of tile_rows / s rows
    and its column: int8's one block (s = 1, the column's scale), int4's 128-row groups
    (s = tile_rows / 128). Every code (|q| <= 127) is a bf16 value: the dot converts
    them exactly, and no scale touches a weight."""
    if scheme == "int8":
        return data, scale.astype(F32)
    if scheme == "int4":
        return int4_codes(data), scale.astype(F32)
    raise ValueError(f"scheme={scheme!r} has no integer feed; {FEEDABLE}")


def scaled_product(w: jax.Array, block_scales: jax.Array, xs: jax.Array,
                   gain: float = 1.0) -> jax.Array:
    """xs [M, R] times w [R, O] (codes the MXU takes as they are) whose row block b (R / s
    rows, block_scales [s, O]) is scaled by block_scales[b], float32 [M, O]: the scales
    multiply the float32 product rows, never the weights. A block of at least 128 rows
    gets one product (int8's whole tile, int4's and fp8's 128-row blocks); smaller blocks
    (fp4's 32 rows) share one product per 128 rows, xs's 128 columns masked to each
    block's and stacked along M, so the unit's weights are pushed once and row block k of
    the product is block k's (the masked columns add exact zeros). Then x `gain`."""
    rows, blocks = w.shape[0], block_scales.shape[0]
    per = rows // blocks  # rows sharing a scale
    unit = max(per, GROUP["fp8"])  # rows of one product
    groups, m = unit // per, xs.shape[0]
    group_of_column = jax.lax.broadcasted_iota(jnp.int32, (1, unit), 1) // per
    total = None
    for u in range(rows // unit):
        xu = xs[:, u * unit:(u + 1) * unit]
        stacked = jnp.concatenate([jnp.where(group_of_column == k, xu, 0)
                                   for k in range(groups)]) if groups > 1 else xu
        wu = w[u * unit:(u + 1) * unit]
        if stacked.dtype == jnp.float32:  # a float32 kernel multiplies in float32
            wu = wu.astype(jnp.float32)
        product = jnp.dot(stacked, wu, precision=exact(stacked, wu),
                          preferred_element_type=jnp.float32)
        for k in range(groups):
            b = u * groups + k
            part = product[k * m:(k + 1) * m] * block_scales[b:b + 1]
            total = part if total is None else total + part
    return total if gain == 1.0 else total * gain


def fp8_product(scheme: str, data: jax.Array, scale: jax.Array, xs: jax.Array) -> jax.Array:
    """xs [M, tile_rows] (the compute dtype) times one packed tile fed fp8, float32 [M,
    tile_cols]: its e4m3 codes (`fp8_feed_tile`) in one product per 128 rows, each block of
    rows sharing a scale (fp8 128, fp4 32) scaled by its row of scales and summed in
    float32 (`scaled_product`: fp4's four 32-row groups share one product)."""
    w8, block_scales, gain = fp8_feed_tile(scheme, data, scale)
    return scaled_product(w8, block_scales, xs, gain)


def int_product(scheme: str, data: jax.Array, scale: jax.Array, xs: jax.Array) -> jax.Array:
    """xs [M, tile_rows] (the compute dtype) times one int8 or int4 tile, float32 [M,
    tile_cols]: its codes straight into the dot (`int_feed_tile`) and its scales on the
    product's rows (`scaled_product`: int8 one product scaled per column, int4 one per
    128-row group, each scaled and summed)."""
    return scaled_product(*int_feed_tile(scheme, data, scale), xs)


def choose_feeds(formats: dict[str, str], feeds=None, chip: ChipSpec | None = None
                 ) -> dict[str, str]:
    """{group: feed} of each group of `formats` ({group: scheme}, the packed ones): the
    group's entry of `feeds` if given, else fp8 for fp8 and fp4 where `chip`'s MXU takes
    fp8 (`ChipSpec.mxu_feeds`), else bf16 (without a chip: bf16; any feed may be asked,
    e.g. to run the fp8 path in interpret mode). Raises ValueError for a feed of a group
    not in `formats`, a feed its scheme cannot reach exactly (`FEEDABLE`) or one the chip's
    MXU does not take."""
    feeds = dict(feeds or {})
    for group, feed in feeds.items():
        if group not in formats:
            raise ValueError(f"feeds[{group!r}]={feed!r}: {group} is not stored packed "
                             f"(formats {formats})")
        if feed not in FEEDABLE[formats[group]]:
            raise ValueError(f"feeds[{group!r}]={feed!r}: {formats[group]} weights feed "
                             f"the MXU exactly only as {FEEDABLE[formats[group]]}")
        if chip is not None and feed not in chip.mxu_feeds:
            raise ValueError(f"feeds[{group!r}]={feed!r}: {chip.name}'s MXU takes "
                             f"{chip.mxu_feeds} (mxu_feeds, mk/data/chips.csv); feed "
                             f"{formats[group]} {group} as bf16 there")
    native = () if chip is None else chip.mxu_feeds
    return {group: feeds.get(group, "fp8" if "fp8" in native and "fp8" in FEEDABLE[scheme]
                             else "bf16") for group, scheme in formats.items()}


def oracle_dtype(scheme: str, feed: str, dtype):
    """The dtype a `scheme` weight fed `feed` is dequantised to for the reference to
    multiply by what the kernel does (the one rule, `dequantize`): fed bf16, `dtype` (the
    tile is dequantised to it); fp8 fed fp8, float32 (the kernel multiplies the exact e4m3
    values and scales the float32 product: value x scale is never rounded to `dtype`); fp4
    fed fp8, `dtype` (e2m1 x a power of two is a bf16 value: nothing to round); int8 and
    int4, float32 (their values unrounded; `mk.model.quant.dequantize` gives the reference their
    codes and scales instead, `scaled_weight`, which also rounds the activations)."""
    if feed not in FEEDABLE[scheme]:
        raise ValueError(f"feed={feed!r}: {scheme} feeds as {FEEDABLE[scheme]}")
    return F32 if scheme in INT_SCHEMES or (scheme, feed) == ("fp8", "fp8") else dtype
