"""Random quantised weights drawn as codes: a model's real shapes and formats in seconds.

Quantising a normal float tensor takes minutes at a real model's size (gpt-oss-20b's
experts); `random_weight` draws each code uniformly over its scheme's values (no NaN code,
int8 and int4 symmetric) and each scale block's scale near the one that gives a wanted
root mean square, jittered so that a kernel applying the wrong block's scale is seen. A
lane-padded model's padding gets zero codes (`mk.model.quant.ZERO_CODE`).

Here: `random_weight` and the values it draws from (`_code_values`). Not here: the layouts
and `QuantWeight` (`mk.model.quant`), quantising real weights (`mk.model.quant.quantize`), a whole
model's random parameters (`mk.model.checkpoint.init_params`, which calls this a leading row at
a time), the element decoders (`mk.model.unpack`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mk.model.quant import INT4_MAX, INT8_MAX, ZERO_CODE, QuantWeight, check_shape
from mk.model.unpack import E8M0_BIAS, GROUP, INT_SCHEMES, e2m1_values, e4m3_values, pack_codes
from mk.model.weights import put_corner


def _code_values(scheme: str) -> np.ndarray:
    """Every code `random_weight` draws, as its value: int8's q in [-127, 127], int4's in
    [-7, 7], fp8's finite e4m3 values, fp4's e2m1 values."""
    if scheme in INT_SCHEMES:
        top = INT8_MAX if scheme == "int8" else INT4_MAX
        return np.arange(-top, top + 1, dtype=np.float32)
    if scheme == "fp8":
        values = np.asarray(e4m3_values(jnp.arange(256, dtype=jnp.uint8)))
        return values[np.isfinite(values)]
    return np.asarray(e2m1_values(jnp.arange(16)))


def random_weight(shape: tuple[int, ...], scheme: str, rng: np.random.Generator,
                  rms: float, own: tuple[int, ...] | None = None,
                  name: str = "weight") -> QuantWeight:
    """A weight [..., I, O] in `scheme` drawn as codes, not quantised from floats: each
    code uniform over the scheme's (`_code_values`: no NaN code, int8 and int4 symmetric),
    each scale block's scale the one that gives the codes' values about `rms` root mean
    square, times 2^u (u uniform in [-1/2, 1/2]; fp4's power of two times 2^-1, 1 or 2),
    so that a kernel applying the wrong block's scale is seen. Random weights in a model's
    real shapes and formats in seconds, where quantising a normal tensor takes minutes
    (gpt-oss-20b's experts). `own`: the weight's own shape in a lane-padded model; the
    codes past it are zero (`ZERO_CODE`), so the padding's values are zero."""
    check_shape(name, scheme, tuple(shape))
    own = tuple(shape) if own is None else tuple(own)
    if len(own) != len(shape) or any(o > n for o, n in zip(own, shape)):
        raise ValueError(f"{name}: own={own} must fit in the corner of shape={tuple(shape)}")
    *lead, I, O = shape
    values = _code_values(scheme)
    codes = np.full(shape, ZERO_CODE[scheme], np.uint8 if scheme != "int8" else np.int8)
    if scheme == "int8":
        drawn = rng.integers(-INT8_MAX, INT8_MAX + 1, own, dtype=np.int8)
    elif scheme == "int4":
        drawn = rng.integers(8 - INT4_MAX, 8 + INT4_MAX + 1, own, dtype=np.uint8)
    elif scheme == "fp8":  # the 254 finite bytes: skip mk.model.quant.NAN_CODES 0x7f, 0xff
        drawn = rng.integers(0, 254, own, dtype=np.uint8)
        drawn += drawn >= 0x7F
    else:
        drawn = rng.integers(0, 16, own, dtype=np.uint8)
    put_corner(codes, drawn)
    base = rms / float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
    g = GROUP.get(scheme, I)
    blocks = {"int8": (1, O), "fp8": (I // g, O // g)}.get(scheme, (I // g, O))
    if scheme == "fp4":
        code = E8M0_BIAS + round(math.log2(base)) + rng.integers(-1, 2, (*lead, *blocks))
        scale = code.astype(np.uint8)
    else:
        jitter = np.exp2(rng.uniform(-0.5, 0.5, (*lead, *blocks)))
        scale = (base * jitter).astype(np.float32)
    if scheme in ("int4", "fp4"):
        data = pack_codes(scheme, codes)
    else:
        data = jnp.asarray(codes.view(np.uint8) if scheme == "fp8" else codes)
    return QuantWeight(data, jnp.asarray(scale, jnp.bfloat16 if scheme == "int4" else None),
                       scheme)
