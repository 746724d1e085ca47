"""The KV cache's traffic around decode attention's body
(`mk.kinds.attention.decode_attention.attend`): the named scratch refs (`AttentionScratch`), the
stream of KV tiles in (`KvStream`) and the write-backs' staging slots, drained at a
kernel's end (`start_write_backs`, `drain_write_backs`). The stage kernels, the fused
layer and the megakernel drive these around their attention layers.

Per sequence only its visible KV tiles come from HBM (`first_kv_tile`, `kv_tiles`,
`tile_counts`), all sequences' tiles one stream through a `kv_slots`-deep VMEM ring
(`KvStream.prime` issues the first loads at a layer's start); a write-back of new rows is
sent from one of 2B staging slots and waited for only when its slot is needed again,
normally a full layer later.

Not here: the attention body that reads the tiles, merges the new rows and starts the
write-backs (`attend`), the sizes and allocation of the scratch
(`decode_attention_buffers`, `decode_attention_scratch`, `attention_semaphores`), the
stage wrappers (all `mk.kinds.attention.decode_attention`). The stream and the staging slots at
length: docs/design/mk.kernels.kv_stream.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernels.common import BlockSizes, start_dma


def first_kv_tile(position, kv_tile: int, window=0):
    """The first KV tile a sequence at `position` reads: tile 0, or in a layer with a
    sliding window of `window` positions (> 0; a traced or a host integer) the tile
    holding position - window + 1, the oldest position its first new row sees."""
    if isinstance(window, (int, np.integer)) and not window:
        return 0
    if isinstance(window, (int, np.integer)) and isinstance(position, (int, np.integer)):
        return max(position - window + 1, 0) // kv_tile
    return jnp.where(window > 0, jnp.maximum(position - window + 1, 0) // kv_tile, 0)


def last_kv_tile(position, rows: int, kv_tile: int):
    """The last KV tile a sequence at `position` reads: the one holding its last new row."""
    return (position + rows - 1) // kv_tile


def kv_tiles(position, rows: int, kv_tile: int, window=0):
    """How many KV tiles a sequence at `position` reads for its `rows` new rows: tiles
    `first_kv_tile` .. `last_kv_tile` (0 .. (position + rows - 1) // kv_tile without a
    window): the one count the kernel, `tile_counts`, the plan and the simulator use."""
    first = first_kv_tile(position, kv_tile, window)
    end = last_kv_tile(position, rows, kv_tile) + 1
    return end if isinstance(first, int) and first == 0 else end - first


def tile_counts(positions, rows: int, kv_tile: int, window: int = 0) -> tuple[int, int]:
    """(tiles read, tiles written back) of one layer (with a sliding window of `window`
    positions, or 0) for sequences at `positions`; a tile is K and V of all K heads, and a
    written tile sends `write_back_rows` rows of it back."""
    pos = [int(p) for p in np.asarray(positions)]
    read = sum(kv_tiles(p, rows, kv_tile, window) for p in pos)
    return read, sum(last_kv_tile(p, rows, kv_tile) + 1 - p // kv_tile for p in pos)


class AttentionScratch(NamedTuple):
    """The scratch refs of `attend`, by the names `decode_attention_scratch` gives them
    (with values in the keys, the latent cache's, there are no v_tiles and v_rows)."""

    k_tiles: Any = None  # [kv_slots, K, kv_tile, H] cache dtype: the KV ring
    v_tiles: Any = None  # [kv_slots, K, kv_tile, H] cache dtype
    q_blocks: Any = None  # [B*K*R, H] f32: rows (g, t) of block (b, k)
    out_blocks: Any = None  # [B*K*R, H] f32: attention output, same layout
    k_rows: Any = None  # [B*K*Rt, H] f32, Rt = round_up(T, 8): new K rows t of block (b, k)
    v_rows: Any = None  # [B*K*Rt, H] f32
    stage: Any = None  # [B*T, H] f32: one head's column, for the strided regrouping
    m: Any = None  # [K*R, 1] f32 running max of the current sequence
    l: Any = None  # [K*R, 1] f32 running sum
    acc: Any = None  # [K*R, H] f32 running P @ V
    k_back: Any = None  # [2B, K, W, H] cache dtype: write-backs in flight (staging slots)
    v_back: Any = None  # [2B, K, W, H] cache dtype
    load_sems: Any = None  # DMA semaphores [2, kv_slots]: K and V tile loads
    write_sems: Any = None  # DMA semaphores [2, 2B]: K and V write-backs, one per staging slot
    writes: Any = None  # SMEM [1] int32: write-backs started since the kernel's start


def start_write_backs(scratch: AttentionScratch) -> None:
    """At a kernel's start, before its first `attend`: no write-back is in flight."""
    scratch.writes[0] = 0


def drain_write_backs(scratch: AttentionScratch, k_cache_hbm, v_cache_hbm=None) -> None:
    """At a kernel's end: wait for the write-backs `attend` left in flight (the last 2B
    started, or all if fewer), on the caches it wrote (v_cache_hbm None: the latent one)."""
    s = scratch
    backs, _, W, _ = s.k_back.shape
    pairs = [(s.k_back, k_cache_hbm)] + ([] if v_cache_hbm is None else
                                         [(s.v_back, v_cache_hbm)])

    n = s.writes[0]

    def wait(i, carry):  # staging slot (n - 1 - i) % 2B holds write-back n - 1 - i, the one
        staged = (n - 1 - i) % backs  # DMA on its semaphore, of this size
        for j, (back, cache) in enumerate(pairs):
            pltpu.make_async_copy(back.at[staged], cache.at[0, 0, :, pl.ds(0, W), :],
                                  s.write_sems.at[j, staged]).wait()
        return carry

    lax.fori_loop(0, jnp.minimum(n, backs), wait, 0)
    s.writes[0] = 0


class KvStream:
    """The KV tiles one layer's attention reads, in order: sequence by sequence, each
    sequence's tiles `first_kv_tile` .. `last_kv_tile` (0 .. (positions[b] + T - 1) //
    kv_tile, or from its window's first), through a `kv_slots` ring; a cursor (b, i) names
    tile i of sequence b's cache.

    `prime()` issues the first kv_slots - 1 loads; it needs only the positions and the
    cache, so a fused layer issues them at the layer's start, before its projections, and
    `attend(..., primed=True)` carries on from there.
    """

    def __init__(self, positions_smem, k_cache_hbm, v_cache_hbm, scratch: AttentionScratch,
                 *, rows: int, layer, block: BlockSizes, window=0):
        # v_cache_hbm None: the values are the keys (MLA's latent cache), one load a tile;
        # window: the layer's sliding window (a traced or host integer; 0: none)
        self.positions_smem = positions_smem
        self.caches = (k_cache_hbm,) if v_cache_hbm is None else (k_cache_hbm, v_cache_hbm)
        self.s, self.T, self.layer, self.block = scratch, rows, layer, block
        self.window = window
        B = positions_smem.shape[0]
        self.total = lax.fori_loop(0, B, lambda b, n: n + self.tiles_of(b), jnp.int32(0))

    def _position(self, b):  # sequence b's position (the last one's past the end)
        return self.positions_smem[jnp.minimum(b, self.positions_smem.shape[0] - 1)]

    def tiles_of(self, b):  # KV tiles sequence b reads: its window's up to its last new row
        return kv_tiles(self._position(b), self.T, self.block.kv_tile, self.window)

    def first_of(self, b):  # the first tile sequence b reads
        return first_kv_tile(self._position(b), self.block.kv_tile, self.window)

    @property
    def windowed(self) -> bool:
        return not (isinstance(self.window, int) and self.window == 0)

    def last_of(self, b):  # the last tile sequence b reads (without a window: its count - 1)
        if not self.windowed:
            return self.tiles_of(b) - 1
        return last_kv_tile(self._position(b), self.T, self.block.kv_tile)

    def first(self):  # the stream's first cursor
        return jnp.int32(0), jnp.asarray(self.first_of(0), jnp.int32)

    def advance(self, cursor):  # (b, i) -> the next tile of the stream
        b, i = cursor
        if not self.windowed:  # every sequence from its tile 0
            last, first = i + 1 == self.tiles_of(b), 0
        else:
            last, first = i == self.last_of(b), self.first_of(b + 1)
        return jnp.where(last, b + 1, b), jnp.where(last, first, i + 1)

    def copies(self, cursor, slot):  # the K and V loads of tile (b, i) (K only: latent)
        b, i = cursor
        tile = self.block.kv_tile
        rows = pl.ds(pl.multiple_of(i * tile, tile), tile)
        return [pltpu.make_async_copy(cache.at[self.layer, b, :, rows, :], tiles.at[slot],
                                      self.s.load_sems.at[j, slot])
                for j, (cache, tiles) in enumerate(zip(self.caches, (self.s.k_tiles,
                                                                     self.s.v_tiles)))]

    def start(self, cursor, slot):  # issue the K and V loads of tile (b, i)
        k_tiles = self.s.k_tiles
        nbytes = math.prod(k_tiles.shape[1:]) * k_tiles.dtype.itemsize
        for c, what in zip(self.copies(cursor, slot), ("k_tile", "v_tile")):
            start_dma(c, what, nbytes)

    def prime(self, issue: bool = True):
        """Issue tiles 0 .. kv_slots - 2 (those that exist); return the cursor of the next
        tile to issue. `issue=False` only computes the cursor (the stream was primed). A
        loop: the kernel's code does not grow with kv_slots."""
        def tile(j, ahead):
            if issue:
                @pl.when(j < self.total)
                def prime_tile():
                    self.start(ahead, j)
            return self.advance(ahead)

        return lax.fori_loop(0, self.block.kv_slots - 1, tile, self.first())
