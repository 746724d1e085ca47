"""Design sweeps built on the simulator.

`sweep(config, chip, parameter, values, ...)` runs `mk.sim.simulate` once per value of one
design parameter (ring slots, tile, KV tile, KV slots, cross-layer prefetch, batch, T, tp,
the assumed DMA latency) and returns a table row each.

Not here: the simulator itself (`mk.sim`), the published numbers against the models
(`mk.ledger`), drawing (`mk.plots.sweep_lines`), the notebook that reads these
(`11_design_review`).
"""

from __future__ import annotations

import dataclasses

from mk import perf
from mk.chips import ChipSpec
from mk.config import ModelConfig
from mk.kernels.plan import DecodePlan
from mk.sim import Assumptions, simulate


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
                block = kw.pop("block", None) or DecodePlan.make(
                    config, tp=kw.get("tp", 1), position=kw.get("context", 0),
                    rows=kw.get("rows", 1), batch=kw.get("batch", 1)).block
                change = ({"tile_rows": value, "tile_cols": value} if parameter == "tile"
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
