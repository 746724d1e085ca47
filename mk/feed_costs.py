"""What one weight tile costs the compute lane: a table measured from compiles, not a rule.

A decode step multiplies M activation rows by every weight tile it streams. What that
costs the TensorCore depends on the chip, on how the weight is stored (bf16 or an
`mk.quant` scheme: a packed tile is dequantised in VMEM first), on what is fed to the MXU
(the feed) and on M. `benchmarks/tile_feed_costs.py` measures it: for each row it compiles
the stage-01 ring kernel (`mk.kernels.weight_streaming.stream_matmul`, the same
`Ring.matmul` as the megakernel) over one weight matrix with libtpu's bundle dump on
(`mk.probes.probe_tile`) and counts the bundles of one trip of its steady per-tile loop.
One bundle issues per cycle, so bundles per trip / the clock is one tile's issue time, a
lower bound on the compute lane's time per tile (stalls are not in the count).

The record, data/tile_feed_costs.json (`FEED_COSTS`), holds one row per (chip, weight
dtype, feed, M) with the tile it was measured on and the libtpu version; `recorded()`
reads it, `FeedCost` is a row; `DTYPES`, `FEEDS` and `M_BUCKETS` are its keys (`rows`:
the (dtype, feed) pairs a chip's kernel uses), `weight_dtype` names a weight's storage.
`bundles_per_element(chip, dtype, m)` is the one lookup:
the row of the smallest recorded M at or above m (`bucket`), its bundles per trip over
the tile's elements. `tile_s` turns that into seconds for a tile of any size at one end
of the chip's clock range. `mk.sim` charges every weight tile so and `mk.perf`'s compute
floor sums the same; the MXU rule (`mk.perf.mxu_flops`) is left as a labelled bound.

Approximation: a row is measured at one tile (the stage kernel's default tiling of the
probe matrix, `mk.probes.TILE_PROBE_SHAPE`) and applied per element to tiles of other
sizes; part of a trip is fixed per tile (the ring's bookkeeping), so a much smaller tile
costs more per element than the table says.

Not here: the compiles and the dump reading (`mk.bundles`), which feed a kernel uses for a
scheme (`mk.unpack.choose_feeds`, the plan's `feeds`), the clock (`mk.chips`).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

from mk.chips import DATA, MXU_FEEDS, ChipSpec
from mk.unpack import FEEDABLE

FEED_COSTS = DATA / "tile_feed_costs.json"  # benchmarks/tile_feed_costs.py's record
DTYPES = ("bf16", "fp8", "int8", "int4", "fp4")  # a weight stored plain (bf16) or packed
FEEDS = MXU_FEEDS  # what a tile reaches the MXU as (a plain tile: bf16; `mk.unpack.FEEDABLE`)
M_BUCKETS = (1, 8, 64, 256)  # the rows the table is measured at
PLAIN = {"bfloat16": "bf16"}  # config.dtype -> the table's name for a plain weight


@dataclasses.dataclass(frozen=True)
class FeedCost:
    """One measured row: the steady per-tile loop of the stage kernel over a [K, N]
    weight stored as `dtype`, fed to the MXU as `feed`, against M rows, on `chip`."""

    chip: str
    dtype: str  # DTYPES
    feed: str  # FEEDS
    m: int  # activation rows
    shape: tuple[int, int]  # the probe weight [K, N]
    tile: tuple[int, int]  # (tile_rows, tile_cols) of its default tiling
    tile_bytes: int  # what one tile's DMAs move (packed data and scales when quantised)
    bundles: int  # one trip of the steady per-tile loop
    mxu_bundles: int  # of which drive the MXU
    scalar_only_bundles: int  # of which only the scalar unit works in
    libtpu: str  # the version that compiled it
    compile_s: float  # the compile's seconds on the recording machine, dumps on

    def __post_init__(self):
        for field, value, choices in (("dtype", self.dtype, DTYPES),
                                      ("feed", self.feed, FEEDS), ("m", self.m, M_BUCKETS)):
            if value not in choices:
                raise ValueError(f"tile feed cost row {self.chip}: {field}={value!r} must be "
                                 f"one of {choices}")
        if not self.bundles > 0:
            raise ValueError(f"tile feed cost row {self.chip}/{self.dtype}/M={self.m}: "
                             f"bundles={self.bundles!r} must be positive")

    @property
    def tile_elements(self) -> int:
        return self.tile[0] * self.tile[1]

    @property
    def bundles_per_element(self) -> float:
        return self.bundles / self.tile_elements

    @property
    def bundles_per_mi(self) -> float:
        """Bundles per 2^20 weights (the unit issue 34 quotes)."""
        return self.bundles_per_element * 2**20

    @property
    def key(self) -> tuple:
        return (self.chip, self.dtype, self.feed, self.m)

    def row(self) -> dict:
        """The record of data/tile_feed_costs.json (with the derived columns)."""
        out = dataclasses.asdict(self)
        out.update(shape=list(self.shape), tile=list(self.tile),
                   tile_elements=self.tile_elements,
                   bundles_per_mi=round(self.bundles_per_mi, 2),
                   compile_s=round(self.compile_s, 2))
        return out


_DERIVED = ("tile_elements", "bundles_per_mi")


@cache
def recorded(path: Path = FEED_COSTS) -> dict[tuple, FeedCost]:
    """The recorded rows by (chip, dtype, feed, m); a derived column that disagrees with
    its row (tampered or stale) is an error."""
    out = {}
    for r in json.loads(Path(path).read_text(encoding="utf-8")):
        cost = FeedCost(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in r.items() if k not in _DERIVED})
        if {k: r.get(k) for k in _DERIVED} != {k: cost.row()[k] for k in _DERIVED}:
            raise ValueError(f"{path}: row {cost.key}'s {_DERIVED} disagree with its "
                             "tile and bundles")
        if cost.key in out:
            raise ValueError(f"{path}: row {cost.key} is recorded twice")
        out[cost.key] = cost
    return out


def weight_dtype(config_dtype: str, scheme: str | None) -> str:
    """The table's name for a weight stored in `scheme` (an mk.quant scheme), else plain
    in the config's dtype."""
    if scheme is not None:
        return scheme
    if config_dtype not in PLAIN:
        raise NotImplementedError(f"dtype={config_dtype!r}: the tile cost table holds "
                                  f"weights stored as {DTYPES}, not {config_dtype}")
    return PLAIN[config_dtype]


def bucket(m: int) -> int:
    """The smallest recorded M at or above `m` (a tile against m rows costs at most it)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"M={m} rows is past the tile cost table's largest M bucket "
                     f"{M_BUCKETS[-1]}")


def rows(spec: ChipSpec) -> list[tuple[str, str]]:
    """The (dtype, feed) pairs the table holds for `spec`: each dtype with each feed the
    chip's MXU takes (`ChipSpec.mxu_feeds`) that the dtype reaches exactly (a plain bf16
    tile is fed bf16; `mk.unpack.FEEDABLE`)."""
    return [(d, f) for d in DTYPES for f in spec.mxu_feeds
            if f in FEEDABLE.get(d, FEEDABLE[None])]  # a plain dtype: the plain entry


def bundles_per_element(chip: str, dtype: str, m: int, feed: str = "bf16",
                        path: Path = FEED_COSTS) -> float:
    """Bundles one weight of a tile stored as `dtype` costs against m rows fed as `feed`
    on `chip`: the recorded row of M = `bucket(m)`."""
    table = recorded(path)
    key = (chip, dtype, feed, bucket(m))
    if key not in table:
        have = sorted({k[0] for k in table})
        raise ValueError(f"no tile cost row for chip={chip!r}, dtype={dtype!r}, "
                         f"feed={feed!r}, M bucket {key[3]} in {Path(path).name} (chips "
                         f"recorded: {have}; dtypes {DTYPES}, feeds {FEEDS}): run "
                         "benchmarks/tile_feed_costs.py")
    return table[key].bundles_per_element


def tile_s(spec: ChipSpec, dtype: str, m: int, elements: int, end: str = "low",
           feed: str = "bf16") -> float:
    """Seconds a tile of `elements` weights stored as `dtype` keeps the TensorCore
    issuing against m rows: the table's bundles per element x elements / the chip's clock
    at `end` of its range."""
    return bundles_per_element(spec.name, dtype, m, feed) * elements / spec.clock(end)
