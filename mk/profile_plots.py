"""Notebook 08's figures of measured profiles: `lanes_figure` (a Gantt chart of busy lanes
and bubbles), `gantt` (one step of a `mk.measure.profiling.Timeline`) and `share_bars` (each
variant's idle and host shares). Op and line names come from a trace (a recorded one is
untrusted data) and are escaped. Not here: capturing and measuring (`mk.measure.profiling`), the
simulator's timelines (`mk.sim_plots`).
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

from mk.plots import escape
from mk.measure.profiling import StepBubbles, Timeline

COLORS = {"busy": "#4c78a8", "bubble": "#e45756", "host": "#f2a541"}


def lanes_figure(lanes: dict, idle, host=(), *, title: str = "", x_title: str = "µs",
                 height: int = 300) -> go.Figure:
    """A Gantt chart: `lanes` maps a lane name to (start, end, label) spans drawn busy;
    `idle` (bubbles: no lane busy) and `host` (host gaps) are (start, end) spans drawn on
    one "bubbles" lane."""
    fig = go.Figure()
    for lane, spans in lanes.items():
        fig.add_trace(go.Bar(
            y=[lane] * len(spans), x=[z - a for a, z, _ in spans], base=[a for a, _, _ in spans],
            orientation="h", marker_color=COLORS["busy"], showlegend=False,
            customdata=[escape(label) for _, _, label in spans],  # a trace's text
            hovertemplate="%{customdata}: %{x:.2f}<extra></extra>"))
    for label, spans, color in (("idle: no op running", idle, COLORS["bubble"]),
                                ("host gap", host, COLORS["host"])):
        spans = [(a, z) for a, z in spans if z > a]
        if spans:
            fig.add_trace(go.Bar(
                y=["bubbles"] * len(spans), x=[z - a for a, z in spans],
                base=[a for a, _ in spans], orientation="h", marker_color=color, name=label,
                hovertemplate=f"{label}: %{{x:.2f}}<extra></extra>"))
    fig.update_layout(title=title, barmode="overlay", height=height, xaxis_title=x_title,
                      yaxis=dict(title="lane", autorange="reversed"))
    return fig


def gantt(tl: Timeline, per_step: list[StepBubbles], step: int = -1, *, title: str = "",
          max_lines: int = 4, measured_on: str = "this machine") -> go.Figure:
    """One measured step: its ops on the `max_lines` busiest lines, the idle gaps (no op on
    any line) and the host gap, in µs from the step's start; `measured_on` names where
    (a recorded chip trace: "TPU v5 lite, 2026-12-07")."""
    i = range(len(tl.steps))[step]
    s, b = tl.steps[i], per_step[i]
    events = [o for o in tl.ops if o.step == i]
    load: dict = defaultdict(float)
    for o in events:
        load[o.line] += o.duration_ns
    lines = sorted(load, key=lambda n: -load[n])[:max_lines]

    def us(t):
        return (t - s.start_ns) / 1e3

    lanes = {escape(line): [(us(o.start_ns), us(o.end_ns), o.name) for o in events
                            if o.line == line] for line in lines}
    first = min((o.start_ns for o in events), default=s.end_ns)
    last = min(max((o.end_ns for o in events), default=s.end_ns), s.end_ns)
    host = [(us(s.start_ns), us(first)), (us(last), us(s.end_ns))]
    return lanes_figure(lanes, [(us(a), us(z)) for a, z in b.idle], host,
                        title=title or f"step {s.number}",
                        x_title=f"µs from the step's start (measured on {measured_on})")


def share_bars(rows: list[dict], *, title: str = "Bubble share per variant") -> go.Figure:
    """Stacked bars of idle-inside-the-step and host-gap shares of the wall time, one bar
    per `summary` row (its `variant` label)."""
    labels = [r["variant"] for r in rows]
    host = [r["host_share"] for r in rows]
    idle = [r["bubble_share"] - r["host_share"] for r in rows]
    fig = go.Figure([
        go.Bar(x=labels, y=idle, name="idle inside the step", marker_color=COLORS["bubble"]),
        go.Bar(x=labels, y=host, name="host gap", marker_color=COLORS["host"])])
    fig.update_layout(barmode="stack", title=title, xaxis_title="variant",
                      yaxis=dict(title="share of the step's wall time (fraction)", tickformat=".0%",
                                 range=[0, 1]))
    return fig
