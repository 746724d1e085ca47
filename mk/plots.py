"""Plotly figures and tables for the notebooks, and `show` that keeps them self-contained.

Here: `roofline`, `bytes_breakdown`, `published_vs_floor` (figures built from numbers and
records that `mk.perf` computed), `tile_stream` (the ring's schedule, drawn from the
`TileStream` the kernel executes), `table` (a Markdown table) and `show`. Not here: any
model or chip arithmetic (that is `mk.perf`); static image export (kaleido needs Chrome).

Why `show` and not `fig.show()`: plotly 7's default output is only the plotly JSON mime
type, which JupyterLab draws but nbconvert's HTML export and GitHub do not. `show` emits
that JSON together with an HTML rendering, and embeds plotly.js (offline, ~5 MB) in the
first figure of a kernel session only; later figures reuse `window.Plotly`. So a notebook
run top to bottom is self-contained, in JupyterLab and in its HTML export alike. On Colab
each output is its own iframe, so there every figure loads plotly.js (Colab is online).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from IPython.display import Markdown, display
from plotly.offline import get_plotlyjs

TERA = 1e12
GIGA = 1e9
_state = {"plotlyjs_embedded": False}


# -- Display --------------------------------------------------------------------------------
def show(fig: go.Figure) -> None:
    """Display `fig` so that the saved notebook and its HTML export both draw it."""
    if "google.colab" in sys.modules:
        fig.show(renderer="colab")
        return
    html = pio.to_html(fig, include_plotlyjs=False, full_html=False,
                       default_width="100%", default_height=500)
    if not _state["plotlyjs_embedded"]:
        html = f'<script type="text/javascript">{get_plotlyjs()}</script>\n{html}'
        _state["plotlyjs_embedded"] = True
    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
    bundle["text/html"] = html
    bundle["text/plain"] = f"<plotly figure: {fig.layout.title.text or 'untitled'}>"
    display(bundle, raw=True)


def table(rows: Sequence[Mapping[str, object]]) -> Markdown:
    """A Markdown table of `rows` (dicts with the same keys, in column order)."""
    if not rows:
        raise ValueError("rows is empty: a table needs at least one row")
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return Markdown("\n".join(lines))


# -- Figures --------------------------------------------------------------------------------
def roofline(curves: Mapping[str, tuple], points: Mapping[str, Mapping[str, object]], *,
             title: str = "Roofline: attainable FLOP/s per chip") -> go.Figure:
    """Roofline lines and decode-step points.

    `curves`: chip name -> (intensity FLOP/byte, attainable FLOP/s), e.g. from
    `mk.perf.roofline_curve`. `points`: slider label -> {point label -> StepEstimate};
    each estimate is drawn at (intensity_flop_per_byte, attainable_flops_per_chip). With
    more than one slider label, a slider switches between the point sets.
    """
    fig = go.Figure()
    for name, (x, y) in curves.items():
        fig.add_trace(go.Scatter(x=x, y=[v / TERA for v in y], mode="lines", name=name,
                                 hovertemplate="%{x:.3g} FLOP/B: %{y:.4g} TFLOP/s"))
    first_point = len(fig.data)
    owner = []  # slider index of each point trace
    for i, estimates in enumerate(points.values()):
        for label, e in estimates.items():
            fig.add_trace(go.Scatter(
                x=[e.intensity_flop_per_byte], y=[e.attainable_flops_per_chip / TERA],
                mode="markers", name=label, visible=i == 0, marker=dict(size=11),
                hovertemplate=f"{label}: %{{x:.3g}} FLOP/B, %{{y:.4g}} TFLOP/s<extra></extra>"))
            owner.append(i)
    steps = [dict(method="update", label=step,
                  args=[{"visible": [True] * first_point + [j == i for j in owner]}])
             for i, step in enumerate(points)]
    fig.update_layout(
        title=title, xaxis=dict(type="log", title="arithmetic intensity (FLOP per HBM byte)"),
        yaxis=dict(type="log", title="attainable TFLOP/s per chip"),
        sliders=[dict(steps=steps, active=0, pad=dict(t=50))] if len(steps) > 1 else [])
    return fig


_BYTE_PARTS = (  # (StepEstimate field(s), legend name)
    (("attention_bytes",), "attention weights"),
    (("dense_mlp_bytes",), "dense MLP weights"),
    (("router_bytes",), "routers"),
    (("expert_bytes",), "experts touched"),
    (("embed_bytes", "lm_head_bytes"), "embedding rows + lm_head"),
    (("kv_read_bytes",), "KV cache read"),
    (("kv_write_bytes",), "KV cache written"),
)


def bytes_breakdown(estimates: Mapping[str, object], *, relative: bool = True,
                    title: str = "What one decode step reads and writes") -> go.Figure:
    """Stacked bars of a step's HBM bytes by kind, one bar per label -> StepEstimate;
    `relative` shows shares of the step's bytes (hover gives GB)."""
    labels = list(estimates)
    fig = go.Figure()
    for fields, name in _BYTE_PARTS:
        gb = [sum(getattr(e, f) for f in fields) / GIGA for e in estimates.values()]
        total = [e.total_bytes / GIGA for e in estimates.values()]
        y = [g / t for g, t in zip(gb, total)] if relative else gb
        fig.add_trace(go.Bar(x=labels, y=y, name=name, customdata=gb,
                             hovertemplate=f"{name}: %{{customdata:.4g}} GB<extra></extra>"))
    fig.update_layout(barmode="stack", title=title,
                      yaxis=dict(title="share of step bytes" if relative else "GB",
                                 tickformat=".0%" if relative else None))
    return fig


def published_vs_floor(labels: Sequence[str], published: Sequence[float],
                       bounds: Mapping[str, Sequence[float]], *,
                       title: str = "Published tokens/s and the HBM-floor bound") -> go.Figure:
    """Grouped bars: the published tokens/s and each named floor-based upper bound."""
    fig = go.Figure(go.Bar(x=list(labels), y=list(published), name="published",
                           hovertemplate="%{x}: %{y:.4g} tokens/s<extra>published</extra>"))
    for name, values in bounds.items():
        if len(values) != len(labels):
            raise ValueError(f"bounds[{name!r}] has {len(values)} values for "
                             f"{len(labels)} labels")
        fig.add_trace(go.Bar(x=list(labels), y=list(values), name=name,
                             hovertemplate="%{x}: %{y:.4g} tokens/s<extra></extra>"))
    fig.update_layout(barmode="group", title=title,
                      yaxis=dict(type="log", title="tokens/s (log)"))
    return fig


def tile_stream(stream, *, title: str = "") -> go.Figure:
    """The weight tiles of a `mk.kernels.ring.TileStream` in consumption order, one row
    per matrix: the schedule the ring executes (tile g lands in slot g mod slots)."""
    slots = stream.block.slots
    fig = go.Figure()
    by_name: dict[str, list] = {}
    for g, layer, name, i, j in stream.tiles():
        by_name.setdefault(name.split("[")[0], []).append((g, layer, name, i, j))
    for name, tiles in by_name.items():
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[name] * len(tiles), x=[1] * len(tiles),
            base=[t[0] for t in tiles],
            customdata=[(t[2], t[1], t[3], t[4], t[0] % slots) for t in tiles],
            hovertemplate="tile %{base} of %{customdata[0]}, layer %{customdata[1]}<br>"
                          "row tile %{customdata[2]}, col tile %{customdata[3]}, "
                          "slot %{customdata[4]}<extra></extra>"))
    fig.update_layout(title=title or f"{stream.total} weight tiles through a {slots}-slot ring",
                      xaxis_title="tile index g (consumption order)", barmode="overlay",
                      yaxis=dict(autorange="reversed"), bargap=0.2, height=320)
    return fig
