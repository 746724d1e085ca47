"""The bound each TPU's schedule puts on an MXU-bound bundle rate: one bf16 matmul a chip.

For each chip, `mk.cost.probes.probe_clock` compiles x[M, K] @ w[K, N] (bf16 in, f32 out; the
shape `mk.cost.probes.CLOCK_PROBE_SHAPE`) for one TensorCore with libtpu's bundle dump on and
asks at what bundle rate its MXU span would run at the datasheet bf16 peak of one
TensorCore (`clock_hz`, its recorded name). No MXU-bound loop runs faster: it bounds
`mxu_bundle_rate` in `mk/data/chips.csv` (tests/test_chips.py) and gives no rate (the
rates: docs/design/mk.model.chips.md); tests/test_bundles.py re-compiles and checks the
record, so a libtpu that schedules it differently is noticed.

    .venv/bin/python benchmarks/clock_probe.py --json mk/data/clock_probes.json

Nothing here runs on a TPU: the bundle counts are the compiler's static schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mk.cost import probes  # noqa: E402
from mk.model.chips import all_chips  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=[c.name for c in all_chips("tpu")])
    p.add_argument("--shape", nargs=3, type=int, default=list(probes.CLOCK_PROBE_SHAPE),
                   metavar=("M", "K", "N"))
    p.add_argument("--json", type=Path, help="write the rows here (replaces the file)")
    args = p.parse_args(argv)
    table = []
    for chip in args.chips:
        probe = probes.probe_clock(chip, tuple(args.shape))
        table.append(probe.row())
        print(json.dumps(table[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
