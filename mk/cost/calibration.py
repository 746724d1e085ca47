"""The simulator held to a chip: what the steps record measured, read into `Assumptions`.

`benchmarks/tpu_steps.py` writes data/measured/<chip>-steps.json: each row a model, B, T
and context timed on the chip. Its device-loop rows of one model form two sweeps, each of
which measures one quantity of the attention loop that the tile cost model lacks:
- over context (B = 1): the KV bytes the loop consumes a second (`kv_bytes_per_s`), the
  step's extra time over its extra KV bytes (`mk.cost.perf.predict`'s `kv_read_bytes`);
- over batch (one context): each added sequence's cost in each attention layer beyond
  its KV bytes at that rate (`sequence_s`).
`assumptions(chip)` is `Assumptions.measured(chip)` (the DMA probe's latency and
bandwidth) with both. `call_seconds` reads the host's cost of one dispatched step (one
step less a loop's step), where the record timed it with the cache donated.
`agreement(chip)` simulates every row: measured, simulated, error, and which rows a
quantity was read from (the others test the simulator: tests/test_calibration.py holds
them within `TOLERANCE`).

Not here: the DMA probe and the steps' timing (`mk.measure.measure`), the simulator (`mk.cost.sim`),
the table that shows the record (`mk.cost.ledger.steps_table`; this module needs no plotly, so
`benchmarks/tpu_steps.py` runs on a bare TPU machine).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from mk.cost import perf, sim
from mk.model import untrusted
from mk.model.chips import spec_of
from mk.cost.machine import Assumptions
from mk.model.config import finite_number
from mk.model.errors import shown
from mk.step.plan import DecodePlan
from mk.measure.measure import MEASURED, STEP_SERIES, step_plan
from mk.model.presets import preset

TOLERANCE = 0.10  # issue 59: every row simulated within 10 % of the chip
LOOP = "megakernel_loop"  # the record's device-loop series (`mk.measure.measure.STEP_SERIES`)
ONE_STEP = "megakernel"  # its one dispatched step
CACHE_MODES = ("donated", "copied")  # how the one dispatched step passed its cache


def steps_path(chip: str) -> Path:
    """Where `chip`'s steps record lives: MEASURED/<chip>-steps.json."""
    return MEASURED / f"{spec_of(chip).name}-steps.json"


def load_steps(path: str | Path, chip: str | None = None) -> dict:
    """A steps record, read with `mk.model.untrusted`'s limits (a regular UTF-8 file, bounded in
    size and nesting) and its rows checked for the fields read here: ValueError naming the
    file, the row, the field, the value and what it must be. With `chip`, a record
    measured on another chip is refused too."""
    data = untrusted.load_json(path, "steps record")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: must be an object with a list 'rows'")
    if chip is not None and data.get("chip") != spec_of(chip).name:
        raise ValueError(f"{path}: chip={shown(data.get('chip'))}, not the simulated chip "
                         f"{spec_of(chip).name!r}: a record holds one chip's steps")
    _check_cache(f"{path}: megakernel_cache", data.get("megakernel_cache"))
    for i, row in enumerate(data["rows"]):
        where = f"{path}: rows[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}={shown(row)} must be an object (one timed step)")
        try:
            preset(row.get("model"))
        except (TypeError, ValueError):  # an unhashable value, an unknown name
            raise ValueError(f"{where}.model={shown(row.get('model'))} must be a preset's "
                             "name (mk.preset)") from None
        for field, least in (("batch", 1), ("rows", 1), ("context", 0), ("layers", 1)):
            value = row.get(field)
            if field == "layers" and value is None:  # every layer
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{where}.{field}={shown(value)} must be an integer >= "
                                 f"{least}" + (" or null" if field == "layers" else ""))
        for series in STEP_SERIES:  # seconds a step, or null: not timed
            if row.get(series) is not None:
                finite_number(f"{where}.{series}", row[series], open_low=True)
        _check_cache(f"{where}.megakernel_cache", row.get("megakernel_cache"))
    return data


def _check_cache(field: str, value) -> None:
    if value is not None and value not in CACHE_MODES:
        raise ValueError(f"{field}={shown(value)} must be one of {CACHE_MODES} or absent")


def row_config(row: dict):
    """The model a row timed: its preset, cut to its first `layers` when given."""
    config = preset(row["model"])
    return config if row.get("layers") is None else config.first_layers(row["layers"])


PROVENANCE = ("commit", "when", "megakernel_cache")  # a row's own, else its record's


def provenance(record: dict, row: dict) -> dict:
    """Where and how `row` was measured: its own PROVENANCE fields (a record keeps rows
    of earlier commits that a later run did not measure again, `benchmarks/tpu_steps.py`),
    else the record's."""
    return {f: row.get(f, record.get(f)) for f in PROVENANCE}


def _seconds(row: dict, series: str = LOOP) -> float | None:
    value = row.get(series)
    return value if isinstance(value, (int, float)) and value > 0 else None


def call_seconds(record: dict) -> tuple[float, tuple[int, ...]] | None:
    """The host's cost of one dispatched step and the rows it was read from: the median,
    over rows of T = 1 that timed the one step with its cache donated (`megakernel_cache`,
    `provenance`: a copied cache adds its own bytes), of one dispatched step less a
    device-loop step. None when no row has both."""
    pairs = [(i, _seconds(r, ONE_STEP) - _seconds(r)) for i, r in enumerate(record["rows"])
             if r["rows"] == 1 and _seconds(r, ONE_STEP) and _seconds(r)
             and provenance(record, r)["megakernel_cache"] == "donated"]
    if not pairs:
        return None
    return statistics.median(d for _, d in pairs), tuple(i for i, _ in pairs)


def _kv(row: dict, chip: str) -> float:
    return perf.predict(row_config(row), chip, batch=row["batch"], rows=row["rows"],
                        context=row["context"]).kv_read_bytes


@dataclasses.dataclass(frozen=True)
class AttentionCosts:
    """The attention loop's two measured quantities and the rows they were read from."""

    kv_bytes_per_s: float
    sequence_s: float
    context_sweep: tuple[int, int]  # indices of the record's rows: B = 1, two contexts
    batch_row: int  # the row at the first one's context with B > 1


def attention_costs(record: dict, chip: str) -> AttentionCosts | None:
    """The two sweeps of the first model whose device-loop rows hold them (module
    docstring); None when no model's do."""
    loops = [(i, r) for i, r in enumerate(record["rows"]) if _seconds(r) and r["rows"] == 1]
    for i, first in loops:
        if first["batch"] != 1:
            continue
        same = [(j, r) for j, r in loops if (r["model"], r.get("layers")) == (
            first["model"], first.get("layers"))]
        longer = [(j, r) for j, r in same if r["batch"] == 1 and r["context"] > first["context"]]
        wider = [(j, r) for j, r in same if r["batch"] > 1 and r["context"] == first["context"]]
        if not (longer and wider):
            continue
        (j, far), (k, wide) = longer[-1], wider[0]
        rate = (_kv(far, chip) - _kv(first, chip)) / (_seconds(far) - _seconds(first))
        if rate <= 0:
            raise ValueError(f"rows {i} and {j}: a longer context stepped no slower; the "
                             "record cannot give the attention loop's KV rate")
        extra = _seconds(wide) - _seconds(first) - (_kv(wide, chip) - _kv(first, chip)) / rate
        layers = len(row_config(first).full_layers)
        return AttentionCosts(rate, max(extra, 0.0) / ((wide["batch"] - 1) * layers),
                              (i, j), k)
    return None


def assumptions(chip: str, path: str | Path | None = None) -> Assumptions:
    """`Assumptions.measured(chip)` with the attention costs of `chip`'s steps record
    (`path`, else `steps_path(chip)`); without a record or its sweeps, the DMA probe's
    fields alone."""
    path = Path(path) if path is not None else steps_path(chip)
    costs = attention_costs(load_steps(path, chip), chip) if path.exists() else None
    base = Assumptions.measured(chip)
    if costs is None:
        return base
    return dataclasses.replace(base, kv_bytes_per_s=costs.kv_bytes_per_s,
                               sequence_s=costs.sequence_s,
                               source=f"{base.source}; attention loop from {path.name}")


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One row's measured and simulated seconds per step, of one series: a device loop's
    step, or one dispatched step (simulated + `call_seconds`)."""

    index: int
    row: dict
    series: str  # LOOP or ONE_STEP
    measured_s: float
    simulated_s: float
    derived: bool  # one of the rows a measured quantity was read from

    @property
    def error(self) -> float:
        return self.simulated_s / self.measured_s - 1


def agreement(chip: str, path: str | Path | None = None,
              a: Assumptions | None = None) -> list[Agreement]:
    """Every device loop of `chip`'s steps record, and every one dispatched step timed
    with its cache donated where `call_seconds` has the host's cost, simulated with `a`
    (default `assumptions(chip, path)`) on the block the chip ran
    (`mk.measure.measure.step_plan`)."""
    path = Path(path) if path is not None else steps_path(chip)
    record = load_steps(path, chip)
    costs, call = attention_costs(record, chip), call_seconds(record)
    used = {LOOP: set() if costs is None else {*costs.context_sweep, costs.batch_row},
            ONE_STEP: set() if call is None else set(call[1])}
    a = a or assumptions(chip, path)
    out = []
    for i, row in enumerate(record["rows"]):
        config, kw = row_config(row), dict(batch=row["batch"], rows=row["rows"],
                                           context=row["context"])
        block = step_plan(config, **kw).block
        donated = provenance(record, row)["megakernel_cache"] == "donated"
        for series, extra in ((LOOP, 0.0), (ONE_STEP, call and call[0])):
            if not _seconds(row, series) or extra is None or (series == ONE_STEP
                                                               and not donated):
                continue  # a copied cache's one step holds its copy: not simulated
            step = sim.simulate(DecodePlan.make(
                config, chip=chip, batch=row["batch"], rows=row["rows"],
                position=row["context"], block=block, kernel=False),
                assumptions=a).step_s
            out.append(Agreement(i, row, series, _seconds(row, series), step + extra,
                                 i in used[series]))
    return out
