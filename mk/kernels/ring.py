"""The weight ring: weight tiles streamed HBM -> VMEM through N slots, never stalling.

A kernel consumes an ordered list of weight tiles, a `mk.kernels.stream.TileStream` (its
matrices, one segment each, repeated once per layer, then an optional tail: the lm_head).
Tile g lives in ring slot g % slots; when tile g has been consumed, tile g + slots is
issued into the slot it freed, across segment and layer edges, so memory never waits at
a matrix or a layer's edge.

Here: `Ring`, the in-kernel side (`prime`, `start(g)`, `slot(i)`, `skip`, and `matmul`,
which multiplies activations by one segment while keeping the ring full); the weights in
HBM in stream order (`ring_layout`, `tile_major`); the buffers (`ring_buffers`, one per
tile shape and storage, each slots deep; `plain_ring`). A quantised segment's tiles reach
the MXU as its feed says: int8 and int4 codes straight into the dot with the scales on
the product (`mk.model.unpack.int_product`), fp8 and fp4 dequantised in VMEM or fed fp8
(`mk.model.unpack.fp8_product`): the reference's product on `mk.model.quant.dequantize`'s weights.

Not here: what a kernel computes with the products (the stage kernels, the megakernel),
KV tiles (`decode_attention`). Transposed and folded tiles, tiles of several shapes,
switched-off segments, repeats: docs/design/mk.kernels.ring.md.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant, unpack
from mk.kernels.common import BlockSizes, Buffer, start_dma
from mk.model.ops import exact
from mk.kernels.fold import fold_tiles, folded_product, folded_shape
from mk.kernels.stream import Segment, TileStream, buffer_name, stored_fold


def tile_major(w, segment: Segment):
    """Weight w [..., K, N] (leading stacked axes) in the ring's HBM layout for `segment`:
    [..., tiles, tile_rows, tile_cols] of its tile, tile t the stream's t-th (output panel
    t // in_tiles, contraction step t % in_tiles; transposed segments tiled from W^T), each
    tile folded as `Segment.fold` says ([tile_rows / fold, fold x tile_cols]). A
    `mk.model.quant.QuantWeight` (never transposed) becomes `mk.model.quant.tile_major`'s."""
    r, c = segment.tile
    if isinstance(w, quant.QuantWeight):
        return quant.tile_major(w, r, c)
    *lead, K, N = w.shape
    if lead:  # a matrix at a time: relaying a stack out whole takes a temporary of two
        flat = lax.map(lambda m: tile_major(m, segment), w.reshape(-1, K, N))
        return flat.reshape(*lead, *flat.shape[1:])
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
    return Buffer(buffer_name(None, tile, block),
                  (block.slots, *folded_shape(tile, stored_fold(None, tile))), dtype)


def ring_buffers(stream: TileStream, dtype) -> list[Buffer]:
    """The ring's VMEM slots ("layer" group), one set per `TileStream.storages` entry,
    named by `TileStream.buffer_name`: plain tiles' `plain_ring` of `dtype`; a quantised
    scheme's packed data and its "_scales" (`mk.model.quant.tile_shapes`). All are slots deep:
    tile g lands in slot g % slots of its segment's buffer."""
    out = []
    for scheme, (r, c) in stream.storages:
        name = buffer_name(scheme, (r, c), stream.block)
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

    fetch: segment name -> Fetch (a quantised segment's returns an `mk.model.quant.QuantWeight`
    of refs in `mk.model.quant.tile_major` layout). Every tile started is waited for by the
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
        its codes as they are and its scales on the product (fed fp8: e4m3 codes,
        `mk.model.unpack.fp8_product`; int8 and int4: `mk.model.unpack.int_product`)."""
        xs = xs.astype(self.dtype)
        if segment.fold > 1:
            return folded_product(xs, self._weights(segment, slot), segment.fold,
                                  segment.transposed)
        if segment.feed == "fp8":
            return unpack.fp8_product(segment.scheme, self.slot(slot, segment)[...],
                                      self._scales(segment)[slot], xs)
        if segment.scheme in unpack.INT_SCHEMES:
            return unpack.int_product(segment.scheme, self.slot(slot, segment)[...],
                                      self._scales(segment)[slot], xs)
        w = self._weights(segment, slot)
        return lax.dot_general(xs, w, contract, precision=exact(xs, w),
                               preferred_element_type=jnp.float32)

    def _holders(self, in_layers, layer, local, tail, candidates):
        """(segment, layer, copy, t, hit) for each of `candidates`: whether tile t of its
        copy `copy` is the one sought, which is tile `local` of `layer` (traced) while
        `in_layers`, else tile `tail` of the tail (its activity flag not asked). The layer
        is clamped and a miss's copy too (`Segment.locate`), so the fetches of the
        segments that miss still index in range."""
        s = self.stream
        layer = jnp.minimum(layer, s.layers - 1)
        found = []
        for seg in candidates:
            if seg in s.tail:
                hit, copy, t = seg.locate(tail)
                hit = jnp.logical_not(in_layers) & hit
            else:
                hit, copy, t = seg.locate(local)
                hit = in_layers & hit
            found.append((seg, layer, copy, t, hit))
        return found

    def _following(self, seg: Segment, layer, copy, t, candidates):
        """`_holders` among `candidates` of tile g + slots, where g is tile t of `seg`'s copy
        `copy` in `layer` (an edge tile of `matmul`; slots <= period): its offset in the
        period (or the tail) is `seg`'s own plus t + slots, less than a period past it, so
        a compare finds its layer where `start` divides g by the period."""
        s = self.stream
        pos = seg.start + copy * seg.stride + t + self.n
        if seg in s.tail:
            return self._holders(False, s.layers - 1, pos, pos, candidates)
        over = pos >= s.period
        local = jnp.where(over, pos - s.period, pos)
        layer = layer + over.astype(jnp.int32)
        return self._holders(layer < s.layers, layer, local, local, candidates)

    def _one_holder(self, seg: Segment, layer, end: int, after) -> Segment | None:
        """The segment holding tile t + slots of `seg` for every t < `end` of an edge run
        whose holders may be `after`, when that is one segment, not repeated, in the same
        layer and on wherever `seg`'s product runs (no activity flag, or `seg`'s own
        kind): its tile is then known with no search."""
        s = self.stream
        if (len(after) != 1 or seg.stride or seg in s.tail or after[0].stride
                or seg.start + end - 1 + self.n >= s.period):
            return None
        holder = after[0]
        on = holder.kind is not None and holder.kind == seg.kind
        return holder if on or self._active(holder, layer) is True else None

    def _each_segment(self, g, action, candidates=None):
        """Call action(segment, layer, copy, t) for the segment holding tile g (g traced),
        searching only `candidates` (segments that may hold g; default all of them)."""
        s = self.stream
        candidates = s.segments + s.tail if candidates is None else candidates
        layered = s.layers * s.period
        def in_segment(seg, layer, copy, t):
            # The activity flag may read SMEM: only the one segment holding g reads it.
            pl.when(self._active(seg, layer, copy))(lambda: action(seg, layer, copy, t))

        for seg, layer, copy, t, hit in self._holders(g < layered, g // s.period,
                                                      g % s.period, g - layered, candidates):
            pl.when(hit)(functools.partial(in_segment, seg, layer, copy, t))

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

    def matmul(self, name: str, x, out_ref, *, layer=0, copy=0, slot=None):
        """out_ref[M, N] (float32) = x[M, K] @ weight `name` of `layer` (copy `copy` of a
        repeated segment), through the ring; returns the slot of the stream's next tile.
        slot: its first tile's, if known (what the `matmul` of the tiles just before it
        returned: the expert slots' loop carries it, so no trip divides by the ring's
        depth); by default computed.

        x is a VMEM ref (its contraction steps are dynamic lane slices, which Mosaic takes
        from refs, not values); each step is cast to the weight dtype and the products
        accumulate in float32 in out_ref's panel (the `mk.model.ops.matmul` numerics). A
        transposed segment's tile is W^T's: x's step times the tile transposed. Every tile
        consumed issues tile g + slots into its slot. The loops carry each tile's slot,
        contraction step and panel from trip to trip: no divide a tile (TPU7x's bundle
        dumps: Kimi K3's TP32 loops up to 12 % fewer bundles, the 27B's TP8 costliest 352 ->
        336); `mk.measure.bounds` proves the carried slot and step in range.

        Loops: in the steady one (most tiles: no search of the stream) tile g + slots is
        this segment's own tile t + slots; the last `slots` tiles (the edge) issue it from
        whichever segment, layer or tail holds it, one loop per run of tiles the same few
        segments can follow and be on (`TileStream.following_on`: not a rival kind this
        layer skips; where only rivals follow, the trip issues nothing): one segment in
        this layer that is on wherever this one runs (no flag, or this segment's kind)
        gives its tile directly (`_one_holder`); else each candidate's hit and flag come
        from compares, not a divide of g by the period (`_following`), and each issue is
        under its branch (`mk.cost.bundles` counts every branch). TPU7x's dumps, before -> after
        that edge rework: the 27B's TP8 costliest loop 336 -> 315 bundles, Kimi K3's TP32
        plain 223 -> 190 and FP4 trip 1517 -> 1483; then the kinds (Kimi K3 TP32): edges
        to a segment of the same kind 137 -> 118-120, to a rival only 137 -> 117 and 164
        -> 141 (transposed), the FP4 trip 1483 -> 1425; then no branch on a repeat's
        copy flag: the FP4 trip 1322 -> 1156.

        A product is guarded by neither its layer's kind nor its copy's flag: call `matmul`
        only in layers of its kind (as `Kind.run` is called: under the layer's flag,
        `mk.step.one_layer.layer_body`) and for a copy that is on (`experts_body` loops
        over the chosen slots, s < count). Elsewhere its tiles are never issued and the
        first wait would never end. A guard here would cost each trip a branch, and libtpu
        schedules each branch's code apart: the product, the activation between an expert's
        tiles and the edge's search would not overlap.
        """
        seg = self.stream.segment(name)
        base = self.stream.base(layer, seg, copy)
        # widths of one contraction step and one output panel
        step, panel = seg.tile[::-1] if seg.transposed else seg.tile
        steps = seg.in_tiles
        contract = (((1,), (1,)), ((), ())) if seg.transposed else (((1,), (0,)), ((), ()))

        def tile(t, carry, *, after=None):
            slot, i, j = carry  # tile t's slot, contraction step and panel: no divide

            def multiply():
                self._wait(seg, layer, copy, t, slot)  # one wait, no search
                xs = x[:, pl.ds(pl.multiple_of(i * step, step), step)]
                part = self._product(seg, slot, xs, contract)
                # (j < out_tiles always: the clip lets mk.measure.bounds prove it, never binds)
                cols = pl.ds(pl.multiple_of(jnp.clip(j, 0, seg.out_tiles - 1) * panel, panel),
                             panel)
                if steps == 1:
                    out_ref[:, cols] = part
                else:  # the first step's select drops whatever the panel held
                    out_ref[:, cols] = jnp.where(i == 0, part, out_ref[:, cols] + part)

            def multiply_then_issue(holder, holder_copy, holder_t):
                multiply()
                self._issue(holder, layer, holder_copy, holder_t, slot)

            if after is None:  # steady: g + slots is this segment's own t + slots
                multiply_then_issue(seg, copy, t + self.n)
            elif isinstance(after, Segment):  # g + slots is that one's (`_one_holder`)
                multiply_then_issue(after, 0, seg.start + t + self.n - after.start)
            elif self.n > self.stream.period:  # g + slots may lie layers ahead
                multiply()
                self.start(base + t + self.n, after)
            else:  # a search with no divide, its scalar work beside the product's
                multiply()
                for holder, h_layer, h_copy, h_t, hit in self._following(seg, layer, copy, t,
                                                                          after):
                    # one branch a candidate: its flag read beside the hit, in range
                    on = hit & self._active(holder, h_layer, h_copy)
                    pl.when(on)(functools.partial(self._issue, holder, h_layer, h_copy, h_t,
                                                  slot))
            last = i == steps - 1
            return (jnp.where(slot == self.n - 1, 0, slot + 1), jnp.where(last, 0, i + 1),
                    jnp.where(last, j + 1, j))

        edge = max(0, seg.tiles - self.n)  # the first tile whose g + slots may lie beyond
        first_tile = (jnp.asarray(base % self.n if slot is None else slot, jnp.int32),
                      jnp.int32(0), jnp.int32(0))
        carry = lax.fori_loop(0, edge, tile, first_tile)
        # the edge: one loop per run of tiles whose g + slots the same segments may hold
        # (`TileStream.following_on`), so a trip carries the DMA code of those few only
        runs = []
        for t in range(edge, seg.tiles):
            after = self.stream.following_on(seg, self.n, (t,))
            if runs and runs[-1][2] == after:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1, after])
        for first, end, after in runs:
            after = self._one_holder(seg, layer, end, after) or after
            carry = lax.fori_loop(first, end, functools.partial(tile, after=after), carry)
        return carry[0]
