"""Small compiles that each read one number from libtpu's schedule.

Each probe is a tiny kernel compiled for one TensorCore of a TPU in a child process with
libtpu's bundle dump on (`mk.cost.bundles.compile_with_dumps`), recorded in data/ with the
libtpu version and re-checked by tests:
- `probe_tile(chip, dtype, m, feed)` -> `mk.cost.feed_costs.FeedCost`: one weight tile's cost
  by storage, feed and M, the rows of the tile cost table `mk.cost.sim` and `mk.cost.perf` charge;
- `probe_clock(chip)` -> `ClockProbe`: the bundle rate at which a straight-line bf16
  matmul's schedule would run at the datasheet peak, which bounds an MXU-bound loop's
  rate from above and gives no rate (data/clock_probes.json, `recorded_clock_probes()`);
- `probe_floor(chip, feed, m)` -> `mk.cost.feed_costs.FeedFloor`: the fewest bundles per weight
  element of a matmul with its weight already in VMEM.

Not here: a whole megakernel's per-tile loops and schedule (`mk.cost.bundles.measure`,
`dump_schedule`), the compile itself (`mk.measure.tpu`). Each probe's kernel and what its number
means: docs/design/mk.cost.probes.md.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import tempfile
import time

import jax.numpy as jnp

from mk.cost import feed_costs
from mk.model import untrusted
from mk.cost.bundles import (compile_with_dumps, drives_mxu, dump_file, loops, read_bundles,
                        tile_loops, tile_parts)
from mk.model.chips import DATA, ChipSpec, spec_of
from mk.kernels.weight_streaming import stream_matmul_block


# -- One weight tile by storage, feed and M: the stage kernel's own loop ---------------
TILE_PROBE_SHAPE = (4096, 2048)  # w [K, N]: 8 bf16 tiles of 2048 x 512, 32 packed 512 x 512
# XLA's memory-space assignment moves a small program's weight (the probe relays it out
# into the ring's layout, a temporary) into VMEM, and the ring's DMAs become vector copy
# loops; a model's weights never fit VMEM. Off, the probe's weight stays in HBM, as theirs.
KEEP_IN_HBM = ("--xla_msa_enable=false",)
_COMPILE_STREAM = """import functools, sys, jax, jax.numpy as jnp, mk
from mk.model import quant
from mk.kernels.weight_streaming import stream_matmul
chip, dtype, feed = sys.argv[1:4]
m, k, n = map(int, sys.argv[4:7])
w = (jax.ShapeDtypeStruct((k, n), jnp.bfloat16) if dtype == "bf16"
     else quant.abstract_weight((k, n), dtype))
fn = functools.partial(stream_matmul, dtype=jnp.bfloat16, feed=feed)
report = mk.measure.tpu.compile_for_chip(fn, [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w], chip)
sys.stderr.write(report.error)
sys.exit(0 if report.ok else 1)
"""


def probe_tile(chip: str | ChipSpec, dtype: str, m: int, feed: str = "bf16", *,
               shape: tuple[int, int] = TILE_PROBE_SHAPE, timeout: float = 300.0
               ) -> feed_costs.FeedCost:
    """Compile the stage-01 ring kernel (`stream_matmul`: `Ring.matmul` over one weight
    [K, N] = `shape` at its default tiling, `stream_matmul_block`) for one TensorCore of
    `chip`, the weight stored as `dtype` (bf16, or an mk.model.quant scheme: `abstract_weight`,
    the `QuantWeight` `quantize_weight` makes) and fed to the MXU as `feed`, against m
    bf16 rows, with the dumps on and the weight kept in HBM (`KEEP_IN_HBM`); read one trip
    of its steady per-tile loop (the first of `Ring.matmul`'s two in program order: the
    edge loop follows it). Raises ValueError for a GPU or a dtype, feed or m the table
    does not hold, RuntimeError if it does not compile or shows not exactly
    `Ring.matmul`'s per-tile loops."""
    spec = spec_of(chip)
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}: no TPU compile to probe")
    for field, value, choices in (("dtype", dtype, feed_costs.DTYPES),
                                  ("m", m, feed_costs.M_BUCKETS)):
        if value not in choices:
            raise ValueError(f"{field}={value!r} must be one of {choices}")
    if (dtype, feed) not in feed_costs.rows(spec):
        raise ValueError(f"feed={feed!r}: {spec.name}'s kernel does not feed {dtype} "
                         f"weights so (it does: {feed_costs.rows(spec)})")
    scheme = None if dtype == "bf16" else dtype
    block = stream_matmul_block(*shape, jnp.bfloat16, scheme)
    parts = tile_parts(scheme, block.tile_rows, block.tile_cols)
    with tempfile.TemporaryDirectory(prefix="mk-tile-") as folder:
        start = time.perf_counter()
        jf = compile_with_dumps(_COMPILE_STREAM, [spec.name, dtype, feed, m, *shape], folder,
                                phases=False, flags=KEEP_IN_HBM, timeout=timeout)
        seconds = time.perf_counter() - start
        text = dump_file(jf, "mk_stream_matmul", "final_bundles.txt").read_text()
    found = tile_loops(loops(text), parts)
    if not 1 <= len(found) <= 2:  # the steady loop, and the edge loop unless unrolled
        raise RuntimeError(f"{spec.name} {dtype} M={m}: {len(found)} per-tile loops of "
                           f"{parts} B DMAs in the dump, not Ring.matmul's steady and edge")
    steady = found[0]
    return feed_costs.FeedCost(
        chip=spec.name, dtype=dtype, feed=feed, m=m, shape=tuple(shape),
        tile=(block.tile_rows, block.tile_cols), tile_bytes=sum(parts),
        bundles=steady.bundles, mxu_bundles=steady.mxu,
        scalar_only_bundles=steady.scalar_only,
        libtpu=importlib.metadata.version("libtpu"), compile_s=seconds)


# -- The bound a schedule puts on an MXU-bound bundle rate ----------------------------------
CLOCK_PROBE_SHAPE = (512, 4096, 512)  # x[M, K] @ w[K, N]: compiles in seconds on every chip
CLOCK_PROBES = DATA / "clock_probes.json"  # benchmarks/clock_probe.py's record
_MXU_ID = re.compile(r"\.mxu(\d+)\b")
_COMPILE_MATMUL = """import sys, jax, jax.numpy as jnp, mk
from jax.experimental import pallas as pl
m, k, n = map(int, sys.argv[2:5])
w_dtype = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[sys.argv[5]]

def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

def f(x, w):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                          name="mk_matmul_probe")(x, w)

report = mk.measure.tpu.compile_for_chip(f, [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                     jax.ShapeDtypeStruct((k, n), w_dtype)], sys.argv[1])
sys.stderr.write(report.error)
print(report.compile_seconds)
sys.exit(0 if report.ok else 1)
"""


@dataclasses.dataclass(frozen=True)
class ClockProbe:
    """One straight-line bf16 matmul x[M, K] @ w[K, N] (f32 out) compiled for one
    TensorCore of a chip, and the bundle rate at which its schedule would run at the
    datasheet peak: its MXU span takes bundles / rate seconds for 2 M K N FLOP.

    No loop can beat the peak, so this bounds the bundle rate of a loop as dense in FLOPs
    a bundle as this schedule; it gives no rate, and a sparser loop may run faster: on the
    v5e (data/measured/v5e-bundles.json) an MXU-bound loop of 121 k FLOP a bundle (this
    probe's: 158 k) ran at 1.02x it, a decode-style loop at 0.80x. mk/data/chips.csv's
    assumed rates scale it by those ratios. The field keeps its recorded name, `clock_hz`.
    It depends on the shape (the MXU's weight pushes and result pops are amortised over
    M): compare probes of the same shape only."""

    chip: str
    shape: tuple[int, int, int]  # (M, K, N)
    bundles: int  # from the first to the last bundle driving an MXU (the matmul itself)
    total_bundles: int  # the whole kernel's (with its input and output DMAs)
    mxus: tuple[int, ...]  # the MXU ids the schedule addresses (mxuN in its ops)
    peak_flops: float  # one TensorCore's datasheet bf16 peak, FLOP/s
    libtpu: str  # the libtpu version that compiled it
    compile_s: float  # the compile's seconds on this machine (with the dumps)

    @property
    def flops(self) -> int:
        m, k, n = self.shape
        return 2 * m * k * n

    @property
    def clock_hz(self) -> float:
        """The bundle rate (per second) at which `bundles` do `flops` at `peak_flops`."""
        return self.peak_flops * self.bundles / self.flops

    def row(self) -> dict:
        """The record of data/clock_probes.json."""
        return dict(chip=self.chip, shape=list(self.shape), bundles=self.bundles,
                    total_bundles=self.total_bundles, mxus=list(self.mxus),
                    flops=self.flops, peak_flops=self.peak_flops,
                    clock_hz=self.clock_hz, libtpu=self.libtpu,
                    compile_s=round(self.compile_s, 2))


def _mxu_span(spec: ChipSpec, shape: tuple[int, int, int], feed: str, what: str,
              timeout: float) -> tuple[int, int, tuple[int, ...], float]:
    """Compile the straight-line x[M, K] bf16 @ w[K, N] `feed` (f32 out) for one
    TensorCore of `spec` with the dumps on: (bundles from the first to the last driving an
    MXU, all bundles, the MXU ids addressed, the compile's seconds). `what` names the
    probe in errors."""
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}: no TPU schedule to probe")
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape) or any(
            d % 128 for d in shape[1:]):
        raise ValueError(f"shape={shape!r} must be (M, K, N): positive, K and N multiples "
                         "of 128")
    with tempfile.TemporaryDirectory(prefix="mk-matmul-") as folder:
        start = time.perf_counter()
        jf = compile_with_dumps(_COMPILE_MATMUL, [spec.name, *shape, feed], folder,
                                phases=False, timeout=timeout)
        seconds = time.perf_counter() - start
        found = read_bundles(dump_file(jf, "mk_matmul_probe", "final_bundles.txt").read_text())
    if any(b.mark == "LB" for b in found):
        raise RuntimeError(f"the {what} on {spec.name} compiled to a loop: its bundles are "
                           "not its cycles")
    mxu = [i for i, b in enumerate(found) if any(map(drives_mxu, b.ops))]
    if not mxu:
        raise RuntimeError(f"the {what} on {spec.name} drives no MXU")
    ids = sorted({int(i) for b in found for o in b.ops for i in _MXU_ID.findall(o)})
    return mxu[-1] - mxu[0] + 1, len(found), tuple(ids), seconds


def probe_clock(chip: str | ChipSpec, shape: tuple[int, int, int] = CLOCK_PROBE_SHAPE, *,
                timeout: float = 300.0) -> ClockProbe:
    """Compile the `ClockProbe` matmul of `shape` for one TensorCore of `chip` with the
    dumps on (`compile_with_dumps`) and read its bundles. Raises ValueError for a GPU or a
    shape that is not three positive multiples of 128, RuntimeError if it does not compile
    or its schedule is not straight-line (a loop: bundles would not be cycles)."""
    spec = spec_of(chip)
    if len(shape) == 3 and shape[0] % 128:
        raise ValueError(f"shape={shape!r} must be (M, K, N), positive multiples of 128")
    span, total, ids, seconds = _mxu_span(spec, shape, "bf16", "clock probe", timeout)
    return ClockProbe(spec.name, tuple(shape), span, total, ids,
                      spec.bf16_flops / spec.tensorcores_per_chip,
                      importlib.metadata.version("libtpu"), seconds)


# -- The feed floor: the MXU taking one feed's weights, nothing else -------------------
# w [K, N] of the floor probes: at most 8 MiB of bf16, so with x and the output it fits
# v5e's 16 MiB of scoped VMEM (the probe takes whole operands into VMEM). libtpu's
# straight-line schedules are not monotone in N (tpu7x bf16 at M 8: 424, 289, 478 bundles
# per Mi weights at N 256, 512, 1024), so the floor is the least of these.
FLOOR_PROBE_SHAPES = ((4096, 256), (4096, 512), (4096, 1024), (2048, 2048))


def probe_floor(chip: str | ChipSpec, feed: str, m: int, *,
                shapes: tuple[tuple[int, int], ...] = FLOOR_PROBE_SHAPES,
                timeout: float = 300.0) -> feed_costs.FeedFloor:
    """Compile the straight-line matmul x[m, K] bf16 @ w[K, N], w already in VMEM as
    `feed`, for one TensorCore of `chip`, at each [K, N] of `shapes`, and read each MXU
    span: the `mk.cost.feed_costs.FeedFloor` of the fewest bundles per weight. Raises
    ValueError for a GPU, a feed the chip's MXU does not take (`ChipSpec.mxu_feeds`), an M
    the table does not hold or a shape the MXU does not tile."""
    spec = spec_of(chip)
    if spec.kind == "tpu" and feed not in spec.mxu_feeds:
        raise ValueError(f"feed={feed!r}: {spec.name}'s MXU takes {spec.mxu_feeds}")
    if m not in feed_costs.M_BUCKETS:
        raise ValueError(f"m={m!r} must be one of {feed_costs.M_BUCKETS}")
    found = []
    for kn in shapes:
        span, _, _, seconds = _mxu_span(spec, (m, *kn), feed, "floor probe", timeout)
        found.append(feed_costs.FeedFloor(spec.name, feed, (m, *kn), span,
                                          importlib.metadata.version("libtpu"), seconds))
    return min(found, key=lambda f: f.bundles_per_element)


def recorded_clock_probes(path=CLOCK_PROBES) -> dict[str, dict]:
    """The recorded `ClockProbe.row`s by chip (data/clock_probes.json)."""
    fields = dict(chip=str, shape=(untrusted.INTS, 3), bundles=int, total_bundles=int,
                  mxus=untrusted.INTS, flops=int, peak_flops=float, clock_hz=float, libtpu=str,
                  compile_s=float)
    return {r["chip"]: r for r in untrusted.rows(untrusted.load_json(
        path, "clock probes record"), path, "clock probes record", fields)}
