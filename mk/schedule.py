"""The megakernel's tile schedule: every weight tile of one decode step, in order.

One `TileStream` (mk.kernels.ring): one layer's segments (wq, wk, wv, wo, then the dense
MLP and/or the expert slots) repeated for every layer, then the lm_head as the tail. The
megakernel executes it, the simulator will replay it, the plots draw it; `rows()` prints
it. The vocab is padded up to whole tiles (the padded logits are masked before argmax).

Here: `decode_stream`, `padded_vocab`, `rows`. Not here: executing it (`mk.megakernel`).
"""

from __future__ import annotations

from mk.config import ModelConfig
from mk.kernels.common import BlockSizes
from mk.kernels.one_layer import layer_matrices, mlp_kinds
from mk.kernels.ring import TileStream


def padded_vocab(config: ModelConfig, block: BlockSizes) -> int:
    """V rounded up to whole lm_head tiles."""
    return -(-config.vocab // block.tile_n) * block.tile_n


def decode_stream(config: ModelConfig, rows: int, block: BlockSizes) -> TileStream:
    """The stream of one decode step of M = B*T `rows` through `block`'s ring."""
    return TileStream.build(block, layer_matrices(config, mlp_kinds(config), rows),
                            layers=config.layers,
                            tail=[("lm_head", config.hidden, padded_vocab(config, block))])


def rows(stream: TileStream, itemsize: int = 2) -> list[dict]:
    """One dict per tile (g, layer, matrix, row/col tile, ring slot, KiB), for a table."""
    kib = stream.block.tile_k * stream.block.tile_n * itemsize / 1024
    return [dict(g=g, layer="lm_head" if layer is None else layer, matrix=name, row_tile=i,
                 col_tile=j, slot=g % stream.block.slots, KiB=kib)
            for g, layer, name, i, j in stream.tiles()]
