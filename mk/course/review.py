"""Design sweeps built on the simulator.

`sweep(config, chip, parameter, values, ...)` runs `mk.cost.sim.simulate` once per value of one
design parameter (ring slots, tile, KV tile, KV slots, cross-layer prefetch, batch, T, tp,
the assumed DMA latency) and returns a table row each.

`check_invariants` holds notebook 11's checks of one simulated step (no step beats its
bytes over the bandwidth, the bubbles add up, prefetch across layers never slows a step,
a slower bundle rate never makes a step faster); `rate_ends` simulates a step at both ends
of the chip's bundle rate with one source of tile costs. The rate invariant compares one
source at its two ends: the tile cost table's slow end against a compiled kernel's
recorded loop at its fast end is no statement about the rate (the two cost a tile
differently), and tests/test_review.py runs the invariants over a grid of presets,
chips, B, T and tp.

Not here: the simulator itself (`mk.cost.sim`), the published numbers against the models
(`mk.cost.ledger`), drawing (`mk.sim_plots.sweep_lines`), the notebook that reads these
(`11_design_review`).
"""

from __future__ import annotations

import dataclasses

from mk.cost import perf
from mk.model.chips import RATE_ENDS, ChipSpec
from mk.model.config import ModelConfig
from mk.model.errors import shown
from mk.step.plan import DecodePlan
from mk.cost.machine import Simulation
from mk.cost.sim import Assumptions, simulate

RTOL = 1e-12  # the simulator's float sums: an "at least" holds to this relative tolerance


# -- Design sweeps ---------------------------------------------------------------------------
SWEEPS = ("slots", "tile", "kv_tile", "kv_slots", "cross_layer_prefetch", "batch", "rows",
          "tp", "dma_latency_s")
REPLAY_ARGS = ("cross_layer_prefetch", "routing", "experts_active")  # `simulate`'s own; the
#   others of a sweep's row are its plan's (`DecodePlan.make`; `context` its position)


def sweep(config: ModelConfig, chip: ChipSpec | str, parameter: str, values, *,
          accepted: float | None = None, **kwargs) -> list[dict]:
    """One `simulate` per value of `parameter` (one of SWEEPS), the other arguments fixed
    (the plan's, `DecodePlan.make(config, chip=, position=context, ...)`, and
    `REPLAY_ARGS`): a table row each (step, HBM utilisation, tokens/s per user, the
    largest bubble). A value the kernel cannot tile (e.g. a tile that does not divide a
    matrix) gives a row whose `note` says why."""
    perf.check_choice("parameter", parameter, SWEEPS)
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not values:
        raise ValueError(f"values={shown(values)} must be a non-empty list of {parameter} "
                         "values, one row each")
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
            replayed = {k: kw.pop(k) for k in REPLAY_ARGS if k in kw}
            sim = simulate(DecodePlan.make(config, chip=chip, position=kw.pop("context", 0),
                                           kernel=False, **kw), assumptions=a, **replayed)
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


# -- Invariants of a simulated step (notebook 11's checks) -------------------------------------
def rate_ends(plan: DecodePlan, *, assumptions: Assumptions | None = None,
              **kwargs) -> dict[str, Simulation]:
    """{rate end: the step `simulate(plan, **kwargs)` with `assumptions` at that end of
    the chip's bundle rate} (`mk.model.chips.RATE_ENDS`): one source of tile costs (the
    tile cost table, or a compiled kernel's recorded loop) at both ends."""
    if assumptions is not None and not isinstance(assumptions, Assumptions):
        raise ValueError(f"assumptions is a {type(assumptions).__name__}; it must be a "
                         "mk.cost.sim.Assumptions")
    a = assumptions or Assumptions()
    return {end: simulate(plan, assumptions=dataclasses.replace(a, rate_end=end), **kwargs)
            for end in RATE_ENDS}


def check_invariants(step: Simulation, *, no_prefetch: Simulation,
                     by_rate=(), hbm_floor_ms: float | None = None) -> None:
    """Raise AssertionError naming the first invariant the simulated `step` breaks: it is
    no shorter than its bytes over the bandwidth (nor `hbm_floor_ms`, `mk.cost.perf`'s HBM
    floor, if given); its HBM bubbles add up to step - floor; `no_prefetch`, the same step
    without cross-layer prefetch, is no faster; and in each of `by_rate` ({rate end:
    the same step}, `rate_ends`: one source of tile costs each) the slow end is no faster
    than the fast end."""
    floor = step.hbm_floor_s
    assert step.step_s >= floor > 0, (
        f"a step of {step.step_s:.6g} s is shorter than its bytes over the bandwidth "
        f"({floor:.6g} s)")
    idle = sum(step.bubble_share().values())
    assert abs(idle - (step.step_s - floor)) <= 1e-9 * step.step_s, (
        f"the bubbles add to {idle:.6g} s, not step - floor = {step.step_s - floor:.6g} s")
    assert no_prefetch.step_s >= step.step_s * (1 - RTOL), (
        f"prefetch across layers made a step slower: {step.step_s:.6g} s against "
        f"{no_prefetch.step_s:.6g} s without")
    if hbm_floor_ms is not None:
        assert step.step_ms >= hbm_floor_ms * (1 - 1e-9), (
            f"a simulated step of {step.step_ms:.6g} ms beat its HBM floor "
            f"{hbm_floor_ms:.6g} ms")
    for ends in by_rate:
        slow, fast = ends["slow"], ends["fast"]
        assert slow.step_s >= fast.step_s * (1 - RTOL), (
            f"a slower bundle rate made a step faster: {slow.step_s:.6g} s at the slow end, "
            f"{fast.step_s:.6g} s at the fast end ({slow.assumptions})")
