"""What every kernel shares before it is traced: tiling and the VMEM budget.

Here: `BlockSizes` (ring slots, weight tile, KV tile), which validates itself against the
TPU (8, 128) tiling rule and cuts each weight matrix into its tiles (`BlockSizes.cut`:
stored as it is, or transposed when only its transpose is a whole number of tiles);
`default_block`, the one tiling rule every kernel uses; `transposed_dot`
(a product with a weight held transposed: `mk.kinds.base.TRANSPOSED`); `Buffer` and
`vmem_budget`, the list of every VMEM buffer of one kernel configuration with its padded
size, checked against the chip's VMEM per core before anything is compiled.

`dma_log` / `start_dma` / `sequenced`: every HBM DMA a kernel starts, recorded with its
name and bytes while a `dma_log()` is open (interpret mode: a host callback runs where the
DMA starts, so a DMA under a false `pl.when` is not recorded); the byte-count test reads
it. Interpret mode runs a kernel's host callbacks in no fixed order; a kernel body wrapped
in `sequenced` (the megakernel) records in issue order (the DMA order test reads that).

Not here: the ring itself (`mk.kernels.ring`), compiling (`mk.measure.tpu`). Block sizes change
speed, never numerics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernels import backend
from mk.model.config import LANES
from mk.model.ops import exact

KV_ALIGN = 16  # a KV tile's positions are whole groups of 16 sublanes (bf16)
SUBLANE_BITS = 8 * 32  # 8 sublanes of 32-bit words: 8 rows of f32, 16 of bf16, 32 of int8


def sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile for `dtype`: 8 for 32-bit, 16 for 16-bit."""
    return SUBLANE_BITS // (8 * np.dtype(dtype).itemsize)


def transposed_dot(h, w_t):
    """h [M, D] @ w in float32 for a weight held transposed, w_t [n, D]
    (`mk.kinds.base.TRANSPOSED`), h rounded to the weight's dtype (mk.model.ops.matmul's)."""
    h = h.astype(w_t.dtype)
    return jax.lax.dot_general(h, w_t, (((1,), (1,)), ((), ())), precision=exact(h, w_t),
                               preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Cut:
    """How one weight matrix W [K, N] (x @ W, K the contraction) is cut into stored tiles.

    Plain: stored as W, a tile is tile_rows of K x tile_cols of N. Transposed: stored as
    W^T [N, K], a tile is tile_rows of N x tile_cols of K, multiplied as x @ tile^T. Either
    way the tiles are consumed output panel by output panel, the contraction's tiles
    innermost: tile t is contraction step t % in_tiles of output panel t // in_tiles.
    """

    transposed: bool
    in_tiles: int  # tiles along K
    out_tiles: int  # tiles along N


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel configuration.

    slots:     weight tiles in flight in the VMEM ring (>= 2 to overlap DMA and compute;
               1 is the no-overlap teaching version of notebook 01).
    tile_rows: rows of a stored weight tile (`cut`: K rows of a plain matrix, N rows of a
               transposed one); a multiple of 128 because it may slice the lanes of the
               activations it multiplies.
    tile_cols: columns of a stored weight tile; a multiple of 128 lanes.
    kv_tile:   cached positions per attention tile; a multiple of 16 sublanes (bf16).
    kv_slots:  KV tiles in flight (>= 2).
    tiles:     ((weight name, (tile_rows, tile_cols)), ...) of the weights whose tiles
               are not tile_rows x tile_cols (`mk.kernels.ring`: each such shape has ring
               buffers of its own, on the one slot index); multiples of 128.
    """

    slots: int = 3
    tile_rows: int = 256
    tile_cols: int = 256
    kv_tile: int = 128
    kv_slots: int = 2
    tiles: tuple[tuple[str, tuple[int, int]], ...] = ()

    def __post_init__(self):
        for field, low in (("slots", 1), ("kv_slots", 2)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"BlockSizes.{field}={value!r} must be an integer >= {low}")
        for field, multiple in (("tile_rows", LANES), ("tile_cols", LANES),
                                ("kv_tile", KV_ALIGN)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < multiple or value % multiple:
                raise ValueError(f"BlockSizes.{field}={value!r} must be a positive multiple "
                                 f"of {multiple} (TPU (8, 128) tiling)")
        for item in self.tiles:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], tuple) and len(item[1]) == 2
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= LANES
                            and d % LANES == 0 for d in item[1])):
                raise ValueError(f"BlockSizes.tiles entry {item!r} must be (weight name, "
                                 f"(tile_rows, tile_cols)), positive multiples of {LANES}")
        names = [name for name, _ in self.tiles]
        if len(set(names)) != len(names):
            raise ValueError(f"BlockSizes.tiles={self.tiles!r} names a weight twice")

    def cut(self, name: str, rows: int, cols: int, *, transpose: bool = True) -> Cut:
        """The tiles of weight `name` [rows=K, cols=N]: plain when the tiles divide it, else
        transposed (if `transpose`: a quantised weight's packing runs along K, so it is
        never transposed); raises if neither divides."""
        if rows % self.tile_rows == 0 and cols % self.tile_cols == 0:
            return Cut(False, rows // self.tile_rows, cols // self.tile_cols)
        if transpose and cols % self.tile_rows == 0 and rows % self.tile_cols == 0:
            return Cut(True, rows // self.tile_cols, cols // self.tile_rows)
        turned = (f", nor its transpose [{cols}, {rows}]" if transpose else
                  " (a quantised weight is never transposed)")
        raise ValueError(f"weight {name} [{rows}, {cols}]{turned} is not a whole number of "
                         f"tiles tile_rows={self.tile_rows} x tile_cols={self.tile_cols}")

    def check_context(self, context: int) -> int:
        """KV tiles of a cache of `context` positions; raises if kv_tile does not divide."""
        if context % self.kv_tile:
            raise ValueError(f"context={context} is not a multiple of kv_tile={self.kv_tile}")
        return context // self.kv_tile


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One VMEM buffer of a kernel: a scratch, or an operand the kernel keeps in VMEM.

    group: where the megakernel finds it (`mk.step.plan`): "layer" (an attribute of the
    layer scratch), "attention", "vectors", a collective's name, or "operand" (not scratch).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str = "layer"

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The shape VMEM really holds: minor dim to 128 lanes, second-minor to sublanes."""
        shape = list(self.shape) or [1]
        shape[-1] = math.ceil(shape[-1] / LANES) * LANES
        if len(shape) >= 2:
            rows = sublanes(self.dtype)
            shape[-2] = math.ceil(shape[-2] / rows) * rows
        return tuple(shape)

    @property
    def bytes(self) -> int:
        return math.prod(self.padded_shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class VmemBudget:
    """Every VMEM buffer of one kernel configuration against one chip's VMEM per core."""

    kernel: str
    buffers: tuple[Buffer, ...]
    chip: str
    limit_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    def rows(self) -> list[dict]:
        """One dict per buffer, biggest first, for a table in a notebook."""
        return [dict(buffer=b.name, shape=b.shape, dtype=b.dtype, padded=b.padded_shape,
                     MiB=b.bytes / 2**20)
                for b in sorted(self.buffers, key=lambda b: -b.bytes)]

    def check(self) -> VmemBudget:
        if self.total_bytes > self.limit_bytes:
            biggest = ", ".join(f"{r['buffer']} {r['padded']} {r['MiB']:.1f} MiB"
                                for r in self.rows()[:3])
            raise ValueError(f"{self.kernel}: VMEM buffers need {self.total_bytes / 2**20:.1f}"
                             f" MiB, over {self.chip}'s {self.limit_bytes / 2**20:.0f} MiB per "
                             f"core; biggest: {biggest}. Use fewer slots or smaller tiles.")
        return self


VMEM_HEADROOM, VMEM_ROOM = 1.5, 8 * 2**20  # the scoped VMEM asked: 1.5 x buffers + 8 MiB


def vmem_limit_bytes(buffers, cap: int | None = None) -> int:
    """The scoped-VMEM request a kernel passes to Mosaic: its buffers plus room for Mosaic's
    internal scratch (the vector values it keeps in VMEM: a dequantised tile, the logits'
    argmax; 11.9 MiB beside 23.4 MiB of buffers for qwen3-8b's fp8 megakernel on TPU7x),
    never below 32 MiB (the default scoped limit is 16 MiB on v5e, 32 MiB on v6e; without
    the request a hardware run can refuse a kernel the budget accepts), at most `cap` (the
    chip's VMEM per core, when the kernel knows its chip)."""
    need = sum(b.bytes for b in buffers) * VMEM_HEADROOM + VMEM_ROOM
    limit = max(32 * 2**20, math.ceil(need / 2**20) * 2**20)
    return limit if cap is None else min(limit, cap)


SLOTS = 3  # default weight ring slots
TILE_BYTES = 2 * 2**20  # default weight tiles hold at most this many bytes
REPEAT_TILE_BYTES = 2 * TILE_BYTES  # at most this many bytes in an expert slot's own tiles
# Beside expert slots in tiles of their own, the other matrices' tiles hold at most this many
# times the smallest of those (`mk.step.one_layer.model_block`).
OTHERS_OVER_REPEAT_BYTES = 2
# A quantised tile fed bf16 is dequantised in VMEM through float32 temporaries that Mosaic
# keeps in its scoped VMEM (qwen3-8b's int4 megakernel with 4096 x 256 tiles asked 35 MiB
# on TPU7x); the default keeps such tiles to this size: 384 Ki elements, so that a matrix
# 23 x 128 wide (gpt-oss's 2944) can take one 128-row panel of its whole width (376,832
# elements; the next smaller tile dividing it is 128 x 128, whose fixed per-tile cost
# swamps its DMA). A tile fed fp8 is not bound by it: its e4m3 codes take a byte a
# weight, its float32 products 128 rows at a time (`mk.kernels.ring`).
QUANT_TILE_ELEMENTS = 3 * 2**17
KV_TILE = 256  # default cached positions per KV tile, capped by the cache
# The output panel (a tile's output columns) that feeds every MXU of a TensorCore at once
# (mxus_per_core x mxu width in data/chips.csv: 4 x 128 on v5e and v5p, 2 x 256 on v6e
# and TPU7x): of two tiles as large, the one whose panels reach it streams faster (TPU7x,
# M 1, bundles per Mi weights of the stage kernel's steady loop: 2560 x 256 tiles 469,
# 1280 x 512 376). A narrower plain tile is stored folded to it (`mk.kernels.fold`).
PANEL_COLS = 512


def default_block(matrices, *, context: int | None = None, slots: int = SLOTS,
                  itemsize: int = 2, quantised=(), padded_rows=(),
                  most_bytes: int = TILE_BYTES, dequantised=None) -> BlockSizes:
    """The default tiling, the one rule every kernel uses: the largest weight tile of at
    most `most_bytes` (TILE_BYTES; elements of `itemsize` bytes) that cuts every matrix of
    `matrices` ((name, K, N) triples, or `mk.kernels.stream.Repeat`s of them), so one ring
    slot shape serves every matrix (`BlockSizes.cut`: plain or transposed; the `quantised`
    names plain only, and, while some of them are `dequantised` whole in VMEM (fed bf16;
    default all), at most QUANT_TILE_ELEMENTS a tile); of tiles as large,
    the one cutting more weights into output panels that feed every MXU (at least
    PANEL_COLS wide: a plain cut's columns, a transposed one's rows), then the taller.
    `padded_rows`: the rows of matrices whose columns are padded to whole tiles (the
    lm_head: only its rows must divide). KV tiles of `default_kv_tile(context)` positions
    for a kernel reading a cache of `context` positions.

    A decode matmul's cost is moving its weights, and each tile costs the TensorCore a
    fixed issue time besides (`mk.cost.bundles`): big tiles amortise it. Tensor-parallel shards
    have one wide dimension (the model width D) and one narrow (a shard's heads or FFN
    columns): cut D-major (row-sharded matrices transposed), their tiles are D x 128 and
    more, where one tile shape dividing both dimensions of every matrix would be 128 x 128.
    """
    shapes = []
    for item in matrices:
        for name, rows, cols in getattr(item, "matrices", (item,)):
            shapes.append((name, rows, cols))
    widest = max([d for _, r, c in shapes for d in (r, c)] + list(padded_rows) + [LANES])
    dequantised = quantised if dequantised is None else dequantised
    most = most_bytes // itemsize if not dequantised else min(most_bytes // itemsize,
                                                              QUANT_TILE_ELEMENTS)
    best = None
    for rows in range(LANES, widest + 1, LANES):
        if any(d % rows for d in padded_rows):
            continue
        for cols in range(LANES, min(widest, most // rows) + 1, LANES):
            if best and rows * cols < best[0][0]:
                continue
            block = BlockSizes(slots=slots, tile_rows=rows, tile_cols=cols)
            cuts = _cuts(block, shapes, quantised)
            if cuts is None:
                continue
            # weights whose output panels feed every MXU (a transposed cut's panel is
            # the tile's rows)
            fed = sum(r * c * min(rows if cut.transposed else cols, PANEL_COLS)
                      for (_, r, c), cut in zip(shapes, cuts))
            key = (rows * cols, fed, rows)
            if key > (best[0] if best else (0,)):
                best = (key, block)
    if best is None:
        uncut = [f"{name} [{r}, {c}]" for name, r, c in shapes if r % LANES or c % LANES]
        raise ValueError(f"no tile of multiples of {LANES} up to {most_bytes} bytes cuts every "
                         "weight" + (f": {', '.join(uncut)} (a side not a multiple of {LANES})"
                                     if uncut else f" {[(r, c) for _, r, c in shapes]}"))
    kv = {} if context is None else {"kv_tile": default_kv_tile(context)}
    return dataclasses.replace(best[1], **kv)


def default_kv_tile(context: int, name: str = "context") -> int:
    """The default KV tile of a cache of `context` positions: the largest multiple of
    KV_ALIGN up to KV_TILE that divides it; raises ValueError naming `name` (the caller's
    word for the capacity: "max_context" in a generate call) when none does."""
    if context % KV_ALIGN:
        raise ValueError(f"{name}={context} must be a multiple of {KV_ALIGN} for the "
                         f"megakernel, whose KV tiles hold whole groups of {KV_ALIGN} cached "
                         f"positions (mk.model.reference takes any): use "
                         f"{-(-context // KV_ALIGN) * KV_ALIGN}")
    return max(tile for tile in range(KV_ALIGN, min(KV_TILE, context) + 1, KV_ALIGN)
               if context % tile == 0)


def _cuts(block: BlockSizes, shapes, quantised) -> list[Cut] | None:
    """Each of `shapes` cut by `block`, or None if one is not."""
    try:
        return [block.cut(name, rows, cols, transpose=name not in quantised)
                for name, rows, cols in shapes]
    except ValueError:
        return None


def vmem_budget(kernel: str, buffers, chip) -> VmemBudget:
    """The checked budget of `buffers` on `chip` (a `ChipSpec`); raises when over."""
    if chip.vmem_bytes is None:
        raise ValueError(f"chip={chip.name!r} has no VMEM (it is a {chip.kind})")
    return VmemBudget(kernel, tuple(buffers), chip.name, chip.vmem_bytes).check()


def aliases(inputs: dict, outputs: dict, names) -> dict[int, int]:
    """`input_output_aliases` of a pallas_call called with one dict of inputs and
    returning one dict of outputs: each of `names` is an input updated in place as the
    output of the same name (found by name, never by position)."""
    def flat_index(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(leaves)}

    ins, outs = flat_index(inputs), flat_index(outputs)
    return {ins[f"['{n}']"]: outs[f"['{n}']"] for n in names}


def vmem_scratch(buffers) -> dict:
    """{name_vmem: pltpu.VMEM} of the buffers that are not operands: a stage kernel's
    VMEM scratch, passed to it by keyword."""
    return {f"{b.name}_vmem": pltpu.VMEM(b.shape, b.dtype)
            for b in buffers if b.group != "operand"}


def memory_specs(spaces: dict) -> dict:
    """{name: memory space} -> {name: BlockSpec} (whole arrays; pl.ANY leaves them in HBM)."""
    return {name: pl.BlockSpec(memory_space=space) for name, space in spaces.items()}


_DMA_LOG: list | None = None  # (what, bytes) of every DMA started while a dma_log is open
_DMA_SEQ = None  # the DMA counter (SMEM [1] int32) of the `sequenced` kernel being traced


@contextlib.contextmanager
def dma_log(*jitted):
    """Record (what, bytes) of every DMA `start_dma` starts while open; yields the list.
    The recording is part of a kernel's trace: the jit caches of `jitted` (the functions
    whose traces hold the kernels, e.g. `mk.step.megakernel.traced_step`) are cleared on entry
    and on exit, so they are traced with the recording and never reused without it.

    Interpret mode only: on a v5e the log of notebook 05d's attention came back 4 K tiles
    short, so `start_dma` refuses to trace a kernel for the chip while a log is open.

    Order: a `sequenced` kernel's records are in the order it issues its DMAs (per device;
    one call after another); any other kernel's are in the order interpret mode happened to
    run their host callbacks (right for totals, not for order)."""
    global _DMA_LOG
    for fn in jitted:
        fn.clear_cache()
    _DMA_LOG = log = []
    try:
        yield log
    finally:
        _DMA_LOG = None
        for fn in jitted:
            fn.clear_cache()


def sequenced(kernel):
    """A pallas_call body `kernel` as it is, unless a `dma_log` is open when it is built:
    then with a DMA counter around it (an SMEM scalar, `pl.run_scoped`) that chains its
    `start_dma` records in issue order. Interpret mode orders a kernel's memory operations
    (an SMEM read or write is an ordered host callback) but not its other host callbacks:
    each record reads the counter, is the callback that returns the counter plus one, and
    that value is written back, so the next record's read waits for it. A kernel built
    without a log open has no counter: nothing in the compiled kernel."""
    if _DMA_LOG is None:
        return kernel

    @functools.wraps(kernel)
    def counted(*args, **kwargs):
        def body(seq_smem):
            global _DMA_SEQ
            seq_smem[0] = jnp.int32(0)
            _DMA_SEQ = seq_smem
            try:
                kernel(*args, **kwargs)
            finally:
                _DMA_SEQ = None
        pl.run_scoped(body, pltpu.SMEM((1,), jnp.int32))
    return counted


def start_dma(copy, what: str, nbytes: int) -> None:
    """copy.start(), recorded as (what, nbytes) while a `dma_log` is open (in issue order
    inside a `sequenced` kernel)."""
    copy.start()
    if _DMA_LOG is None:
        return
    if backend.on_tpu() and not backend.interpreting():
        raise RuntimeError(
            "dma_log records DMAs with host callbacks, which only TPU interpret mode runs "
            "(inside mk.kernels.backend.use('interpret')); a kernel built for the chip would "
            "record "
            "nothing: count DMAs in interpret mode")
    log = _DMA_LOG
    if _DMA_SEQ is None:
        jax.debug.callback(lambda: log.append((what, nbytes)))
        return

    def record(n):
        log.append((what, nbytes))
        return n + 1

    seq = _DMA_SEQ
    seq[0] = io_callback(record, jax.ShapeDtypeStruct((), jnp.int32), seq[0])
