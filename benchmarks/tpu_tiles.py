"""Time one ring tile per weight format on a TPU (issue 61): the stage-01 kernel, a tile.

For each format (bf16 and every `mk.model.quant.SCHEMES`), `stream_matmul`
(`mk.kernels.weight_streaming`: x [ROWS, K] by w [K, TILE] through a SLOTS-slot ring of
TILE x TILE tiles) runs at two depths of K, `--depths` tiles, each the median of
`--repeats` dispatched calls (`mk.measure.measure.median_seconds`). Their difference over the
tiles between them is one tile's time: the call's fixed cost (dispatch, the ring's fill
and drain) cancels. Beside it: the tile's HBM bytes (`mk.model.quant.tile_bytes`, data and
scales) and the rate they moved at, and the deeper call's largest error against the
reference's product (`mk.model.ops.matmul` by `reference_weight`), so that a fast tile is also
a right one.

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_tiles.py [--formats int8 int4]

The record: data/measured/<chip>-tiles.json (or $MK_MEASURED), the chip, versions, commit
and date with it. On a CPU it refuses; --interpret --json PATH tries the script in
interpret mode (small tiles; a CPU's seconds, labelled so, never under data/measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mk.measure import measure  # noqa: E402
from mk.model import ops, quant  # noqa: E402
from mk.kernels import backend as backends  # noqa: E402
from mk.kernels.common import BlockSizes  # noqa: E402
from mk.kernels.weight_streaming import stream_matmul  # noqa: E402

FORMATS = ("bf16", *quant.SCHEMES)
ROWS = 8  # activation rows: a decode step's batch
SLOTS = 3  # the ring's depth
TILE = 512  # the tile: 0.95 us an int8 512 x 512 tile on the v5e before it
# Tiles along K at the two depths. Their difference must dwarf the spread of a call's
# cost: on the v5e (2026-12-07) medians of calls at one depth moved by ~0.1 ms, so 4 and
# 36 tiles (32 apart, 15-120 us of tiles) gave negative times; 1024 apart resolve them.
DEPTHS = (8, 1032)
INTERPRET = dict(tile=256, depths=(2, 4), repeats=1)  # --interpret: seconds, not minutes


def time_tile(fmt: str, *, tile: int, depths: tuple[int, int], repeats: int,
              backend: str, seed: int = 0) -> dict:
    """One row: `fmt`'s seconds a tile (the two depths' difference over their tiles), its
    bytes, their rate, each depth's median call and the deeper call's largest error."""
    short, deep = depths
    if not (isinstance(short, int) and isinstance(deep, int) and 1 <= short < deep):
        raise ValueError(f"depths={depths!r} must be two tile counts, 1 <= first < second")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {FORMATS}")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((ROWS, deep * tile)), jnp.float32)
    w = rng.standard_normal((deep * tile, tile)).astype(np.float32)
    block = BlockSizes(slots=SLOTS, tile_rows=tile, tile_cols=tile)

    def weight(tiles: int):
        part = w[:tiles * tile]
        return (jnp.asarray(part, jnp.bfloat16) if fmt == "bf16"
                else quant.quantize_weight(part, fmt))

    args = {n: (x[:, :n * tile], weight(n)) for n in depths}
    with backends.use(backend):
        calls = {n: jax.jit(lambda x, q: stream_matmul(x, q, block=block)).lower(
            *args[n]).compile() for n in depths}
        seconds = measure.median_seconds({n: lambda n=n: calls[n](*args[n]) for n in depths},
                                         repeats)
        got = np.asarray(calls[deep](*args[deep]))
    want = np.asarray(ops.matmul(x, reference_weight(args[deep][1])))
    nbytes = tile * tile * 2 if fmt == "bf16" else quant.tile_bytes(fmt, tile, tile)
    per_tile = (seconds[deep] - seconds[short]) / (deep - short)
    return dict(format=fmt, tile=tile, rows=ROWS, slots=SLOTS, depths=list(depths),
                call_s=[seconds[short], seconds[deep]], tile_s=per_tile,
                tile_bytes=nbytes, gb_per_s=nbytes / per_tile / 1e9 if per_tile > 0 else None,
                max_error=float(np.abs(got - want).max()),
                scale=float(np.abs(want).max()))


def reference_weight(q):
    """What the reference multiplies by to compute what the kernel does with `q` (a bf16
    array or a `QuantWeight`, `mk.model.quant.dequantize_weight` at bf16)."""
    return q if not isinstance(q, quant.QuantWeight) else quant.dequantize_weight(
        q, jnp.bfloat16)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--depths", type=int, nargs=2, default=list(DEPTHS),
                   help="tiles along K of the two calls (their difference cancels a call's cost)")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: interpret mode, small tiles (not a TPU's time)")
    p.add_argument("--json", type=Path, help="where the record goes")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    try:
        made = measure.labelled(measure.provenance(), interpret=args.interpret,
                                json_path=args.json)
    except ValueError as err:
        p.error(str(err))
    if args.interpret:
        sizes, backend = INTERPRET, "interpret"
    else:
        sizes = dict(tile=TILE, depths=tuple(args.depths), repeats=args.repeats)
        backend = "hardware"
    path = args.json or measure.MEASURED / f"{made['chip']}-tiles.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in args.formats:
        rows.append(time_tile(fmt, backend=backend, **sizes))
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps(made | dict(rows=rows), indent=1) + "\n",
                        encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
