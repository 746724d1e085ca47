"""One ledger of the published numbers and one vocabulary for every time the course states.

`TERMS` defines each word once; every notebook that states a step time uses these words
and no others, and links to notebook 00's definitions (`glossary()`). `entries(...)` sets
every row of data/published.csv against the models under one set of assumptions, named
once here (`runs()`: `VERIFY_ROWS`, batch 1 where unstated, every device of the run in one
tensor-parallel group, each row's own context, `mk.cost.published.Published.context`),
and, where `benchmarks/tile_costs.py --published` recorded it, against the simulated step
of the run's compiled kernel. `latency_grid` lays its TPU rows out over
`COLLECTIVE_LATENCIES_US`, rounds of a collective. Nothing is fitted to the published
numbers. `verified_table`, `basis_table` and `steps_table` say what rests on a chip (tokens
judged, the simulator's inputs and error, each timed step beside its calibrated one).

Not here: the models (`mk.cost.perf`, `mk.cost.sim`), parsing (`mk.cost.published`), drawing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mk.cost import calibration, perf
from mk.measure import exactness
from mk import plots
from mk.cost.bundles import packed_bundles
from mk.model.chips import RATE_ENDS, ChipSpec, spec_of
from mk.model.config import ModelConfig, positive_int
from mk.model.errors import shown
from mk.model.presets import preset as named_preset
from mk.cost.published import Published, published
from mk.kernels.collectives import choose_algorithm, rounds
from mk.step.plan import DecodePlan, shard_config
from mk.kinds.layers import layer_kinds
from mk.cost.machine import Simulation
from mk.measure.measure import TPU_NAMES, path_for
from mk.measure.measure import load as load_measured
from mk.cost.sim import Assumptions, simulate, tile_seconds

TERMS = {
    "published": "a number of data/published.csv as the release states it (tokens/s), and "
                 "the step time derived from it (tokens kept per step / tokens/s)",
    "HBM floor": "bytes one step moves / the HBM bandwidth of the devices sharing it "
                 "(datasheet peak, perfect sharding; `mk.cost.perf.predict`): no step can be "
                 "shorter",
    "measured HBM floor": "the HBM floor at the bandwidth a chip's DMA probe measured "
                          "(data/measured/<chip>.json), not its datasheet peak: issue 60's "
                          "bar; no bound on a kernel that beats the probe",
    "MXU floor": "a labelled bound, not the simulator's cost: the step's matmuls at the "
                 "MXU rule, each weight pass costing at least "
                 "the MXU's rows (`mk.cost.perf.mxu_floor_ms`), at the rate of one feed: bf16 "
                 "(compute=\"bf16\") or fp8 (compute=\"fp8\": 8- and 4-bit weights fed at "
                 "the fp8/int8 rate, twice bf16 on TPU7x). At the fastest feed the chip has "
                 "for the weights no TPU step can be shorter; at the bf16 feed FP4 experts "
                 "are overcharged. A TPU quantity: GPU rows have none",
    "tile floor": "the weights' compute at the measured tile cost table (bundles per "
                  "weight by chip, storage, feed and M, compiled from the ring kernel's own "
                  "per-tile loop: `mk.cost.feed_costs`, `mk.cost.perf.tile_floor_ms`) over the "
                  "chip's bundle rate at one end of its range: the cost `mk.cost.sim` charges "
                  "each weight tile",
    "modelled step": "max(HBM floor, tile floor at the slow end of the bundle rate + the "
                     "tensor-parallel collectives over "
                     "ICI) (`mk.cost.perf`): the compute lane's matmuls and all-reduces run one "
                     "after another while HBM streams beside them. A model of a megakernel "
                     "step under stated assumptions, not a bound and not a simulation: a "
                     "published run faster than it shows an assumption failing for that "
                     "run",
    "conventional step": "the same step as one kernel per op, each op at its own floor "
                         "plus a launch gap (`mk.cost.perf.conventional`): a GPU baseline",
    "simulated step": "the megakernel's tile schedule for the run's plan (ring slots by "
                      "Little's law at `mk.step.plan.ring_cover_s`, the simulator's "
                      "default latencies) replayed on a model of the chip (`mk.cost.sim`): DMA "
                      "latency, ring depth, bubbles, each weight tile at the tile cost "
                      "table at the slow end of the bundle rate; not a TPU measurement",
    "compiled-kernel step": "the simulated step of the kernel libtpu compiled for the run "
                            "(`benchmarks/tile_costs.py --published`): its ring's slots, "
                            "the DMA latency it was sized for and its per-tile issue time "
                            "(the compiled bundles per tile / the chip's bundle rate), "
                            "replayed by `mk.cost.sim` at both ends of the chip's bundle "
                            "rate (`mk.model.chips.ChipSpec.bundle_rate`: measured, derived "
                            "or assumed per chip); a simulation, not a measurement",
    "measured": "timed or counted on a machine named with it: a TPU's times carry its chip, "
                "commit and date (data/measured); CPU interpret mode is never TPU time; "
                "for acceptance, counted from real drafts",
    "calibrated step": "the simulated step with a chip's measured inputs "
                       "(`mk.cost.calibration.assumptions`: the DMA probe's latency and bandwidth, "
                       "the attention loop's KV rate from sweeps of the real kernel), checked "
                       "against that chip's measured device loops; a simulation, not a "
                       "measurement, and only for a chip that was measured",
}
# The terms that claim no step can be shorter, each with its `entries` column and compute
# feed (`entries(compute=...)`); tests/test_ledger.py checks every published TPU row.
FLOORS = {"HBM floor": ("hbm_floor_ms", "bf16"), "MXU floor": ("mxu_floor_ms", "fp8")}
VERIFY_ROWS = 8  # rows each speculative step verifies in the published runs (issue #5)


def glossary(*terms: str) -> plots.Table:
    """The definitions of `terms` (all of `TERMS` if none) as a table."""
    for term in terms:
        perf.check_choice("term", term, tuple(TERMS))
    return plots.table([{"term": t, "meaning": TERMS[t]} for t in (terms or TERMS)])


def verified_table(root=".") -> plots.Table:
    """Which model family's greedy tokens were judged on which chip
    (`mk.measure.exactness.verified`, the hardware tier's records): its exact, near-tie and wrong
    tokens, the commit and date measured, and "stale" where kernel code changed since that
    commit."""
    def state(row):
        if row["chip"] is None:
            return "never run on a chip"
        return {True: "stale (kernel changed since)", False: "current",
                None: "unknown (no git history)"}[row["stale"]]
    return plots.table([
        {"family": r["family"], "preset": r["preset"], "chip": r["chip"] or "-",
         "tokens exact / near-tie / wrong": "-" if r["chip"] is None else
         f"{r['exact']} / {r['ties']} / {r['wrong']} of {r['total']}",
         "measured at": "-" if r["chip"] is None else f"{r['commit']}, {r['when'][:10]}",
         "record": state(r)} for r in exactness.verified(root)])


def basis_table() -> plots.Table:
    """What the simulator's numbers rest on, chip by chip: the DMA probe's file
    (`mk.measure.measure`), the attention loop's sweeps and the simulated against the measured
    device loops (`mk.cost.calibration`), or, with neither file, assumptions only."""
    out = []
    for chip in TPU_NAMES:
        dma, steps = path_for(chip), calibration.steps_path(chip)
        row = {"chip": chip}
        if dma.exists():
            m = load_measured(dma)
            row["DMA latency, bandwidth"] = (
                f"measured: {m.dma_latency_s * 1e6:.2f} µs, {m.hbm_bw / 1e9:.0f} GB/s "
                f"({m.commit[:7]}, {m.when[:10]})")
        else:
            row["DMA latency, bandwidth"] = "assumed: 0.5 µs, the datasheet's HBM"
        rows = calibration.agreement(chip) if dma.exists() and steps.exists() else []
        a = calibration.assumptions(chip) if rows else None
        row["attention loop"] = (f"measured: {a.kv_bytes_per_s / 1e9:.0f} GB/s of KV"
                                 if a and a.kv_bytes_per_s else "modelled (MXU rule)")
        errors = [g.error for g in rows]
        loops = sum(g.series == calibration.LOOP for g in rows)
        row["simulated vs measured"] = (
            f"{loops} device loops, {len(rows) - loops} one steps, {min(errors):+.1%} to "
            f"{max(errors):+.1%}" if rows else "no measured steps")
        row["numbers rest on"] = "measurement" if rows else (
            "a DMA probe, no steps" if dma.exists() else "assumptions only")
        out.append(row)
    return plots.table(out)


def steps_table(chip: str, path: str | Path | None = None, *,
                model: str | None = None) -> plots.Table:
    """`chip`'s steps record (`mk.cost.calibration`) in `TERMS`' words (`model`: its rows of
    that preset only, whole or cut; none is one row saying so): each row's device loop, one
    dispatched step and XLA's step (both with the host's dispatch) as measured, the
    calibrated steps of both series and their errors (`mk.cost.calibration.agreement`), the
    HBM floor and its share of the loop, and the measured HBM floor's. Each row names its
    commit and date (`mk.cost.calibration.provenance`), and a one step timed with its cache
    copied (before 4cbaec7) says so. No record at `path` (an installed mk, e.g. on Colab) is
    one row saying so, not an error."""
    path = Path(path) if path is not None else calibration.steps_path(chip)
    if not path.exists():
        return plots.table([{"chip": chip, "steps record": f"none here ({path.name} is in "
                             "data/measured of a checkout of mk; benchmarks/tpu_steps.py "
                             "writes it on a TPU)"}])
    record = calibration.load_steps(path, chip)
    simulated = {(g.index, g.series): g for g in calibration.agreement(chip, path)}
    measured_share = Assumptions.measured(chip).hbm_share  # the DMA probe's bandwidth
    out = []
    for i, row in enumerate(record["rows"]):
        if model is not None and row["model"] != model:
            continue
        config, made = calibration.row_config(row), calibration.provenance(record, row)
        copied = " (its cache copied)" if made["megakernel_cache"] == "copied" else ""
        floor = perf.predict(config, chip, batch=row["batch"], rows=row["rows"],
                             context=row["context"]).hbm_floor_ms
        g = simulated.get((i, calibration.LOOP))
        one = simulated.get((i, calibration.ONE_STEP))
        out.append({
            "model": config.name + ("" if row.get("layers") is None
                                    else f", first {row['layers']} layers"),
            "B": row["batch"], "T": row["rows"], "context": row["context"],
            "measured at": f"{str(made['commit'] or '?')[:7]}, "
                           f"{str(made['when'] or '?')[:10]}",
            f"device loop ms (measured on {chip})": _ms(row.get(calibration.LOOP)),
            "one dispatched step ms": _ms(row.get(calibration.ONE_STEP), copied),
            "XLA's step ms": _ms(row.get("xla")),
            "calibrated step ms": _versus(g), "calibrated one step ms": _versus(one),
            "HBM floor ms": f"{floor:.3f}",
            "share of HBM floor": "-" if g is None else f"{floor / (g.measured_s * 1e3):.0%}",
            "share of measured HBM floor": "-" if g is None else
            f"{floor / measured_share / (g.measured_s * 1e3):.0%}"})
    if not out:
        return plots.table([{"chip": chip, "steps record": f"no row of {model} in {path.name}"}])
    return plots.table(out)


def _versus(g: calibration.Agreement | None) -> str:
    return "-" if g is None else f"{g.simulated_s * 1e3:.3f} ({g.error:+.1%})"


def _ms(seconds, note: str = "") -> str:
    return f"{seconds * 1e3:.3f}{note}" if isinstance(seconds, (int, float)) else "-"


@dataclasses.dataclass(frozen=True)
class Run:
    """How the ledger models one published row: the preset, the chip (None: no row for the
    system in data/chips.csv), the tensor-parallel width, batch, verified rows and cached
    positions (the row's context; 0 where it states none)."""

    row: Published
    config: ModelConfig
    spec: ChipSpec | None
    tp: int
    batch: int
    rows: int
    context: int

    @property
    def key(self) -> tuple:
        """What a recorded per-tile cost (`benchmarks/tile_costs.py --published`) is
        matched on."""
        return (self.config.name, self.row.system, self.tp, self.batch, self.rows)


def runs(*, speculative_only: bool = False, batches=None) -> list[Run]:
    """Every row of data/published.csv (only those with an acceptance length if
    `speculative_only`; only those of a batch in `batches`, if given) under the ledger's
    assumptions: batch 1 where unstated, `VERIFY_ROWS` rows per speculative step, every
    device of the run in one group, the row's context (0 where unstated). A batch no
    published row has is refused (naming the batches there are), not silently empty."""
    rows_all = published()
    if batches is not None:
        if isinstance(batches, (str, bytes)) or not hasattr(batches, "__iter__"):
            raise ValueError(f"batches={shown(batches)} must be a collection of batch sizes")
        batches = {positive_int(f"batches[{i}]", b) for i, b in enumerate(batches)}
        there = sorted({row.batch or 1 for row in rows_all})
        if not batches or batches - set(there):
            raise ValueError(f"batches={sorted(batches)}: published rows have batches "
                             f"{there}; give a non-empty subset of them")
    out = []
    for row in rows_all:
        batch = row.batch or 1
        if (speculative_only and not row.acceptance_length) or (
                batches is not None and batch not in batches):
            continue
        config = named_preset(row.preset)
        rows = VERIFY_ROWS if row.acceptance_length else 1
        context = row.context or 0
        try:
            spec = spec_of(row.system)
        except ValueError:
            out.append(Run(row, config, None, 0, batch, rows, context))
            continue
        tp = row.chips * spec.cores_per_chip
        if row.tp is not None and row.tp != tp:
            raise ValueError(f"published row {row.model} on {row.system}: tp={row.tp} is "
                             f"not chips*cores_per_chip={tp}")
        out.append(Run(row, config, spec, tp, batch, rows, context))
    return out


def entries(*, routing: str = "uniform", compute: str = "bf16",
            simulate_tpu: bool = False, assumptions: Assumptions | None = None,
            speculative_only: bool = False, batches=None, tile_costs=()) -> list[dict]:
    """Every row of data/published.csv against the models, one dict each.

    Always: "run", "model", "preset", "system", "tau" (acceptance length or None), "batch",
    "rows", "context" (the cached positions modelled: the row's), "metric", "published"
    (tokens/s), "published_step_ms". For a chip of
    data/chips.csv also "hbm_floor_ms", "mxu_floor_ms" (TPU rows only, a labelled bound:
    no GPU MXU floor), "tile_floor_ms" and "tile_floor_fast_ms" (TPU rows: the tile
    floor at the slow and the fast end of the bundle rate), "collective_ms",
    "modelled_ms" (its compute lane the tile floor at the slow end; a GPU's, its FLOP floor),
    "bound" (what bounds the modelled step: "hbm", else the larger of "tile" (GPU:
    "compute") and "collective" on the compute lane), and
    "state_share" (the linear layers' state bytes over the step's bytes; 0 without
    linear layers); TPU rows
    with `simulate_tpu` "simulated_ms" (the plan's ring for the chip: the slots Little's
    law asks for at `mk.step.plan.ring_cover_s`) with "simulated_slots",
    "simulated_utilisation", "simulated_bound" and, at each end E of the bundle rate,
    "table_tile_E_ns" (the tile cost table's time for the plan's costliest weight tile,
    `mk.cost.sim.tile_seconds`); GPU
    rows "conventional_ms", "conventional_gap_ms". Each X_ms has X (tokens/s in the row's
    metric) and X_error (X / published - 1). A system without a chip row gets a "note" and
    nothing else; every other row's "note" says what differs from the published run.
    `routing` and `compute` are `mk.cost.perf.predict`'s (compute="fp8": the MXU runs 8- and
    4-bit weights at its fp8/int8 rate; the simulator keeps its own `assumptions`, whose
    `ici_latency_s`, one message round of a collective, every column uses: `mk.cost.perf`'s
    collective term too).
    `speculative_only`: only the rows with an acceptance length (the simulator replays a
    whole Kimi TP32 step in tens of seconds: a reader who needs only those skips the rest);
    `batches`: only the rows of these batches (`(1,)`: the speculative runs and batch 1,
    the runs of the release's headline).

    `tile_costs`: rows of `benchmarks/tile_costs.py --published` (mk/data/tile_costs/
    published.json), each the compiled kernel of one run (`Run.key`): its ring's slots,
    the DMA latency it was sized for and its per-tile issue time from libtpu's bundles.
    With `simulate_tpu`, a TPU row with a recorded cost also gets, at each end E ("slow",
    "fast") of the chip's bundle rate (`mk.model.chips.RATE_ENDS`), "compiled_E_ms" (the
    simulated step of that kernel: that ring, that latency, its costliest per-tile loop's
    bundles at that rate, and each packed tile's own loop where the row has it:
    `mk.cost.bundles.packed_bundles`), "compiled_E_over_floor" (its step / the HBM floor),
    "compiled_E_utilisation", "compiled_E_bound" and "tile_E_ns" (the issue time per
    tile); and "compiled_slots", "tile_bundles", "tile_dma_ns". A recorded
    kernel that does not fit its core gets "compiled_note" with the reason, and the
    columns above only if its per-tile cost was measured on a cut of it (`measured_on`)."""
    _check_entries(routing, compute, simulate_tpu, speculative_only, assumptions)
    out, sims = [], {}
    if isinstance(tile_costs, (str, bytes, dict)) or not hasattr(tile_costs, "__iter__"):
        raise ValueError(f"tile_costs={shown(tile_costs)} must be a list of rows of "
                         "benchmarks/tile_costs.py --published")
    recorded = {cost_key(c): c for c in tile_costs}

    def simulated(config, spec, a=assumptions, *, context, **kw):  # rows differing only
        key = (config.name, spec.name, a, context, tuple(sorted(kw.items(), key=str)))
        if key not in sims:  # in tau share it; a run's plan, at its context's position
            sims[key] = simulate(DecodePlan.make(config, chip=spec, position=context,
                                                 kernel=False, **kw), assumptions=a)
        return sims[key]

    for run in runs(speculative_only=speculative_only, batches=batches):
        rec = _published_columns(run)
        if run.spec is None:
            out.append(rec | dict(note=f"no row for {run.row.system} in data/chips.csv: "
                                       "no model"))
            continue
        kw = dict(batch=run.batch, rows=run.rows, context=run.context, tp=run.tp)
        modelled, est = _modelled_columns(run, routing, compute, assumptions, kw)
        rec |= modelled
        if run.spec.kind == "tpu" and simulate_tpu:
            rec |= _simulated_columns(run, simulated, assumptions, kw)
            cost = recorded.get(run.key)
            if cost is not None:
                rec |= _compiled_columns(run, cost, simulated, assumptions, est, kw)
        elif run.spec.kind == "gpu":
            conv = perf.conventional(run.config, run.spec, accepted=run.row.acceptance_length
                                     or 1, routing=routing, compute=compute, **kw)
            rec |= _timed(run, "conventional", conv.step_ms) | dict(
                conventional_gap_ms=conv.gap_ms)
        out.append(rec | dict(note=_explain(run)))
    return out


# -- entries, phase by phase --------------------------------------------------------------
def _check_entries(routing, compute, simulate_tpu, speculative_only, assumptions) -> None:
    perf.check_choice("routing", routing, perf.ROUTINGS)  # a trace is one model's
    perf.check_choice("compute", compute, perf.COMPUTES)
    for field, flag in (("simulate_tpu", simulate_tpu), ("speculative_only", speculative_only)):
        if not isinstance(flag, bool):
            raise ValueError(f"{field}={shown(flag)} must be True or False")
    if assumptions is not None and not isinstance(assumptions, Assumptions):
        raise ValueError(f"assumptions is a {type(assumptions).__name__}; it must be a "
                         "mk.cost.sim.Assumptions")


def _timed(run: Run, name: str, ms: float) -> dict:
    """{name_ms, name (tokens/s in the row's metric), name_error} of a step of `ms`."""
    row = run.row
    per_user = (row.acceptance_length or 1) / (ms / 1e3)
    tokens = per_user if row.metric == "per_user" else run.batch * per_user
    return {f"{name}_ms": ms, name: tokens, f"{name}_error": tokens / row.tokens_per_s - 1}


def _published_columns(run: Run) -> dict:
    """The row as published: what ran, on what, and its tokens/s and step."""
    row, config, tau = run.row, run.config, run.row.acceptance_length
    return dict(run=f"{config.name} on {row.chips or '?'} {row.system}, "
                    + (f"tau={tau:g}" if tau else f"B={row.batch}"),
                model=row.model, preset=row.preset, system=row.system, tau=tau,
                batch=run.batch, rows=run.rows, context=run.context, metric=row.metric,
                published=row.tokens_per_s,
                published_step_ms=row.step_ms)


def _modelled_columns(run: Run, routing, compute, assumptions, kw) -> tuple[dict, object]:
    """The floors, the modelled step, the collective and the bound (`mk.cost.perf`), and the
    `mk.cost.perf.predict` estimate they come from."""
    config, spec = run.config, run.spec
    accepted = run.row.acceptance_length or 1
    ici = dict(ici_latency_s=(assumptions or Assumptions()).ici_latency_s)
    est = perf.predict(config, spec, accepted=accepted, routing=routing, compute=compute,
                       **ici, **kw)
    mxu = perf.mxu_floor_ms(config, spec, routing=routing, compute=compute, **kw)
    modelled = perf.modelled_step_ms(config, spec, routing=routing, compute=compute,
                                     **ici, **kw)
    # MXU and tile floors are TPU quantities (a GPU's compute lane: its FLOP floor, perf)
    tpu = spec.kind == "tpu"
    tiles = {end: perf.tile_floor_ms(config, spec, routing=routing, rate_end=end,
                                     batch=kw["batch"], rows=kw["rows"], tp=kw["tp"])
             for end in RATE_ENDS} if tpu else {}
    lane = tiles["slow"] if tpu else est.compute_floor_ms
    return (_timed(run, "hbm_floor", est.hbm_floor_ms)
            | (_timed(run, "mxu_floor", mxu) | dict(tile_floor_ms=tiles["slow"],
                                                    tile_floor_fast_ms=tiles["fast"])
               if tpu else {})
            | _timed(run, "modelled", modelled)
            | dict(collective_ms=est.collective_ms,
                   bound=perf.critical_term(est.hbm_floor_ms, lane, est.collective_ms,
                                            "tile" if tpu else "compute"),
                   state_share=est.state_bytes / est.total_bytes)), est


def _simulated_columns(run: Run, simulated, assumptions, kw) -> dict:
    """The simulated step of the plan's ring, and the tile cost table's costliest weight
    tile of that plan at each end of the bundle rate."""
    spec = run.spec
    sim = simulated(run.config, spec, **kw)
    rec = _timed(run, "simulated", sim.step_ms) | dict(
        simulated_slots=sim.block.slots, simulated_utilisation=sim.hbm_utilisation,
        simulated_bound=_bound(sim))
    plan = sim.plan
    for end in RATE_ENDS:  # the table's costliest weight tile of the run's plan
        table = dataclasses.replace(assumptions or Assumptions(), tile_issue_s=0.0,
                                    tile_bundles=0, packed_bundles=(), rate_end=end)
        rec[f"table_tile_{end}_ns"] = 1e9 * max(tile_seconds(
            plan.stream, spec, plan.M, dict(plan.formats), plan.local.dtype,
            table).values())
    return rec


def _compiled_columns(run: Run, cost: dict, simulated, assumptions, est, kw) -> dict:
    """The simulated step of the recorded compiled kernel `cost` (its ring, its latency,
    its per-tile loops) at each end of the bundle rate, or why it has none."""
    rec = {}
    if not cost["fits"]:
        rec["compiled_note"] = (f"the whole kernel: {cost['error']}" + (
            f"; its per-tile cost measured on {cost['measured_on']}"
            if "tile_ns" in cost else ""))
    if "tile_ns" not in cost:
        return rec
    ring = dataclasses.replace(simulated(run.config, run.spec, **kw).block,
                               slots=cost["slots"])
    rec |= dict(compiled_slots=cost["slots"], tile_bundles=tile_bundles(cost),
                tile_dma_ns=cost["dma_ns"])
    for end in RATE_ENDS:
        a = recorded_assumptions(cost, assumptions, rate_end=end)
        compiled = simulated(run.config, run.spec, a, block=ring, **kw)
        rec |= _timed(run, f"compiled_{end}", compiled.step_ms) | {
            f"compiled_{end}_over_floor": compiled.step_ms / est.hbm_floor_ms,
            f"compiled_{end}_utilisation": compiled.hbm_utilisation,
            f"compiled_{end}_bound": _bound(compiled),
            f"tile_{end}_ns": a.issue_s(run.spec, compiled.plan.M) * 1e9}
    return rec


ENTRY, COST = "entries row", "tile cost row"  # handed-in rows `_fields` checks, by source
ROWS = {ENTRY: "a row of mk.cost.ledger.entries", COST: "a row of benchmarks/tile_costs.py"}


def _fields(row, what: str, *names: str) -> dict:
    """`row`, a mapping holding `names`; else ValueError naming what it lacks."""
    if not isinstance(row, dict):
        raise ValueError(f"{what} {shown(row)} must be a mapping ({ROWS[what]})")
    if missing := [n for n in names if n not in row]:
        raise ValueError(f"{what} {shown(row.get('run', row.get('preset')))}: missing "
                         f"{missing} ({ROWS[what]})")
    return row


def tile_bundles(cost: dict) -> int:
    """The costliest loop's bundles a tile of a cost row ("least-most": `TileCost.row`)."""
    text = str(_fields(cost, COST).get("bundles_per_tile", ""))
    if not text.rpartition("-")[2].isdigit():
        raise ValueError(f"tile cost row {cost.get('preset')!r}: bundles_per_tile={text!r} "
                         "must read 'least-most' (a row of benchmarks/tile_costs.py)")
    return int(text.rpartition("-")[2])


def recorded_assumptions(cost: dict, base: Assumptions | None = None, **kw) -> Assumptions:
    """The `mk.cost.sim.Assumptions` a recorded per-tile cost (a row of
    benchmarks/tile_costs.py) is replayed with: its DMA latency, its costliest plain
    loop's bundles (`tile_bundles`) and its packed loops' (`mk.cost.bundles.packed_bundles`),
    over `base`'s other fields (default `Assumptions()`), then `kw`'s (the rate's end)."""
    _fields(cost, COST, "latency_us")
    return dataclasses.replace(base or Assumptions(), dma_latency_s=cost["latency_us"] * 1e-6,
                               tile_issue_s=0.0, tile_bundles=tile_bundles(cost),
                               packed_bundles=packed_bundles(cost), **kw)


def cost_key(cost: dict) -> tuple:
    """`Run.key` of a recorded per-tile cost (a row of benchmarks/tile_costs.py)."""
    _fields(cost, COST, "preset", "chip", "tp", "batch", "rows", "fits")
    return (cost["preset"], cost["chip"], cost["tp"], cost["batch"], cost["rows"])


def _bound(sim: Simulation) -> str:
    """The largest share of a simulated step: streaming bytes ("hbm") or the largest
    bubble's cause."""
    share = sim.bubble_share()
    cause, idle = next(iter(share.items()), ("", 0.0))
    return "hbm" if sim.hbm_floor_s >= idle else cause


def _explain(run: Run) -> str:
    """What differs between the published run and the modelled one (facts, not fits)."""
    row, config, spec, tp, batch, rows = (run.row, run.config, run.spec, run.tp, run.batch,
                                          run.rows)
    notes = []
    kinds = layer_kinds(config)
    notes.append(f"{config.name} ({', '.join(kind.described() for kind in kinds)}; its "
                 f"sources and assumptions in mk.model.presets) for the release's {row.model}")
    notes += list(dict.fromkeys(kind.note for kind in kinds if kind.note))
    if config.formats:
        cost = (", at the tile cost table's row for the scheme (its dequantisation; the "
                "compiled columns: the compiled kernel's own loop where it was recorded)"
                if spec.kind == "tpu" else "")
        stored = ", ".join(f"{group} as {scheme}" for group, scheme in config.formats)
        notes.append(f"{stored} (mk.model.quant's packed data and scales; the release's FP4){cost}")
    layouts = [k.layout_note() for k in layer_kinds(shard_config(config, tp))]
    if tp > 1 and any(layouts):  # a shard's partial lane tiles, router split (tp 1: above)
        notes.append(f"TP{tp}: {''.join(layouts).removeprefix(', ')} (expert layout unpublished)")
    if row.acceptance_length:
        notes.append(f"each step verifies T={rows} rows and keeps the published mean "
                     f"acceptance {row.acceptance_length:g} (forced acceptance in the "
                     "release's benchmark scripts)")
    if row.batch is None:
        notes.append(f"batch not published: B={batch} assumed")
    if row.context is None:
        notes.append(f"context not published: S={run.context} assumed")
    if spec.kind == "gpu":
        notes.append(f"baseline modelled as one kernel per op (vLLM-like) with TP{tp} over "
                     f"{row.chips} GPUs (layout not published)")
    else:
        algorithm = choose_algorithm(tp)
        notes.append(f"TP{tp} over {row.chips} chips, the collectives as mk.kernels.collectives "
                     f"runs them ({algorithm}: {2 * rounds(algorithm, tp)} message rounds an "
                     f"all-reduce, {rounds(algorithm, tp)} an all-gather)")
    return "; ".join(notes)


def headline(rows: list[dict], *, model: str = "Kimi K3", system: str = "tpu7x",
             tau: float = 6) -> str:
    """The distance between the course's kernel and the release for one published run,
    from `entries(simulate_tpu=True, tile_costs=...)` rows: the published step against
    the compiled-kernel step at both ends of the bundle rate (else the simulated step),
    the modelled step and the HBM floor, with what the ledger says differs."""
    row = next((r for r in rows if _fields(r, ENTRY, "model", "system", "tau")["model"]
                == model and r["system"] == system and r["tau"] == tau), None)
    if row is None or "simulated_ms" not in row:
        raise ValueError(f"no simulated row for {model} on {system} at tau={tau}: call "
                         "entries(simulate_tpu=True)")
    _fields(row, ENTRY, "published", "published_step_ms", "modelled_ms", "hbm_floor_ms", "note")
    published = row["published_step_ms"]
    if "compiled_slow_ms" in row:
        slow, fast = row["compiled_slow_ms"], row["compiled_fast_ms"]
        ours = (f"simulated (compiled-kernel step), takes {slow:.2f} ms at the slow end of "
                f"the bundle rate and {fast:.2f} ms at its fast end: {slow / published:.2f}x"
                f" and {fast / published:.2f}x the release's step, {published / slow:.0%} "
                f"and {published / fast:.0%} of its speed")
    else:
        slow = row["simulated_ms"]
        ours = (f"simulated (simulated step), takes {slow:.2f} ms: {slow / published:.2f}x "
                f"the release's step, {published / slow:.0%} of its speed")
    return (f"{model} on {system}, tau {tau:g}: the release publishes {row['published']:g} "
            f"tokens/s per user, a {published:.2f} ms step. The course's kernel for it, "
            f"{ours}. The release also beats "
            f"the course's modelled step ({row['modelled_ms']:.2f} ms) and stays above the "
            f"HBM floor ({row['hbm_floor_ms']:.2f} ms). What differs: {row['note']}"
            + (f". The compiled kernel: {row['compiled_note']}" if "compiled_note" in row
               else ""))


# Rounds of a collective the TPU rows are shown at (the default, `round_s`: TPU7x's 4.1)
COLLECTIVE_LATENCIES_US = (0.5, 1.0, 2.0, 4.1)


def latency_grid(rows_by_latency: dict[float, list[dict]]) -> list[dict]:
    """One table row per (TPU run, collective round) of {latency_us: `entries(simulate_tpu=
    True, assumptions=Assumptions(ici_latency_s=latency_us * 1e-6), ...)`}: the published
    step, the HBM floor, the collective chain and the simulated steps (the plan's, and
    the compiled kernel's at each end of the bundle rate where recorded), in ms."""
    out = []
    for us, rows in sorted(rows_by_latency.items()):
        for r in rows:
            if "simulated_ms" not in _fields(r, ENTRY):
                continue
            _fields(r, ENTRY, "run", "published_step_ms", "hbm_floor_ms", "collective_ms")
            out.append({"run": r["run"], "round (µs)": us,
                        "published (ms)": r["published_step_ms"],
                        "HBM floor (ms)": r["hbm_floor_ms"],
                        "collective chain (ms)": r["collective_ms"],
                        "simulated (ms)": r["simulated_ms"]}
                       | {f"compiled, {end} bundle rate (ms)": r[f"compiled_{end}_ms"]
                          for end in RATE_ENDS if f"compiled_{end}_ms" in r})
    return sorted(out, key=lambda r: (r["run"], r["round (µs)"]))


def floor_tokens(row: dict) -> float:
    """The tokens/s bound of an `entries` row: the smallest over its floors (the HBM
    floor, and the MXU floor on a TPU row)."""
    _fields(row, ENTRY, "hbm_floor")
    return min(row[f] for f in ("hbm_floor", "mxu_floor") if f in row)


def larger_floor(row: dict) -> tuple[str, float]:
    """("HBM" or "MXU", ms) of the larger floor of an `entries` row."""
    mxu = _fields(row, ENTRY, "hbm_floor_ms").get("mxu_floor_ms", 0.0)
    return ("HBM", row["hbm_floor_ms"]) if row["hbm_floor_ms"] >= mxu else ("MXU", mxu)
