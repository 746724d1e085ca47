"""Quantised weight storage: int8, fp8, int4 and fp4 (MXFP4), packed, checked and counted.

Here: the four storage schemes (`SCHEMES`), each laid out exactly as below (a
`QuantWeight` checks its layout on construction: `check_layout`; its values where they
are concrete, NaN or inf scales and NaN codes: `check_values`); `quantize` (finite bf16
params -> a params dict whose quantised weights are `QuantWeight`s), `dequantize` (back
to plain arrays: the oracle's weights, fed to the unchanged `mk.reference`, in the dtype
each group's MXU feed calls for: `oracle_dtype`), the element decoders a kernel calls on
one streamed tile (`nibble_words` / `nibble_bytes`, `int4_values`, `e2m1_to_e4m3`,
`e4m3_values`, `dequantize_tile`, `fp8_feed_tile`; `unpack_nibbles` and `e2m1_values`, the
same decoders one code an element), the feeds (`FEEDS`, `FEEDABLE`,
`choose_feeds`: each packed group's, per chip), `check_error` (every group's error
against its scale's bound), `accuracy` (a quantised model's logits and greedy tokens
against the bf16 model's) and `storage_bytes` / `group_bytes` / `stored_bytes` (packed
bytes plus scales; a model's own `formats` by default), `check_quantisable` / `unstreamed`, the
kernel's tile layout (`tile_shapes`, `tile_bytes`, `tile_major`, `pad_columns`, `ZERO_CODE`,
`UNIT_SCALE`),
`formats_of` (the scheme of each group of a params dict) and `schemes_of` (the scheme of
each weight name). Not here: reading quantised Hugging Face checkpoints (`mk.checkpoint`),
the ring that streams packed tiles (`mk.kernels.ring`), splitting them for tensor
parallelism (`mk.shards`).

Which weights. The three format groups of `mk.weights.FORMAT_GROUPS` ("dense": attention's
projections and the dense and shared-expert SwiGLUs; "experts"; "lm_head", an untied model
only), each with one scheme or None (stays `config.dtype`): a `formats` dict, the one
precision knob (`mk.config.check_formats`; a `ModelConfig`'s own `formats` are its
default, e.g. kimi-k3's FP4 experts). The embedding (B*T rows
gathered per step), the router (small, and its top-k flips on a small error), norms and
biases stay in `config.dtype`, and so do the linear-attention kinds' weights (in no group),
so a hybrid's groups quantise as any model's; a group holding a weight the megakernel
moves whole (not as ring tiles) is refused (`check_streamed`).

Layouts. A weight is [..., I, O] (mk's [in, out], leading stacked axes; I is the
contraction axis). Every scheme groups values along I so a tile of whole groups along I
carries its own scales; dequantisation computes value * scale in float32, then rounds once
to the requested dtype.

    int8  data  int8  [..., I, O]        q in [-127, 127], w = q * scale
          scale f32   [..., 1, O]        per output channel: absmax over I / 127
    fp8   data  uint8 [..., I, O]        float8_e4m3fn bit patterns (1 sign, 4 exponent
                                         bias 7, 3 mantissa; 0x7f/0xff are NaN, max 448)
          scale f32   [..., I/128, O/128]  one per 128x128 block: absmax / 448. This is
                                         Hugging Face "fine-grained FP8" (`weight` [O, I]
                                         float8_e4m3fn + `weight_scale_inv` [O/128, I/128]
                                         float32, w = weight * weight_scale_inv),
                                         transposed to mk's [in, out].
    int4  data  uint8 [..., I/2, O]      two 4-bit codes per byte, code = q + 8 with q in
                                         [-7, 7] (offset binary)
          scale bf16  [..., I/128, O]    group of 128 along I: absmax / 7, rounded to bf16
                                         before q is computed (so |w - q*scale| <= scale/2)
    fp4   data  uint8 [..., I/2, O]      two float4_e2m1fn codes per byte (1 sign, 2
                                         exponent bias 1, 1 mantissa: 0 .5 1 1.5 2 3 4 6)
          scale uint8 [..., I/32, O]     e8m0 per 32 values along I: 2^(code - 127), the
                                         smallest power of two with absmax / scale <= 6
                                         (codes 0 and 255 unused; 255 is NaN in OCP MX)

The kernel's layout (`tile_major`, made once by `mk.megakernel.prepare` for its tiling
tile_rows x tile_cols): the data and the scales regrouped by tile, in the ring's order
(column panel by column panel): tile t's data at [..., t, :, :] of a [..., tiles, data
rows, tile_cols] array and its scales at [..., t, :, :] of [..., tiles, r, c], (r, c) =
`tile_shapes`'s scale block. Each is then one contiguous DMA; slicing
fp8's [.., I/128, O/128] scales by tile is a lane slice of tile_cols/128 values, which
Mosaic refuses ("dynamic offset ... not a multiple of the memory space word size", measured
on v5e, v6e and tpu7x), and int4's one-row scale slices of 128-row tiles are refused too.
int8's per-channel [1, O] row is repeated once per row tile (every tile streams its own
scales): 4 / tile_rows bytes per weight byte more in HBM and on the wire, 0.8 % at
tile_rows 512.
`tile_bytes` is what one streamed tile moves (data plus scale block): the byte count of
the plan, `mk.perf` and the kernel's DMAs.

Nibble order (int4 and fp4): rows of I are packed in units of 128; byte row 64u + j holds
row 128u + j in its low nibble and row 128u + 64 + j in its high nibble. Unpacking a tile
of 64n byte rows is then two shifts/masks, a concatenation of two aligned [64, O] halves
per unit, and no lane shuffle; an interleaved order (gpt-oss packs rows 2k and 2k + 1 into
one byte) would need a sublane interleave. `mk.checkpoint` repacks gpt-oss MXFP4 bytes into
this order at load: a permutation of nibbles, bit-exact.

Why uint8 with shifts. Measured with libtpu ahead-of-time compiles of a one-tile
dequantise-and-matmul pallas_call (tests/test_quant.py keeps one per scheme per chip):
the uint8 decoders below lower for v5e, v6e and tpu7x, with bf16 or float32 output, and
run unchanged in TPU interpret mode on CPU. Native element types do not all lower: a
float4_e2m1fn ref fails on v5e and v6e ("Unsupported type vector<...xf4E2M1FN>", Mosaic's
unpack_subelements) and compiles only for tpu7x; int4 and float8_e4m3fn refs compile on all
three (and interpret). Plain bytes (uint8; int8 for int8) for all four schemes also make the
bytes in HBM the bytes of the documented layout (a sub-byte array's packing is the
compiler's choice). Packed bytes are worked on four at a time: `pltpu.bitcast` views a
tile's uint8 [R, O] as int32 words [R/4, O] and back (free on all three chips), and the
nibble split, int4's offset and e2m1 -> e4m3 are byte-wise integer ops that never carry
into the next byte (SWAR): one 32-bit op handles four codes, where widening each byte to
int32 first costs a 32-bit op a code. 16-bit integer vectors do not help: uint8 -> int16
lowers, but int16 shifts do not ("failed to legalize arith.shli", all three chips). fp4 is
then decoded as the e4m3 it equals (`e4m3_values`: the bytes bitcast to float8_e4m3fn and
converted to float32, which lowers on all three chips and cost 2.1-2.6x fewer bundles per
tile than the integer decoder of fp8 it replaced), int4 as int8 bytes converted to
float32, int8 converted to float32 directly. Every decoder computes value x scale in
float32 and rounds once, bit-identical to the int32 decoders they replaced (every code,
every fp4 scale code). Bundles per Mi weights (stream_matmul's steady per-tile loop, 2048
x 128 packed tiles, M 8, libtpu 0.0.42.1; the int32 decoders -> these): tpu7x fp4 fed
bf16 6016 -> 2192, fed fp8 3964 -> 2224 (1852 with the ring's stacked products, below),
int4 1876 -> 1716, int8 1244 -> 1244; v6e fp4 6016 -> 3724, int4 1876 -> 1684
(mk/data/tile_feed_costs.json: the bf16 feed's rows for every chip and M).
What is left is the float work per value: int8's 1244 is one unpack, one int -> float
convert and one multiply a value, the loop's VALU slots full.

Feeds: what a packed tile becomes for the MXU, chosen per chip from what its MXU takes
beside bf16 activations (`mk.chips.ChipSpec.mxu_feeds`; `choose_feeds`, carried by the plan
and its stream's segments). "bf16": `dequantize_tile` in float32, rounded once to the
compute dtype (every scheme, every chip). "fp8" (fp8 and fp4; TPU7x multiplies bf16 by
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
32-row products, checked on CPU). At the probe's 2048 x 128 tiles, M 1 / 8 / 64 / 256:
fp4 fed fp8 3952 / 3964 / 4932 / 9964 with the int32 decoders and 32-row products, 2244 /
2224 / 3368 / 9560 byte-wise, 1964 / 1852 / 3480 / 10000 stacked (half the MXU bundles at
M 8; a little dearer from M 64, where 4M rows outweigh the pushes saved).

Accuracy against bf16 (tests/test_quant.py, every group quantised, a transformers-written
tiny Qwen3-MoE, 2 x 64 teacher-forced steps; random weights, so flatter logits than a
trained model's): relative RMS of logits int8 0.020, fp8 0.072, int4 0.24, fp4 0.23; argmax
agreement 0.98, 0.91, 0.73, 0.71.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from mk import reference
from mk.chips import MXU_FEEDS, ChipSpec
from mk.config import DTYPE_BITS, SCHEME_BITS, ModelConfig, check_formats
from mk.errors import shown
from mk.weights import FORMAT_GROUPS, param_shapes, weights_of

SCHEMES = tuple(SCHEME_BITS)  # each laid out as the module docstring says
PACK_ROWS = 128  # rows of I packed together (low nibbles: first 64, high: last 64)
# Rows of I sharing one scale (int8: all of I; fp8 also 128 columns of O).
GROUP = {"int4": 128, "fp4": 32, "fp8": 128}
FP8_MAX, INT8_MAX, INT4_MAX, FP4_MAX = 448.0, 127, 7, 6.0
E8M0_BIAS = 127
F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"],
                   meta_fields=["scheme"])
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """One quantised weight: packed `data` and its `scale`s, in the layout of `scheme`
    (module docstring)."""

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


# Each scheme's stored dtypes (module docstring): {scheme: (data, scale)}, and its scales.
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
# never writes them (module docstring's layouts).
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


# -- Element decoders (pure jnp; a kernel applies them to one tile in VMEM) ----------------
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
    patterns (`e2m1_to_e4m3`) decoded (`e4m3_values`), as `dequantize_tile` does."""
    return e4m3_values(e2m1_to_e4m3(code))


ONES = 0x01010101  # bit 0 of each byte of an int32 word
NIBBLES = 0x0F0F0F0F  # the low nibble of each byte


@jax.jit  # pltpu.bitcast has no eager rule: traced, it runs anywhere
def nibble_words(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 [..., R, O] (R a multiple of 4) -> its (low, high) nibbles as int32 words
    [..., R/4, O], each byte of a word one code in [0, 16): byte k of word r is row 4r + k
    (`pltpu.bitcast`'s order, `nibble_bytes` undoes it). Two 32-bit ops a nibble of four
    bytes, and no widening of each byte to 32 bits."""
    words = pltpu.bitcast(packed, jnp.int32)
    return words & NIBBLES, (words >> 4) & NIBBLES  # the mask drops the shifted-in bits


@functools.partial(jax.jit, static_argnames="dtype")
def nibble_bytes(lo: jax.Array, hi: jax.Array, dtype=jnp.uint8) -> jax.Array:
    """Words of bytes [..., R/4, O] from `nibble_words` (or made from them byte-wise) ->
    [..., 2R, O] bytes of `dtype` (8-bit) in the module docstring's row order: per unit of
    64 byte rows, the low nibbles' 64 rows then the high nibbles'."""
    lo, hi = pltpu.bitcast(lo, dtype), pltpu.bitcast(hi, dtype)
    *lead, half, cols = lo.shape
    lo = lo.reshape(*lead, half // 64, 64, cols)
    hi = hi.reshape(*lead, half // 64, 64, cols)
    return jnp.concatenate([lo, hi], axis=-2).reshape(*lead, 2 * half, cols)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., I/2, O] -> int32 codes [..., I, O] in the nibble order of the module
    docstring (I/2 a multiple of 64)."""
    return nibble_bytes(*nibble_words(packed)).astype(jnp.int32)


@jax.jit
def pack_nibbles(codes: jax.Array) -> jax.Array:
    """int codes in [0, 16) [..., I, O] -> uint8 [..., I/2, O]; inverse of unpack_nibbles."""
    c = jnp.asarray(codes).astype(jnp.uint8)
    *lead, rows, cols = c.shape
    c = c.reshape(*lead, rows // PACK_ROWS, 2, PACK_ROWS // 2, cols)
    return (c[..., 0, :, :] | (c[..., 1, :, :] << 4)).reshape(*lead, rows // 2, cols)


def _grouped(values, scale, rows: int, cols: int = 0):
    """values [..., I, O] * scale repeated over groups of `rows` along I (and `cols`
    along O when given), in float32."""
    *lead, I, O = values.shape
    if cols:
        v = values.reshape(*lead, I // rows, rows, O // cols, cols)
        return (v * scale[..., :, None, :, None]).reshape(values.shape)
    v = values.reshape(*lead, I // rows, rows, O)
    return (v * scale[..., :, None, :].astype(F32)).reshape(values.shape)


@functools.partial(jax.jit, static_argnames="scheme")
def dequantize_tile(scheme: str, data: jax.Array, scale: jax.Array) -> jax.Array:
    """Float32 values of a weight (or a tile of whole groups of one) in `scheme`'s layout."""
    if scheme == "int8":
        return data.astype(F32) * scale
    if scheme == "fp8":
        return _grouped(e4m3_values(data), scale, GROUP["fp8"], GROUP["fp8"])
    if scheme == "int4":
        q = nibble_bytes(*map(int4_values, nibble_words(data)), jnp.int8)
        return _grouped(q.astype(F32), scale, GROUP["int4"])
    if scheme == "fp4":
        e4m3 = nibble_bytes(*map(e2m1_to_e4m3, nibble_words(data)))
        return _grouped(e4m3_values(e4m3), pow2(scale.astype(jnp.int32) - E8M0_BIAS),
                        GROUP["fp4"])
    raise ValueError(f"scheme={scheme!r} must be one of {SCHEMES}")


# -- Feeding the MXU fp8 (mk.chips' `mxu_feeds`: TPU7x takes bf16 x float8_e4m3fn) -------
FEEDS = MXU_FEEDS  # what a packed tile is turned into for the MXU (module docstring)
# The feeds each scheme reaches exactly: int8 and int4 values are not e4m3 values.
FEEDABLE = {"int8": ("bf16",), "int4": ("bf16",), "fp8": FEEDS, "fp4": FEEDS}


def int4_values(code: jax.Array) -> jax.Array:
    """int4 codes (offset binary, q + 8) in the low nibble of each byte of an int32 array
    (`nibble_words`) -> q in the same bytes as int8 (two's complement): flipping bit 3
    gives q's 4-bit two's complement, whose sign bit 8 x 0x1e = 0xf0 extends, per byte."""
    flipped = code ^ 0x08080808
    return flipped | ((flipped & 0x08080808) * 0x1E)


def e2m1_to_e4m3(code: jax.Array) -> jax.Array:
    """float4_e2m1fn codes in the low nibble of each byte of an int32 array (one code an
    element, or four a word: `nibble_words`) -> the float8_e4m3fn bit patterns of the same
    values in the same bytes: every e2m1 value is an e4m3 value (exact). Byte-wise integer
    ops that never carry into the next byte, so one 32-bit op turns four codes."""
    c = code.astype(jnp.int32)
    mag = c & 0x07070707  # e2m1 magnitude 2e + m, per byte
    big = ((mag >> 1) | (mag >> 2)) & ONES  # 1 where e > 0 (mag >= 2)
    nonzero = (big | mag) & ONES
    # e > 0: (1 + m/2) 2^(e-1) is e4m3 exponent field e + 6, mantissa m << 2, so the
    # pattern is 8e + 4m + 48 = 4 mag + 48; mag 1 (0.5 = 2^-1): field 6, mantissa 0 (48),
    # 4 (mag - 1) + 48; mag 0: 0. Per byte at most 76: no carry.
    return ((mag + nonzero * 12 - (nonzero ^ big)) << 2) | ((c & 0x08080808) << 4)


def fp8_feed_tile(scheme: str, data: jax.Array, scale: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """A tile of an fp8 or fp4 weight as the MXU's fp8 feed takes it: (its codes as
    float8_e4m3fn [tile_rows, tile_cols], float32 scales [s, tile_cols]), the weight being
    e4m3 x the scale of its row's block of tile_rows / s rows and its column, exactly:
    fp8's codes as they are with each 128 x 128 block's scale repeated over its columns
    (s = tile_rows / 128); fp4's codes turned into e4m3 (`e2m1_to_e4m3`) with each 32-row
    group's power of two (s = tile_rows / 32)."""
    if scheme == "fp8":
        per = GROUP["fp8"]
        scales = jnp.concatenate([jnp.broadcast_to(scale[:, c:c + 1], (scale.shape[0], per))
                                  for c in range(data.shape[-1] // per)], axis=-1)
        return jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn), scales
    if scheme == "fp4":
        codes = nibble_bytes(*map(e2m1_to_e4m3, nibble_words(data)), jnp.float8_e4m3fn)
        return codes, pow2(scale.astype(jnp.int32) - E8M0_BIAS)
    raise ValueError(f"scheme={scheme!r} has no fp8 feed; {FEEDABLE}")


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
    fed fp8, `dtype` (e2m1 x a power of two is a bf16 value: nothing to round)."""
    if feed not in FEEDABLE[scheme]:
        raise ValueError(f"feed={feed!r}: {scheme} feeds as {FEEDABLE[scheme]}")
    return F32 if (scheme, feed) == ("fp8", "fp8") else dtype


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
    w = np.asarray(jnp.asarray(w, F32))
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
        return QuantWeight(pack_nibbles(q.astype(np.int32) + 8), jnp.asarray(scale), scheme)
    g = GROUP["fp4"]  # fp4: the smallest power of two 2^e with absmax / 2^e <= 6
    mant, exp = np.frexp(_absmax(w, g) / np.float32(FP4_MAX))  # x = mant * 2^exp, mant in [.5, 1)
    e = np.where(mant == 0.5, exp - 1, exp)
    code = np.where(mant == 0, E8M0_BIAS, np.clip(e + E8M0_BIAS, 1, 254)).astype(np.uint8)
    step = rep(np.ldexp(np.float32(1), code.astype(np.int32) - E8M0_BIAS), g)
    q = (w / step).astype(jnp.float4_e2m1fn).view(np.uint8) & 15
    return QuantWeight(pack_nibbles(q), jnp.asarray(code), scheme)


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
    """`formats` checked (`mk.config.check_formats`) and quantisable here -> {group:
    scheme}: every weight of the chosen groups is streamed through the ring
    (`check_streamed`), so neither `quantize` nor the megakernel's plan takes formats
    that would quantise another (the byte model charges them:
    `mk.kernels.plan.DecodePlan.make(kernel=False)`). A model's linear-attention weights
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
                                 "quantize takes plain weights (mk.quant.dequantize)")
            check_values(name, p)
    out = dict(params)
    for group, scheme in chosen.items():
        for name in FORMAT_GROUPS[group]:
            if name in shapes:
                out[name] = quantize_weight(params[name], scheme, name)
    return out


def dequantize(params: dict, dtype=None, feeds=None) -> dict:
    """Params holding `QuantWeight`s -> plain arrays: each weight's float32 values rounded
    once to `dtype` (default: the dtype of the params' embedding table, config.dtype), or,
    for a group of `feeds` ({group: feed}, a plan's `feeds`), to its `oracle_dtype`: the
    weights the reference multiplies by to compute what the kernel does. The reference
    rounds a matmul's activations to its weight's dtype, so float32 weights (fp8 fed fp8)
    in a bf16 model leave them unrounded where the kernel rounds them to bf16: exact in a
    float32 model (`mk.reference.check_params` takes only config.dtype weights)."""
    dtype = dtype or params["embed"].dtype
    into = {name: oracle_dtype(p.scheme, feed, dtype) for name, feed in
            schemes_of(feeds).items() if isinstance(p := params.get(name), QuantWeight)}
    return {name: (dequantize_tile(p.scheme, p.data, p.scale).astype(into.get(name, dtype))
                   if isinstance(p, QuantWeight) else p) for name, p in params.items()}


# -- The kernel's tile layout (module docstring) ------------------------------------------
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
    """`q` in the kernel's layout for tile_rows x tile_cols tiles (module docstring): the
    data [..., tiles, data rows, tile_cols] and the scales [..., tiles, r, c], tile t the
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


def pad_columns(q: QuantWeight, columns: int) -> QuantWeight:
    """`q` (mk.quant's layout) with `columns` more output columns of value zero
    (`ZERO_CODE`, in both nibbles of a packed byte) and scale one (`UNIT_SCALE`)."""
    data_zero = ZERO_CODE[q.scheme] * (17 if q.scheme == "int4" else 1)
    scale_one = UNIT_SCALE[q.scheme]
    cols = columns // GROUP["fp8"] if q.scheme == "fp8" else columns
    if q.scheme == "fp8" and columns % GROUP["fp8"]:
        raise ValueError(f"columns={columns}: fp8 pads whole 128-column blocks")
    pad = [(0, 0)] * (q.data.ndim - 1)
    return QuantWeight(jnp.pad(q.data, pad + [(0, columns)], constant_values=data_zero),
                       jnp.pad(q.scale, pad + [(0, cols)], constant_values=scale_one),
                       q.scheme)


def schemes_of(formats) -> dict[str, str]:
    """{group: scheme} -> {weight name: scheme} of every weight of those groups
    (`FORMAT_GROUPS`): the ring's segments stored quantised (any per-group value maps
    the same way: {group: feed} -> each weight's feed)."""
    return {name: scheme for group, scheme in dict(formats or {}).items()
            for name in FORMAT_GROUPS[group]}


def formats_of(params: dict) -> dict[str, str]:
    """{group: scheme} of the quantised groups of `params` (those holding
    `QuantWeight`s); raises ValueError if one group mixes schemes or plain weights."""
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
        return _grouped(ones, q.scale, GROUP["fp8"], GROUP["fp8"])
    scale = (q.scale.astype(F32) if q.scheme == "int4"
             else pow2(q.scale.astype(jnp.int32) - E8M0_BIAS))
    return _grouped(ones, scale, GROUP[q.scheme])


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
    [..., I, O] weight in `scheme` (module docstring's layouts): what an ahead-of-time
    compile traces with, and what `storage_bytes` counts."""
    check_shape("weight", scheme, shape)
    *lead, I, O = shape
    data = {"int8": ((I, O), jnp.int8), "fp8": ((I, O), jnp.uint8),
            "int4": ((I // 2, O), jnp.uint8), "fp4": ((I // 2, O), jnp.uint8)}[scheme]
    scale = {"int8": ((1, O), F32), "fp8": ((I // 128, O // 128), F32),
             "int4": ((I // 128, O), jnp.bfloat16), "fp4": ((I // 32, O), jnp.uint8)}[scheme]
    return QuantWeight(*(jax.ShapeDtypeStruct((*lead, *s), d) for s, d in (data, scale)),
                       scheme)


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
    every kind or of `kind`'s weights only (`mk.weights.WEIGHTS`' kinds)."""
    schemes = schemes_of(config.formats)
    return sum(sum(storage_bytes(w.stacked(config), schemes.get(w.name), config.dtype)
                   .values()) for w in weights_of(config) if kind is None or w.kind == kind)
