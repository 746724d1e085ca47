"""Stage 01, weight streaming: y = x @ W with W left in HBM and streamed through the ring.

Decode multiplies a few activation rows (M = B * T <= 64) by every weight matrix, so the
time of a step is the time to move the weights. This kernel keeps W [K, N] in HBM
(`memory_space=pl.ANY`) and copies it by hand, tile by tile, into a VMEM ring; the
teaching progression is one parameter, `BlockSizes.slots` (1: DMA and MXU take turns; 2:
double buffering; N: N - 1 tiles in flight hide DMA latency and jitter).

Here: `stream_matmul` (its kernel, buffers and default tiling, `stream_matmul_block`: what
`mk.cost.probes.probe_tile` compiles the tile cost table's rows at), and the steps every stage
wrapper takes for the weights it streams, plain or an `mk.model.quant.QuantWeight`:
`stage_block` (its default tiling), `weight_stream` (the stream, with each quantised
family's scheme) and `ring_weights` (the weights in the ring's layout, with a BlockSpec
per array). A quantised weight streams packed tiles and their scales; in VMEM int8 and
int4 codes go straight into the dot (scales on the product), fp8 and fp4 tiles are
dequantised to the compute dtype or (`feed="fp8"`) fed as e4m3 (notebook 12).

Not here: the ring mechanics (`mk.kernels.ring`), fused layers (`one_layer`). The
progression at length: docs/design/mk.kernels.weight_streaming.md.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant, unpack
from mk.kernels.common import BlockSizes, Buffer, default_block
from mk.kernels.ring import Ring, ring_buffers, ring_layout
from mk.kernels.stream import TileStream


# Rows this stage kernel takes: a decode step's MAX_ROWS (mk.model.config) up to one pass of the
# largest MXU (256 rows on v6e and TPU7x), the largest M of the tile cost table
# (`mk.cost.feed_costs`, measured on this kernel by `mk.cost.probes.probe_tile`).
STAGE_ROWS = 256


def weight_stream(block: BlockSizes, matrices, formats=None, **kwargs) -> TileStream:
    """`TileStream.build(block, matrices, **kwargs)` with every weight of a quantised family
    in its scheme; formats: {family: mk.model.quant scheme} (`mk.model.quant.formats_of` the
    weights)."""
    return TileStream.build(block, matrices, schemes=quant.schemes_of(formats), **kwargs)


def stage_block(matrices, dtype, formats=None, **kwargs) -> BlockSizes:
    """A stage kernel's default tiling for its `matrices` ((name, K, N) triples or
    `Repeat`s) stored in `dtype` (`default_block`; the weights of quantised `formats`
    never transposed)."""
    return default_block(matrices, itemsize=jnp.dtype(dtype).itemsize,
                         quantised=tuple(quant.schemes_of(formats)), **kwargs)


def ring_weights(weights: dict, stream: TileStream) -> tuple[dict, dict]:
    """(weights, specs) a stage wrapper passes for the weights by name: each in the ring's
    HBM layout for `stream` (`ring_layout`: its tiles in stream order, a quantised one's
    scales beside them), with a pl.ANY BlockSpec per array (the ring copies by hand)."""
    laid = ring_layout(weights, stream)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return laid, jax.tree.map(lambda _: hbm, laid)


def stream_matmul_buffers(M: int, K: int, N: int, dtype, block: BlockSizes,
                          scheme: str | None = None) -> list[Buffer]:
    """Every VMEM buffer of `stream_matmul` (the budget and the scratch come from here);
    scheme: the weight's mk.model.quant storage scheme (its packed slots), or None."""
    stream = _stream(K, N, block, scheme)
    dtype = str(jnp.dtype(dtype))
    return [Buffer("x", (M, K), dtype), Buffer("out", (M, N), "float32"),
            *ring_buffers(stream, dtype)]


def _stream(K: int, N: int, block: BlockSizes, scheme: str | None,
            feed: str = "bf16") -> TileStream:
    return TileStream.build(block, [("w", K, N)], schemes={"w": scheme} if scheme else None,
                            feeds={"w": feed})


def stream_matmul_block(K: int, N: int, dtype, scheme: str | None = None) -> BlockSizes:
    """`stream_matmul`'s default tiling of w [K, N]: plain in `dtype`, or stored in the
    mk.model.quant `scheme` (never transposed, at most QUANT_TILE_ELEMENTS a tile)."""
    return default_block([("w", K, N)], itemsize=jnp.dtype(dtype).itemsize,
                         quantised=("w",) if scheme else ())


def stream_matmul_kernel(
    # Inputs
    x_vmem,  # [M, K] compute dtype
    w_hbm,  # [tiles, tile_rows, tile_cols] weight dtype (`ring_layout`), or an
    #         mk.model.quant.QuantWeight in its tile-major layout, in HBM
    # Outputs
    out_vmem,  # [M, N] f32
    # Scratch
    slots,  # {name: the ring's VMEM slots (`mk.kernels.ring.ring_buffers`)}
    sems,  # DMA semaphores [slots]
    *,
    stream: TileStream,
):
    ring = Ring.in_scratch(stream, {"w": lambda layer: (w_hbm, None)},
                           SimpleNamespace(**slots), sems, x_vmem.dtype)
    ring.prime()
    ring.matmul("w", x_vmem, out_vmem)


def stream_matmul(x: jax.Array, w, *, block: BlockSizes | None = None,
                  dtype=jnp.bfloat16, feed: str = "bf16"):
    """x [M, K] @ w [K, N] -> [M, N] float32, w streamed through a `block.slots`-slot ring.
    w: an array (multiplied in its own dtype), or an `mk.model.quant.QuantWeight` (in
    mk.model.quant's layout; its packed tiles and scales are streamed and, in VMEM, int8 and int4
    codes fed to the dot and scaled on the product, fp8 and fp4 dequantised to `dtype` or, with
    `feed="fp8"`, fed to the MXU as e4m3: `mk.model.unpack.FEEDABLE`).
    The product is `mk.model.ops.matmul(x.astype(dtype), w)` of `mk.model.unpack.dequantize_tile(w)`
    in `mk.model.unpack.oracle_dtype`."""
    M, K = x.shape
    K2, N = w.shape
    if K2 != K:
        raise ValueError(f"x [M, K={K}] and w [K={K2}, N] disagree on K")
    if not 1 <= M <= STAGE_ROWS:
        raise ValueError(f"rows M={M} must be in [1, {STAGE_ROWS}]")
    packed = isinstance(w, quant.QuantWeight)
    scheme, dtype = (w.scheme, jnp.dtype(dtype)) if packed else (None, w.dtype)
    if packed:
        unpack.oracle_dtype(scheme, feed, dtype)  # raises for a feed the scheme lacks
    elif feed != "bf16":
        raise ValueError(f"feed={feed!r}: a plain {dtype} weight is multiplied as it is")
    if block is None:
        block = stream_matmul_block(K, N, dtype, scheme)
    stream = _stream(K, N, block, scheme, feed)
    weights, specs = ring_weights({"w": w}, stream)
    ring = stream_matmul_buffers(M, K, N, dtype, block, scheme)[2:]
    return pl.pallas_call(
        functools.partial(stream_matmul_kernel, stream=stream),
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), specs["w"]],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[{b.name: pltpu.VMEM(b.shape, b.dtype) for b in ring},
                        pltpu.SemaphoreType.DMA((block.slots,))],
        name="mk_stream_matmul",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N, transcendentals=0,
            bytes_accessed=sum(a.nbytes for a in jax.tree.leaves(weights))
            + x.size * dtype.itemsize + M * N * 4),
    )(x.astype(dtype), weights["w"])  # rounding x once here is what each tile would do
