"""Time a compiled bundle on a TPU (issue 61): the bundle rate of mk/data/chips.csv.

mk turns libtpu's bundle counts (`mk.cost.bundles`, `mk.cost.feed_costs`) into seconds at a
chip's bundle rate. Here each of two loops, `LOOPS`, is one Pallas kernel: a `fori_loop`
of `trips` dots x [M, K] bf16 @ w[i % TILES] [K, N] bf16 (f32 accumulated), every
operand resident in VMEM, no DMA inside the loop. "decode" is a decode step's loop (M 8:
the weight feed sets the pace); "mxu" an MXU-bound one (M 512, at or above every chip's
mxu_rows: the MXU sets it). Each is compiled for the chip with libtpu's bundle dump
(`mk.cost.bundles.compile_with_dumps`, in a child process) at two trip counts; the loop's
body (`mk.cost.bundles.loops`: the one loop, the same bundles in both) is what the extra
trips add, so (the longer call's median - the shorter's) / ((trips difference) x body
bundles) is seconds per bundle, the call's fixed cost (dispatch, the loads into VMEM,
the prologue) cancelled.

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_bundle_time.py

The record: data/measured/<chip>-bundles.json (or $MK_MEASURED), the chip, versions,
commit and date with it (`mk.measure.measure.provenance`); tests/test_chips.py holds
chips.csv's rates to it. About a minute on a v5e (six compiles with the dumps; the timed
calls take seconds). On a CPU it refuses; --interpret --json PATH
tries the script in interpret mode (a CPU's seconds, labelled so, never under
data/measured), its bundles counted for `--chip` (default v5e).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from mk.cost import bundles  # noqa: E402
from mk.kernels import backend as backends  # noqa: E402
from mk.measure import measure  # noqa: E402
from mk.model.chips import all_chips  # noqa: E402

# loop -> (M, the activation rows of each dot; the trips of the two calls). A call's
# median moves by ~0.1 ms (benchmarks/tpu_tiles.py), so the trips between the two calls
# take ~25 ms (a decode trip, 183 bundles on a v5e: ~0.13 us) and ~80 ms (an MXU-bound
# one, 2214 bundles: ~2 us) there: the bundle's time to under 0.5 %.
LOOPS = {"decode": (8, (1_000, 201_000)), "mxu": (512, (1_000, 41_000))}
K = N = 512  # each weight tile [K, N]
TILES = 4  # weight tiles in VMEM, one a trip in turn (a trip's dot is not hoisted)
INTERPRET = dict(trips=(2, 4), repeats=1)  # --interpret: seconds, not minutes
KERNEL = "mk_bundle_loop"
_COMPILE = """import sys
sys.path.insert(0, sys.argv[1])
import tpu_bundle_time as b
from mk.measure import tpu
loop, chip, trips = sys.argv[2], sys.argv[3], int(sys.argv[4])
m = b.LOOPS[loop][0]
report = tpu.compile_for_chip(b.loop_call(m, trips), b.operands(m), chip)
sys.stderr.write(report.error)
sys.exit(0 if report.ok else 1)
"""


def bundle_loop_kernel(x_vmem, w_vmem, o_vmem, *, trips: int):
    # Inputs
    #   x_vmem,  # [M, K] bf16
    #   w_vmem,  # [TILES, K, N] bf16
    # Outputs
    #   o_vmem,  # [M, N] f32
    def trip(i, acc):
        return acc + jnp.dot(x_vmem[...], w_vmem[i % TILES],
                             preferred_element_type=jnp.float32)

    o_vmem[...] = jax.lax.fori_loop(0, trips, trip, jnp.zeros(o_vmem.shape, jnp.float32))


def loop_call(m: int, trips: int):
    """The kernel of `trips` dots against m rows, as a function of (x, w)."""
    if not (isinstance(trips, int) and trips >= 1 and isinstance(m, int) and m >= 1):
        raise ValueError(f"trips={trips!r} and m={m!r} must be positive integers")
    return pl.pallas_call(functools.partial(bundle_loop_kernel, trips=trips),
                          out_shape=jax.ShapeDtypeStruct((m, N), jnp.float32), name=KERNEL)


def operands(m: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((m, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((TILES, K, N), jnp.bfloat16)]


def _dump(loop: str, chip: str, trips: int) -> str:
    """The final bundles of `loop`'s kernel of `trips` trips compiled for `chip`."""
    with tempfile.TemporaryDirectory(prefix="mk-bundle-time-") as folder:
        jf = bundles.compile_with_dumps(
            _COMPILE, [Path(__file__).resolve().parent, loop, chip, trips], folder,
            phases=False)
        return bundles.dump_file(jf, KERNEL, "final_bundles.txt").read_text()


def _pushes(rows) -> int:
    """Weight pushes into an MXU among `rows` (`mk.cost.bundles.Bundle`s)."""
    return sum(o.startswith("vmatpush") for r in rows for o in r.ops)


def body_bundles(loop: str, chip: str, trips: tuple[int, int]) -> int:
    """The bundles of one trip of `loop`'s kernel compiled for `chip`: its one loop's body
    (`mk.cost.bundles.loops`), the same at both trip counts (so their difference in a
    call's bundles is trips x body), pushing one dot's weights (those of the one-trip
    kernel: the loop is not unrolled). Raises RuntimeError when the compile shows more or
    fewer loops driving the MXU, bodies that differ or a body of more or fewer dots."""
    one_dot = _pushes(bundles.read_bundles(_dump(loop, chip, 1)))
    found = []
    for n in trips:
        text = _dump(loop, chip, n)
        mxu = [lp for lp in bundles.loops(text) if lp.mxu]
        if len(mxu) != 1 or mxu[0].nested:
            raise RuntimeError(f"{loop} on {chip} at {n} trips: {len(mxu)} loops drive the "
                               "MXU, not one flat loop: a trip's bundles are not known")
        lp = mxu[0]
        pushes = _pushes(bundles.read_bundles(text)[lp.first:lp.first + lp.bundles])
        if pushes != one_dot:
            raise RuntimeError(f"{loop} on {chip} at {n} trips: the body pushes {pushes} "
                               f"weights, one dot {one_dot}: unrolled, not one dot a trip")
        found.append(lp.bundles)
    if len(set(found)) != 1:
        raise RuntimeError(f"{loop} on {chip}: the loop's body differs with its trips "
                           f"({found} bundles)")
    return found[0]


def time_loop(loop: str, chip: str, *, trips: tuple[int, int], repeats: int,
              backend: str, seed: int = 0) -> dict:
    """One row: `loop`'s body bundles on `chip`, each trip count's median call, and the
    seconds per bundle (and bundles per second) their difference gives."""
    short, long = trips
    if not (isinstance(short, int) and isinstance(long, int) and 1 <= short < long):
        raise ValueError(f"trips={trips!r} must be two trip counts, 1 <= first < second")
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} must be one of {tuple(LOOPS)}")
    m, body = LOOPS[loop][0], body_bundles(loop, chip, trips)
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, K), jnp.bfloat16)
    w = jax.random.normal(kw, (TILES, K, N), jnp.bfloat16)
    with backends.use(backend):
        calls = {n: jax.jit(loop_call(m, n)).lower(x, w).compile() for n in trips}
        seconds = measure.median_seconds({n: lambda n=n: calls[n](x, w) for n in trips},
                                         repeats)
    per_bundle = (seconds[long] - seconds[short]) / ((long - short) * body)
    return dict(loop=loop, m=m, k=K, n=N, tiles=TILES, trips=list(trips),
                call_s=[seconds[short], seconds[long]], body_bundles=body,
                s_per_bundle=per_bundle,
                bundles_per_s=1 / per_bundle if per_bundle > 0 else None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--trips", type=int, nargs=2,
                   help="trips of the two calls of every loop (their difference cancels a "
                        "call's cost); default each loop's own (`LOOPS`)")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: interpret mode, few trips (not a TPU's time)")
    p.add_argument("--chip", default="v5e", choices=[c.name for c in all_chips("tpu")],
                   help="with --interpret: the chip the bundles are counted for")
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
        sizes, backend, chip = INTERPRET, "interpret", args.chip
        made |= dict(bundles_for=chip)
    else:
        sizes = dict(trips=args.trips and tuple(args.trips), repeats=args.repeats)
        backend, chip = "hardware", made["chip"]
    path = args.json or measure.MEASURED / f"{made['chip']}-bundles.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for loop in args.loops:
        trips = sizes["trips"] or LOOPS[loop][1]
        rows.append(time_loop(loop, chip, backend=backend, trips=trips,
                              repeats=sizes["repeats"]))
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps(made | dict(rows=rows), indent=1) + "\n",
                        encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
