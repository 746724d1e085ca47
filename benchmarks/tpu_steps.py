"""Time decode steps on a TPU: the megakernel and XLA's step, row by row.

For each row of `ROWS` (a preset, or its first layers where the whole model does not fit
one chip; B sequences, T rows each, a cache of `context` positions), `mk.measure`'s
`time_step_series` times one dispatched megakernel step, a device loop of 32 (T = 1) and
XLA's step (`mk.reference.forward` jitted). The record goes to
data/measured/<chip>-steps.json (or $MK_MEASURED), rewritten after every row so a run cut
short by a time limit keeps what it measured; a row the chip refuses (out of memory) is
kept with its error. Random weights: the time of a step does not depend on their values.

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_steps.py [--rows 0 3 5] [--budget 500]

On a CPU it refuses (interpret-mode time is not a TPU's): pass --interpret to try the
script on `tiny` rows, whose record goes to the path given by --json, never under
data/measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mk  # noqa: E402
from mk import measure  # noqa: E402

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
)
INTERPRET_ROWS = (("tiny", None, 1, 1, 64), ("tiny-moe", None, 2, 4, 64))


def row_config(preset: str, layers: int | None):
    config = mk.preset(preset)
    return config if layers is None else config.first_layers(layers)


def time_row(preset, layers, batch, rows, context, *, backend: str, repeats: int) -> dict:
    """One row of the record: the row's fields and each series' seconds per step, or the
    error the chip gave."""
    row = dict(model=preset, layers=layers, batch=batch, rows=rows, context=context)
    series = measure.STEP_SERIES if rows == 1 else ("megakernel", "xla")
    try:
        row |= measure.time_step_series(row_config(preset, layers), batch=batch, rows=rows,
                                        context=context, series=series, repeats=repeats,
                                        backend=backend)
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
    args = p.parse_args(argv)
    made = measure.provenance()
    if args.interpret:
        if args.json is None or args.json.stem.split("-")[0] in measure.TPU_NAMES:
            p.error("--interpret needs --json, a path not named for a TPU")
        table, backend = INTERPRET_ROWS, "interpret"
        made |= dict(label=measure.INTERPRET_LABEL)
    elif made["chip"] is None:
        p.error(f"no TPU here ({made['device_kind']}); --interpret tries the script")
    else:
        table, backend = ROWS, "hardware"
        made |= dict(label=f"measured on {made['device_kind']}")
    picked = [table[i] for i in args.rows] if args.rows else list(table)
    path = args.json or measure.MEASURED / f"{made['chip']}-steps.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    for preset, layers, batch, t, context in picked:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(picked) - len(rows)} rows left",
                  flush=True)
            break
        rows.append(time_row(preset, layers, batch, t, context, backend=backend,
                             repeats=args.repeats))
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps(made | dict(rows=rows), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
