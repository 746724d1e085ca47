"""Unpacking a packed weight tile in VMEM: the element decoders and the MXU feeds.

`mk.quant` stores a weight packed (its layouts, the packing units `PACK_ROWS` and the scale
groups `GROUP`, `E8M0_BIAS` are here because the decoders read them); this module is what a
kernel does to one streamed tile of it, pure jnp that lowers for v5e, v6e and tpu7x and runs
in TPU interpret mode: the element decoders (`int4_codes`, `nibble_bytes`,
`fp4_words_to_e4m3`, `e2m1_to_e4m3`, `e4m3_values`, `pow2`, `grouped`, `dequantize_tile`;
`unpack_codes` and `e2m1_values`, the same decoders one code an element; `pack_codes`, the
packing's inverse; `pack_nibbles` / `unpack_nibbles`, int4's), the products of a tile with
its scales on the product (`int_feed_tile`, `fp8_feed_tile`, `scaled_product`,
`int_product`, `fp8_product`) and the feeds (`FEEDS`, `FEEDABLE`, `INT_SCHEMES`,
`choose_feeds`: what each packed group reaches the MXU as, per chip; `oracle_dtype`: the
dtype the reference's weights are dequantised to so it multiplies what the kernel does).
Not here: the layouts, quantising, checks and byte counts (`mk.quant`), the ring that
streams the tiles and calls these (`mk.kernels.ring`).

Packing order. int4: byte row b holds row 2b's code in its low nibble and row 2b + 1's in
its high (`pack_nibbles`), each q + 8 (offset binary), so a word of four bytes is eight
rows in order: one xor a word makes the codes two's complement and the words viewed as
int4 are the tile's codes (`int4_codes`), which the dot converts natively (tpu7x unpacks
them to e4m3, `vunpack.c.l.s4`, and pushes `vmatpush1.f8e4m3`; v5e through int32 and
float32). It was packed in fp4's order below and decoded byte-wise to int8 (a nibble
split, a sign extension: nine 32-bit ops a word); tpu7x, M 8, stream_matmul's loop fed the
codes: 820 -> 536 bundles per Mi weights. fp4: rows of I are packed in units of 128; byte
row 64u + j holds row 128u + j and row 128u + 64 + j. Unpacking a tile of 64n byte rows
is then shifts and masks, a concatenation of two aligned [64, O] halves per unit, and no
lane shuffle; the interleaved order (gpt-oss packs rows 2k and 2k + 1 into one byte) would
need a sublane interleave where no native type decodes it (float4_e2m1fn lowers on tpu7x
only, below). fp4 places the first row's code (sign s, exponent e1 e0, mantissa m) where
its e4m3 byte has them (bits 7, 4..2: `e2m1_to_e4m3`), and the second row's in the bits left
(s at 5, e1 at 6, e0 m at 1..0: `pack_codes`), so the MXU's fp8 codes are one mask of a word
for the first rows and two shifts for the others (`fp4_words_to_e4m3`: six 32-bit ops a word
of four bytes, where two nibbles took nine; stage-01 kernel's loop on tpu7x, 512 x 512 tiles
fed fp8, M 8: 208 -> 183 bundles). `mk.hf_quant` repacks gpt-oss MXFP4 bytes into this
order at load: a permutation of bits, bit-exact.

Why uint8 with shifts. Measured with libtpu ahead-of-time compiles of a one-tile
dequantise-and-matmul pallas_call (tests/test_quant.py keeps one per scheme per chip):
the uint8 decoders below lower for v5e, v6e and tpu7x, with bf16 or float32 output, and
run unchanged in TPU interpret mode on CPU. Native element types do not all lower: a
float4_e2m1fn ref fails on v5e and v6e ("Unsupported type vector<...xf4E2M1FN>", Mosaic's
unpack_subelements) and compiles only for tpu7x; int4 and float8_e4m3fn refs compile on all
three (and interpret). Plain bytes (uint8; int8 for int8) for all four schemes also make the
bytes in HBM the bytes of the documented layout (a sub-byte array's packing is the
compiler's choice). Packed bytes are worked on four at a time: `pltpu.bitcast` views a
tile's uint8 [R, O] as int32 words [R/4, O] and back (free on all three chips), and fp4's
nibble split and e2m1 -> e4m3 are byte-wise integer ops that never carry
into the next byte (SWAR): one 32-bit op handles four codes, where widening each byte to
int32 first costs a 32-bit op a code. 16-bit integer vectors do not help: uint8 -> int16
lowers, but int16 shifts do not ("failed to legalize arith.shli", all three chips). fp4 is
then decoded through e4m3 (`e4m3_values`: the bytes bitcast to float8_e4m3fn and
converted to float32, which lowers on all three chips and cost 2.1-2.6x fewer bundles per
tile than the integer decoder of fp8 it replaced): its bits placed in an e4m3 byte
(`e2m1_to_e4m3`, `fp4_words_to_e4m3`) read value / 64, and the 64 (`E2M1_GAIN`) comes back
as one float32 multiply, a value fed bf16, a tile's product fed fp8. int4 is decoded
natively (`int4_codes`) and int8 directly, each converted to float32 (`dequantize_tile`:
the reference's weights; in the ring int8 and int4 are never dequantised, below). Every decoder
computes value x scale in float32 and rounds once, bit-identical to the int32 decoders
they replaced (every code, every fp4 scale code). Bundles per Mi weights (stream_matmul's
steady per-tile loop, 2048 x 128 packed tiles, M 8, libtpu 0.0.42.1; the int32 decoders ->
these): tpu7x fp4 fed bf16 6016 -> 2192, fed fp8 3964 -> 2224 (1852 with the ring's
stacked products, below), int4 1876 -> 1716, int8 1244 -> 1244; v6e fp4 6016 -> 3724, int4
1876 -> 1684. Then fp4's exact-value e4m3 (bias 6 added to the normal codes, 0.5 and 0
mapped apart: fifteen 32-bit ops a nibble of a word after a three-op split, 33 a word,
where the placement takes nine for both nibbles), 512 x 512 tiles, M 1 / 8 / 64 / 256 ->
the placement: tpu7x fed fp8 1468 / 1680 / 3264 / 9328 -> 600 / 884 / 2888 / 9044, fed
bf16 2232 / 2200 / 2360 / 2956 -> 1688 / 1644 / 1804 / 2376; v6e fed bf16 3776 / 3680 /
3976 / 4736 -> 3236 / 3128 / 3460 / 4280 (measured then; mk/data/tile_feed_costs.json
holds today's, every chip and M). Folding the 64 into a fed-bf16 group's scale instead of
each value would save 8-15% more (tpu7x 1644 -> 1396, v6e 3128 -> 2876 at M 8) but
overflows float32 for scale codes above 248: not taken.
What is left is the float work per value: int8's 1244 is one unpack, one int -> float
convert and one multiply a value, the loop's VALU slots full (why int8 and int4 now feed
their codes, below). fp8's block scales reach
the values as one row of scales per 128 rows (`block_scale_rows`, a lane broadcast): the
[.., 128, O/128, 128] view of the values it replaced cost a relayout per tile (fp8 fed
bf16 at M 8: v6e 21280 -> 2576, tpu7x 20012 -> 1148 bundles per Mi weights; bit-identical).

Feeds: what a packed tile becomes for the MXU, chosen per chip from what its MXU takes
beside bf16 activations (`mk.chips.ChipSpec.mxu_feeds`; `choose_feeds`, carried by the plan
and its stream's segments). "bf16": fp8 and fp4 tiles dequantised (`dequantize_tile`) in
float32 and rounded once to the compute dtype (every chip); int8 and int4 tiles are never
dequantised: their codes go straight into the dot beside the activations (`int_product`;
every code is a bf16 value, so the dot's conversion is exact) and their scales multiply
the float32 product, int8's per column on the tile's product, int4's per 128-row group on
that group's product, the groups' summed in float32 (`scaled_product`). So int8 and int4
compute x @ (q x s) with q x s never rounded to the compute dtype, and their oracle
multiplies the same way: `mk.quant.dequantize` gives the reference their codes and scales
(`scaled_weight`, an `mk.ops.Scaled`), which `mk.ops.scaled_dot` multiplies by the
activations rounded to the compute dtype, each block of rows summed in float32, then
scaled: kernel and reference differ by float32 summation order only, in a bf16 model as
in a float32 one (the weights in float32, `oracle_dtype`, would leave a bf16 model's
activations unrounded, as fp8 fed fp8 still does). Bundles per Mi weights (stream_matmul's steady per-tile loop, 512 x 512
tiles, M 8, libtpu 0.0.42.1), dequantised -> codes into the dot (int4 byte-wise to int8)
-> int4 natively: tpu7x int8 1128 -> 536, int4 1548 -> 820 -> 536; v5e int8 1228 -> 896,
int4 1604 -> 1220 -> 932 (mk/data/tile_feed_costs.json holds every chip and M). Tried and
not taken: int8 codes converted to bf16 by hand before the dot (tpu7x the same, v5e 896
-> 984); int4's groups as one block-diagonal product a tile (x masked to each group's 128
columns, stacked along M): tpu7x 816 at M 8 but 1380 at M 64 against 1124, v5e 1448
against 1220. "fp8" (fp8 and fp4; TPU7x multiplies bf16 by
float8_e4m3fn): `fp8_feed_tile` hands the MXU e4m3 codes, fp8's as stored (a bitcast of the
uint8 bytes, which lowers for tpu7x and v6e and runs in interpret mode) and fp4's turned
into the e4m3 codes of the same values (`e2m1_to_e4m3`: integer ops, exact), with a float32
scale row per block of rows sharing a scale (fp8 128 rows, its block's scale over each 128
columns; fp4 32 rows, each column's power of two) that multiplies the block's float32
product (`mk.kernels.ring.Ring`). bf16 x e4m3 products are exact in float32, so the fp8
feed computes x_bf16 @ (e4m3 x scale) without rounding the weight: its oracle is the weight
dequantised to float32 for fp8 and to the compute dtype for fp4 (e2m1 x a power of two is a
bf16 value), `oracle_dtype`. int8 and int4 are fed bf16 (their values are not e4m3 values;
the MXUs' int8 paths want int8 activations too). Measured on tpu7x (stream_matmul's
per-tile loop, libtpu 0.0.42.1, 1024 x 256 tiles, bundles per Mi weights at M 1 / 8, with
the int32 decoders: fp8 fed bf16 5952 / 5912, fed fp8 696 / 664 (`vmatpush1.f8e4m3`);
plain bf16 1296 / 1268). fp4's scales cannot move onto the activations (a 32-column group
of x times a power of two per output column is not separable), nor be folded into the e4m3
exponents exactly (a group's shift can leave e4m3's range; measured slower too, 4400 /
4344 with the int32 decoders). So each 32-row group gets its own product rows, but not its
own product: the ring stacks x masked to each group's 32 columns along M, one [4M, 128] x
[128, 128] product per 128 rows (the masked columns add exact zeros: bit-identical to four
32-row products, checked on CPU). At 2048 x 128 tiles (the probe's before the panel rule,
`mk.kernels.common.PANEL_COLS`), M 1 / 8 / 64 / 256:
fp4 fed fp8 3952 / 3964 / 4932 / 9964 with the int32 decoders and 32-row products, 2244 /
2224 / 3368 / 9560 byte-wise, 1964 / 1852 / 3480 / 10000 stacked (half the MXU bundles at
M 8; a little dearer from M 64, where 4M rows outweigh the pushes saved).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from mk.chips import MXU_FEEDS, ChipSpec
from mk.config import SCHEME_BITS
from mk.ops import Scaled, exact

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
    tile than decoding the fields with integer ops (module docstring)."""
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
    `dtype` (8-bit) in fp4's row order (module docstring): per unit of 64 byte rows, the
    first rows' 64 then the second rows'."""
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
    8r + k). No shift or mask a code: the dot converts int4 natively (module docstring)."""
    return pltpu.bitcast(pltpu.bitcast(packed, jnp.int32) ^ INT4_FLIP, jnp.int4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., I/2, O] -> int32 codes [..., I, O] in int4's order (row 2b low, 2b + 1
    high), by shifts and masks (no `pltpu.bitcast`: the tests' independent decoder)."""
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
    codes and float32 scales (`mk.ops.Scaled`, activations rounded to `dtype`), so that
    `mk.ops.dot` sums each block's codes x activations in float32 and then scales them, as
    `int_product` does a tile's, where `dequantize_tile`'s values rounded to a bf16 `dtype`
    would round q x scale, which the kernel never does."""
    if scheme == "int8":
        return Scaled(data, scale.astype(F32), jnp.dtype(dtype))
    if scheme == "int4":
        return Scaled(int4_codes(data).astype(jnp.int8), scale.astype(F32), jnp.dtype(dtype))
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
    tile (module docstring). Fed to the MXU, the small values are e4m3 subnormals, as
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


# -- Feeds (mk.chips' `mxu_feeds`: TPU7x takes bf16 x float8_e4m3fn) -----------------------
FEEDS = MXU_FEEDS  # what a packed tile is turned into for the MXU (module docstring)
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
    int4, float32 (their values unrounded; `mk.quant.dequantize` gives the reference their
    codes and scales instead, `scaled_weight`, which also rounds the activations)."""
    if feed not in FEEDABLE[scheme]:
        raise ValueError(f"feed={feed!r}: {scheme} feeds as {FEEDABLE[scheme]}")
    return F32 if scheme in INT_SCHEMES or (scheme, feed) == ("fp8", "fp8") else dtype
