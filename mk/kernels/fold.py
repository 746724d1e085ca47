"""Folded tiles: a narrow plain weight tile stored PANEL_COLS wide.

A tensor-parallel shard's ring tiles are tall and narrow (the 27B's TP8 shard 5120 x
128); folded, a tile [rows, cols] is stored [rows / f, f * cols], its row blocks side by
side (f = `panel_fold`), so it fills the PANEL_COLS output panel that feeds every MXU of a
TensorCore. The bytes and the tile's place in the stream are unchanged and the products
equal up to float32 summation order. `folded_product` multiplies by a folded tile, plain
or transposed, `stack` blocks at a time.

Not here: which tiles a stream stores folded (`mk.kernels.stream.Segment.fold`), their
VMEM slots (`mk.kernels.ring.ring_buffers`). The product's block algebra and the
measured bundles it saves: docs/design/mk.kernels.fold.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mk.kernels.common import PANEL_COLS
from mk.model.ops import exact

FOLD_ROWS = 128  # a folded block's rows: whole lane groups of x's contraction columns
# Stacked rows of one folded product. Measured (TPU7x, stage-01 kernel, 5120 x 128 tiles
# folded 4, bundles a tile, plain / transposed): M 32 stacking 2 blocks 287 / 419, while
# M 64 stacking none 561 / 659 against 552 / 608 unfolded: past 64 rows, stacking costs.
STACK_ROWS = 64


def panel_fold(tile_rows: int, tile_cols: int) -> int:
    """How many row blocks of a plain tile_rows x tile_cols tile are stored side by side:
    the largest f <= PANEL_COLS / tile_cols with tile_rows a multiple of f x FOLD_ROWS (1:
    stored as it is)."""
    return max([1] + [f for f in range(2, PANEL_COLS // tile_cols + 1)
                      if tile_rows % (f * FOLD_ROWS) == 0])


def folded_shape(tile: tuple[int, int], fold: int) -> tuple[int, int]:
    """The stored [rows / fold, fold x cols] of a tile (rows, cols)."""
    return tile[0] // fold, tile[1] * fold


def fold_tiles(tiles, fold: int):
    """tiles [..., rows, cols] stored folded, [..., rows / fold, fold x cols]: row block b
    in columns b cols .. (b + 1) cols."""
    if fold == 1:
        return tiles
    *lead, rows, cols = tiles.shape
    blocks = tiles.reshape(*lead, fold, rows // fold, cols)
    return jnp.swapaxes(blocks, -3, -2).reshape(*lead, rows // fold, fold * cols)


def stack(fold: int, m: int) -> int:
    """Folded blocks one product takes for M = m rows: the largest divisor of fold with
    stack x m <= STACK_ROWS (at least 1)."""
    return max(s for s in range(1, fold + 1)
               if fold % s == 0 and (s == 1 or s * m <= STACK_ROWS))


def folded_product(xs, wf, fold: int, transposed: bool):
    """xs [M, K] times the folded tile wf [R, fold x c], float32: plain (K = fold R) the
    tile's [fold R, c] product, [M, c]; transposed (K = c) its [fold R, c]^T one, [M, fold
    R]. xs is in wf's dtype."""
    m, (r, width) = xs.shape[0], wf.shape
    c, s = width // fold, stack(fold, m)
    zeros = jnp.zeros_like(xs) if transposed else None  # x's off-diagonal blocks
    parts = []
    for k in range(0, fold, s):
        blocks = wf[:, k * c:(k + s) * c]
        if transposed:  # x block-diagonal [s m, s c] times the blocks transposed
            x = jnp.concatenate([jnp.concatenate([xs if j == b else zeros for j in range(s)],
                                                 axis=1) for b in range(s)]) if s > 1 else xs
            product = lax.dot_general(x, blocks, (((1,), (1,)), ((), ())),
                                      precision=exact(x, blocks),
                                      preferred_element_type=jnp.float32)
            parts += [product[b * m:(b + 1) * m] for b in range(s)]
        else:  # x's column blocks stacked along M times the blocks side by side
            x = jnp.concatenate([xs[:, (k + b) * r:(k + b + 1) * r] for b in range(s)])
            product = lax.dot_general(x, blocks, (((1,), (0,)), ((), ())),
                                      precision=exact(x, blocks),
                                      preferred_element_type=jnp.float32)
            parts += [product[b * m:(b + 1) * m, b * c:(b + 1) * c] for b in range(s)]
    if transposed:
        return jnp.concatenate(parts, axis=1)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total
