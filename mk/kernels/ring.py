"""The weight ring: weight tiles streamed HBM -> VMEM through N slots, never stalling.

A kernel consumes an ordered list of weight tiles, `TileStream`: segments (one weight
matrix each, cut into tile_rows x tile_cols tiles by `BlockSizes.cut`, output panel by
output panel; a weight `BlockSizes.tiles` names in tiles of its own shape), repeated once
per layer, then an optional tail (the lm_head). Tile g of the
stream lives in ring slot g % slots. The rule that makes the ring work: when tile g has
been consumed, tile g + slots is issued into the slot it just freed. Because g runs across
segment and layer boundaries, the loads for the next matrix, the next layer and the lm_head
are already in flight while the current one computes: memory never waits at a matrix or
layer edge.

`TileStream` is static data (a reader can print it; the simulator and plots replay it).
`Ring` is the in-kernel side: `prime`, `start(g)`, `slot(g)`, `skip`, and `matmul`, which
multiplies activations by one segment while keeping the ring full (it waits for each of
its tiles: it knows which segment they belong to).

The weights sit in HBM in stream order (`ring_layout`, made once by the kernel's
wrapper or `mk.megakernel.prepare`): each matrix as [tiles, tile_rows, tile_cols], tile t
at index t, so every tile is one contiguous DMA at one address (`fetch(layer).at[t]`),
whatever the matrix's shape. A matrix whose transpose is the one the tiles divide (on a
tensor-parallel shard the row-sharded wo and w_down: [narrow, D]) is stored transposed
and multiplied as x @ tile^T, so one tall tile shape (D x 128 and more) serves every
matrix of a shard. A plain tile narrower than PANEL_COLS is stored folded, its row blocks
side by side (`Segment.fold`, `mk.kernels.fold`): same bytes, fewer bundles a tile.

Tiles of different shapes and storages share the one slot index: tile g lands in slot
g % slots of its segment's own ring buffer (`ring_buffers`: one per `TileStream.storages`
entry, plain or packed, each tile shape; `TileStream.buffer_name`), so every buffer is
slots deep and the prefetch rule is unchanged. What that costs: VMEM for slots tiles of
every shape, and one depth for all (`mk.kernels.plan.ring_slots`: Little's law over the
stream's own tile sequence), so shapes of very different bytes do not mix well.

A segment may be switched off at run time (`active`), e.g. the slot of an expert no token
selected: its tiles are neither loaded nor waited for, but still "consumed" in order so
the tiles behind it are issued.

A segment may be stored quantised (`Segment.scheme`, one of `mk.quant.SCHEMES`): its tiles
travel as packed data plus their scale block (two DMAs on the slot's semaphore, both waited
for) into that scheme's own buffers (`ring_buffers`), tile g still in slot g % slots, and
reach the MXU as the segment's feed says (`Segment.feed`, chosen per chip by the plan:
`mk.unpack.choose_feeds`): dequantised in VMEM to the compute dtype (`mk.unpack.
dequantize_tile`) before one product, or fed fp8 (fp8 and fp4 on TPU7x) as e4m3 codes with
each scale block's float32 product rows scaled after (`mk.unpack.fp8_product`; why, and what each
feed costs: `mk.unpack`'s docstring). Either way the product is the reference's on
`mk.quant.dequantize(params, feeds=...)`'s weights.

A run of matrices may be repeated (`Repeat`), e.g. gate, up, down once per expert slot:
copy c's Fetch gets (layer, c) and `matmul(..., copy=c)` takes a traced c, so a kernel
loops over copies with `fori_loop` and its code does not grow with their number.

Not here: what a kernel computes with the products (the stage kernels and the
megakernel), KV tiles (`decode_attention`, whose KV ring is shaped by positions).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk import quant, unpack
from mk.kernels.common import BlockSizes, Buffer, start_dma
from mk.kernels.fold import fold_tiles, folded_product, folded_shape, panel_fold


@dataclasses.dataclass(frozen=True)
class Segment:
    """One weight matrix of the stream: its name and its tile grid."""

    name: str
    in_tiles: int  # tiles along K, the contraction (`BlockSizes.cut`)
    out_tiles: int  # tiles along N, the output
    transposed: bool = False  # stored as W^T [N, K] (`BlockSizes.cut`)
    start: int = 0  # offset of its first tile within a layer (or within the tail)
    copies: int = 1  # in a `Repeat`: copy c starts at start + c * stride
    stride: int = 0  # tiles from one copy to the next (a Repeat's tiles per copy); 0 if
    #                  the segment is not repeated
    scheme: str | None = None  # mk.quant storage scheme of its tiles; None: plain
    feed: str = "bf16"  # what its tiles reach the MXU as (mk.unpack.FEEDS): "bf16"
    #                     dequantised to the compute dtype, "fp8" as e4m3 with scales after
    tile: tuple[int, int] = (0, 0)  # (rows, cols) of its stored tiles (`TileStream.build`)

    @property
    def tiles(self) -> int:
        """Tiles of one copy."""
        return self.in_tiles * self.out_tiles

    @property
    def fold(self) -> int:
        """Row blocks of its tile stored side by side in HBM and VMEM (`stored_fold`)."""
        return stored_fold(self.scheme, self.tile)

    @property
    def end(self) -> int:
        return self.start + (self.copies - 1) * self.stride + self.tiles

    def locate(self, local):
        """(hit, copy, t): whether layer-local tile `local` (traced) is tile t of copy
        `copy` of this segment; copy is clamped into range so a miss still indexes safely."""
        if not self.stride:
            return (local >= self.start) & (local < self.end), 0, local - self.start
        offset = local - self.start
        copy, t = offset // self.stride, offset % self.stride
        hit = (offset >= 0) & (copy < self.copies) & (t < self.tiles)
        return hit, jnp.clip(copy, 0, self.copies - 1), t


@dataclasses.dataclass(frozen=True)
class Repeat:
    """`copies` back-to-back copies of a run of matrices (name, rows, cols)."""

    copies: int
    matrices: tuple

    def __post_init__(self):
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 1:
            raise ValueError(f"Repeat.copies={self.copies!r} must be an integer >= 1")


def _place(groups) -> tuple[Segment, ...]:
    """groups: (copies or None for a plain matrix, its segments) in stream order."""
    placed, offset = [], 0
    for copies, segments in groups:
        stride = sum(s.tiles for s in segments) if copies else 0
        for s in segments:
            placed.append(dataclasses.replace(s, start=offset, copies=copies or 1,
                                              stride=stride))
            offset += s.tiles
        offset += max(0, (copies or 1) - 1) * stride
    return tuple(placed)


@dataclasses.dataclass(frozen=True)
class TileStream:
    """Every weight tile a kernel loads, in the order it consumes them.

    Global tile index g: layer l's segment s tile t is g = l * period + s.start + t; the
    tail's tiles follow all layers.
    """

    block: BlockSizes
    segments: tuple[Segment, ...]  # one layer's matrices, in consumption order
    layers: int = 1
    tail: tuple[Segment, ...] = ()

    @classmethod
    def build(cls, block: BlockSizes, matrices, *, layers: int = 1, tail=(),
              schemes=None, feeds=None) -> TileStream:
        """matrices / tail: (name, rows, cols) of each weight, or a `Repeat` of such
        triples, in consumption order; schemes: {name: mk.quant scheme} of the weights
        stored quantised; feeds: {name: mk.quant feed} of those not fed bf16. Each weight
        is cut into the block's tiles, or those `block.tiles` gives it."""
        schemes, feeds, tiles = dict(schemes or {}), dict(feeds or {}), dict(block.tiles)
        own = (block.tile_rows, block.tile_cols)
        for name, feed in feeds.items():
            if feed not in unpack.FEEDABLE[schemes.get(name)]:
                raise ValueError(f"feeds[{name!r}]={feed!r}: weight {name} stored "
                                 f"{schemes.get(name) or 'plain'} cannot be fed {feed}")

        def segs(items):
            out = []
            for name, rows, cols in items:
                shaped = block if name not in tiles else dataclasses.replace(
                    block, tile_rows=tiles[name][0], tile_cols=tiles[name][1])
                if name in schemes:  # raises if its tiles do not hold whole groups
                    quant.tile_shapes(schemes[name], shaped.tile_rows, shaped.tile_cols)
                cut = shaped.cut(name, rows, cols, transpose=name not in schemes)
                out.append(Segment(name, cut.in_tiles, cut.out_tiles, cut.transposed,
                                   scheme=schemes.get(name), feed=feeds.get(name, "bf16"),
                                   tile=tiles.get(name, own)))
            return out

        def groups(items):
            return _place((i.copies, segs(i.matrices)) if isinstance(i, Repeat)
                          else (None, segs([i])) for i in items)
        return cls(block, groups(matrices), layers, groups(tail))

    @property
    def period(self) -> int:
        return sum(s.copies * s.tiles for s in self.segments)

    @property
    def total(self) -> int:
        return self.layers * self.period + sum(s.copies * s.tiles for s in self.tail)

    def segment(self, name: str) -> Segment:
        for s in self.segments + self.tail:
            if s.name == name:
                return s
        raise KeyError(f"no segment {name!r} in the stream")

    def shape(self, segment: Segment) -> tuple[int, int]:
        """(K, N) of the matrix `segment` cuts (its logical [K, N], not the stored one)."""
        r, c = segment.tile
        step, panel = (c, r) if segment.transposed else (r, c)
        return segment.in_tiles * step, segment.out_tiles * panel

    def base(self, layer, segment: Segment, copy=0):
        """Global index of the first tile of `segment` (copy `copy`) in `layer` (layer and
        copy may be traced)."""
        first = segment.start + copy * segment.stride
        if segment in self.tail:
            return self.layers * self.period + first
        return layer * self.period + first

    def tiles(self):
        """(g, layer or None for the tail, segment name, contraction step, output panel) of
        every tile; a repeated segment's name carries its copy: "we_gate[3]"."""
        def ordered(segments):
            return sorted((s.start + c * s.stride + t, s, c, t) for s in segments
                          for c in range(s.copies) for t in range(s.tiles))

        def named(s, c):
            return f"{s.name}[{c}]" if s.stride else s.name

        for layer in range(self.layers):
            for local, s, c, t in ordered(self.segments):
                yield (layer * self.period + local, layer, named(s, c), t % s.in_tiles,
                       t // s.in_tiles)
        for local, s, c, t in ordered(self.tail):
            yield (self.layers * self.period + local, None, named(s, c), t % s.in_tiles,
                   t // s.in_tiles)

    def table(self, itemsize: int = 2) -> list[dict]:
        """One dict per tile (g, layer, matrix, contraction step, output panel, ring slot,
        KiB), for a table; itemsize: bytes per element of the plain segments."""
        return [dict(g=g, layer="lm_head" if layer is None else layer, matrix=name,
                     k_step=i, panel=j, slot=g % self.block.slots,
                     KiB=self.segment_tile_bytes(self.segment(name.split("[")[0]),
                                                 itemsize) / 1024)
                for g, layer, name, i, j in self.tiles()]

    def segment_tile_bytes(self, segment: Segment, itemsize: int) -> int:
        """Bytes one tile of `segment` moves: its tile's elements x itemsize when plain,
        its packed data and scale block when quantised (`mk.quant.tile_bytes`)."""
        k, n = segment.tile
        return k * n * itemsize if segment.scheme is None else quant.tile_bytes(
            segment.scheme, k, n)

    @property
    def storages(self) -> tuple[tuple[str | None, tuple[int, int]], ...]:
        """(scheme or None for plain, tile shape) of each set of ring buffers the stream's
        segments need, in a fixed order: plain first, then `mk.quant.SCHEMES`' order;
        within each, the block's tile first."""
        found = {(s.scheme, s.tile) for s in self.segments + self.tail}
        order, own = (None, *quant.SCHEMES), (self.block.tile_rows, self.block.tile_cols)
        return tuple(sorted(found, key=lambda st: (order.index(st[0]), st[1] != own, st[1])))

    def buffer_name(self, segment: Segment) -> str:
        """The ring buffer `segment`'s tiles land in (`ring_buffers`): "ring" for plain
        tiles of the block's shape, "ring_<scheme>" for packed ones, with "_<rows>x<cols>"
        for tiles of another shape (a packed one's scale block: the name + "_scales")."""
        return _buffer_name(segment.scheme, segment.tile, self.block)

    @property
    def schemes(self) -> tuple[str, ...]:
        """The quantised schemes of the stream's segments, in a fixed order."""
        found = {s.scheme for s in self.segments + self.tail}
        return tuple(q for q in quant.SCHEMES if q in found)

    @staticmethod
    def owners(segments) -> dict[int, tuple[Segment, int]]:
        """Tile offset -> (segment, copy) for every tile of `segments` (one layer's, offsets
        within the period; or the tail's, offsets within the tail)."""
        return {s.start + c * s.stride + t: (s, c) for s in segments
                for c in range(s.copies) for t in range(s.tiles)}

    def following(self, segment: Segment, span: int, tiles=None) -> tuple[Segment, ...]:
        """The segments that may hold tile t + `span` of any copy of `segment`, for t in
        `tiles` (default its last `span` tiles: every tile its edge loop issues), in any
        layer: the next ones in the period, the next layer's first ones, the tail's first
        ones. The stream's layout is static (only the layer and the copies' activity are
        known at run time), so this is exact up to the layer."""
        if span >= self.period:
            return self.segments + self.tail
        tiles = range(max(0, segment.tiles - span), segment.tiles) if tiles is None else tiles
        local, tail = self.owners(self.segments), self.owners(self.tail)
        found = set()
        for c in range(segment.copies):
            for pos in (segment.start + c * segment.stride + t + span for t in tiles):
                if segment in self.tail:
                    found.add(tail.get(pos))
                elif pos < self.period:
                    found.add(local[pos])
                else:  # past this layer: the next layer's start, or the tail's
                    found |= {local[pos - self.period], tail.get(pos - self.period)}
        named = {owner[0] for owner in found if owner is not None}
        return tuple(s for s in self.segments + self.tail if s in named)

    @property
    def tile_bytes(self) -> int:
        """Elements of the block's tile (times the weight itemsize: its bytes); a segment
        with a tile of its own moves `segment_tile_bytes`."""
        return self.block.tile_rows * self.block.tile_cols


def _buffer_name(scheme: str | None, tile: tuple[int, int], block: BlockSizes) -> str:
    shaped = "" if tile == (block.tile_rows, block.tile_cols) else f"_{tile[0]}x{tile[1]}"
    return "ring" + (f"_{scheme}" if scheme else "") + shaped


def stored_fold(scheme: str | None, tile: tuple[int, int]) -> int:
    """How a tile of `scheme` (None: plain) and shape `tile` is stored: plain ones folded
    `mk.kernels.fold.panel_fold` times, packed ones as they are (1)."""
    return 1 if scheme is not None else panel_fold(*tile)


def tile_major(w, segment: Segment):
    """Weight w [..., K, N] (leading stacked axes) in the ring's HBM layout for `segment`:
    [..., tiles, tile_rows, tile_cols] of its tile, tile t the stream's t-th (output panel
    t // in_tiles, contraction step t % in_tiles; transposed segments tiled from W^T), each
    tile folded as `Segment.fold` says ([tile_rows / fold, fold x tile_cols]). A
    `mk.quant.QuantWeight` (never transposed) becomes `mk.quant.tile_major`'s."""
    r, c = segment.tile
    if isinstance(w, quant.QuantWeight):
        return quant.tile_major(w, r, c)
    *lead, K, N = w.shape
    if segment.transposed:  # stored W^T [N, K]: grid (output panel, step) is (row, col)
        grid = jnp.swapaxes(w, -1, -2).reshape(*lead, N // r, r, K // c, c)
        tiles = jnp.swapaxes(grid, -3, -2)
    else:  # stored W: grid (step, output panel) is (row, col); panels outermost
        grid = w.reshape(*lead, K // r, r, N // c, c)
        tiles = jnp.moveaxis(grid, -2, -4)
    return fold_tiles(tiles.reshape(*lead, segment.tiles, r, c), segment.fold)


def ring_layout(weights: dict, stream: TileStream) -> dict:
    """Weights by name as the ring reads them: each of the stream's segments `tile_major`
    (its tiles in stream order, one contiguous DMA each), the others as they are."""
    names = {s.name: s for s in stream.segments + stream.tail}
    return {name: tile_major(w, names[name]) if name in names else w
            for name, w in weights.items()}


def plain_ring(block: BlockSizes, dtype, tile: tuple[int, int] | None = None) -> Buffer:
    """The VMEM slots of plain tiles of shape `tile` (default the block's), named by
    `TileStream.buffer_name`: [slots, *stored tile] of `dtype` (folded: `stored_fold`)."""
    tile = tile or (block.tile_rows, block.tile_cols)
    return Buffer(_buffer_name(None, tile, block),
                  (block.slots, *folded_shape(tile, stored_fold(None, tile))), dtype)


def ring_buffers(stream: TileStream, dtype) -> list[Buffer]:
    """The ring's VMEM slots ("layer" group), one set per `TileStream.storages` entry,
    named by `TileStream.buffer_name`: plain tiles' `plain_ring` of `dtype`; a quantised
    scheme's packed data and its "_scales" (`mk.quant.tile_shapes`). All are slots deep:
    tile g lands in slot g % slots of its segment's buffer."""
    out = []
    for scheme, (r, c) in stream.storages:
        name = _buffer_name(scheme, (r, c), stream.block)
        if scheme is None:
            out.append(plain_ring(stream.block, dtype, (r, c)))
            continue
        shapes = quant.tile_shapes(scheme, r, c)
        for part, suffix in (("data", ""), ("scale", "_scales")):
            shape, part_dtype = shapes[part]
            out.append(Buffer(name + suffix, (stream.block.slots, *shape), part_dtype))
    return out


# fetch(layer) -> (the [K, N] HBM ref of that matrix in that layer, active flag or None);
# a repeated segment's fetch is fetch(layer, copy).
Fetch = Callable[..., tuple[object, object]]


class Ring:
    """The in-kernel ring over `stream`: buffers, {name: VMEM ref} of every ring buffer
    `ring_buffers` names (e.g. "ring" [slots, tile_rows, tile_cols]; "ring_fp4" and
    "ring_fp4_scales"); sems [slots]; dtype: what tiles are multiplied in (default the
    plain ring's).

    fetch: segment name -> Fetch (a quantised segment's returns an `mk.quant.QuantWeight`
    of refs in `mk.quant.tile_major` layout). Every tile started is waited for by the
    `matmul` that consumes it, in increasing g, with `start(g + slots)` only after tile g
    was read.
    """

    def __init__(self, stream: TileStream, fetch: dict[str, Fetch], buffers: dict, sems, *,
                 dtype=None):
        self.stream, self.fetch, self.sems = stream, fetch, sems
        self.buffers = dict(buffers)
        missing = [b.name for b in ring_buffers(stream, "float32")
                   if b.name not in self.buffers]
        if missing:
            raise ValueError(f"Ring: no buffers {missing} for the stream's segments")
        if dtype is None and "ring" not in self.buffers:
            raise ValueError("Ring: dtype is needed when no plain ring holds the tiles")
        self.dtype = jnp.dtype(dtype or self.buffers["ring"].dtype)
        self.n = stream.block.slots

    @classmethod
    def in_scratch(cls, stream: TileStream, fetch: dict[str, Fetch], scratch, sems, dtype
                   ) -> Ring:
        """The ring over the buffers `ring_buffers` names, found as attributes of
        `scratch` (a kernel's layer scratch namespace)."""
        return cls(stream, fetch, {b.name: getattr(scratch, b.name)
                                   for b in ring_buffers(stream, dtype)}, sems, dtype=dtype)

    def _fetch(self, segment: Segment, layer, copy):
        fetch = self.fetch[segment.name]
        return fetch(layer, copy) if segment.stride else fetch(layer)

    def _copies(self, segment: Segment, layer, copy, t, slot) -> list:
        """The DMAs that bring tile t of `segment` into `slot`, with their bytes: one
        contiguous copy for a plain tile (`tile_major`); its packed data and its scale
        block for a quantised one, both on the slot's semaphore."""
        src, _ = self._fetch(segment, layer, copy)
        into = self.buffers[self.stream.buffer_name(segment)]
        if segment.scheme is None:
            parts = [(src, into)]
        else:
            parts = [(src.data, into), (src.scale, self._scales(segment))]
        return [(pltpu.make_async_copy(source.at[t], into.at[slot], self.sems.at[slot]),
                 math.prod(into.shape[1:]) * into.dtype.itemsize) for source, into in parts]

    def _wait(self, segment: Segment, layer, copy, t, slot):
        for dma, _ in self._copies(segment, layer, copy, t, slot):
            dma.wait()

    def _scales(self, segment: Segment):
        return self.buffers[self.stream.buffer_name(segment) + "_scales"]

    def _weights(self, segment: Segment, slot):
        """The weights of the tile in `slot`: a value of the compute dtype, [tile_rows,
        tile_cols] (plain ones as stored: folded, `Segment.fold`)."""
        data = self.slot(slot, segment)[...]
        if segment.scheme is None:
            return data
        return unpack.dequantize_tile(segment.scheme, data,
                                     self._scales(segment)[slot]).astype(self.dtype)

    def _product(self, segment: Segment, slot, xs, contract):
        """xs [M, step] times the tile of `segment` in `slot`, float32 [M, panel]: one product
        with the tile in the compute dtype (folded: `mk.kernels.fold.folded_product`), or
        fed fp8, its e4m3 codes and scales as they are (`mk.unpack.fp8_product`)."""
        xs = xs.astype(self.dtype)
        if segment.fold > 1:
            return folded_product(xs, self._weights(segment, slot), segment.fold,
                                  segment.transposed)
        if segment.feed == "fp8":
            return unpack.fp8_product(segment.scheme, self.slot(slot, segment)[...],
                                      self._scales(segment)[slot], xs)
        return lax.dot_general(xs, self._weights(segment, slot), contract,
                               preferred_element_type=jnp.float32)

    def _each_segment(self, g, action, candidates=None):
        """Call action(segment, layer, copy, t) for the segment holding tile g (g traced),
        searching only `candidates` (segments that may hold g; default all of them)."""
        s = self.stream
        candidates = s.segments + s.tail if candidates is None else candidates
        layered = s.layers * s.period
        # A tile past the layers (the tail, or past the end) still traces every segment's
        # fetch under a false guard: clamp the layer so those fetches index in range.
        layer, local = jnp.minimum(g // s.period, s.layers - 1), g % s.period
        def in_segment(seg, copy, t):
            # The activity flag may read SMEM: only the one segment holding g reads it.
            pl.when(self._active(seg, layer, copy))(lambda: action(seg, layer, copy, t))

        for seg in candidates:
            if seg in s.tail:
                hit, copy, t = seg.locate(g - layered)
            else:
                hit, copy, t = seg.locate(local)
                hit = (g < layered) & hit
            pl.when(hit)(functools.partial(in_segment, seg, copy, t))

    def _active(self, segment: Segment, layer, copy=0):
        _, active = self._fetch(segment, layer, copy)
        return True if active is None else active

    def _issue(self, segment: Segment, layer, copy, t, slot):
        """Start the DMA of tile t of `segment`'s copy `copy` in `layer` into `slot`."""
        for dma, nbytes in self._copies(segment, layer, copy, t, slot):
            start_dma(dma, segment.name, nbytes)

    def start(self, g, candidates=None):
        """Issue tile g into slot g % slots; a no-op past the end or for an off segment.
        candidates: the segments that may hold g (`TileStream.following`), if known."""
        self._each_segment(
            g, lambda seg, layer, copy, t: self._issue(seg, layer, copy, t, g % self.n),
            candidates)

    def prime(self, first: int = 0):
        """Issue the first `slots` tiles from `first` on (a kernel's prologue): a loop, so
        the kernel's code does not grow with the ring's depth."""
        def issue(g, carry):
            self.start(g)
            return carry

        lax.fori_loop(first, min(first + self.n, self.stream.total), issue, 0)

    def slot(self, index, segment: Segment | None = None):
        """Slot `index` (tile g's is g % slots) of `segment`'s ring buffer (its packed data
        if quantised); by default the plain ring of the block's tile ("ring")."""
        name = "ring" if segment is None else self.stream.buffer_name(segment)
        return self.buffers[name].at[index]

    def region(self, step, first: str, last: str):
        """[first tile, end) of the segments `first` .. `last` of layer `step`."""
        a, b = self.stream.segment(first), self.stream.segment(last)
        return (self.stream.base(step, a),
                self.stream.base(step, b) + (b.copies - 1) * b.stride + b.tiles)

    def skip(self, first, end):
        """Consume tiles [first, end) of switched-off segments without loading or computing:
        only the tiles they would issue past `end` (the next weights) are issued."""
        def issue_past_the_skipped(t, carry):
            g = end - self.n + t
            pl.when(g >= first)(lambda: self.start(g + self.n))
            return carry

        lax.fori_loop(0, self.n, issue_past_the_skipped, 0)

    def matmul(self, name: str, x, out_ref, *, layer=0, copy=0):
        """out_ref[M, N] (float32) = x[M, K] @ weight `name` of `layer` (copy `copy` of a
        repeated segment), through the ring.

        x is a VMEM ref (its contraction steps are dynamic lane slices, which Mosaic takes
        from refs, not values); each step is cast to the weight dtype and the products
        accumulate in float32 in out_ref's panel (the `mk.ops.matmul` numerics). A
        transposed segment's tile is W^T's: x's step times the tile transposed. Every tile
        consumed issues tile g + slots into its slot. The loops carry each tile's slot,
        contraction step and panel from trip to trip: no divide a tile (TPU7x's bundle
        dumps: Kimi K3's TP32 loops up to 12 % fewer bundles, the 27B's TP8 costliest 352 ->
        336); `mk.bounds` proves the carried slot and step in range.

        Loops: in the steady one (most tiles: no search of the stream) tile g + slots is
        this segment's own tile t + slots; the last `slots` tiles (the edge) look up which
        segment, layer or tail holds it (`start`), one loop per run of tiles the same few
        segments can follow (`TileStream.following`): `mk.bundles` counts every branch.
        """
        seg = self.stream.segment(name)
        base = self.stream.base(layer, seg, copy)
        # widths of one contraction step and one output panel
        step, panel = seg.tile[::-1] if seg.transposed else seg.tile
        steps = seg.in_tiles
        active = self._active(seg, layer, copy)
        contract = (((1,), (1,)), ((), ())) if seg.transposed else (((1,), (0,)), ((), ()))

        def when_active(action):
            if active is True:
                action()
            else:
                pl.when(active)(action)

        def tile(t, carry, *, after=None):
            slot, i, j = carry  # tile t's slot, contraction step and panel: no divide

            def multiply():
                self._wait(seg, layer, copy, t, slot)  # one wait, no search
                xs = x[:, pl.ds(pl.multiple_of(i * step, step), step)]
                part = self._product(seg, slot, xs, contract)
                # (j < out_tiles always: the clip lets mk.bounds prove it, never binds)
                cols = pl.ds(pl.multiple_of(jnp.clip(j, 0, seg.out_tiles - 1) * panel, panel),
                             panel)
                if steps == 1:
                    out_ref[:, cols] = part
                else:  # the first step's select drops whatever the panel held
                    out_ref[:, cols] = jnp.where(i == 0, part, out_ref[:, cols] + part)

            def multiply_then_issue():  # steady: g + slots is this segment's own t + slots
                multiply()
                self._issue(seg, layer, copy, t + self.n, slot)

            if after is None:
                when_active(multiply_then_issue)
            else:
                when_active(multiply)
                self.start(base + t + self.n, after)
            last = i == steps - 1
            return (jnp.where(slot == self.n - 1, 0, slot + 1), jnp.where(last, 0, i + 1),
                    jnp.where(last, j + 1, j))

        edge = max(0, seg.tiles - self.n)  # the first tile whose g + slots may lie beyond
        first_tile = (jnp.asarray(base % self.n, jnp.int32), jnp.int32(0), jnp.int32(0))
        carry = lax.fori_loop(0, edge, tile, first_tile)
        # the edge: one loop per run of tiles whose g + slots the same segments may hold
        # (`TileStream.following`), so a trip carries the DMA code of those few only
        runs = []
        for t in range(edge, seg.tiles):
            after = self.stream.following(seg, self.n, (t,))
            if runs and runs[-1][2] == after:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1, after])
        for first, end, after in runs:
            carry = lax.fori_loop(first, end, functools.partial(tile, after=after), carry)
