"""An MoE expert's gate and up joined in one lane tile: the layout `mk.kinds.mlp.kinds.MoE`
streams where a shard leaves each of them a sliver of a tile (Kimi K3 at TP32: 64 of its
2048 columns a device), and the split of their joined product in the kernel.

Here: the rule (`gate_up_width`), the split (`split_gate_up`, called by
`mk.kinds.mlp.mlp.experts_body`) and that split alone in one pallas_call (`gate_up`:
notebook 05c, the tests). Not here: the joined weight's name and segments
(`mk.kinds.mlp.mlp.JOINED_EXPERT_WEIGHTS`, `moe_segments`), laying the weights out
(`mk.kinds.mlp.kinds.MoE.prepare`, `mk.model.quant.side_by_side`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import LANES, padded_width


def gate_up_width(ffn: int, used: int) -> int | None:
    """The width of an expert's gate and up side by side in one matrix (`we_gate_up`)
    where both fit one lane tile: each holds `used` columns of values in its `ffn` (the
    rest zeros: a shard's lane padding, `ModelConfig.own_width`), so apart each pads a
    tile of its own and joined they stream one (Kimi K3 at TP32: 64 + 64 columns in 128
    lanes, not 2 x 128; up's lanes come out by a rotation inside each lane tile). Else
    None: e.g. 96 columns take 256 lanes either way; wider shares that joining would
    save a tile of (gpt-oss-20b's 2880 of 2944 on one chip, qwen3-30b-a3b's 192 of 256
    at TP4) shift up's lanes across every tile of a slot's product, and gpt-oss-20b
    joined simulated slower with its compiled loops (v6e 20.62 ms against 20.34 apart:
    its costliest fp4 tile loop 184 bundles against 179), so they stay apart."""
    width = padded_width(2 * used)
    return width if width == LANES < 2 * ffn else None


def split_gate_up(joined, used: int, width: int):
    """gate and up [M, width] of an expert's joined product joined [M, gate_up_width]
    (gate in its lanes [0, used), up in [used, 2 used)): lanes [0, used) of each hold the
    values (up's rotated down by `used` lanes), the rest whatever the rotation leaves."""
    up = pltpu.roll(joined, joined.shape[1] - used, 1)
    return joined[:, :width], up[:, :width]


def gate_up(joined: jax.Array, used: int, width: int) -> tuple[jax.Array, jax.Array]:
    """`split_gate_up` alone in one pallas_call (notebook 05c, the tests): an expert's
    joined product joined [M, W] float32 -> its gate and up [M, width], their lanes from
    `used` on set to zero."""
    M, W = joined.shape
    if not 0 < used <= width <= W or 2 * used > W:
        raise ValueError(f"used={used}, width={width}: need 0 < used <= width <= W={W} "
                         "and both parts in the joined width (2 x used <= W)")

    def kernel(joined_ref, gate_ref, up_ref):
        gate, up = split_gate_up(joined_ref[...], used, width)
        values = lax.broadcasted_iota(jnp.int32, gate.shape, 1) < used
        gate_ref[...] = jnp.where(values, gate, 0.0)
        up_ref[...] = jnp.where(values, up, 0.0)

    part = jax.ShapeDtypeStruct((M, width), jnp.float32)
    return pl.pallas_call(kernel, out_shape=(part, part), name="mk_gate_up")(
        joined.astype(jnp.float32))
