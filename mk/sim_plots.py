"""Figures of a simulated step (`mk.cost.machine.Simulation`): `timeline` (its DMA, compute
and HBM-idle lanes), `collective_timeline` (one collective of a tensor-parallel step and
what the ring loads meanwhile), `bubble_bars` (HBM busy and each bubble cause),
`sweep_lines` (a design sweep, `mk.course.review.sweep`), and `category` (an event's colour
category).

Not here: the simulation itself (`mk.cost.sim`, `mk.cost.machine`), figures of measured traces
(`mk.measure.profiling`) or of `mk.cost.perf`'s numbers (`mk.plots`), `show` (`mk.plots.show`). Its
lanes and colours: docs/design/mk.plots.md.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from mk.colours import CATEGORY_COLOURS, IDLE_COLOURS
from mk.model.errors import shown
from mk.plots import LEGEND_ENTRIES

def _family(what: str) -> str:
    return what.split("[")[0]


_VECTOR_WORK = ("norm", "qk_norm_rope", "residual", "final_norm", "swiglu", "router",
                "combine", "selected", "argmax")


def category(lane: str, what: str) -> str:
    """The colour category of a simulated event: "DMA" (the DMA lane), "collective",
    "vector" (norms, RoPE, SwiGLU, routing) or "MXU" (weight tiles, attention)."""
    family = _family(what)
    if lane == "dma":
        return "DMA"
    if family == "collective":
        return "collective"
    return "vector" if family in _VECTOR_WORK else "MXU"


def timeline(sims, *, layers: tuple[int, int] | None = None,
             window_s: tuple[float, float] | None = None, title: str = "") -> go.Figure:
    """The simulated timeline: per simulation, a DMA lane, a compute lane and an HBM-idle
    lane (bubbles coloured by cause; the colours of `CATEGORY_COLOURS` and `IDLE_COLOURS`
    in every notebook); `sims` is one `mk.cost.machine.Simulation` or {label: sim}. A bar spans a
    run of merged intervals; its opacity is the share of that span the lane was busy (or
    HBM idle), so a run that is idle 44 % of its span is not drawn solid. The legend keeps
    `LEGEND_ENTRIES`: every busy category, then the idle causes with the most idle time
    (the others are named on hover, in their fixed colours).
    `layers=(first, last)` keeps the events of those layers (inclusive), so a big model
    stays drawable; `window_s` zooms the x axis to that interval and keeps only what
    overlaps it. Times in microseconds."""
    sims = _simulations(sims if isinstance(sims, Mapping) else {"": sims}, "events",
                        "bubbles")
    lo, hi = _span("layers", layers, int) if layers is not None else (None, None)
    w0, w1 = (_span("window_s", window_s, float) if window_s is not None
              else (-math.inf, math.inf))

    def keep(layer, start_s=0.0, end_s=0.0):
        return ((layers is None or (layer is not None and lo <= layer <= hi))
                and end_s >= w0 and start_s <= w1)

    traces: dict[tuple[str, str], dict] = {}
    idle: dict[str, float] = {}  # HBM idle seconds per cause, over what is drawn
    for label, sim in sims.items():
        prefix = f"{label} " if label else ""
        for e in sim.events:
            if keep(e.layer, e.start_s, e.end_s):
                lane = prefix + ("DMA" if e.lane == "dma" else "compute")
                t = traces.setdefault((category(e.lane, e.what), lane),
                                      dict(x=[], base=[], y=[], text=[], share=[]))
                t["share"].append(_share(e.busy_s, e.start_s, e.end_s))
                t["x"].append((e.end_s - e.start_s) * 1e6)
                t["base"].append(e.start_s * 1e6)
                t["y"].append(lane)
                t["text"].append(f"{e.what}, layer {e.layer}: {e.count} interval(s), busy "
                                 f"{e.busy_s * 1e6:.3g} µs")
        for b in sim.bubbles:
            if keep(b.layer, b.start_s, b.end_s):
                lane = prefix + "HBM idle"
                t = traces.setdefault(("idle: " + b.cause, lane), dict(x=[], base=[], y=[],
                                                                       text=[], share=[]))
                idle[b.cause] = idle.get(b.cause, 0.0) + b.idle_s
                t["share"].append(_share(b.idle_s, b.start_s, b.end_s))
                t["x"].append((b.end_s - b.start_s) * 1e6)
                t["base"].append(b.start_s * 1e6)
                t["y"].append(lane)
                t["text"].append(f"{b.cause}, layer {b.layer}: idle {b.idle_s * 1e6:.3g} µs")
    # at most LEGEND_ENTRIES: every busy category, then the causes with the most idle time
    busy = {name for name, _ in traces if not name.startswith("idle: ")}
    keyed = busy | {"idle: " + c for c in sorted(idle, key=lambda c: -idle[c])[
        :max(0, LEGEND_ENTRIES - len(busy))]}
    fig = go.Figure()
    shown = set()
    for (name, _), t in traces.items():
        colour = IDLE_COLOURS.get(name[len("idle: "):], "#7f7f7f") if name.startswith(
            "idle: ") else CATEGORY_COLOURS[name]
        fig.add_trace(go.Bar(orientation="h", name=name, legendgroup=name, marker_color=colour,
                             marker_opacity=[max(0.2, x) for x in t["share"]],
                             showlegend=name in keyed and name not in shown,
                             x=t["x"], base=t["base"],
                             y=t["y"], hovertext=t["text"],
                             hovertemplate="%{hovertext}<br>%{base:.4g} µs + %{x:.3g} µs"
                                           "<extra></extra>"))
        shown.add(name)
    first = next(iter(sims.values()))
    fig.update_layout(barmode="overlay", bargap=0.3, xaxis_title="time (µs, simulated)",
                      title=title or f"Simulated step of {first.config_name} on "
                                     f"{first.chip_name}",
                      yaxis=dict(title="lane", autorange="reversed"),
                      height=200 + 60 * len(sims) * 3)
    if window_s is not None:
        fig.update_xaxes(range=[window_s[0] * 1e6, window_s[1] * 1e6])
    return fig


def _simulations(sims: Mapping, *fields: str) -> Mapping:
    """`sims` after checking each value has the `fields` of a `mk.cost.machine.Simulation` that
    the figure reads (`mk.cost.sim.simulate`'s; anything else is named, not an AttributeError)."""
    for label, sim in sims.items():
        if not all(hasattr(sim, f) for f in fields):
            raise ValueError(f"sims[{label!r}] is a {type(sim).__name__}; a figure of a "
                             "simulated step takes mk.cost.sim.simulate's Simulation")
    return sims


def _span(field: str, span, kind) -> tuple:
    """(first, last) of `kind` (int: layers, inclusive; float: seconds), first <= last;
    a span the wrong way round would draw an empty figure silently."""
    ok = isinstance(span, (tuple, list)) and len(span) == 2 and all(
        not isinstance(v, bool) and isinstance(v, numbers.Real if kind is float
                                               else numbers.Integral)
        and math.isfinite(v) for v in span)
    if not ok or span[0] > span[1]:
        raise ValueError(f"{field}={shown(span)} must be (first, last) with first <= last, "
                         + ("whole layer indices" if kind is int else "finite seconds"))
    return tuple(span)


def collective_timeline(sim, *, index: int, pad: float = 0.5, title: str = "") -> go.Figure:
    """`timeline` around the `index`-th collective of a tensor-parallel `mk.cost.machine.Simulation`
    (its "collective" compute events in program order: per layer the all-reduce after
    attention or the mixer, then after the MLP; the argmax's gather last): the compute
    lane blocked on it, the DMA lane loading the ring's next tiles meanwhile, HBM idle
    once the ring is full. `pad`: the share of the collective's length shown each side."""
    found = [e for e in sim.events if e.what == "collective"]
    if not found:
        raise ValueError(f"the simulation of {sim.config_name} at tp={sim.tp} has no "
                         "collective: simulate a tp > 1 shard")
    if not -len(found) <= index < len(found):
        raise ValueError(f"index={index} must be in [-{len(found)}, {len(found)}): the "
                         "step's collectives")
    c = found[index]
    span = (c.end_s - c.start_s) * pad
    where = f"layer {c.layer}" if c.layer is not None else "after the lm_head"
    return timeline(sim, window_s=(c.start_s - span, c.end_s + span), title=title or (
        f"{sim.config_name} TP{sim.tp} on {sim.chip_name}: collective {index % len(found)} "
        f"({where}), simulated"))


def _share(part_s: float, start_s: float, end_s: float) -> float:
    """The share of [start_s, end_s] that `part_s` covers (1 for an empty span)."""
    return 1.0 if end_s <= start_s else min(1.0, part_s / (end_s - start_s))


def bubble_bars(sims: Mapping[str, object], *, title: str = "Where the step goes "
                "(simulated): HBM busy and each bubble cause") -> go.Figure:
    """Stacked bars per label -> Simulation: HBM busy time and the idle time per cause, ms;
    the legend lists HBM busy and the causes with the most idle time (`LEGEND_ENTRIES` in
    all), the others named on hover."""
    sims = _simulations(sims if isinstance(sims, Mapping) else {"": sims}, "bubble_share",
                        "hbm_floor_s")
    labels = list(sims)
    idle: dict[str, float] = {}
    for sim in sims.values():
        for c, seconds in sim.bubble_share().items():
            idle[c] = idle.get(c, 0.0) + seconds
    causes = sorted(idle, key=lambda c: -idle[c])
    fig = go.Figure(go.Bar(x=labels, y=[s.hbm_floor_s * 1e3 for s in sims.values()],
                           name="HBM busy", marker_color=CATEGORY_COLOURS["DMA"],
                           hovertemplate="HBM busy %{y:.4g} ms<extra></extra>"))
    for i, cause in enumerate(causes):
        fig.add_trace(go.Bar(x=labels, y=[s.bubble_share().get(cause, 0.0) * 1e3
                                          for s in sims.values()], name=f"idle: {cause}",
                             marker_color=IDLE_COLOURS[cause],
                             showlegend=i < LEGEND_ENTRIES - 1,
                             hovertemplate=f"{cause}: %{{y:.4g}} ms<extra></extra>"))
    fig.update_layout(barmode="stack", title=title, xaxis_title="configuration",
                      yaxis_title="step (ms, simulated)")
    return fig


_SWEPT = {"step_ms": "step (ms, simulated)", "hbm_utilisation": "HBM busy (share of the step)"}


def sweep_lines(rows: Sequence[Mapping[str, object]], parameter: str, *,
                y: str = "step_ms", title: str = "") -> go.Figure:
    """A design sweep (`mk.course.review.sweep` rows): `y` against the swept parameter, with the
    HBM utilisation and the largest bubble in the hover; rows without a value are left
    out."""
    ok = [r for r in rows if r.get(y) is not None]
    fig = go.Figure(go.Scatter(
        x=[str(r[parameter]) for r in ok], y=[r[y] for r in ok], mode="lines+markers",
        customdata=[(r["hbm_utilisation"], r["largest_bubble"]) for r in ok],
        hovertemplate="%{x}: %{y:.4g}<br>HBM busy %{customdata[0]:.0%}, largest bubble "
                      "%{customdata[1]}<extra></extra>"))
    fig.update_layout(title=title or f"{y} against {parameter} (simulated)",
                      xaxis_title=parameter, yaxis_title=_SWEPT.get(y, y))
    return fig
