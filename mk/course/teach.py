"""The course's kernels in two layers: a short teaching version of each idea, tested equal
to the real module on the same inputs (tests/test_course.py), and the real code shown as
annotated excerpts.

Teaching versions (30-40 lines each, one idea each, none used by the real kernels):
`block_copy` and `hand_copy` (00c: one copy by a grid of BlockSpecs, then by hand-written
DMAs), `ring_matmul` (01: a weight streamed through a VMEM ring by hand-written DMAs),
`attend` (03: one sequence's online softmax over only its visible KV tiles; `attend_tile`
one tile, `online_softmax_update` the five lines it is about), `moe_experts` (04: the
selected experts' SwiGLU, one grid step per expert slot; `compact_experts` the picked
experts compacted into its slots), `all_reduce` (10: recursive halving and doubling over a
stacked array, bit-equal to `mk.kernels.collectives`). Also here:
`ring_schedule` (the ring rule in time, tile by tile: notebook 01's Gantt chart, a
teaching twin of the simulator's weight lane) with `tile_times`, and `excerpt` (a real
function as numbered excerpts, found from anchors in its source, with a callout each).

Not here: the exercises and their checks (`mk.course.course`), the real kernels (`mk.kernels`).
Each teaching version beside the real code it teaches: docs/design/mk.course.teach.md.
"""

from __future__ import annotations

import functools
import html
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import Markdown
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.cost import perf, sim
from mk.model.chips import spec_of
from mk.model.config import finite_number, positive_int
from mk.model.decode_checks import checked_int32
from mk.model.errors import shown
from mk.kinds.mlp import mlp
from mk.kernels.common import BlockSizes
from mk.kernels.stream import TileStream

F32 = jnp.float32


def _check_ndim(name: str, array, ndim: int) -> None:
    """ValueError naming `name` unless it is an array of `ndim` dimensions."""
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) != ndim:
        got = f"shape {tuple(shape)}" if shape is not None else type(array).__name__
        raise ValueError(f"{name} must be an array of {ndim} dimensions; got {got}")


# -- 00c: the first kernel, a copy two ways --------------------------------------------------
def block_copy_kernel(x_vmem, o_vmem):
    """One grid step: o_vmem = x_vmem, both [block_rows, C] blocks Pallas has placed in
    VMEM (it copied x's block in before the step and copies o's out after it)."""
    o_vmem[...] = x_vmem[...]


def block_copy(x: jax.Array, *, block_rows: int = 8) -> jax.Array:
    """A copy of x [R, C] by a grid of R // block_rows steps: step i's BlockSpecs map it to
    rows [i * block_rows, (i + 1) * block_rows) of x and of the output, and Pallas pipelines
    those blocks HBM -> VMEM -> HBM (block i + 1 loads while step i runs)."""
    (R, C), block_rows = _rows_in_blocks(x, block_rows)
    block = pl.BlockSpec((block_rows, C), lambda i: (i, 0))  # step i -> block (i, 0)
    return pl.pallas_call(block_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(R // block_rows,), in_specs=[block], out_specs=block,
                          name="teach_block_copy")(x)


def hand_copy_kernel(x_hbm, o_hbm, buf_vmem, sems, *, block_rows: int):
    """o_hbm [R, C] = x_hbm [R, C], both left in HBM, one block of block_rows rows at a time
    through buf_vmem [block_rows, C], with two DMA semaphores in sems (0: in, 1: out).

    For each block i (a `lax.fori_loop`), rows [i * block_rows, (i + 1) * block_rows):
    copy them from x_hbm into buf_vmem and wait for that copy; then copy buf_vmem into the
    same rows of o_hbm and wait for that one. Every copy started is waited for, and none
    reads buf_vmem before the copy writing it has landed."""
    def one_block(i, carry):
        rows = pl.ds(pl.multiple_of(i * block_rows, block_rows), block_rows)
        copy_in = pltpu.make_async_copy(x_hbm.at[rows], buf_vmem, sems.at[0])
        copy_out = pltpu.make_async_copy(buf_vmem, o_hbm.at[rows], sems.at[1])
        copy_in.start()  # hand the descriptor to a DMA engine; returns at once
        copy_in.wait()  # block i is in VMEM
        copy_out.start()
        copy_out.wait()  # and back in HBM: buf_vmem may be overwritten
        return carry

    lax.fori_loop(0, x_hbm.shape[0] // block_rows, one_block, 0)


def hand_copy(x: jax.Array, *, block_rows: int = 8, kernel=hand_copy_kernel) -> jax.Array:
    """`block_copy` by hand: x and the output stay in HBM (`pl.ANY`), `kernel` (refs as
    `hand_copy_kernel`'s, and `block_rows`) moves each block with its own DMAs through one
    [block_rows, C] VMEM buffer; no grid, so no pipeline and no overlap."""
    (_, C), block_rows = _rows_in_blocks(x, block_rows)
    hbm = pl.BlockSpec(memory_space=pl.ANY)  # left where it is: the kernel copies it
    return pl.pallas_call(
        functools.partial(kernel, block_rows=block_rows),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[hbm], out_specs=hbm,
        scratch_shapes=[pltpu.VMEM((block_rows, C), x.dtype), pltpu.SemaphoreType.DMA((2,))],
        name="teach_hand_copy")(x)


def _rows_in_blocks(x, block_rows):
    """x's shape and block_rows, checked: x [R, C] with R a multiple of block_rows."""
    _check_ndim("x", x, 2)
    block_rows = positive_int("block_rows", block_rows)
    if x.shape[0] % block_rows:
        raise ValueError(f"x {x.shape}: its rows must be a multiple of {block_rows=}")
    return x.shape, block_rows


# -- 01: the ring -------------------------------------------------------------------------------
def ring_matmul_kernel(x_vmem, w_hbm, out_vmem, slots_vmem, sems, *, tile: int):
    """out_vmem [M, N] = x_vmem [M, K] @ w_hbm [K, N], W copied from HBM one [tile, tile]
    tile at a time into a ring of VMEM slots (slots_vmem [slots, tile, tile], one DMA
    semaphore each in sems).

    Tile g is row block g % steps of column panel g // steps (steps = K // tile) and lands
    in slot g % slots. Prime: start the copies of the first `slots` tiles. Then for each g
    in order (a `lax.fori_loop`): wait for tile g's copy; multiply x's row block of it by
    the slot (float32 accumulation) into the panel's columns of out_vmem (the first step
    of a panel sets them, the others add); then, the slot read, start tile g + slots's copy
    into it, if there is such a tile. Every copy started is waited for."""
    K, N = w_hbm.shape
    slots, steps = slots_vmem.shape[0], K // tile
    total = steps * (N // tile)  # tile g: contraction step g % steps of panel g // steps

    def dma(g):  # tile g of W, HBM -> ring slot g % slots
        i, j = g % steps, g // steps
        src = w_hbm.at[pl.ds(pl.multiple_of(i * tile, tile), tile),
                       pl.ds(pl.multiple_of(j * tile, tile), tile)]
        return pltpu.make_async_copy(src, slots_vmem.at[g % slots], sems.at[g % slots])

    for g in range(min(slots, total)):  # prime: the first `slots` tiles in flight
        dma(g).start()

    def consume(g, carry):
        i, j = g % steps, g // steps
        dma(g).wait()  # tile g has landed in its slot
        xs = x_vmem[:, pl.ds(pl.multiple_of(i * tile, tile), tile)]
        part = jnp.dot(xs, slots_vmem[g % slots], preferred_element_type=F32)
        cols = pl.ds(pl.multiple_of(j * tile, tile), tile)
        out_vmem[:, cols] = jnp.where(i == 0, part, out_vmem[:, cols] + part)

        @pl.when(g + slots < total)
        def refill():  # the slot was just read: tile g + slots may now land in it
            dma(g + slots).start()
        return carry

    lax.fori_loop(0, total, consume, 0)


def ring_matmul(x: jax.Array, w: jax.Array, *, slots: int = 3, tile: int = 128,
                kernel=ring_matmul_kernel):
    """x [M, K] @ w [K, N] -> [M, N] float32, w left in HBM and streamed through `slots`
    VMEM slots of [tile, tile] (x rounded to w's dtype, float32 accumulation). `kernel`
    takes `ring_matmul_kernel`'s refs and `tile` (01's from-spec exercise passes its own)."""
    _check_ndim("x", x, 2)
    _check_ndim("w", w, 2)
    slots, tile = positive_int("slots", slots), positive_int("tile", tile)
    (M, K), N = x.shape, w.shape[1]
    if w.shape[0] != K or K % tile or N % tile:
        raise ValueError(f"x {x.shape}, w {w.shape}: x [M, K] @ w [K, N] with K and N "
                         f"multiples of tile={tile}")
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        functools.partial(kernel, tile=tile),
        out_shape=jax.ShapeDtypeStruct((M, N), F32),
        in_specs=[vmem, pl.BlockSpec(memory_space=pl.ANY)], out_specs=vmem,
        scratch_shapes=[pltpu.VMEM((slots, tile, tile), w.dtype),
                        pltpu.SemaphoreType.DMA((slots,))],
        name="teach_ring_matmul")(x.astype(w.dtype), w)


# -- 03: online-softmax attention -------------------------------------------------------------
def online_softmax_update(m, l, acc, scores, v):
    """One KV tile into the running max m, sum l, accumulator acc ([R, 1], [R, 1], [R, H]
    float32): scores [R, tile] float32 (masked -inf), v [tile, H] in the cache dtype."""
    m_next = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_next)  # rescales what earlier tiles summed under the old max
    probs = jnp.exp(scores - m_next)
    l_next = alpha * l + jnp.sum(probs, axis=1, keepdims=True)
    acc_next = alpha * acc + jnp.dot(probs.astype(v.dtype), v, preferred_element_type=F32)
    return m_next, l_next, acc_next


def attend_tile(m, l, acc, q, k, v, start, position, *, rows: int,
                update=online_softmax_update):
    """One KV tile into the running max m, sum l, accumulator acc ([R, 1], [R, 1], [R, H]
    float32) of R = G*T query rows q [R, H] float32 (row r: head r // T, new row t = r % T
    at position + t, T = rows); k, v [tile, H] in the cache dtype hold cached positions
    start .. start + tile - 1.

    Scores: q rounded to k's dtype, times k transposed, float32 accumulation, times
    1 / sqrt(H) ([R, tile]). Causal mask: row t sees key s only if s <= position + t; a
    score it cannot see is -inf. Returns `update(m, l, acc, scores, v)`, the new (m, l,
    acc)."""
    q, scale = q.astype(k.dtype), 1 / math.sqrt(q.shape[1])
    scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=F32) * scale  # [R, tile]
    t = lax.broadcasted_iota(jnp.int32, scores.shape, 0) % rows
    s = start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(s <= position + t, scores, -jnp.inf)  # causal: key s seen by row t
    return update(m, l, acc, scores, v)


def attend_kernel(pos_smem, q_vmem, k_vmem, v_vmem, o_vmem, m, l, acc, *, rows: int,
                  update, tile_body):
    i, tile = pl.program_id(0), k_vmem.shape[0]
    p = pos_smem[0]  # row t of the sequence sits at position p + t

    @pl.when(i == 0)
    def start():
        m[...] = jnp.full(m.shape, -jnp.inf, F32)
        l[...] = jnp.zeros(l.shape, F32)
        acc[...] = jnp.zeros(acc.shape, F32)

    @pl.when(i * tile <= p + rows - 1)  # tile i holds a position some row sees
    def visible_tile():
        m[...], l[...], acc[...] = tile_body(m[...], l[...], acc[...], q_vmem[...],
                                             k_vmem[...], v_vmem[...], i * tile, p,
                                             rows=rows, update=update)

    @pl.when(i == pl.num_programs(0) - 1)
    def finish():
        o_vmem[...] = acc[...] / l[...]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, position, *, rows: int,
           kv_tile: int = 128, update=online_softmax_update, tile_body=attend_tile):
    """Attention of one sequence's query rows q [G*T, H] float32 (row r: head r // T, new
    row t = r % T at position + t) over one kv head's cache k, v [S, H] (already holding
    the new rows) -> [G*T, H] float32. `update`: the online-softmax step; `tile_body`: one
    KV tile, `attend_tile`'s arguments (03's from-spec exercise passes its own)."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        _check_ndim(name, array, 2)
    rows, kv_tile = positive_int("rows", rows), positive_int("kv_tile", kv_tile)
    S, H = k.shape
    if S % kv_tile or q.shape[0] % rows or q.shape[1] != H or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: S must be a multiple of "
                         f"kv_tile={kv_tile}, q [G*T, H] with T=rows={rows}, v as k")
    # The rows sit at position .. position + rows - 1, inside the cache: one row past it
    # would read tiles that are not there, and a negative one none at all.
    position = checked_int32("position", jnp.reshape(position, (1,)) if hasattr(
        position, "shape") else [position], 0, S - rows + 1, "S - rows + 1")

    def kv_map(i, pos):  # past the last visible tile, stay on it: nothing new is read
        return jnp.minimum(i, (pos[0] + rows - 1) // kv_tile), 0
    kv = pl.BlockSpec((kv_tile, H), kv_map)
    whole = pl.BlockSpec(q.shape, lambda i, pos: (0, 0))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(S // kv_tile,), in_specs=[whole, kv, kv],
        out_specs=whole, scratch_shapes=[pltpu.VMEM((q.shape[0], 1), F32)] * 2
        + [pltpu.VMEM(q.shape, F32)])
    return pl.pallas_call(
        functools.partial(attend_kernel, rows=rows, update=update,
                          tile_body=tile_body), grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct(q.shape, F32), name="teach_attend",
    )(position, q, k, v)


# -- 04: the experts ------------------------------------------------------------------------------
def compact_experts_kernel(picked_smem, ids_smem, count_smem, seen_smem):
    """The experts a batch picked, compacted into the slots the expert kernel streams.

    Reads picked_smem [M*X] int32: each row's X routed experts, row after row (a row's X
    differ; rows may share experts). Writes ids_smem [slots] int32: every expert some row
    picked, once, in increasing order, then the last of them again in every slot left
    over; and count_smem [1] int32: how many distinct experts. seen_smem [E] int32 is
    scratch, one flag per expert, holding garbage at the start.

    All of it lives in SMEM, so it is scalar loops (`lax.fori_loop`): clear the flags,
    flag each picked expert, walk the experts 0 .. E-1 writing each flagged one into the
    next free slot, then fill the slots after the last written with its id."""
    E, slots = seen_smem.shape[0], ids_smem.shape[0]

    def clear(e, carry):
        seen_smem[e] = 0
        return carry

    def flag(i, carry):
        seen_smem[picked_smem[i]] = 1
        return carry

    def take(e, count):
        @pl.when(seen_smem[e] > 0)
        def write():
            ids_smem[count] = e

        return count + seen_smem[e]

    def pad(s, carry):
        ids_smem[s] = ids_smem[s - 1]
        return carry

    lax.fori_loop(0, E, clear, 0)
    lax.fori_loop(0, picked_smem.shape[0], flag, 0)
    count = lax.fori_loop(0, E, take, jnp.int32(0))
    lax.fori_loop(count, slots, pad, 0)
    count_smem[0] = count


def compact_experts(picked, experts: int, *, kernel=compact_experts_kernel):
    """picked [M, X] int32 (each row's routed experts, ids in [0, experts)) -> (ids [slots]
    int32 the distinct experts sorted and padded with the last, count [1] int32), slots =
    `mlp.expert_slots(E, X, M)`: what `moe_experts` takes. `kernel` takes
    `compact_experts_kernel`'s refs (04's from-spec exercise passes its own)."""
    _check_ndim("picked", picked, 2)
    E = positive_int("experts", experts)
    (M, X), picked = picked.shape, checked_int32("picked", picked, 0, E, "experts")
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(
        kernel, in_specs=[smem], out_specs=(smem, smem),
        out_shape=(jax.ShapeDtypeStruct((mlp.expert_slots(E, X, M),), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)),
        scratch_shapes=[pltpu.SMEM((E,), jnp.int32)], name="teach_compact_experts",
    )(picked.reshape(-1))


def moe_experts_kernel(ids_smem, count_smem, x_vmem, weight_vmem, gate_vmem, up_vmem,
                       down_vmem, out_vmem):
    s = pl.program_id(0)  # expert slot s holds expert ids_smem[s]

    @pl.when(s == 0)
    def start():
        out_vmem[...] = jnp.zeros(out_vmem.shape, F32)

    @pl.when(s < count_smem[0])  # slots past count are off: no load, no compute
    def expert():
        dtype = gate_vmem.dtype
        x = x_vmem[...].astype(dtype)  # [M, D]
        gate = jnp.dot(x, gate_vmem[0], preferred_element_type=F32)  # [M, Fe]
        up = jnp.dot(x, up_vmem[0], preferred_element_type=F32)
        hidden = (jax.nn.silu(gate) * up).astype(dtype)
        y = jnp.dot(hidden, down_vmem[0], preferred_element_type=F32)  # [M, D]
        e = lax.broadcasted_iota(jnp.int32, weight_vmem.shape, 1)
        w = jnp.sum(jnp.where(e == ids_smem[s], weight_vmem[...], 0.0), 1, keepdims=True)
        out_vmem[...] += w * y  # [M, 1] routing weight of expert ids[s] per row


def moe_experts(x: jax.Array, combine: jax.Array, we_gate: jax.Array, we_up: jax.Array,
                we_down: jax.Array, ids, count: int):
    """sum over slots s < count of combine[:, ids[s]] * SwiGLU of expert ids[s]: x [M, D]
    float32, combine [M, E] float32 routing weights, we_gate, we_up [E, D, Fe], we_down
    [E, Fe, D]; ids [slots] int32 the selected experts (sorted, padded)."""
    _check_experts(x, combine, we_gate, we_up, we_down)
    (M, D), (E, _, Fe) = x.shape, we_gate.shape
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or not len(ids):
        raise ValueError(f"ids={shown(ids)} must be a non-empty list of expert ids, one "
                         "a slot (course.routed's)")
    ids = checked_int32("ids", ids, 0, E, "E")
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) \
            or not 0 <= count <= ids.shape[0]:
        raise ValueError(f"count={shown(count)} must be an integer in [0, {ids.shape[0]}] "
                         "(the live slots of ids)")

    def expert(s, ids, count):  # an off slot keeps the last live slot's expert: no DMA
        return ids[jnp.minimum(s, jnp.maximum(count[0] - 1, 0))], 0, 0
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(ids.shape[0],),
        in_specs=[pl.BlockSpec((M, D), lambda s, *_: (0, 0)),
                  pl.BlockSpec((M, E), lambda s, *_: (0, 0)),
                  pl.BlockSpec((1, D, Fe), expert), pl.BlockSpec((1, D, Fe), expert),
                  pl.BlockSpec((1, Fe, D), expert)],
        out_specs=pl.BlockSpec((M, D), lambda s, *_: (0, 0)))
    return pl.pallas_call(moe_experts_kernel, grid_spec=grid, name="teach_moe_experts",
                          out_shape=jax.ShapeDtypeStruct((M, D), F32),
                          )(ids, jnp.asarray([count], jnp.int32), x, combine, we_gate,
                            we_up, we_down)


def _check_experts(x, combine, we_gate, we_up, we_down) -> None:
    """ValueError naming the first of `moe_experts`' arrays whose shape does not agree:
    x [M, D], combine [M, E], we_gate and we_up [E, D, Fe], we_down [E, Fe, D]."""
    for name, array, ndim in (("x", x, 2), ("combine", combine, 2), ("we_gate", we_gate, 3),
                              ("we_up", we_up, 3), ("we_down", we_down, 3)):
        _check_ndim(name, array, ndim)
    (M, D), (E, _, Fe) = x.shape, we_gate.shape
    for name, array, want in (("combine", combine, (M, E)), ("we_gate", we_gate, (E, D, Fe)),
                              ("we_up", we_up, (E, D, Fe)), ("we_down", we_down, (E, Fe, D))):
        if tuple(array.shape) != want:
            raise ValueError(f"{name} has shape {tuple(array.shape)}; with x [M, D]="
                             f"{tuple(x.shape)} and we_gate [E, D, Fe]={tuple(we_gate.shape)} "
                             f"it must be {want}")


# -- 10: the all-reduce ------------------------------------------------------------------------
def all_reduce(x: jax.Array) -> jax.Array:
    """x [n, R, C]: device i's partial sum at i (n a power of two, C a multiple of n) ->
    [n, R, C], every device's copy of the sum. In each round every device `me` exchanges
    with its partner me XOR d at once (what the kernel's remote DMAs do in parallel)."""
    _check_ndim("x", x, 3)
    n, R, C = x.shape
    if n < 1 or n & (n - 1) or C % n:
        raise ValueError(f"x {x.shape}: n={n} must be a power of two dividing C={C}")
    c = C // n
    held = [[x[me, :, k * c:(k + 1) * c] for k in range(n)] for me in range(n)]
    d = n // 2
    while d >= 1:  # reduce-scatter by recursive halving: d = n/2, ..., 1
        before = [list(h) for h in held]
        for me in range(n):
            first = (me & ~(2 * d - 1)) + (me & d)  # the half of the range holding chunk me
            for k in range(first, first + d):  # plus the partner's partial of that half
                held[me][k] = before[me][k] + before[me ^ d][k]
        d //= 2
    # now device me holds the whole sum of chunk me, and only that one
    gathered = [[held[me][me] if k == me else None for k in range(n)] for me in range(n)]
    d = 1
    while d < n:  # all-gather by recursive doubling: d = 1, 2, ..., n/2
        before = [list(g) for g in gathered]
        for me in range(n):
            first = me & ~(d - 1)  # the aligned block of d chunks gathered so far
            for k in range(first, first + d):  # sent to the partner, same positions
                gathered[me ^ d][k] = before[me][k]
        d *= 2
    return jnp.stack([jnp.concatenate(g, axis=1) for g in gathered])


# -- 01: the ring rule in time ----------------------------------------------------------------
def ring_schedule(stream, *, slots: int, latency_s: float, dma_s: float,
                  compute_s: float, active=None) -> list[dict]:
    """Per tile of `stream` (a `mk.kernels.stream.TileStream`) with a `slots`-deep ring:
    issue (tile g < slots at 0, else when tile g - slots was consumed: the ring rule),
    land (latency after its issue, or when the DMA engine finishes the tile before it,
    plus its transfer), consume start (landed and the compute lane free) and end.
    active(name) -> bool (name as `TileStream.tiles` gives it, "we_gate[3]"): a tile of
    a switched-off segment is neither loaded nor computed, only consumed in order
    (`Ring.skip`): "skipped", start = end = when the lane reaches it."""
    positive_int("slots", slots)
    for field, value in (("latency_s", latency_s), ("dma_s", dma_s), ("compute_s", compute_s)):
        finite_number(field, value)
    if not isinstance(stream, TileStream):
        raise ValueError(f"stream={shown(stream)} must be a mk.kernels.stream.TileStream "
                         "(a plan's stream: DecodePlan.make(...).stream)")
    if active is not None and not callable(active):
        raise ValueError(f"active={shown(active)} must be a function of a tile's name "
                         "(first_copies(count)) or None")
    out, engine, lane = [], 0.0, 0.0  # when the DMA engine and the compute lane are free
    for g, _layer, name, _, _ in stream.tiles():
        issue = 0.0 if g < slots else out[g - slots]["end"]
        on = active is None or active(name)
        land = max(issue + latency_s, engine) + dma_s if on else issue
        engine = land if on else engine
        start = max(land, lane)
        lane = start + (compute_s if on else 0.0)
        out.append(dict(g=g, family=name.split("[")[0], slot=g % slots, issue=issue,
                        land=land, start=start, end=lane, skipped=not on))
    return out


def first_copies(count: int):
    """An `active` for `ring_schedule`: copies 0 .. count - 1 of every repeated segment
    (the live expert slots: `select_experts` compacts the picked experts to the front)
    and every plain segment."""
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) \
            or count < 0:
        raise ValueError(f"count={shown(count)} must be a non-negative integer (live "
                         "expert slots)")

    def active(name: str) -> bool:
        return "[" not in name or int(name.split("[")[1].rstrip("]")) < count
    return active


def tile_times(spec, block, itemsize: int, rows: int) -> dict:
    """`ring_schedule`'s times for one plain tile of `block` on chip `spec` (a
    `mk.model.chips.ChipSpec`): the simulator's assumed DMA latency, the transfer at one core's
    share of the datasheet bandwidth, the MXU rule's compute (`mk.cost.sim`'s rule). `spec`
    may be a chip's name."""
    spec = spec_of(spec, "spec")
    if not isinstance(block, BlockSizes):
        raise ValueError(f"block={shown(block)} must be a mk.kernels.common.BlockSizes")
    itemsize, rows = positive_int("itemsize", itemsize), positive_int("rows", rows)
    cores = spec.cores_per_chip
    return dict(latency_s=sim.Assumptions().dma_latency_s,
                dma_s=block.tile_rows * block.tile_cols * itemsize / (spec.hbm_bw / cores),
                compute_s=perf.mxu_flops(rows, block.tile_rows * block.tile_cols, spec.mxu_rows)
                / (perf.peak_flops(spec) / cores))


# -- Annotated excerpts -----------------------------------------------------------------------
def excerpt(obj, callouts, *, title: str = "") -> Markdown:
    """The real code of `obj` as excerpts: callouts [(first anchor, last anchor, callout)],
    each anchor a piece of one source line (the first line holding it, searched from the
    previous excerpt on); each excerpt shows its module line numbers and is followed by its
    callout; then the whole source folded. Raises if an anchor is missing (the code moved
    on and the page must too)."""
    source, start = inspect.getsourcelines(obj)
    name = f"{obj.__module__}.{obj.__qualname__}"

    def find(anchor, after):
        for i in range(after, len(source)):
            if anchor in source[i]:
                return i
        raise ValueError(f"excerpt of {name}: no line holding {anchor!r} after line "
                         f"{start + after}")

    head = f"{html.escape(title)}: " if title else ""
    parts, at = [f"{head}`{name}`, from line {start} of its module\n"], 0
    for number, (first, last, callout) in enumerate(callouts, 1):
        a = find(first, at)
        b = find(last, a)
        at = b + 1
        lines = "".join(f"{start + i:4d}  {source[i]}" for i in range(a, b + 1))
        parts.append(f"```python\n{lines.rstrip()}\n```\n**({number})** {callout}\n")
    full = html.escape("".join(source))
    parts.append(f"<details><summary>The whole of {name} ({len(source)} lines)</summary>"
                 f"\n\n<pre><code>{full}</code></pre>\n\n</details>")
    return Markdown("\n".join(parts))


def lines_of(obj) -> int:
    """Lines of the source of `obj` (for checking a teaching version stays short)."""
    return len(inspect.getsourcelines(obj)[0])

