"""Stage 01, weight streaming: y = x @ W with W left in HBM and streamed through the ring.

Decode multiplies a few activation rows (M = B * T <= 64) by every weight matrix, so the
time of a step is the time to move the weights. This kernel keeps W [K, N] in HBM
(`memory_space=pl.ANY`) and copies it by hand, tile by tile, into a VMEM ring.

The teaching progression is one parameter, `BlockSizes.slots`:
- slots=1, no overlap: a tile is issued only after the previous one is consumed, so the
  DMA engine and the MXU take turns;
- slots=2, double buffering: tile g+1 loads while tile g computes;
- slots=N, the ring: N-1 tiles in flight hide DMA latency and jitter.

Not here: the ring mechanics (`mk.kernels.ring`), fused layers (`one_layer`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.config import MAX_ROWS
from mk.kernels.common import BlockSizes, Buffer, default_block
from mk.kernels.ring import Ring, TileStream



def stream_matmul_buffers(M: int, K: int, N: int, dtype, block: BlockSizes) -> list[Buffer]:
    """Every VMEM buffer of `stream_matmul` (the budget and the scratch come from here)."""
    return [Buffer("x", (M, K), str(jnp.dtype(dtype))),
            Buffer("out", (M, N), "float32"),
            Buffer("ring", (block.slots, block.tile_k, block.tile_n), str(jnp.dtype(dtype)))]


def stream_matmul_kernel(
    # Inputs
    x_vmem,  # [M, K] weight dtype
    w_hbm,  # [K, N] weight dtype, left in HBM
    # Outputs
    out_vmem,  # [M, N] f32
    # Scratch
    ring_vmem,  # [slots, tile_k, tile_n] weight dtype
    sems,  # DMA semaphores [slots]
    *,
    stream: TileStream,
):
    ring = Ring(stream, {"w": lambda layer: (w_hbm, None)}, ring_vmem, sems)
    ring.prime()
    ring.matmul("w", x_vmem, out_vmem)


def stream_matmul(x: jax.Array, w: jax.Array, *, block: BlockSizes | None = None):
    """x [M, K] @ w [K, N] -> [M, N] float32, w streamed through a `block.slots`-slot ring."""
    M, K = x.shape
    K2, N = w.shape
    if K2 != K:
        raise ValueError(f"x [M, K={K}] and w [K={K2}, N] disagree on K")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"rows M={M} must be in [1, {MAX_ROWS}]")
    block = block or default_block(K, N)
    stream = TileStream.build(block, [("w", K, N)])
    ring = stream_matmul_buffers(M, K, N, w.dtype, block)[-1]
    return pl.pallas_call(
        functools.partial(stream_matmul_kernel, stream=stream),
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(ring.shape, ring.dtype),
                        pltpu.SemaphoreType.DMA((block.slots,))],
        name="mk_stream_matmul",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N, transcendentals=0,
            bytes_accessed=(w.size + x.size) * w.dtype.itemsize + M * N * 4),
    )(x.astype(w.dtype), w)  # rounding x once here is what each tile would do
