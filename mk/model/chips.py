"""Accelerator specifications: `ChipSpec`, `chip(name)`, `spec_of`, `CHIP_NAMES`,
`all_chips()`, `read_chips`, and a jax device kind's chip (`chip_of`).

One row of `mk/data/chips.csv` per chip: vendor peak numbers (HBM size and bandwidth, dense
bf16 and fp8 FLOP/s, interconnect bandwidth; where measured, the links a collective's
bytes move over and one message round's latency) plus, for TPUs, the VMEM per core, the MXU's
side and count, the weight dtypes its MXU takes (`mxu_feeds`), the TensorCores per chip,
the bundle rate (compiled VLIW bundles a second: `ChipSpec.bundle_rate(end, m)`, a range
with ends `RATE_ENDS`, measured, derived or assumed per chip, `RATE_SOURCES`) and the
topology to compile for. Each row names the vendor document it comes from.

Units: bytes, bytes per second, FLOP per second, all per CHIP; `cores_per_chip` says how
many JAX devices share the chip's numbers (a TPU7x's two TensorCores are two devices,
v5p's megacore one).

Not here: anything derived from a model (bytes, FLOPs, floors: `mk.cost.perf`), sustained HBM
bandwidth (a datasheet peak; measured: `mk.measure.measure`), multi-chip topologies. No TensorCore
clock: a bundle count becomes seconds at the rate a compiled loop's bundles issue, stalls
and all, not at a clock (issue 61). Where the MXU feeds and each chip's bundle rate come
from: docs/design/mk.model.chips.md.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.resources
import io
from functools import cache
from pathlib import Path

from mk.model import untrusted
from mk.model.errors import shown

# The csv files mk reads ship inside the package, so a non-editable install finds them.
DATA = importlib.resources.files("mk") / "data"
CHIPS_CSV = DATA / "chips.csv"
KINDS = ("tpu", "gpu")
RATE_ENDS = ("slow", "fast")  # the ends of a TPU's bundle-rate range
RATE_SOURCES = ("measured", "derived", "assumed")  # where a row's bundle rate comes from
# The weight dtypes an MXU may be fed beside bf16 activations (a row's `mxu_feeds`):
# "bf16" (every TPU), "fp8" (float8_e4m3fn: TPU7x).
MXU_FEEDS = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Peak numbers of one chip (see the module docstring for units)."""

    name: str
    kind: str  # "tpu" or "gpu"
    hbm_bytes: int  # HBM capacity per chip
    hbm_compile_bytes: int | None  # HBM per core the libtpu compiler lets a program hold
    #                                (measured; what capacity checks use); None on GPUs
    hbm_bw: float  # HBM bandwidth per chip, bytes/s
    bf16_flops: float  # dense bf16 peak per chip, FLOP/s
    fp8_flops: float  # dense fp8 peak per chip, FLOP/s (int8 TOP/s on v5e, v6e, v5p)
    vmem_bytes: int | None  # VMEM per TensorCore enforced by the compiler; None on GPUs
    mxu_rows: int | None  # the MXU is mxu_rows x mxu_rows multiply-accumulators; None on GPUs
    mxus_per_core: int | None  # MXUs per TensorCore (JAX's tpu_info); None on GPUs
    mxu_feeds: tuple[str, ...]  # weight dtypes the MXU takes with bf16 activations
    #                             (`MXU_FEEDS`; module docstring); () on GPUs
    tensorcores_per_chip: int | None  # TensorCores sharing bf16_flops; None on GPUs
    bundle_rate_slow: float | None  # bundles a second of a decode-style loop (M below
    bundle_rate_fast: float | None  # mxu_rows): the range's ends; None on GPUs
    mxu_bundle_rate: float | None  # an MXU-bound loop's rate (M >= mxu_rows); None: the
    #                                decode loop's (`bundle_rate`)
    bundle_rate_source: str  # one of RATE_SOURCES for a TPU (the notes say whence); ""
    cores_per_chip: int  # JAX devices per chip
    ici_bw: float  # chip-to-chip bandwidth per chip, bytes/s (NVLink on GPUs)
    link_bw: float | None  # one device's one-way bandwidth to its collective peers as
    #                        measured (bytes/s; TPU7x: the release's); None: not measured
    collective_round_s: float | None  # one message round of a collective as measured;
    #                                   None: not measured (`mk.kernels.collectives`)
    topology: str  # libtpu topology name that compiles for one chip; "" on GPUs
    source: str  # the vendor document the numbers come from
    notes: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"chip {self.name}: kind={self.kind!r} must be one of {KINDS}")
        for field in ("hbm_bytes", "hbm_bw", "bf16_flops", "fp8_flops", "ici_bw",
                      "cores_per_chip"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"chip {self.name}: {field}={value!r} must be positive")
        if (self.kind == "tpu") != (self.hbm_compile_bytes is not None) or not (
                self.hbm_compile_bytes or 1) > 0:
            raise ValueError(f"chip {self.name}: hbm_compile_bytes={self.hbm_compile_bytes!r} "
                             "must be positive for a TPU and empty for a GPU")
        if (self.kind == "tpu") != (self.vmem_bytes is not None):
            raise ValueError(f"chip {self.name}: vmem_bytes={self.vmem_bytes!r} must be set "
                             "for a TPU and empty for a GPU")
        if (self.kind == "tpu") != ("bf16" in self.mxu_feeds) or not set(
                self.mxu_feeds) <= set(MXU_FEEDS):
            raise ValueError(f"chip {self.name}: mxu_feeds={self.mxu_feeds!r} must be some of "
                             f"{MXU_FEEDS} with bf16 for a TPU and empty for a GPU")
        if (self.kind == "tpu") != (self.mxu_rows is not None) or (self.mxu_rows or 1) < 1:
            raise ValueError(f"chip {self.name}: mxu_rows={self.mxu_rows!r} must be a positive "
                             "integer for a TPU and empty for a GPU")
        for field in ("mxus_per_core", "tensorcores_per_chip", "bundle_rate_slow",
                      "bundle_rate_fast"):
            value = getattr(self, field)
            if (self.kind == "tpu") != (value is not None) or (value is not None
                                                                and not value > 0):
                raise ValueError(f"chip {self.name}: {field}={value!r} must be positive for "
                                 "a TPU and empty for a GPU")
        for field in ("link_bw", "collective_round_s", "mxu_bundle_rate"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"chip {self.name}: {field}={value!r} must be positive or "
                                 "empty (not measured)")
        if self.kind == "tpu" and self.bundle_rate_slow > self.bundle_rate_fast:
            raise ValueError(f"chip {self.name}: bundle_rate_slow={self.bundle_rate_slow!r} "
                             f"is above bundle_rate_fast={self.bundle_rate_fast!r}: the slow "
                             "end must not exceed the fast end")
        if self.mxu_bundle_rate is not None and self.kind != "tpu":
            raise ValueError(f"chip {self.name}: mxu_bundle_rate={self.mxu_bundle_rate!r} "
                             "must be empty for a GPU")
        if self.bundle_rate_source not in (RATE_SOURCES if self.kind == "tpu" else ("",)):
            raise ValueError(f"chip {self.name}: bundle_rate_source="
                             f"{self.bundle_rate_source!r} must be one of {RATE_SOURCES} for "
                             "a TPU and empty for a GPU")
        if (self.kind == "tpu") != bool(self.topology):
            raise ValueError(f"chip {self.name}: topology={self.topology!r} must be set for "
                             "a TPU and empty for a GPU")
        if not self.source.strip():
            raise ValueError(f"chip {self.name}: source is empty; every row names its "
                             "vendor document")

    def bundle_rate(self, end: str = "slow", m: int = 1) -> float:
        """Bundles a second a compiled loop issues at `end` of the chip's range (one of
        `RATE_ENDS`; "slow": the longer time) against `m` activation rows: the decode-style
        loop's rate, or, at m >= mxu_rows, the MXU-bound loop's (`mxu_bundle_rate`, one
        rate at both ends, where the row has one). Why m >= mxu_rows: a weight-stationary MXU
        takes mxu_rows cycles to load a weight tile and m cycles to stream the rows through
        it, so from there on the MXU, not the weight feed, sets the pace, and its bundles
        stall differently (v5e: 1.18 cycles a bundle at 1.50 GHz, the decode loop's 1.50)."""
        if end not in RATE_ENDS:
            raise ValueError(f"end={end!r} must be one of {RATE_ENDS}")
        if self.kind != "tpu":
            raise ValueError(f"chip {self.name} is a {self.kind}: no bundle rate")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"m={m!r} must be a positive integer (activation rows)")
        rate = self.bundle_rate_slow if end == "slow" else self.bundle_rate_fast
        if m >= self.mxu_rows and self.mxu_bundle_rate is not None:
            return self.mxu_bundle_rate
        return rate

    @property
    def device_hbm_bw(self) -> float:
        """HBM bytes/s of one JAX device: the chip's bandwidth shared by its
        cores_per_chip devices."""
        return self.hbm_bw / self.cores_per_chip

    @property
    def ridge_flop_per_byte(self) -> float:
        """bf16 peak over HBM bandwidth: below this arithmetic intensity a kernel is
        bound by HBM."""
        return self.bf16_flops / self.hbm_bw


def _optional_int(text: str) -> int | None:
    return int(text) if text.strip() else None


def _optional_float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _row_to_spec(row: dict[str, str]) -> ChipSpec:
    return ChipSpec(
        name=row["name"], kind=row["kind"], hbm_bytes=int(row["hbm_bytes"]),
        hbm_bw=float(row["hbm_bw"]), bf16_flops=float(row["bf16_flops"]),
        fp8_flops=float(row["fp8_flops"]),
        hbm_compile_bytes=_optional_int(row["hbm_compile_bytes_per_core"]),
        vmem_bytes=_optional_int(row["vmem_bytes_per_core"]),
        mxu_rows=_optional_int(row["mxu_rows"]),
        mxus_per_core=_optional_int(row["mxus_per_core"]),
        mxu_feeds=tuple(row["mxu_feeds"].split()),
        tensorcores_per_chip=_optional_int(row["tensorcores_per_chip"]),
        bundle_rate_slow=_optional_float(row["bundle_rate_slow"]),
        bundle_rate_fast=_optional_float(row["bundle_rate_fast"]),
        mxu_bundle_rate=_optional_float(row["mxu_bundle_rate"]),
        bundle_rate_source=row["bundle_rate_source"],
        cores_per_chip=int(row["cores_per_chip"]), ici_bw=float(row["ici_bw"]),
        link_bw=_optional_float(row["link_bw"]),
        collective_round_s=_optional_float(row["collective_round_s"]),
        topology=row["topology"], source=row["source"], notes=row["notes"])


@cache
def read_chips(path: Path = CHIPS_CSV) -> dict[str, ChipSpec]:
    """The `ChipSpec`s of a chips.csv by name (default the package's, read once), read with
    `mk.model.untrusted.read_text`'s limits; raises ValueError naming the file and the row for
    a field that is missing or no number, and when two rows share a name."""
    specs = []
    text = untrusted.read_text(path, "chips table")
    for i, row in enumerate(csv.DictReader(io.StringIO(text, newline=""))):
        try:
            specs.append(_row_to_spec(row))
        except (KeyError, TypeError, ValueError) as err:  # a column missing, "fast" for a number
            raise ValueError(f"{path}: row {i + 1} ({shown(row.get('name'))}): "
                             f"{type(err).__name__} {err}") from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: chip names {names} are not unique")
    return {s.name: s for s in specs}


CHIP_NAMES: tuple[str, ...] = tuple(read_chips())


def chip(name: str) -> ChipSpec:
    """The `ChipSpec` called `name`; `CHIP_NAMES` lists them."""
    specs = read_chips()
    if not isinstance(name, str) or name not in specs:  # a list: unhashable, not a name
        raise ValueError(f"chip={shown(name)} is not known; choose one of {CHIP_NAMES}")
    return specs[name]


def spec_of(which: ChipSpec | str, field: str = "chip") -> ChipSpec:
    """`which` as a `ChipSpec`: the one a name names (`chip`), or a spec itself (the
    modules whose own argument is called `chip` ask for it so); anything else is a
    ValueError naming `field`."""
    if isinstance(which, str):
        return chip(which)
    if not isinstance(which, ChipSpec):
        raise ValueError(f"{field}={shown(which)} must be a mk.model.chips.ChipSpec or a chip's "
                         f"name, one of {CHIP_NAMES}")
    return which


def all_chips(kind: str | None = None) -> tuple[ChipSpec, ...]:
    """Every chip in file order, or only those of `kind` ("tpu" or "gpu")."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS} or None")
    return tuple(s for s in read_chips().values() if kind is None or s.kind == kind)


# jax's device_kind of each TPU in mk/data/chips.csv (the names of
# jax._src.pallas.mosaic.tpu_info.chip_version_from_device_kind).
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e",
                "TPU v6e": "v6e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU7x": "tpu7x"}


def chip_of(device_kind: str) -> str:
    """The mk chip name of a jax device kind ("TPU v6 lite" -> "v6e")."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind={device_kind!r} is not a TPU of mk/data/chips.csv; "
                         f"known: {sorted(DEVICE_KINDS)}")
    return DEVICE_KINDS[device_kind]
