"""The figures the course draws, read back from their plotly JSON: for each public figure
function of mk.plots (and mk.profiling's, which notebook 08 draws), built on tiny data,
its traces (how many, their names), its axes' titles and units, at most 10 legend
entries, and the drawn values against the inputs.

tests/test_plots.py has the colour rules (one colour per category and per weight family)
and the ring's Gantt; this module does not repeat them.
"""

from __future__ import annotations

import dataclasses

import pytest

import mk
from mk import perf, plots, profiling, sim


def legend(fig) -> list[str]:
    """The legend's entries: one per shown trace name (a legend group shows once)."""
    d = fig.to_dict()
    if d["layout"].get("showlegend") is False:
        return []
    shown = [t for t in d["data"] if t.get("showlegend", True) is not False]
    if len(shown) == 1 and "showlegend" not in shown[0]:
        return []  # plotly hides the legend of a lone trace
    return list(dict.fromkeys(t.get("name", "") for t in shown))


def axes(fig) -> tuple[str, str]:
    layout = fig.to_dict()["layout"]
    return tuple(layout.get(a, {}).get("title", {}).get("text", "")
                 for a in ("xaxis", "yaxis"))


def check_rules(fig, *, x_unit: str | None = None, y_unit: str | None = None) -> None:
    """Both axes titled (with the unit where the axis has one), a title, <= 10 legend
    entries."""
    x, y = axes(fig)
    assert x and y, (x, y)
    assert x_unit is None or x_unit in x, x
    assert y_unit is None or y_unit in y, y
    assert fig.layout.title.text
    assert len(legend(fig)) <= 10, legend(fig)


# -- The simulator's timeline, and one collective of a tensor-parallel step -----------------
@pytest.fixture(scope="module")
def shard():
    """qwen3-8b's TP4 shard on v6e, batch 8: its 73 collectives (two a layer, the argmax's
    gather) simulated in ~0.1 s."""
    return sim.simulate(mk.preset("qwen3-8b"), mk.chip("v6e"), batch=8, context=512, tp=4)


def _collectives(s):
    return [e for e in s.events if e.what == "collective"]


def test_collective_timeline_draws_that_collective_and_what_overlaps_it(shard):
    found = _collectives(shard)
    assert len(found) == 2 * shard.plan.config.layers + 1
    c = found[9]
    fig = plots.collective_timeline(shard, index=9, pad=0.5)
    check_rules(fig, x_unit="µs")
    assert "simulated" in fig.layout.xaxis.title.text and "simulated" in fig.layout.title.text
    assert "qwen3-8b TP4 on v6e: collective 9 (layer 4)" in fig.layout.title.text
    span = c.end_s - c.start_s
    lo, hi = fig.layout.xaxis.range
    assert (lo, hi) == pytest.approx(((c.start_s - span / 2) * 1e6,
                                      (c.end_s + span / 2) * 1e6))
    bars = {t.name: t for t in fig.data}
    # the collective itself: one bar, where the simulation put it
    assert bars["collective"].base == pytest.approx((c.start_s * 1e6,))
    assert bars["collective"].x == pytest.approx(((c.end_s - c.start_s) * 1e6,))
    # every DMA run overlapping the window is drawn, and nothing outside it
    dma = [e for e in shard.events if e.lane == "dma" and e.end_s >= lo / 1e6
           and e.start_s <= hi / 1e6]
    assert dma and len(bars["DMA"].base) == len(dma)
    assert sorted(bars["DMA"].base) == pytest.approx(sorted(e.start_s * 1e6 for e in dma))
    assert all(b + w >= lo and b <= hi for t in fig.data for b, w in zip(t.base, t.x))
    # the ring keeps loading while the compute lane waits: DMA during the collective
    assert any(e.start_s < c.end_s and e.end_s > c.start_s for e in dma)
    # the last collective is the argmax's gather after the lm_head
    assert "after the lm_head" in plots.collective_timeline(shard, index=-1).layout.title.text


def test_collective_timeline_refuses_a_step_without_collectives_and_a_bad_index(shard):
    one = sim.simulate(mk.preset("tiny"), mk.chip("v6e"), context=64)
    with pytest.raises(ValueError, match="tp=1 has no collective"):
        plots.collective_timeline(one, index=0)
    n = len(_collectives(shard))
    with pytest.raises(ValueError, match=f"index={n} must be in \\[-{n}, {n}\\)"):
        plots.collective_timeline(shard, index=n)


def test_timeline_window_keeps_only_what_overlaps_it(shard):
    whole = plots.timeline(shard, layers=(2, 3))
    c = _collectives(shard)[5]
    window = plots.timeline(shard, layers=(2, 3), window_s=(c.start_s, c.end_s))
    count = {t.name: len(t.base) for t in whole.data}
    inside = {t.name: len(t.base) for t in window.data}
    assert sum(inside.values()) < sum(count.values())
    assert all(inside[k] <= count[k] for k in inside)
    assert inside["collective"] == 1
