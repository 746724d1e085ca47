"""What one weight tile costs the compute lane: a table measured from compiles, not a rule.

A tile's cost depends on the chip, on how the weight is stored (bf16 or an `mk.model.quant`
scheme), on what is fed to the MXU (the feed) and on M. `benchmarks/tile_feed_costs.py`
measures it from the bundles of one trip of the ring kernel's per-tile loop
(`mk.cost.probes.probe_tile`) and records data/tile_feed_costs.json (`FEED_COSTS`).

Here: `recorded()`, `FeedCost` (a row), `DTYPES`, `FEEDS`, `M_BUCKETS`, `rows`,
`weight_dtype`, `bundles_per_element(chip, dtype, m)` (the one lookup, by M `bucket`),
`tile_s` (seconds at one end of the bundle rate); the feed floor under the table
(data/feed_floors.json: `FEED_FLOORS`, `recorded_feed_floors`, `FeedFloor`,
`feed_floor_per_element`, `feed_floor_over_dma`). `mk.cost.sim` charges every weight tile so
and `mk.cost.perf`'s compute floor sums the same.

Not here: the compiles and the dump reading (`mk.cost.bundles`), which feed a kernel uses for a
scheme (`mk.model.unpack.choose_feeds`), the bundle rate (`mk.model.chips`). The
approximations (one tile size, per element) and what the floor is and is not:
docs/design/mk.cost.feed_costs.md.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

from mk.model import untrusted
from mk.model.chips import DATA, MXU_FEEDS, ChipSpec
from mk.model.unpack import FEEDABLE

FEED_COSTS = DATA / "tile_feed_costs.json"  # benchmarks/tile_feed_costs.py's record
FEED_FLOORS = DATA / "feed_floors.json"  # benchmarks/tile_feed_costs.py --floors's record
DTYPES = ("bf16", "fp8", "int8", "int4", "fp4")  # a weight stored plain (bf16) or packed
FEEDS = MXU_FEEDS  # what a tile reaches the MXU as (a plain tile: bf16; `mk.model.unpack.FEEDABLE`)
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
    fields = dict(chip=str, dtype=str, feed=str, m=int, shape=(untrusted.INTS, 2),
                  tile=(untrusted.INTS, 2), tile_bytes=int, bundles=int, mxu_bundles=int,
                  scalar_only_bundles=int, libtpu=str, compile_s=float, tile_elements=int,
                  bundles_per_mi=float)
    for r in untrusted.rows(untrusted.load_json(path, "feed costs record"), path,
                            "feed costs record", fields):
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
    """The table's name for a weight stored in `scheme` (an mk.model.quant scheme), else plain
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
    tile is fed bf16; `mk.model.unpack.FEEDABLE`)."""
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


def tile_s(spec: ChipSpec, dtype: str, m: int, elements: int, end: str = "slow",
           feed: str = "bf16") -> float:
    """Seconds a tile of `elements` weights stored as `dtype` keeps the TensorCore
    issuing against m rows: the table's bundles per element x elements / the chip's bundle
    rate at `end` for the loop the row measured (M `bucket(m)`: at a large M the MXU-bound
    rate, `mk.model.chips.ChipSpec.bundle_rate`)."""
    return (bundles_per_element(spec.name, dtype, m, feed) * elements
            / spec.bundle_rate(end, bucket(m)))


# -- The floor under the table: the MXU taking a weight, nothing else -----------------------
@dataclasses.dataclass(frozen=True)
class FeedFloor:
    """One straight-line x[M, K] bf16 @ w[K, N] (f32 out), w already in VMEM as `feed`,
    compiled for one TensorCore of `chip` (`mk.cost.probes.probe_floor`): its MXU span's
    bundles per weight are the least any kernel feeding that dtype spends taking a weight
    into the MXU against M rows. A floor, not a cost: a ring's loop adds its DMAs, waits
    and bookkeeping, a packed tile its decode."""

    chip: str
    feed: str  # FEEDS
    shape: tuple[int, int, int]  # (M, K, N)
    bundles: int  # from the first to the last bundle driving an MXU
    libtpu: str
    compile_s: float

    def __post_init__(self):
        if self.feed not in FEEDS or self.shape[0] not in M_BUCKETS:
            raise ValueError(f"feed floor row {self.chip}: feed={self.feed!r} must be one of "
                             f"{FEEDS} and M={self.shape[0]} one of {M_BUCKETS}")

    @property
    def bundles_per_element(self) -> float:
        _, k, n = self.shape
        return self.bundles / (k * n)

    @property
    def key(self) -> tuple:
        return (self.chip, self.feed, self.shape[0])

    def row(self) -> dict:
        """The record of data/feed_floors.json (with bundles per Mi weights)."""
        return dict(chip=self.chip, feed=self.feed, shape=list(self.shape),
                    bundles=self.bundles,
                    bundles_per_mi=round(self.bundles_per_element * 2**20, 2),
                    libtpu=self.libtpu, compile_s=round(self.compile_s, 2))


@cache
def recorded_feed_floors(path: Path = FEED_FLOORS) -> dict[tuple, FeedFloor]:
    """The recorded floors by (chip, feed, M); a bundles_per_mi that disagrees with its
    row's bundles (tampered or stale), or a key recorded twice, is an error."""
    out = {}
    fields = dict(chip=str, feed=str, shape=(untrusted.INTS, 3), bundles=int, bundles_per_mi=float,
                  libtpu=str, compile_s=float)
    for r in untrusted.rows(untrusted.load_json(path, "feed floors record"), path,
                            "feed floors record", fields):
        floor = FeedFloor(r["chip"], r["feed"], tuple(r["shape"]), r["bundles"],
                          r["libtpu"], r["compile_s"])
        if floor.row() != r or floor.key in out:
            raise ValueError(f"{path}: row {floor.key} disagrees with its own bundles or is "
                             "recorded twice")
        out[floor.key] = floor
    return out


def feed_floor_per_element(chip: str, feed: str, m: int, path: Path = FEED_FLOORS
                           ) -> float:
    """The fewest bundles per weight libtpu has been seen to need for a weight fed `feed`
    against m rows on `chip` (M bucket of m): the recorded straight-line floor, or a
    table row's loop feeding that dtype where one does better."""
    floors = recorded_feed_floors(path)
    key = (chip, feed, bucket(m))
    if key not in floors:
        raise ValueError(f"no feed floor for chip={chip!r}, feed={feed!r}, M bucket "
                         f"{key[2]} in {Path(path).name}: run benchmarks/tile_feed_costs.py "
                         "--floors")
    loops = [c.bundles_per_element for k, c in recorded().items()
             if (k[0], k[2], k[3]) == key]
    return min([floors[key].bundles_per_element, *loops])


def feed_floor_over_dma(spec: ChipSpec, dtype: str, m: int, end: str = "slow",
                        feed: str | None = None, path: Path = FEED_FLOORS
                        ) -> tuple[str, float]:
    """(feed, ratio): the least issue time over own DMA time a weight stored as `dtype`
    can reach against m rows on `spec` at `end` of its bundle rate, whatever the loop
    around it: fed `feed`, or (None) the best of the feeds its kernel may use (`rows`),
    `feed_floor_per_element` over the MXU-bound rate against the weight's bytes (the
    table's row at that M: its tile's bytes, packed data and scales, per weight) at one
    device's HBM bandwidth."""
    table, found = recorded(), []
    for d, f in rows(spec):
        if d == dtype and feed in (None, f):
            cost = table[(spec.name, dtype, f, bucket(m))]
            # The floor's bundles are a straight line of MXU pushes, back to back: the MXU
            # sets their pace, so they issue at the MXU-bound rate whatever M is.
            mxu_rate = spec.bundle_rate(end, max(m, spec.mxu_rows))
            issue_s = feed_floor_per_element(spec.name, f, m, path) / mxu_rate
            dma_s = cost.tile_bytes / cost.tile_elements / spec.device_hbm_bw
            found.append((f, issue_s / dma_s))
    if not found:
        raise ValueError(f"chip={spec.name!r} feeds no {dtype!r} weight"
                         + (f" as {feed!r}" if feed else "") + f" (it feeds {rows(spec)})")
    return min(found, key=lambda f_ratio: f_ratio[1])
