"""Per-tile cost of the compiled megakernel, and what it does to HBM busy (issue 14).

For each model and TPU chip: the megakernel's plan for the chip (`DecodePlan.make(chip=,
position=)`, the plan for the cache the simulator replays:
its tile, a ring sized by Little's law for `mk.step.plan.RING_COVER_S`, 2 us), compiled
ahead of time with libtpu's bundle dump on (`mk.cost.bundles.measure`: bundles per trip of
`Ring.matmul`'s steady and edge loops), and the step is simulated (`mk.cost.sim.simulate`) on
the same plan with a DMA latency (`--latency-us`, default 1 us) and those per-tile costs
(`TileCost.assumptions`). A row says: tile and ring bytes, VMEM, bundles per
tile, issue time per tile against the tile's DMA time at the core's bandwidth, the
simulated HBM busy share, and the compile's seconds on this machine.

Bundle rates come from `mk/data/chips.csv`: a range per chip (`bundle_rate_slow`,
`bundle_rate_fast`; its notes give the source); a row gives the rates it was priced at and
the issue time at both ends, and simulates at the slow end. Interpret nothing here as a
TPU measurement: the bundle counts are the compiler's static schedule, the rest is the
simulator's model. When chips.csv's rates change, `--rerate FILE` prices a record's rows
again from their recorded bundles (no compile) and resimulates them.

    .venv/bin/python benchmarks/tile_costs.py --chips tpu7x v6e v5e \
        --presets qwen3-0.6b qwen3-1.7b qwen3-4b qwen3-8b qwen3-30b-a3b \
        --json build/tile_costs.json
    .venv/bin/python benchmarks/tile_costs.py --published --json build/published.json
    .venv/bin/python benchmarks/tile_costs.py --rerate mk/data/tile_costs/single_core.json

`--published` measures every TPU run of the published-numbers ledger instead (its
tensor-parallel shard on a multi-chip topology, `mk.measure.tpu.topology_for`);
`mk.cost.ledger.entries` reads those rows (`tile_costs=`) for its "compiled" column.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import mk  # noqa: E402
from mk.cost import bundles, ledger, sim  # noqa: E402
from mk.measure import tpu  # noqa: E402
from mk.model.chips import spec_of  # noqa: E402
from mk.step.plan import DecodePlan, packed_formats  # noqa: E402
from mk.kernels.ring import ring_buffers  # noqa: E402


def row(preset: str, chip: str, *, tp: int = 1, topology: str | None = None, batch: int,
        rows: int, context: int, latency_s: float, cut_layers: int = 0) -> dict:
    """One model on one chip (its tp-core shard on `topology` when tp > 1): measure the
    compiled kernel's per-tile loops, simulate.

    cut_layers: when the whole model's weights do not fit one core's HBM (its VMEM plan
    does), measure the per-tile loops on its first `cut_layers` layers instead (the same
    shard, tiles and ring: the loops do not depend on the layer count) and simulate the
    whole model with that cost; the row keeps `fits` false and the reason, and says
    `measured_on`. 0: no cut, such a row is not measured. A compile that fails is
    recorded with the compiler's first line. A preset's `formats` the kernel does not
    pack (`mk.step.plan.packed_formats`: a group holding a weight moved whole) are
    simulated as formats on the plain tiles and compiled in the config's dtype (the same
    tiles and ring)."""
    config, spec = mk.preset(preset), spec_of(chip)
    kw = dict(tp=tp, batch=batch, rows=rows, context=context)
    # what the simulator replays (every sequence `context` positions in, its cache just
    # holding its rows) and the kernel compiles: the plan for the chip (its ring; the
    # kernel's own plan has the same tiles and ring, `measured` below)
    plan = DecodePlan.make(config, chip=spec, tp=tp, batch=batch, rows=rows,
                           position=context, kernel=False)
    block, compiled = plan.block, dict(kw, context=plan.context)
    fit = plan.fits(spec)
    out = dict(preset=preset, chip=chip, **kw, topology=topology or spec.topology,
               latency_us=latency_s * 1e6, slots=block.slots,
               ring_KiB=sum(b.bytes for b in ring_buffers(plan.stream, config.dtype)) / 1024,
               vmem_MiB=fit.vmem.total_bytes / 2**20 if fit.vmem else None, fits=fit.ok)
    if block.tiles:  # weights in tiles of their own shape
        out["tiles"] = {name: list(tile) for name, tile in block.tiles}
    measured, on = config, []
    if dict(plan.formats) != packed_formats(config, dict(plan.formats)):
        measured = dataclasses.replace(config, formats=())  # what the kernel streams
        on.append(f"{dict(config.formats)} in {config.dtype} (the kernel does not pack "
                  "a group holding a weight it moves whole: mk.model.quant.unstreamed)")
    if not fit.ok:
        if fit.vmem is None or fit.hbm_bytes <= fit.hbm_limit_bytes or not cut_layers:
            return dict(out, error=fit.error)
        measured = measured.first_layers(cut_layers)
        on.insert(0, f"its first {cut_layers} of {config.layers} layers (the whole shard "
                     "does not fit one core's HBM)")
        out["error"] = fit.error
    if on:
        out["measured_on"] = ", ".join(on)
    cost = bundles.measure(DecodePlan.make(measured, chip=spec, block=block, **compiled),
                           topology=topology)
    if not cost.report.ok:
        return dict(out, fits=False, error=cost.report.error.splitlines()[0][:300])
    return dict(out, **cost.row(), **simulated(config, spec, out, cost.assumptions(
        dma_latency_s=latency_s)))


def simulated(config, spec, r: dict, assumptions) -> dict:
    """A row's simulated columns: its plan for the chip replayed with `assumptions`."""
    run = sim.simulate(DecodePlan.make(config, chip=spec, tp=r["tp"], batch=r["batch"],
                                       rows=r["rows"], position=r["context"], kernel=False),
                       assumptions=assumptions)
    return dict(hbm_busy=run.hbm_utilisation, sim_step_ms=run.step_ms,
                hbm_floor_ms=run.hbm_floor_s * 1e3, compute_ms=run.compute_s * 1e3)


STALE = ("clock_low_hz", "clock_high_hz", "tile_high_ns", "tile_over_dma_high")  # clocks'


def rerate(r: dict) -> dict:
    """Recorded row `r` priced at today's bundle rates (`mk.cost.bundles.priced`) from its
    recorded bundles and DMA times, its step simulated again (`row`'s columns); a row
    with no per-tile cost as it was. The clock columns of rows recorded before the bundle
    rate (`STALE`) go."""
    if "tile_ns" not in r:
        return r
    spec, m = spec_of(r["chip"]), r["batch"] * r["rows"]
    out = {k: v for k, v in r.items() if k not in STALE}
    out |= bundles.priced(ledger.tile_bundles(r), r["dma_ns"] * 1e-9, spec, m)
    for p in out.get("packed", {}).values():
        for key in STALE:
            p.pop(key, None)
        p |= {k: v for k, v in bundles.priced(p["bundles"], p["dma_ns"] * 1e-9, spec,
                                               m).items() if k.startswith("tile_over_dma")}
    return out | simulated(mk.preset(r["preset"]), spec, r, ledger.recorded_assumptions(r))


def published_runs() -> list[dict]:
    """The TPU runs of the published-numbers ledger (`mk.cost.ledger.runs`), each once: the
    arguments of `row` for it (its context the published row's), its topology named by
    `mk.measure.tpu.topology_for`."""
    jobs = {}
    for run in ledger.runs():
        if run.spec is not None and run.spec.kind == "tpu":
            jobs.setdefault(run.key, dict(
                preset=run.config.name, chip=run.spec.name, tp=run.tp,
                topology=tpu.topology_for(run.spec, run.row.chips), batch=run.batch,
                rows=run.rows, context=run.context))
    return list(jobs.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", nargs="+", default=["tpu7x"])
    p.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--latency-us", type=float, default=1.0)
    p.add_argument("--cut-layers", type=int, default=4,
                   help="a model whose weights do not fit one core is measured on its "
                        "first N layers (0: not measured)")
    p.add_argument("--published", action="store_true",
                   help="instead of --chips x --presets: every TPU run of the published-"
                        "numbers ledger (its preset, chip, TP width, batch, rows and "
                        "context; --context is ignored)")
    p.add_argument("--json", type=Path, help="write the rows here (refuses an existing file)")
    p.add_argument("--rerate", type=Path,
                   help="instead: price this record's rows at today's bundle rates, in place")
    args = p.parse_args(argv)
    if args.rerate:
        table = [rerate(r) for r in json.loads(args.rerate.read_text())]
        args.rerate.write_text(json.dumps(table, indent=1, default=float))
        return
    if args.json and args.json.exists():
        raise SystemExit(f"--json {args.json} exists; choose a new path")
    jobs = published_runs() if args.published else [
        dict(preset=preset, chip=chip, batch=args.batch, rows=args.rows,
             context=args.context) for chip in args.chips for preset in args.presets]
    table = []
    for job in jobs:
        r = row(**job, latency_s=args.latency_us * 1e-6, cut_layers=args.cut_layers)
        table.append(r)
        print(json.dumps(r, default=float), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table, indent=1, default=float))


if __name__ == "__main__":
    main()
