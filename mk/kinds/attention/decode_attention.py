"""Stage 03, decode attention: T new query rows per sequence against a KV cache in HBM.

The cache [L, B, K, S, H] stays in HBM; each sequence streams ONLY its KV tiles
0 .. (positions[b] + T - 1) // kv_tile through a VMEM ring (`mk.kernels.kv_stream`), and
per tile each kv head's G*T query rows update an online softmax at once. The new K/V rows
are merged into the tile(s) holding them in VMEM and written back from a staging slot.
gpt-oss adds sinks and sliding windows; MLA's absorbed form is the same body without
values (`latent_attention`).

Here: `attend` (the in-kernel body the fused layer and the megakernel call; its phases
are `_Call`'s methods: `merge_new_rows`, `attend_tile`, `write_back`), the sizes of its
blocks and write-back windows (`block_rows`, `write_back_rows`, `write_back_slots`),
`decode_attention_buffers` / `decode_attention_scratch` (`attention_semaphores`) and the
stage wrappers `decode_attention` and `latent_attention`. Not here: the KV tile stream
and the write-backs' drain (`mk.kernels.kv_stream`), Q/K/V projections, norms and RoPE
(`attention_prologue`), MLA's absorption (`mk.kinds.attention.mla`), the output projection. The
layout, the write-back, the numerics, sinks, windows and MLA at length:
docs/design/mk.kinds.attention.decode_attention.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.config import COMPUTE_DTYPES, LANES, MAX_ROWS
from mk.kernels.common import BlockSizes, Buffer, start_dma, sublanes
from mk.model.ops import exact
from mk.kernels.kv_stream import (AttentionScratch, KvStream, drain_write_backs,
                                  start_write_backs, tile_counts)
from mk.model.decode_checks import check_positions, concrete

ALIGN = 8  # rows of an f32 (8, 128) tile: dynamic row offsets must be multiples of it
F32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # dot_general dims of a @ b.T


def _round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


def block_rows(group: int, rows: int) -> int:
    """R: rows of one (sequence, kv head) query block, G*T padded to the 8-row tile."""
    return _round_up(group * rows)


def write_back_rows(rows: int, kv_tile: int, dtype) -> int:
    """W: rows of the tile-aligned window that covers any T consecutive rows of a tile."""
    sub = sublanes(dtype)
    return min(kv_tile, _round_up(rows - 1, sub) + sub)


def write_back_slots(batch: int) -> int:
    """Staging slots of the write-backs: one layer's, at most two tiles per sequence."""
    return 2 * batch


def decode_attention_buffers(B: int, T: int, N: int, K: int, H: int, dtype,
                             block: BlockSizes, *, operands: bool = False,
                             latent: bool = False) -> list[Buffer]:
    """Every VMEM buffer of `attend` (its scratch, in `AttentionScratch` order); with
    `operands=True` also q, k_new, v_new and o, which the stage kernel keeps in VMEM.
    latent: the values are the keys (MLA's latent cache): no V tiles or rows."""
    dtype = str(jnp.dtype(dtype))
    R, Rt, tile = block_rows(N // K, T), _round_up(T), (block.kv_slots, K, block.kv_tile, H)
    io = [Buffer("q", (B * T, N * H), "float32", "operand"),
          Buffer("k_new", (B * T, K * H), "float32", "operand"),
          Buffer("v_new", (B * T, K * H), "float32", "operand"),
          Buffer("o", (B * T, N * H), "float32", "operand")]
    f32 = "float32"
    back = (write_back_slots(B), K, write_back_rows(T, block.kv_tile, dtype), H)
    scratch = [Buffer(name, shape, dt, "attention") for name, shape, dt in (
        ("k_tiles", tile, dtype), ("v_tiles", tile, dtype),
        ("q_blocks", (B * K * R, H), f32), ("out_blocks", (B * K * R, H), f32),
        ("k_rows", (B * K * Rt, H), f32), ("v_rows", (B * K * Rt, H), f32),
        ("stage", (B * T, H), f32), ("m", (K * R, 1), f32), ("l", (K * R, 1), f32),
        ("acc", (K * R, H), f32), ("k_back", back, dtype), ("v_back", back, dtype))
        if not (latent and name in ("v_tiles", "v_rows", "v_back"))]
    if latent:
        io = [b for b in io if b.name != "v_new"]
    return io + scratch if operands else scratch


def decode_attention_scratch(B: int, T: int, N: int, K: int, H: int, dtype,
                             block: BlockSizes, *, latent: bool = False) -> dict:
    """The pallas scratch of `attend` by `AttentionScratch` field: wrap the refs in
    `AttentionScratch(**refs)`. latent: as `decode_attention_buffers`'."""
    return {b.name: pltpu.VMEM(b.shape, b.dtype)
            for b in decode_attention_buffers(B, T, N, K, H, dtype, block,
                                              latent=latent)} | attention_semaphores(
        block, B, caches=1 if latent else 2)


def attention_semaphores(block: BlockSizes, batch: int, *, caches: int = 2) -> dict:
    """`attend`'s semaphores and SMEM count (`AttentionScratch` fields) for `caches`
    caches (K and V, or the latent one) and `batch` sequences. A write-back staging slot
    has a semaphore of its own: a DMA semaphore counts bytes, so a wait on one shared by
    several DMAs in flight can return for another's bytes."""
    return dict(load_sems=pltpu.SemaphoreType.DMA((caches, block.kv_slots)),
                write_sems=pltpu.SemaphoreType.DMA((caches, write_back_slots(batch))),
                writes=pltpu.SMEM((1,), jnp.int32))


# -- Regrouping rows (static strided copies: Mosaic cannot prove b*T aligned) -------------
def _copy_rows(dst, dst_first: int, dst_stride: int, src, src_first: int, src_stride: int,
               count: int):
    """dst[dst_first + i * dst_stride] = src[src_first + i * src_stride], i < count, all
    static: one strided copy when rows are 128 lanes wide (Mosaic strides only those), else
    one static row copy per i (head dims of 256: Qwen3.5's full attention)."""
    if dst.shape[-1] == LANES and src.shape[-1] == LANES:
        dst[pl.ds(dst_first, count, stride=dst_stride), :] = (
            src[pl.ds(src_first, count, stride=src_stride), :])
        return
    for i in range(count):
        dst[pl.ds(dst_first + i * dst_stride, 1), :] = (
            src[pl.ds(src_first + i * src_stride, 1), :])


def _gather_blocks(src_vmem, dst_vmem, stage, *, rows: int, group: int, block: int):
    """dst[(b*C + c)*block + j*rows + t] = src[b*T + t, head c*group + j] (H lanes each).

    src [B*T, heads*H]; dst [B*C*block, H] with C = heads / group blocks per sequence.
    """
    M, H = stage.shape
    B, heads = M // rows, src_vmem.shape[1] // H
    stride = heads // group * block
    for n in range(heads):
        c, j = divmod(n, group)
        stage[...] = src_vmem[:, pl.ds(n * H, H)]
        for t in range(rows):
            _copy_rows(dst_vmem, c * block + j * rows + t, stride, stage, t, rows, B)


def _scatter_blocks(src_vmem, dst_vmem, stage, *, rows: int, group: int, block: int):
    """The inverse of `_gather_blocks`: blocks [B*C*block, H] -> dst [B*T, heads*H]."""
    M, H = stage.shape
    B, heads = M // rows, dst_vmem.shape[1] // H
    stride = heads // group * block
    for n in range(heads):
        c, j = divmod(n, group)
        for t in range(rows):
            _copy_rows(stage, t, rows, src_vmem, c * block + j * rows + t, stride, B)
        dst_vmem[:, pl.ds(n * H, H)] = stage[...]


# -- The body -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Call:
    """What the phases of one `attend` call read: its scratch, the caches it writes (key
    rows, then value rows: (new rows, tiles, staging slots, cache, write-back DMA name)),
    the tiles P multiplies, the static shapes, and the row-position grids built once
    before the tile loop."""

    s: AttentionScratch
    caches: list
    values: object  # k_tiles (MLA's latent rows: the keys are the values) or v_tiles
    layer: object
    T: int
    K: int
    H: int
    R: int  # rows of a query block: G*T rounded up to 8
    Rt: int  # rows of a new-row block: T rounded up to 8
    tile: int
    sub: int  # the cache dtype's sublanes
    W: int  # rows of a write-back window
    dtype: object
    precision: object
    scale: object
    row_t: object  # [R, kv_tile] int32: t of query block row r
    column: object  # [R, kv_tile] int32: the key's column in its tile
    window: object
    windowed: bool

    def qblock(self, b, k):  # first row of block (b, k): a multiple of 8, as Mosaic needs
        return pl.multiple_of((b * self.K + k) * self.R, ALIGN)

    def write_back(self, cursor, slot, first):
        """Rows [first, first + T) of tile (b, i) to HBM, from a staging slot."""
        s, tile, sub, W, K, H = self.s, self.tile, self.sub, self.W, self.K, self.H
        backs = s.k_back.shape[0]
        b, i = cursor
        start = jnp.minimum(jnp.maximum(first, 0) // sub * sub, tile - W)  # aligned window
        window = pl.ds(pl.multiple_of(start, sub), W)
        rows = pl.ds(pl.multiple_of(i * tile + start, sub), W)
        n = s.writes[0]
        staged = n % backs
        sends = [pltpu.make_async_copy(back.at[staged], cache.at[self.layer, b, :, rows, :],
                                       s.write_sems.at[j, staged])
                 for j, (_, _, back, cache, _) in enumerate(self.caches)]

        @pl.when(n >= backs)
        def free_staging_slot():  # write-back n - 2B sent from it (normally a layer ago),
            for c in sends:  # the one DMA on its semaphore: its size is this one's
                c.wait()

        for c, (_, tiles, back, _, what) in zip(sends, self.caches):
            back[staged] = tiles[slot, :, window, :]
            start_dma(c, what, K * W * H * self.dtype.itemsize)
        s.writes[0] = n + 1

    def attend_tile(self, b, i, p, slot):
        """The online softmax of every kv head's query block against KV tile (b, i)."""
        s, tile, R, dtype = self.s, self.tile, self.R, self.dtype
        visible = i * tile + self.column <= p + self.row_t  # [R, kv_tile]
        if self.windowed:  # a traced window of 0: this layer has none
            visible &= (self.window == 0) | (
                i * tile + self.column > p + self.row_t - self.window)
        for k in range(self.K):
            rows = pl.ds(k * R, R)
            q = s.q_blocks[pl.ds(self.qblock(b, k), R), :].astype(dtype)  # [R, H]
            scores = lax.dot_general(q, s.k_tiles[slot, k], NT, precision=self.precision,
                                     preferred_element_type=F32) * self.scale  # [R, kv_tile]
            scores = jnp.where(visible, scores, -jnp.inf)
            m_prev = s.m[rows, :]
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)  # tile 0 comes first: m_next is finite
            probs = jnp.exp(scores - m_next)
            s.l[rows, :] = alpha * s.l[rows, :] + jnp.sum(probs, 1, keepdims=True)
            pv = jnp.dot(probs.astype(dtype), self.values[slot, k], precision=self.precision,
                         preferred_element_type=F32)  # [R, H]
            s.acc[rows, :] = alpha * s.acc[rows, :] + pv
            s.m[rows, :] = m_next

    def merge_new_rows(self, b, i, p, slot):
        """The T new rows of sequence b into KV tile i in VMEM (keys, and values)."""
        # Row t of the new block lands on tile row p + t - i*kv_tile: a roll by
        # p % kv_tile (the same for both tiles of a straddle) and a mask.
        tile, H, Rt = self.tile, self.H, self.Rt
        first = p - i * tile
        row = lax.broadcasted_iota(jnp.int32, (tile, H), 0)
        new = (row >= first) & (row < first + self.T)
        for rows_vmem, tiles_vmem, *_ in self.caches:
            for k in range(self.K):
                x = rows_vmem[pl.ds(pl.multiple_of((b * self.K + k) * Rt, ALIGN), Rt), :]
                if Rt < tile:  # x [Rt, H] -> [kv_tile, H]
                    x = jnp.concatenate([x, jnp.zeros((tile - Rt, H), F32)], axis=0)
                x = pltpu.roll(x, p % tile, 0)  # [kv_tile, H]
                tiles_vmem[slot, k] = jnp.where(new, x.astype(self.dtype),
                                                tiles_vmem[slot, k])


def _sink_rows(sinks, K: int, G: int, R: int, T: int):
    """[K*R, 1] f32: each query block row's sink logit (block row r of kv head k is head
    k*G + r // T, or padding)."""
    head = lax.broadcasted_iota(jnp.int32, (K * R, 1), 0)
    head = head // R * G + (head % R) // T
    sink_rows = jnp.zeros((K * R, 1), F32)
    for n in range(K * G):
        sink_rows = jnp.where(head == n, sinks[:, n:n + 1].astype(F32), sink_rows)
    return sink_rows


def _call(q_vmem, k_cache_hbm, v_cache_hbm, positions_smem, s: AttentionScratch, *, layer,
          block: BlockSizes, scale, window) -> _Call:
    """The static shapes of an `attend` call, checked, and the grids its tiles share."""
    B = positions_smem.shape[0]
    T = q_vmem.shape[0] // B
    _, _, K, _, H = k_cache_hbm.shape
    G = q_vmem.shape[1] // H // K
    R, tile, dtype = block_rows(G, T), block.kv_tile, k_cache_hbm.dtype
    latent = v_cache_hbm is None
    caches = [(s.k_rows, s.k_tiles, s.k_back, k_cache_hbm, "k_write_back")] + (
        [] if latent else [(s.v_rows, s.v_tiles, s.v_back, v_cache_hbm, "v_write_back")])
    # Query row r of a block is (g, t) = divmod(r, T); its position is positions[b] + t.
    r = lax.broadcasted_iota(jnp.int32, (R, tile), 0)
    row_t = r - T * sum((r >= j * T).astype(jnp.int32) for j in range(1, G))
    column = lax.broadcasted_iota(jnp.int32, (R, tile), 1)
    return _Call(s=s, caches=caches, values=s.k_tiles if latent else s.v_tiles, layer=layer,
                 T=T, K=K, H=H, R=R, Rt=_round_up(T), tile=tile, sub=sublanes(dtype),
                 W=write_back_rows(T, block.kv_tile, dtype), dtype=dtype,
                 precision=exact(s.k_tiles),  # q and probs are rounded to the cache dtype
                 scale=np.float32(1 / math.sqrt(H) if scale is None else scale),
                 row_t=row_t, column=column, window=window,
                 windowed=not (isinstance(window, int) and window == 0))


def attend(
    # Inputs
    q_vmem,  # [B*T, N*H] f32, normed and RoPE'd
    k_new_vmem,  # [B*T, K*H] f32, normed and RoPE'd: the T new rows of each sequence
    v_new_vmem,  # [B*T, K*H] f32, or None: the values are the keys (MLA's latent rows)
    positions_smem,  # [B] int32: row t of sequence b sits at positions[b] + t
    # Inputs and outputs: the new rows are written in place
    k_cache_hbm,  # [L, B, K, S, H] cache dtype
    v_cache_hbm,  # [L, B, K, S, H] cache dtype, or None with v_new_vmem None
    # Outputs
    o_vmem,  # [B*T, N*H] f32
    # Scratch
    scratch: AttentionScratch,
    *,
    layer,  # int or traced int32 scalar: which layer of the cache
    block: BlockSizes,
    primed: bool = False,  # the caller ran KvStream(...).prime() for this layer
    scale: float | None = None,  # of the scores; default 1/sqrt(H)
    sinks=None,  # [1, N] f32 value: a learned logit per query head (gpt-oss), or None
    window=0,  # int or traced int32: the layer's sliding window (positions; 0: none)
):
    """Causal GQA of q against layer `layer` of the cache, after writing k_new, v_new.

    Without values (v_cache_hbm None) the key rows are the values too: MLA's absorbed
    decode, multi-query attention over the latent cache, whose output is P @ latent rows
    (the caller keeps the latent part of it); its scale is the unabsorbed head's.
    With `sinks` each head's softmax has one more logit that weighs no value: the online
    softmax starts from it (running max the sink, running sum 1) instead of from nothing,
    so a row none of a tile's keys are visible to never divides 0 by 0. With a `window`
    (it needs the sinks) a row at position q sees keys q - window < s <= q, and only the
    tiles holding some come in (`mk.kernels.kv_stream.first_kv_tile`).
    Every DMA it starts (or `KvStream.prime` started) is waited for before it returns,
    but the write-backs of the new rows: they stay in flight from their staging slots
    (module docstring; the kernel ran `start_write_backs` and runs `drain_write_backs`).
    """
    s = scratch
    B = positions_smem.shape[0]
    T = q_vmem.shape[0] // B
    _, _, K, _, H = k_cache_hbm.shape
    G = q_vmem.shape[1] // H // K
    windowed = not (isinstance(window, int) and window == 0)
    if windowed and sinks is None:  # a row could then see no key of a whole tile
        raise ValueError("attend: a sliding window needs the sinks (gpt-oss's attention)")
    R, Rt = block_rows(G, T), _round_up(T)
    _gather_blocks(q_vmem, s.q_blocks, s.stage, rows=T, group=G, block=R)
    for rows_vmem, new in zip((s.k_rows, s.v_rows),
                              (k_new_vmem, v_new_vmem)[:1 if v_cache_hbm is None else 2]):
        _gather_blocks(new, rows_vmem, s.stage, rows=T, group=1, block=Rt)

    kv = KvStream(positions_smem, k_cache_hbm, v_cache_hbm, s, rows=T, layer=layer,
                  block=block, window=window)
    total, advance, copies, slots = kv.total, kv.advance, kv.copies, block.kv_slots
    call = _call(q_vmem, k_cache_hbm, v_cache_hbm, positions_smem, s, layer=layer,
                 block=block, scale=scale, window=window)
    sink_rows = None if sinks is None else _sink_rows(sinks, K, G, R, T)
    tile = call.tile
    ahead = kv.prime(issue=not primed)  # the next tile to issue

    def step(g, carry):
        cursor, ahead = carry
        b, i = cursor
        p = positions_smem[b]
        slot = g % slots
        written = i >= p // tile  # this tile holds some of the new rows

        # Tile g + slots - 1 goes into the slot that tile g - 1 (and its write-back) left.
        @pl.when(g + slots - 1 < total)
        def prefetch():
            kv.start(ahead, (g + slots - 1) % slots)

        @pl.when(i == kv.first_of(b))
        def start_sequence():  # from nothing, or from the sink: its logit, weight 1
            if sinks is None:
                s.m[...] = jnp.full(s.m.shape, -jnp.inf, F32)
                s.l[...] = jnp.zeros(s.l.shape, F32)
            else:
                s.m[...] = sink_rows
                s.l[...] = jnp.ones(s.l.shape, F32)
            s.acc[...] = jnp.zeros(s.acc.shape, F32)

        for c in copies(cursor, slot):
            c.wait()

        @pl.when(written)
        def write_new_rows():
            call.merge_new_rows(b, i, p, slot)

        call.attend_tile(b, i, p, slot)

        # Sent from a staging slot, so the KV slot is free for the next prefetch at once.
        @pl.when(written)
        def send_new_rows():
            call.write_back(cursor, slot, p - i * tile)

        @pl.when(i == kv.last_of(b))
        def finish_sequence():
            out = s.out_blocks.at[pl.ds(call.qblock(b, 0), K * R), :]
            out[...] = s.acc[...] / s.l[...]

        return advance(cursor), advance(ahead)

    lax.fori_loop(0, total, step, (kv.first(), ahead))
    _scatter_blocks(s.out_blocks, o_vmem, s.stage, rows=T, group=G, block=R)


def decode_attention_kernel(
    # Inputs
    layer_smem,  # [1] int32
    positions_smem,  # [B] int32
    q_vmem,  # [B*T, N*H] f32
    k_new_vmem,  # [B*T, K*H] f32
    v_new_vmem,  # [B*T, K*H] f32
    sinks_vmem,  # [1, N] f32: each head's sink logit (zeros and unread without sinks)
    k_cache_in_hbm,  # [L, B, K, S, H], aliased to k_cache_hbm
    v_cache_in_hbm,  # [L, B, K, S, H], aliased to v_cache_hbm
    # Outputs
    o_vmem,  # [B*T, N*H] f32
    k_cache_hbm,  # [L, B, K, S, H] cache dtype, updated in place
    v_cache_hbm,  # [L, B, K, S, H] cache dtype
    *,
    block: BlockSizes,
    sinks: bool,  # whether the heads have sinks
    window: int,  # the sliding window (0: none)
    **scratch,  # decode_attention_scratch, by name
):
    del k_cache_in_hbm, v_cache_in_hbm  # the same buffers as the outputs
    s = AttentionScratch(**scratch)
    start_write_backs(s)
    attend(q_vmem, k_new_vmem, v_new_vmem, positions_smem, k_cache_hbm, v_cache_hbm, o_vmem,
           s, layer=layer_smem[0], block=block, sinks=sinks_vmem[...] if sinks else None,
           window=window)
    drain_write_backs(s, k_cache_hbm, v_cache_hbm)


# -- The stage wrapper ----------------------------------------------------------------------
def _validate(q, k_new, v_new, k_cache, v_cache, positions, layer, block, *,
              lanes: int = LANES):
    """(B, T, N, K, H) of a legal call (H a multiple of `lanes`); raises ValueError naming
    the bad field."""
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both "
                         "be [L, B, K, S, H]")
    if k_cache.dtype != v_cache.dtype or str(k_cache.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"cache dtypes {k_cache.dtype}, {v_cache.dtype} must be one of "
                         f"{COMPUTE_DTYPES} and agree")
    L, B, K, S, H = k_cache.shape
    if H % lanes:
        raise ValueError(f"head_dim H={H} must be a multiple of {lanes} on TPU")
    if positions.shape != (B,):
        raise ValueError(f"positions shape {positions.shape} must be [B={B}]")
    if q.ndim != 2 or q.shape[0] % B or q.shape[1] % (K * H):
        raise ValueError(f"q shape {q.shape} must be [B*T, N*H] with B={B}, H={H} and N a "
                         f"multiple of K={K}")
    T, N = q.shape[0] // B, q.shape[1] // H
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != (B * T, K * H):
            raise ValueError(f"{name} shape {x.shape} must be [B*T={B * T}, K*H={K * H}]")
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if x.dtype != F32:
            raise ValueError(f"{name} dtype {x.dtype} must be float32")
    if not 1 <= B * T <= MAX_ROWS:
        raise ValueError(f"rows B*T={B * T} must be in [1, {MAX_ROWS}]")
    block.check_context(S)
    if T > block.kv_tile:
        raise ValueError(f"T={T} new rows per sequence exceed kv_tile={block.kv_tile}")
    lay = concrete(layer)
    if lay is not None and not 0 <= int(lay) < L:
        raise ValueError(f"layer={int(lay)} must be in [0, L={L})")
    check_positions(positions, T, S)
    return B, T, N, K, H


def decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, positions: jax.Array, *, layer=0,
                     block: BlockSizes | None = None, sinks=None, window: int = 0):
    """-> (o [B*T, N*H] float32, k_cache, v_cache with the new rows of `layer` written).

    q [B*T, N*H], k_new, v_new [B*T, K*H] float32 (normed, RoPE'd); caches [L, B, K, S,
    H]; positions [B] int32 (row t of sequence b sits at positions[b] + t); `layer` may be
    traced; sinks [N] (gpt-oss's: a logit per head) and a sliding `window` (> 0, with
    sinks; positions) as `mk.model.ops.attention`'s. Positions and layer are checked when they
    are concrete.
    """
    positions = jnp.asarray(positions, jnp.int32)
    block = block or BlockSizes()
    B, T, N, K, H = _validate(q, k_new, v_new, k_cache, v_cache, positions, layer, block)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0 \
            or (window and sinks is None):
        raise ValueError(f"window={window!r} must be an integer >= 0, and > 0 only with "
                         "sinks")
    if sinks is not None and jnp.shape(sinks) != (N,):
        raise ValueError(f"sinks shape {jnp.shape(sinks)} must be [N={N}]")
    sinks_row = (jnp.zeros((1, N), F32) if sinks is None
                 else jnp.asarray(sinks, F32).reshape(1, N))
    pos = concrete(positions)
    if pos is None:  # traced: the estimate assumes full caches
        read, written = B * k_cache.shape[3] // block.kv_tile, 2 * B
    else:
        read, written = tile_counts(pos, T, block.kv_tile, window)
    row_bytes = 2 * K * H * k_cache.dtype.itemsize  # K and V of one position
    W = write_back_rows(T, block.kv_tile, k_cache.dtype)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    return pl.pallas_call(
        functools.partial(decode_attention_kernel, block=block, sinks=sinks is not None,
                          window=window),
        out_shape=(jax.ShapeDtypeStruct(q.shape, F32),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        in_specs=[smem, smem, vmem, vmem, vmem, vmem, hbm, hbm],
        out_specs=(vmem, hbm, hbm),
        scratch_shapes=decode_attention_scratch(B, T, N, K, H, k_cache.dtype, block),
        input_output_aliases={6: 1, 7: 2},
        name="mk_decode_attention",
        cost_estimate=pl.CostEstimate(
            flops=4 * read * N * T * block.kv_tile * H,
            transcendentals=read * N * T * block.kv_tile,
            bytes_accessed=(read * block.kv_tile + written * W) * row_bytes
            + 4 * (2 * q.size + k_new.size + v_new.size)),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), positions, q, k_new, v_new,
      sinks_row, k_cache, v_cache)


# -- MLA's absorbed decode over the latent cache -------------------------------------------
def latent_attention_kernel(layer_smem, positions_smem, q_vmem, latent_new_vmem,
                            cache_in_hbm, o_vmem, cache_hbm, *, block: BlockSizes,
                            scale: float, **scratch):
    del cache_in_hbm  # the same buffer as the output
    s = AttentionScratch(**scratch)
    start_write_backs(s)
    attend(q_vmem, latent_new_vmem, None, positions_smem, cache_hbm, None, o_vmem, s,
           layer=layer_smem[0], block=block, scale=scale)
    drain_write_backs(s, cache_hbm)


def latent_attention(q: jax.Array, latent_new: jax.Array, latent_cache: jax.Array,
                     positions: jax.Array, *, scale: float, layer=0,
                     block: BlockSizes | None = None):
    """MLA's absorbed decode attention (`attend` without values): -> (o [B*T, N*W] float32,
    latent_cache with the new rows of `layer` written).

    q [B*T, N*W] float32: each head's query absorbed into the latent space (its no-RoPE
    part times the head's key up-projection, then its shared-key part); latent_new
    [B*T, W] float32: the new rows (the normed latent, then the shared key part);
    latent_cache [La, B, S, W] (`mk.model.cache.LatentCache.latent`); scale: the
    unabsorbed head's 1/sqrt(head_dim). Row n*W + j of o is head n's P @ latent rows: its
    first kv_lora_rank lanes times the head's value up-projection give the head's output.
    """
    positions = jnp.asarray(positions, jnp.int32)
    block = block or BlockSizes()
    if latent_cache.ndim != 4:
        raise ValueError(f"latent_cache shape {latent_cache.shape} must be [La, B, S, W]")
    cache = latent_cache[:, :, None]  # one shared "kv head"
    B, T, N, K, W = _validate(q, latent_new, latent_new, cache, cache, positions, layer,
                              block, lanes=ALIGN)
    read, written = ((B * cache.shape[3] // block.kv_tile, 2 * B)
                     if concrete(positions) is None else
                     tile_counts(concrete(positions), T, block.kv_tile))
    rows = write_back_rows(T, block.kv_tile, cache.dtype)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    o, cache = pl.pallas_call(
        functools.partial(latent_attention_kernel, block=block, scale=scale),
        out_shape=(jax.ShapeDtypeStruct(q.shape, F32),
                   jax.ShapeDtypeStruct(cache.shape, cache.dtype)),
        in_specs=[smem, smem, vmem, vmem, hbm],
        out_specs=(vmem, hbm),
        scratch_shapes=decode_attention_scratch(B, T, N, K, W, cache.dtype, block,
                                                latent=True),
        input_output_aliases={4: 1},
        name="mk_latent_attention",
        cost_estimate=pl.CostEstimate(
            flops=4 * read * N * T * block.kv_tile * W,
            transcendentals=read * N * T * block.kv_tile,
            bytes_accessed=(read * block.kv_tile + written * rows) * W * cache.dtype.itemsize
            + 4 * (2 * q.size + latent_new.size)),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), positions, q, latent_new, cache)
    return o, cache[:, :, 0]
