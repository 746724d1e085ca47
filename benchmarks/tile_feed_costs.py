"""The compute cost of one weight tile per chip, weight dtype, feed and M (issue 34).

For each row `mk.cost.probes.probe_tile` compiles the stage-01 ring kernel
(`mk.kernels.weight_streaming.stream_matmul`, the megakernel's own `Ring.matmul`) over one
weight w[4096, 2048] (`mk.cost.probes.TILE_PROBE_SHAPE`, at the kernel's default tiling: bf16
tiles of 2048 x 512, packed tiles of 512 x 512) stored as the dtype (bf16 or an
`mk.model.quant` scheme: fp8 and fp4 dequantised in VMEM to the feed or fed fp8, int8 and int4
codes straight into the dot, `mk.model.unpack`) against M bf16 rows, for one
TensorCore of the chip, with libtpu's bundle dump on, and counts one trip of the steady
per-tile loop. The table `mk.cost.feed_costs` reads (the simulator's and `mk.cost.perf`'s compute
cost per weight tile):

    .venv/bin/python benchmarks/tile_feed_costs.py --json mk/data/tile_feed_costs.json

(each chip's (dtype, feed) pairs its kernel uses, `mk.cost.feed_costs.rows`; `--chips`,
`--dtypes`, `--feeds`, `--m` re-measure some rows, the others staying as recorded).

The floor under it, `--floors`: per chip, feed its MXU takes and M, one straight-line
matmul x[M, 4096] @ w[4096, N] with w in VMEM in the feed's dtype, the least over N
(`mk.cost.probes.probe_floor`), the least any loop feeding that dtype can issue a weight in:

    .venv/bin/python benchmarks/tile_feed_costs.py --floors --json mk/data/feed_floors.json

Nothing here runs on a TPU: bundle counts are the compiler's static schedule; a row's
seconds are bundles / the chip's bundle rate, a range
(`mk.model.chips.ChipSpec.bundle_rate`). tests/test_feed_costs.py re-compiles rows and compares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mk.cost import feed_costs, probes  # noqa: E402
from mk.model.chips import all_chips, spec_of  # noqa: E402


def table(rows: list[dict]) -> str:
    """Bundles per Mi weights, one line per (chip, dtype, feed), one column per M."""
    ms = sorted({r["m"] for r in rows})
    lines = [f"{'chip':6} {'dtype':5} {'feed':5} " + " ".join(f"{'M=' + str(m):>7}"
                                                            for m in ms)]
    cells = {(r["chip"], r["dtype"], r["feed"], r["m"]): r["bundles_per_mi"] for r in rows}
    for key in dict.fromkeys((r["chip"], r["dtype"], r["feed"]) for r in rows):
        lines.append(f"{key[0]:6} {key[1]:5} {key[2]:5} " + " ".join(
            f"{cells.get((*key, m), float('nan')):7.0f}" for m in ms))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=[c.name for c in all_chips("tpu")])
    p.add_argument("--dtypes", nargs="+", default=list(feed_costs.DTYPES))
    p.add_argument("--feeds", nargs="+", default=list(feed_costs.FEEDS))
    p.add_argument("--m", nargs="+", type=int, default=list(feed_costs.M_BUCKETS))
    p.add_argument("--json", type=Path, help="the record: rows measured here replace its "
                                             "rows of the same key, the others stay (it is "
                                             "rewritten after each row, so a stopped run "
                                             "keeps its rows)")
    p.add_argument("--floors", action="store_true", help="measure the feed floors "
                                                            "(mk.cost.probes.probe_floor) instead")
    args = p.parse_args(argv)
    if args.floors:
        return floors(args)
    record = {}
    if args.json and args.json.exists():
        record = {feed_costs.FeedCost(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in r.items()
                                         if k in feed_costs.FeedCost.__dataclass_fields__}
                                      ).key: r
                  for r in json.loads(args.json.read_text(encoding="utf-8"))}
    rows = []
    for chip in args.chips:
        for dtype, feed in feed_costs.rows(spec_of(chip)):  # what its kernel feeds
            if dtype not in args.dtypes or feed not in args.feeds:
                continue
            for m in args.m:
                cost = probes.probe_tile(chip, dtype, m, feed)
                rows.append(cost.row())
                record[cost.key] = rows[-1]
                print(json.dumps(rows[-1]), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(list(record.values()), indent=1) + "\n",
                                         encoding="utf-8")
    print(table(rows))

def floors(args) -> None:
    """The --floors run: each chip's feeds at each M, merged into --json by key."""
    record = {}
    if args.json and args.json.exists():
        record = {(r["chip"], r["feed"], r["shape"][0]): r
                  for r in json.loads(args.json.read_text(encoding="utf-8"))}
    for chip in args.chips:
        for feed in spec_of(chip).mxu_feeds:
            if feed not in args.feeds:
                continue
            for m in args.m:
                floor = probes.probe_floor(chip, feed, m)
                record[floor.key] = floor.row()
                print(json.dumps(floor.row()), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(list(record.values()), indent=1) + "\n",
                                         encoding="utf-8")


if __name__ == "__main__":
    main()
