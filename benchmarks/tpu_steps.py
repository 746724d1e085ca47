"""Time decode steps on a TPU: the megakernel and XLA's step, row by row.

For each row of `ROWS` (a preset, or its first layers where the whole model does not fit
one chip; B sequences, T rows each, a cache of `context` positions), `mk.measure.measure`'s
`time_step_series` times one dispatched megakernel step, a device loop of 32 steps and
XLA's step (`mk.model.reference.forward` jitted). The record goes to
data/measured/<chip>-steps.json (or $MK_MEASURED), rewritten after every row so a run cut
short by a time limit keeps what it measured. Each row carries its own provenance (commit,
date, how the one step was timed: `mk.cost.calibration.provenance`), so `--rows` may measure a
table in parts and a record keeps the rows of earlier commits (same chip and versions)
that this run did not measure again; a row the chip refuses (out of memory) is kept with
its error. `mk.cost.calibration` reads it. Random weights: the time of a step does
not depend on their values.

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_steps.py [--rows 0 3 5] [--budget 500]

A sweep of the attention loop's KV tiling (issue 60: it took KV at 452 GB/s where the DMA
probe moved 748): `--kv-tiles 128 256 512 --kv-slots 2 4` times each picked row's device
loop at every (kv_tile, kv_slots), the rest of the block the default plan's, into
<chip>-kv-sweep.json beside the steps record (which `mk.cost.calibration` reads, so a
default's rows never mix with a sweep's); a block the plan refuses is kept with its error.

On a CPU it refuses (interpret-mode time is not a TPU's): pass --interpret to try the
script on `tiny` rows, whose record goes to the path given by --json, never under
data/measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mk.cost import calibration  # noqa: E402
from mk.measure import measure  # noqa: E402

# (preset, first layers or None for all, B, T, context)
ROWS = (
    ("qwen3-0.6b", None, 1, 1, 1024),
    ("qwen3-0.6b", None, 8, 1, 1024),
    ("qwen3-0.6b", None, 1, 8, 1024),
    ("qwen3-1.7b", None, 1, 1, 1024),
    ("qwen3-1.7b", None, 8, 1, 1024),
    ("qwen3-1.7b", None, 1, 8, 1024),
    ("qwen3-0.6b", None, 1, 1, 4096),
    ("qwen3-4b", None, 1, 1, 1024),
    ("qwen3-30b-a3b", 6, 1, 1, 1024),  # MoE: 128 experts, top 8
    ("qwen3-30b-a3b", 6, 8, 1, 1024),
    ("qwen3.5-9b", 8, 1, 1, 1024),  # hybrid: gated DeltaNet and full attention
    ("qwen3.5-9b", 8, 1, 8, 1024),
    ("qwen3-8b", 20, 1, 1, 1024),  # 8b's first 20 layers: 8.9 GB of bf16 weights
)
INTERPRET_ROWS = (("tiny", None, 1, 1, 64), ("tiny-moe", None, 2, 4, 64))


def time_row(preset, layers, batch, rows, context, *, backend: str, repeats: int,
             kv: tuple[int, int] | None = None) -> dict:
    """One row of the record: the row's fields and each series' seconds per step, or the
    error the chip gave; with `kv` (kv_tile, kv_slots), the device loop's alone at that
    KV tiling, the rest of the block the default plan's (`mk.measure.measure.step_plan`)."""
    row = dict(model=preset, layers=layers, batch=batch, rows=rows, context=context)
    config, sweep = calibration.row_config(row), {}
    try:
        if kv is not None:
            row |= dict(kv_tile=kv[0], kv_slots=kv[1])
            default = measure.step_plan(config, batch=batch, rows=rows, context=context).block
            sweep = dict(block=dataclasses.replace(default, kv_tile=kv[0], kv_slots=kv[1]),
                         series=(calibration.LOOP,))
        row |= measure.time_step_series(config, batch=batch, rows=rows, context=context,
                                        repeats=repeats, backend=backend, **sweep)
    except Exception as err:  # noqa: BLE001 - a refused row is a result, kept with its error
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, help="indices into ROWS (default: all)")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds after which no new row starts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: the tiny rows in interpret mode (not a TPU's time)")
    p.add_argument("--json", type=Path, help="where the record goes")
    p.add_argument("--kv-tiles", nargs="+", type=int, help="sweep these KV tiles")
    p.add_argument("--kv-slots", nargs="+", type=int, help="sweep these KV slot counts")
    args = p.parse_args(argv)
    if bool(args.kv_tiles) != bool(args.kv_slots):
        p.error("--kv-tiles and --kv-slots sweep together: give both")
    kvs = list(itertools.product(args.kv_tiles, args.kv_slots)) if args.kv_tiles else [None]
    try:
        made = measure.labelled(measure.provenance(), interpret=args.interpret,
                                json_path=args.json)
    except ValueError as err:
        p.error(str(err))
    table, backend = (INTERPRET_ROWS, "interpret") if args.interpret else (ROWS, "hardware")
    made |= dict(megakernel_cache="donated")  # `time_step_series`' one step: in place
    picked = [table[i] for i in args.rows] if args.rows else list(table)
    path = args.json or (calibration.steps_path(made["chip"]) if kvs == [None] else
                         measure.MEASURED / f"{made['chip']}-kv-sweep.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = {_key(r): r for r in _earlier_rows(path, made)}
    start, done = time.perf_counter(), 0
    for (preset, layers, batch, t, context), kv in itertools.product(picked, kvs):
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: "
                  f"{len(picked) * len(kvs) - done} rows left", flush=True)
            break
        row = time_row(preset, layers, batch, t, context, backend=backend,
                       repeats=args.repeats, kv=kv)
        row |= {f: made[f] for f in calibration.PROVENANCE}
        rows[_key(row)], done = row, done + 1
        print(json.dumps(row), flush=True)
        path.write_text(json.dumps(made | dict(rows=list(rows.values())), indent=1) + "\n",
                        encoding="utf-8")
    print(f"wrote {path}")


def _key(row: dict) -> tuple:
    return tuple(row.get(f) for f in ("model", "layers", "batch", "rows", "context",
                                      "kv_tile", "kv_slots"))


def _earlier_rows(path: Path, made: dict) -> list[dict]:
    """The rows of a record at `path` from the same chip and versions (any commit), each
    with its provenance (`mk.cost.calibration.provenance`): the table may be measured in parts
    (`--rows`), and a row not measured again keeps the commit it was measured at."""
    if not path.exists():
        return []
    earlier = calibration.load_steps(path)
    if not all(earlier.get(f) == made[f] for f in ("chip", "jax", "libtpu")):
        return []
    return [row | calibration.provenance(earlier, row) for row in earlier["rows"]]


if __name__ == "__main__":
    main()
