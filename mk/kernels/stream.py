"""The weight stream: every weight tile a kernel loads, in the order it consumes them.

`TileStream` is static data (a reader can print it; the simulator and plots replay it,
`mk.kernels.ring.Ring` streams it in a kernel): segments (one weight matrix each, cut into
tiles output panel by output panel), repeated once per layer, then an optional tail (the
lm_head). A run of matrices may be repeated (`Repeat`: gate, up, down once per expert
slot); a segment may be stored quantised (`Segment.scheme`), fed to the MXU as its feed
says (`Segment.feed`) or stored folded (`Segment.fold`); a megakernel's segments know
their layer kind and role (`Segment.kind`, `rivals`).

`ring_slots` (and `little_slots`): the ring slots Little's law asks for over the stream's
own tiles. Not here: the in-kernel ring (`mk.kernels.ring`: HBM layout, VMEM buffers, `Ring`), the
tiling rule (`mk.kernels.common.default_block`). The stream's indexing, repeats, storages
and rivals at length: docs/design/mk.kernels.stream.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from mk.model import quant, unpack
from mk.kernels.common import BlockSizes
from mk.kernels.fold import panel_fold


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
    scheme: str | None = None  # mk.model.quant storage scheme of its tiles; None: plain
    feed: str = "bf16"  # what its tiles reach the MXU as (mk.model.unpack.FEEDS): "bf16"
    #                     dequantised to the compute dtype, "fp8" as e4m3 with scales after
    tile: tuple[int, int] = (0, 0)  # (rows, cols) of its stored tiles (`TileStream.build`)
    kind: tuple[str, str] | None = None  # (role, name) of the layer kind it is one of (a
    #                                      layer runs one kind of each role); None: no kinds

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
        if self.stride & (self.stride - 1):
            copy, t = offset // self.stride, offset % self.stride
        else:  # a power of two: a shift and a mask (libtpu divides otherwise)
            copy, t = offset >> (self.stride.bit_length() - 1), offset & (self.stride - 1)
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
              schemes=None, feeds=None, kinds=None) -> TileStream:
        """matrices / tail: (name, rows, cols) of each weight, or a `Repeat` of such
        triples, in consumption order; schemes: {name: mk.model.quant scheme} of the weights
        stored quantised; feeds: {name: mk.model.quant feed} of those not fed bf16; kinds:
        {name: (role, kind)} of the weights of layer kinds (`Segment.kind`). Each weight
        is cut into the block's tiles, or those `block.tiles` gives it."""
        schemes, feeds, tiles = dict(schemes or {}), dict(feeds or {}), dict(block.tiles)
        kinds = dict(kinds or {})
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
                                   tile=tiles.get(name, own), kind=kinds.get(name)))
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
        its packed data and scale block when quantised (`mk.model.quant.tile_bytes`)."""
        k, n = segment.tile
        return k * n * itemsize if segment.scheme is None else quant.tile_bytes(
            segment.scheme, k, n)

    @property
    def storages(self) -> tuple[tuple[str | None, tuple[int, int]], ...]:
        """(scheme or None for plain, tile shape) of each set of ring buffers the stream's
        segments need, in a fixed order: plain first, then `mk.model.quant.SCHEMES`' order;
        within each, the block's tile first."""
        found = {(s.scheme, s.tile) for s in self.segments + self.tail}
        order, own = (None, *quant.SCHEMES), (self.block.tile_rows, self.block.tile_cols)
        return tuple(sorted(found, key=lambda st: (order.index(st[0]), st[1] != own, st[1])))

    def buffer_name(self, segment: Segment) -> str:
        """The ring buffer `segment`'s tiles land in (`ring_buffers`): "ring" for plain
        tiles of the block's shape, "ring_<scheme>" for packed ones, with "_<rows>x<cols>"
        for tiles of another shape (a packed one's scale block: the name + "_scales")."""
        return buffer_name(segment.scheme, segment.tile, self.block)

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
        return self._reached(segment, span, tiles)[0]

    def following_on(self, segment: Segment, span: int, tiles=None) -> tuple[Segment, ...]:
        """Those of `following` that may be on where `segment`'s product runs (a layer of
        its kind): not a `rival` that could hold such a tile only in `segment`'s own
        layer, which skips the rival's tiles (`Ring.matmul` issues none of them)."""
        following, crossing = self._reached(segment, span, tiles)
        return tuple(s for s in following if s in crossing or not rivals(segment, s))

    def _reached(self, segment: Segment, span: int, tiles=None):
        """(`following`, those of them that may hold such a tile past `segment`'s layer:
        the next layer's or, from the last layer, the tail's)."""
        everything = self.segments + self.tail
        if span >= self.period:
            return everything, everything
        tiles = range(max(0, segment.tiles - span), segment.tiles) if tiles is None else tiles
        local, tail = self.owners(self.segments), self.owners(self.tail)
        within, past = set(), set()
        for c in range(segment.copies):
            for pos in (segment.start + c * segment.stride + t + span for t in tiles):
                if segment in self.tail:
                    within.add(tail.get(pos))
                elif pos < self.period:
                    within.add(local[pos])
                else:  # past this layer: the next layer's start, or the tail's
                    past |= {local[pos - self.period], tail.get(pos - self.period)}

        def named(found):
            names = {owner[0] for owner in found if owner is not None}
            return tuple(s for s in everything if s in names)
        return named(within | past), named(past)

    @property
    def tile_bytes(self) -> int:
        """Elements of the block's tile (times the weight itemsize: its bytes); a segment
        with a tile of its own moves `segment_tile_bytes`."""
        return self.block.tile_rows * self.block.tile_cols


def rivals(a: Segment, b: Segment) -> bool:
    """Whether segments `a` and `b` are of two kinds of one role (`Segment.kind`): never on
    in the same layer."""
    return a.kind is not None and b.kind is not None and a.kind[0] == b.kind[0] \
        and a.kind[1] != b.kind[1]


def buffer_name(scheme: str | None, tile: tuple[int, int], block: BlockSizes) -> str:
    """The name of the ring buffer holding tiles of `scheme` (None: plain) and shape `tile`
    in a stream of `block`'s tiles (`TileStream.buffer_name`)."""
    shaped = "" if tile == (block.tile_rows, block.tile_cols) else f"_{tile[0]}x{tile[1]}"
    return "ring" + (f"_{scheme}" if scheme else "") + shaped


def stored_fold(scheme: str | None, tile: tuple[int, int]) -> int:
    """How a tile of `scheme` (None: plain) and shape `tile` is stored: plain ones folded
    `mk.kernels.fold.panel_fold` times, packed ones as they are (1)."""
    return 1 if scheme is not None else panel_fold(*tile)


# -- The ring depth the stream asks for ------------------------------------------------------
def little_slots(bandwidth: float, latency_s: float, slot_bytes: float) -> int:
    """Ring slots that keep a DMA engine of `bandwidth` bytes/s busy through `latency_s`
    (Little's law): bandwidth x latency bytes in flight in whole slots, plus one slot being
    computed and one landing."""
    return math.ceil(bandwidth * latency_s / slot_bytes) + 2


def ring_slots(stream: TileStream, itemsize: int, in_flight: float) -> int:
    """The ring slots Little's law asks for over `stream`'s own tile sequence, where tiles
    of different bytes (plain and each scheme's packed ones) share one slot index
    (`mk.kernels.ring`): 2 (one slot computed, one landing) plus the fewest n such that
    every n consecutive tiles of the stream, across layer edges and into the tail, carry
    at least `in_flight` bytes (bandwidth x cover time); a layer's period plus 2 when no
    run of a period's tiles does. On a stream of one tile size, `little_slots`; with
    packed tiles, a run of them as long as the window sets it (their bytes are fewer)."""
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize={itemsize!r} must be an integer >= 1")

    def tile_bytes(segments, tiles):  # bytes of each tile of one layer (or the tail)
        owners = stream.owners(segments)
        return [stream.segment_tile_bytes(owners[t][0], itemsize) for t in range(tiles)]

    tail = sum(s.copies * s.tiles for s in stream.tail)
    order = tile_bytes(stream.segments, stream.period) * min(stream.layers, 2) \
        + tile_bytes(stream.tail, tail)
    sums = np.concatenate([[0], np.cumsum(order, dtype=np.float64)])

    def covers(n: int) -> bool:  # every run of n tiles carries in_flight bytes
        return n <= len(order) and float((sums[n:] - sums[:-n]).min()) >= in_flight

    low, high = 1, stream.period
    if not covers(high):
        return high + 2
    while low < high:  # bytes are >= 0: a longer run covers whenever a shorter one does
        mid = (low + high) // 2
        low, high = (low, mid) if covers(mid) else (mid + 1, high)
    return low + 2
