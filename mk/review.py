"""Design-review tables built on the simulator: design sweeps and the published numbers.

`sweep(config, chip, parameter, values, ...)` runs `mk.sim.simulate` once per value of one
design parameter (ring slots, tile, KV tile, KV slots, cross-layer prefetch, batch, T, tp,
the assumed DMA latency) and returns a table row each. `published_table()` sets every row
of data/published.csv against the models: the roofline with collectives (`mk.perf`), the
simulated megakernel schedule (`mk.sim`, TPU rows) and the conventional one-kernel-per-op
model (GPU rows), with the error and what differs between the published run and the
modelled one. Nothing is fitted to the published numbers.

Not here: the simulator itself (`mk.sim`), drawing (`mk.plots.sweep_lines`), the notebook
that reads these (`11_design_review`).
"""

from __future__ import annotations

import dataclasses

from mk import perf
from mk.chips import ChipSpec, chip as named_chip
from mk.config import ModelConfig, preset as named_preset
from mk.sim import Assumptions, Simulation, latency_slots, simulate, step_plan


# -- Design sweeps ---------------------------------------------------------------------------
SWEEPS = ("slots", "tile", "kv_tile", "kv_slots", "cross_layer_prefetch", "batch", "rows",
          "tp", "dma_latency_s")


def sweep(config: ModelConfig, chip: ChipSpec | str, parameter: str, values, *,
          accepted: float | None = None, **kwargs) -> list[dict]:
    """One `simulate` per value of `parameter` (one of SWEEPS), the other arguments fixed:
    a table row each (step, HBM utilisation, tokens/s per user, the largest bubble). A
    value the kernel cannot tile (e.g. a tile that does not divide a matrix) gives a row
    whose `note` says why."""
    perf.check_choice("parameter", parameter, SWEEPS)
    out = []
    for value in values:
        kw = dict(kwargs)
        a = kw.pop("assumptions", None) or Assumptions()
        try:
            if parameter in ("slots", "tile", "kv_tile", "kv_slots"):
                block = kw.pop("block", None) or step_plan(
                    config, tp=kw.get("tp", 1), context=kw.get("context", 0),
                    rows=kw.get("rows", 1), batch=kw.get("batch", 1)).block
                change = ({"tile_k": value, "tile_n": value} if parameter == "tile"
                          else {parameter: value})
                kw["block"] = dataclasses.replace(block, **change)
            elif parameter == "dma_latency_s":
                a = dataclasses.replace(a, dma_latency_s=value)
            else:
                kw[parameter] = value
            sim = simulate(config, chip, assumptions=a, **kw)
        except ValueError as err:
            out.append({parameter: value, "step_ms": None, "hbm_utilisation": None,
                        "tokens_per_s_per_user": None, "largest_bubble": None,
                        "note": str(err)})
            continue
        share = sim.bubble_share()
        out.append({parameter: value, "step_ms": sim.step_ms,
                    "hbm_utilisation": sim.hbm_utilisation,
                    "tokens_per_s_per_user": sim.tokens_per_s_per_user(accepted),
                    "largest_bubble": next(iter(share), None), "note": ""})
    return out


# -- Published numbers -----------------------------------------------------------------------
VERIFY_ROWS = 8  # rows each speculative step verifies in the published runs (issue #5)


def published_table(*, context: int = 0, assumptions: Assumptions | None = None,
                    simulate_tpu: bool = True) -> list[dict]:
    """Every row of data/published.csv against the models: the roofline with collectives
    (`mk.perf.predict`), the simulated megakernel schedule (TPU rows: default tiles and
    slots, and slots sized by `latency_slots`), the conventional one-kernel-per-op model
    (GPU rows, a vLLM-like baseline). Nothing is fitted: batch 1 where not stated, T = 8
    verification rows for speculative rows, `context` cached positions (not published),
    tp = every device. Errors are (model - published) / published tokens/s.
    `simulate_tpu=False` leaves the simulator out (the Kimi runs take about a minute)."""
    out, sims = [], {}

    def simulated(config, spec, **kw):  # rows differing only in acceptance share a step
        key = (config.name, spec.name, tuple(sorted(kw.items(), key=str)))
        if key not in sims:
            sims[key] = simulate(config, spec, assumptions=assumptions, **kw)
        return sims[key]

    for row in perf.published():
        config = named_preset(row.preset)
        a_len = row.acceptance_length
        batch, rows = row.batch or 1, VERIFY_ROWS if a_len else 1
        base = dict(run=f"{config.name} on {row.chips or '?'} {row.system}, "
                        + (f"a={a_len:g}" if a_len else f"B={row.batch}"),
                    metric=row.metric, published=row.tokens_per_s,
                    published_step_ms=row.step_ms)
        try:
            spec = named_chip(row.system)
        except ValueError:
            out.append(base | dict(note=f"no row for {row.system} in data/chips.csv: "
                                        "no prediction"))
            continue
        tp = row.chips * spec.cores_per_chip
        kw = dict(batch=batch, rows=rows, context=context, tp=tp)
        accepted = a_len or 1

        def tokens(step_ms):
            per_user = accepted / (step_ms / 1e3)
            return per_user if row.metric == "per_user" else batch * per_user

        roof = perf.predict(config, spec, accepted=accepted, **kw)
        rec = base | dict(roofline_ms=roof.step_ms, roofline=tokens(roof.step_ms),
                          roofline_error=tokens(roof.step_ms) / row.tokens_per_s - 1,
                          roofline_dominant=roof.dominant)
        if spec.kind == "tpu" and simulate_tpu:
            sim = simulated(config, spec, **kw)
            block = dataclasses.replace(sim.block, slots=latency_slots(
                config, spec, sim.block, assumptions=assumptions))
            deep = simulated(config, spec, block=block, **kw)
            rec |= dict(sim_ms=sim.step_ms, sim=tokens(sim.step_ms),
                        sim_error=tokens(sim.step_ms) / row.tokens_per_s - 1,
                        sim_slots=sim.block.slots, deep_slots=block.slots,
                        deep_ms=deep.step_ms, deep=tokens(deep.step_ms),
                        deep_error=tokens(deep.step_ms) / row.tokens_per_s - 1,
                        deep_utilisation=deep.hbm_utilisation,
                        deep_dominant=_dominant(deep))
        elif spec.kind == "gpu":
            conv = perf.conventional(config, spec, accepted=accepted, **kw)
            rec |= dict(conventional_ms=conv.step_ms, conventional=tokens(conv.step_ms),
                        conventional_error=tokens(conv.step_ms) / row.tokens_per_s - 1,
                        conventional_gap_ms=conv.gap_ms)
        out.append(rec | dict(note=_explain(row, config, spec, tp, batch, rows)))
    return out


def _dominant(sim: Simulation) -> str:
    """The largest share of the step: streaming bytes ("hbm") or the largest bubble."""
    share = sim.bubble_share()
    cause, idle = next(iter(share.items()), ("", 0.0))
    return "hbm" if sim.hbm_floor_s >= idle else cause


def _explain(row, config, spec, tp, batch, rows) -> str:
    """What differs between the published run and the modelled one (facts, not fits)."""
    notes = []
    if config.is_moe:
        notes.append(f"{config.name}: GQA attention and no shared expert stand in for "
                     "Kimi K3's MLA/linear attention and shared expert")
        if config.expert_dtype:
            notes.append(f"experts stored as {config.expert_dtype} (the release's FP4)")
    else:
        notes.append(f"{config.name}: GQA in every layer stands in for the released "
                     "model's gated-delta-net layers")
    if row.acceptance_length:
        notes.append(f"each step verifies T={rows} rows and keeps the published mean "
                     f"acceptance {row.acceptance_length:g} (forced or measured acceptance "
                     "is not stated)")
    if row.batch is None:
        notes.append(f"batch not published: B={batch} assumed")
    if spec.kind == "gpu":
        notes.append(f"baseline modelled as one kernel per op (vLLM-like) with TP{tp} over "
                     f"{row.chips} GPUs (layout not published)")
    else:
        notes.append(f"TP{tp} over {row.chips} chips; the kernel's in-kernel collectives "
                     "modelled (`mk.perf.allreduce_s`), not measured")
    return "; ".join(notes)
