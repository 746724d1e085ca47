"""A probe of the DMA engine: `count` copies HBM -> VMEM of one size, `in_flight` at a time.

The megakernel's ring keeps tiles in flight so that HBM never waits for a descriptor's
latency (`mk.cost.sim`, Little's law). Whether 0.5 us or 1 us of latency is right, and how many
bytes must be in flight to reach the chip's bandwidth, are properties of the chip, not of
the model: this kernel isolates them. It is the ring with the matmul taken out: chunk i
lands in slot i % in_flight, and waiting for chunk i issues chunk i + in_flight, so
`in_flight` copies are outstanding at every moment. With one in flight each copy pays its
whole latency; with enough in flight only its bytes over the bandwidth.

`count` is an SMEM scalar, so one compiled kernel runs any number of copies: timing two
counts and dividing the difference by the extra copies removes the call's fixed cost
(dispatch, prologue) from the time per copy (`mk.measure.measure`).

Not here: the timing and the sweeps (`mk.measure.measure`); the weight ring (`mk.kernels.ring`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import LANES
from mk.kernels.common import Buffer, sublanes, vmem_limit_bytes

DTYPE = jnp.float32
CHUNK_ROWS = sublanes(DTYPE)  # a chunk is whole (8, 128) f32 tiles
SIZE_UNIT_BYTES = CHUNK_ROWS * LANES * 4  # 4 KiB: the smallest chunk, and the size unit


def chunk_rows(nbytes: int) -> int:
    """Rows of 128 f32 lanes in a chunk of `nbytes`; raises unless whole 4 KiB tiles."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < SIZE_UNIT_BYTES \
            or nbytes % SIZE_UNIT_BYTES:
        raise ValueError(f"nbytes={nbytes!r} must be a positive multiple of "
                         f"{SIZE_UNIT_BYTES} (whole (8, 128) float32 tiles)")
    return nbytes // (LANES * 4)


def dma_probe_buffers(nbytes: int, in_flight: int) -> list[Buffer]:
    """Every VMEM buffer of `dma_probe`: the landing slots and the small output."""
    return [Buffer("slots", (in_flight, chunk_rows(nbytes), LANES), "float32"),
            Buffer("out", (CHUNK_ROWS, LANES), "float32", group="operand")]


def dma_probe_kernel(
    # Inputs
    count_smem,  # [1] int32: copies to make, >= 1
    src_hbm,  # [in_flight, R, 128] f32, left in HBM: chunk i reads src[i % in_flight]
    # Outputs
    out_vmem,  # [8, 128] f32: the first rows of the last chunk landed
    # Scratch
    slots_vmem,  # [in_flight, R, 128] f32
    sems,  # DMA semaphores [in_flight]
):
    in_flight = slots_vmem.shape[0]
    count = count_smem[0]

    def copy(i):
        slot = i % in_flight
        return pltpu.make_async_copy(src_hbm.at[slot], slots_vmem.at[slot], sems.at[slot])

    def prime(i, carry):
        copy(i).start()
        return carry

    def wait_then_issue(i, carry):
        copy(i).wait()

        @pl.when(i + in_flight < count)
        def issue_next():
            copy(i + in_flight).start()
        return carry

    lax.fori_loop(0, jnp.minimum(count, in_flight), prime, 0)
    lax.fori_loop(0, count, wait_then_issue, 0)
    out_vmem[...] = slots_vmem[(count - 1) % in_flight, :CHUNK_ROWS, :]


def dma_probe(src: jax.Array, count: jax.Array) -> jax.Array:
    """Copy `count` chunks of src [in_flight, R, 128] f32 (chunk i = src[i % in_flight])
    into VMEM with in_flight copies outstanding -> the first 8 rows of the last chunk
    [8, 128] (so a check can see the data moved). count: an int32 array [1], >= 1."""
    if src.ndim != 3 or src.shape[2] != LANES or src.dtype != DTYPE:
        raise ValueError(f"src {src.shape} {src.dtype} must be [in_flight, R, {LANES}] "
                         "float32")
    in_flight, rows, _ = src.shape
    nbytes = rows * LANES * 4
    chunk_rows(nbytes)
    buffers = dma_probe_buffers(nbytes, in_flight)
    return pl.pallas_call(
        dma_probe_kernel,
        out_shape=jax.ShapeDtypeStruct((CHUNK_ROWS, LANES), DTYPE),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(buffers[0].shape, DTYPE),
                        pltpu.SemaphoreType.DMA((in_flight,))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(buffers),
                                             has_side_effects=True),
        name="mk_dma_probe",
        cost_estimate=pl.CostEstimate(  # one pass over src: count is known at run time
            flops=0, transcendentals=0, bytes_accessed=src.size * 4),
    )(count.astype(jnp.int32), src)

