"""Plotly figures and tables for the notebooks, and `show` that keeps them self-contained.

Here: figures from `mk.cost.perf`'s numbers (`roofline`, `bytes_breakdown`,
`published_vs_floor`), from the schedule the kernel executes (`tile_stream`,
`ring_gantt`, `kv_tile_map`), `lines`, `tpu_picture` (one chip's memories, units and
paths), `table` / `Table` (HTML tables), `escape` (untrusted text made safe),
`show_source` (a kernel's own code on the page), `knobs` (an ipywidgets panel), `show`,
`whole_at_every_frame` and `LEGEND_ENTRIES` (every figure's legend limit).

Not here: a `mk.cost.machine.Simulation`'s figures (`mk.sim_plots`); any model or chip
arithmetic (`mk.cost.perf`); the colours (`mk.colours`); static image export (kaleido needs
Chrome). Each figure in a line, and why `show` and not `fig.show()` (plotly.js embedded
once per page, offline): docs/design/mk.plots.md.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from IPython.display import Markdown, display
from plotly.offline import get_plotlyjs

from mk.colours import IDLE_GREY, KV_COLOURS, weight_colour
from mk.kernels.kv_stream import first_kv_tile

TERA = 1e12
GIGA = 1e9
# What this page (the notebook being run) has had once: plotly.js, embedded by the first
# `show` (a test sets it to see a figure without the library).
page_state = {"plotlyjs_embedded": False}
LEGEND_ENTRIES = 10  # the most a figure's legend lists (no scrolling legends)
HEADLESS = "MK_HEADLESS"  # set (to "1") for the kernels of a headless run: `knobs`


# -- Display --------------------------------------------------------------------------------
def show(fig: go.Figure) -> None:
    """Display `fig` so that the saved notebook and its HTML export both draw it; an
    animated figure first gets `whole_at_every_frame`."""
    if fig.frames:
        whole_at_every_frame(fig)
    if "google.colab" in sys.modules:
        fig.show(renderer="colab")
        return
    # auto_play=False as in plotly's own renderers (Colab's too): to_html would start the
    # frames playing on load, and a slider click in that second interrupts the play, whose
    # unhandled promise rejection is a JavaScript error ("undefined") on the page.
    html = pio.to_html(fig, include_plotlyjs=False, full_html=False, auto_play=False,
                       default_width="100%", default_height=500)
    if not page_state["plotlyjs_embedded"]:
        html = f"{plotlyjs_script()}\n{html}"
        page_state["plotlyjs_embedded"] = True
    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
    bundle["text/html"] = html
    bundle["text/plain"] = f"<plotly figure: {fig.layout.title.text or 'untitled'}>"
    display(bundle, raw=True)


def _extents(trace, barmode: str) -> dict[str, list]:
    """{"x"/"y": the values `trace` draws on that axis}: a bar's base and base + length
    along its value axis (stacked bars are left out there: their ends are sums), the data
    of other cartesian traces as given."""
    def values(v):
        return [] if v is None else list(v) if hasattr(v, "__len__") and not isinstance(
            v, str) else [v]

    out = {"x": values(getattr(trace, "x", None)), "y": values(getattr(trace, "y", None))}
    if trace.type == "bar":
        along = "x" if trace.orientation == "h" else "y"
        if barmode in ("stack", "relative"):
            out[along] = []
        else:
            base = values(trace.base) or [0]
            base = base * len(out[along]) if len(base) == 1 else base
            out[along] = [*base, *(b + v for b, v in zip(base, out[along]) if v is not None)]
    return out


def whole_at_every_frame(fig: go.Figure) -> go.Figure:
    """Fix each axis of an animated figure to a range that holds every frame: plotly keeps
    the first frame's autorange through the animation, so a frame with more rows or a
    longer span would be clipped (the ring Gantt's slots at 28 slots). A category axis
    holds every category any frame draws, in `categoryarray` order or order of appearance;
    a numeric one spans the data of every frame, padded 2 %. Returns `fig`, changed."""
    barmode = fig.layout.barmode or "group"
    seen: dict[str, list] = {}
    for frame_data in [fig.data, *(f.data or () for f in fig.frames)]:
        for i, trace in enumerate(frame_data):
            kind = fig.data[i] if i < len(fig.data) else trace
            for letter, vals in _extents(trace, barmode).items():
                ref = getattr(trace, f"{letter}axis", None) or getattr(
                    kind, f"{letter}axis", None) or letter
                seen.setdefault(letter + "axis" + ref[1:], []).extend(
                    v for v in vals if v is not None)
    for key, vals in seen.items():
        axis = fig.layout[key]
        reverse = axis.autorange == "reversed"
        if not vals or axis.type == "date":  # dates: left to plotly's autorange
            continue
        if axis.type == "category" or any(isinstance(v, str) for v in vals):
            order = list(axis.categoryarray or ())
            order += [v for v in dict.fromkeys(vals) if v not in order]
            lo, hi = -0.5, len(order) - 0.5
            axis.update(categoryorder="array", categoryarray=order)
        else:
            log = axis.type == "log"
            nums = [math.log10(v) for v in vals if v > 0] if log else [float(v) for v in vals]
            if not nums:
                continue
            pad = 0.02 * ((max(nums) - min(nums)) or 1.0)
            lo, hi = min(nums) - pad, max(nums) + pad
        axis.update(autorange=False, range=[hi, lo] if reverse else [lo, hi])
    return fig


def plotlyjs_script() -> str:
    """The `<script>` holding plotly.js that `show` puts before a session's first figure
    (tools/build_site.py swaps it for one shared file on the site's pages)."""
    return f'<script type="text/javascript">{get_plotlyjs()}</script>'


def knobs(fn, **controls) -> None:
    """`fn`'s panel: ipywidgets' `interactive(fn, **controls)` displayed, where a reader can
    turn the knobs; in a headless run (the `HEADLESS` variable set: `make run`, the tests)
    `fn()` once at its defaults, which is what the panel first shows. A widget nobody
    can turn is only comm traffic there, and papermill's client has sat waiting at such
    a cell, its kernel idle, three times for 9 to 16 minutes (notebook 09's panel)."""
    if os.environ.get(HEADLESS):
        fn()
        return
    import ipywidgets

    display(ipywidgets.interactive(fn, **controls))


def show_source(*objects, lines: tuple[int, int] | None = None) -> Markdown:
    """The source of each function or class (from its module, so it follows the code) as
    one highlighted Python block, each headed by its module and line; `lines=(first, last)`
    keeps those lines (1-based, inclusive) of a single object."""
    blocks = []
    for obj in objects:
        source, start = inspect.getsourcelines(obj)
        if lines is not None:
            if len(objects) != 1 or not 1 <= lines[0] <= lines[1] <= len(source):
                raise ValueError(f"lines={lines} must lie in [1, {len(source)}] of one object")
            source, start = source[lines[0] - 1:lines[1]], start + lines[0] - 1
        where = f"# {obj.__module__}, line {start}: {obj.__qualname__}\n"
        blocks.append(where + textwrap.dedent("".join(source)).rstrip())
    return Markdown("```python\n" + "\n\n".join(blocks) + "\n```")


# Characters that HTML or Markdown read as markup, as numeric character references: the
# text shows as itself in HTML, in Markdown (a reference is never markup) and in a table
# cell, and a newline or a backtick fence cannot start a block.
_ESCAPES = {c: f"&#{ord(c)};" for c in "&<>\"'`|*_[]{}()#!$\\~\n\r"}


def escape(value: object) -> str:
    """`str(value)` safe to write into HTML or Markdown: every character either reads as
    markup (`<`, `&`, quotes, backticks, `|`, `*`, `_`, brackets, `$`, `#`, newlines, ...)
    becomes a numeric character reference, so untrusted text (a checkpoint's name, an
    error message, a runs file's value) is shown as written and never runs or formats."""
    return str(value).translate(str.maketrans(_ESCAPES))


_CELL = "padding: 0.2em 0.8em; font-variant-numeric: tabular-nums"
_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?( ?[%x×])?$")  # 1,234 / 0.5 / 3e-05 / 2.1x


class Table:
    """A table that renders as an HTML `<table>` in JupyterLab, on Colab and on the static
    site alike (`_repr_html_`, every cell through `escape`); its text form (`data`, the
    plain-text output) is a Markdown pipe table."""

    def __init__(self, rows: Sequence[Mapping[str, object]]):
        if not rows:
            raise ValueError("rows is empty: a table needs at least one row")
        self.columns = list(rows[0])
        self.rows = [[row[c] for c in self.columns] for row in rows]

    @property
    def data(self) -> str:
        def cell(value):
            return " ".join(str(value).split()).replace("|", "\\|")
        lines = ["| " + " | ".join(map(cell, self.columns)) + " |",
                 "|" + "---|" * len(self.columns)]
        return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in self.rows])

    def __repr__(self) -> str:
        return self.data

    def _repr_html_(self) -> str:
        # Styles inline: the site's theme, JupyterLab and Colab pad a bare table's cells
        # differently or not at all, and unpadded numbers run together across columns.
        def td(value):
            align = "right" if _NUMBER.match(str(value).strip()) else "left"
            return f'<td style="{_CELL}; text-align: {align}">{escape(value)}</td>'
        head = "".join(f'<th style="{_CELL}">{escape(c)}</th>' for c in self.columns)
        body = "".join("<tr>" + "".join(map(td, r)) + "</tr>" for r in self.rows)
        return (f'<table class="mk-table" style="border-collapse: collapse">'
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def table(rows: Sequence[Mapping[str, object]]) -> Table:
    """A `Table` of `rows` (dicts with the same keys, in column order)."""
    return Table(rows)


# -- Figures --------------------------------------------------------------------------------
def roofline(curves: Mapping[str, tuple], points: Mapping[str, Mapping[str, object]], *,
             title: str = "Roofline: attainable FLOP/s per chip") -> go.Figure:
    """Roofline lines (the legend) and decode-step points (each named beside its marker).

    `curves`: chip name -> (intensity FLOP/byte, attainable FLOP/s), e.g. from
    `mk.cost.perf.roofline_curve`. `points`: slider label -> {point label -> StepEstimate};
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
                mode="markers+text", name=label, visible=i == 0, marker=dict(size=11),
                text=[label], textposition="top center", showlegend=False,  # named in place
                hovertemplate=f"{label}: %{{x:.3g}} FLOP/B, %{{y:.4g}} TFLOP/s<extra></extra>"))
            owner.append(i)
    steps = [dict(method="update", label=step,
                  args=[{"visible": [True] * first_point + [j == i for j in owner]}])
             for i, step in enumerate(points)]
    fig.update_layout(
        title=title, xaxis=dict(type="log", title="arithmetic intensity (FLOP per HBM byte)"),
        yaxis=dict(type="log", title="attainable (TFLOP/s per chip)"),
        sliders=[dict(steps=steps, active=0, pad=dict(t=50))] if len(steps) > 1 else [])
    return fig


_BYTE_PARTS = (  # (StepEstimate field(s), legend name)
    (("attention_bytes",), "attention weights"),
    (("norm_bytes",), "norm weights"),
    (("dense_mlp_bytes",), "dense MLP weights"),
    (("router_bytes",), "routers"),
    (("expert_bytes",), "experts touched"),
    (("embed_bytes", "lm_head_bytes"), "embedding rows + lm_head"),
    (("kv_read_bytes",), "KV cache read"),
    (("kv_write_bytes",), "KV cache written"),
    (("linear_bytes",), "linear-layer weights"),
    (("state_read_bytes", "state_write_bytes"), "linear states read + written"),
)


def bytes_breakdown(estimates: Mapping[str, object], *, relative: bool = True,
                    title: str = "What one decode step reads and writes") -> go.Figure:
    """Stacked bars of a step's HBM bytes by kind, one bar per label -> StepEstimate;
    `relative` shows shares of the step's bytes (hover gives GB)."""
    labels = list(estimates)
    fig = go.Figure()
    for fields, name in _BYTE_PARTS:
        gb = [sum(getattr(e, f) for f in fields) / GIGA for e in estimates.values()]
        if not any(gb):  # a part none of the steps has (no experts, no linear layers)
            continue
        total = [e.total_bytes / GIGA for e in estimates.values()]
        y = [g / t for g, t in zip(gb, total)] if relative else gb
        fig.add_trace(go.Bar(x=labels, y=y, name=name, customdata=gb,
                             hovertemplate=f"{name}: %{{customdata:.4g}} GB<extra></extra>"))
    fig.update_layout(barmode="stack", title=title, xaxis_title="step",
                      yaxis=dict(title="share of step bytes (fraction)" if relative
                                 else "step bytes (GB)", tickformat=".0%" if relative else None))
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
    fig.update_layout(barmode="group", title=title, xaxis_title="published run",
                      yaxis=dict(type="log", title="throughput (tokens/s, log scale)"))
    return fig


def tile_stream(stream, *, title: str = "") -> go.Figure:
    """The weight tiles of a `mk.kernels.stream.TileStream` in consumption order, one row
    per matrix: the schedule the ring executes (tile g lands in slot g mod slots)."""
    slots = stream.block.slots
    fig = go.Figure()
    by_name: dict[str, list] = {}
    for g, layer, name, i, j in stream.tiles():
        by_name.setdefault(name.split("[")[0], []).append((g, layer, name, i, j))
    for name, tiles in by_name.items():
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[name] * len(tiles), x=[1] * len(tiles),
            marker_color=weight_colour(name),
            base=[t[0] for t in tiles],
            customdata=[(t[2], t[1], t[3], t[4], t[0] % slots) for t in tiles],
            hovertemplate="tile %{base} of %{customdata[0]}, layer %{customdata[1]}<br>"
                          "row tile %{customdata[2]}, col tile %{customdata[3]}, "
                          "slot %{customdata[4]}<extra></extra>"))
    fig.update_layout(title=title or f"{stream.total} weight tiles through a {slots}-slot ring",
                      xaxis_title="tile index g (consumption order, tiles)",
                      barmode="overlay",
                      showlegend=False,  # each row's label names its matrix: no legend needed
                      # every row labelled: plotly would skip every other one when crowded
                      yaxis=dict(title="weight matrix", autorange="reversed", tickmode="array",
                                 tickvals=list(by_name)), bargap=0.2,
                      height=max(320, 120 + 22 * len(by_name)))
    return fig


def ring_gantt(schedules: Mapping[str, list], *, title: str) -> go.Figure:
    """Each tile's life in its ring slot: in flight (issue -> land, light) then consumed
    (the compute lane, solid), one row per slot, coloured by weight family (one legend
    entry per family); a skipped tile (switched off, e.g. an idle expert slot) is a grey
    mark where the lane passes it. `schedules`:
    {label: `mk.course.teach.ring_schedule` rows}, one animation frame each (a slider and a play
    button step through them; every frame has the same traces)."""
    families = sorted({t["family"] for rows in schedules.values() for t in rows})
    depth = max(t["slot"] for rows in schedules.values() for t in rows) + 1

    def traces(rows):
        out = []
        for phase, opacity, start, end in (("in flight", 0.35, "issue", "land"),
                                           ("consumed", 1.0, "start", "end")):
            for f in families:
                mine = [t for t in rows if t["family"] == f and not t.get("skipped")]
                out.append(go.Bar(
                    name=f"{f} {phase}" if phase == "in flight" else f,
                    showlegend=phase == "consumed", orientation="h", opacity=opacity,
                    marker_color=weight_colour(f), legendgroup=f,
                    y=[f"slot {t['slot']}" for t in mine],
                    base=[t[start] * 1e6 for t in mine],
                    x=[(t[end] - t[start]) * 1e6 for t in mine],
                    customdata=[t["g"] for t in mine],
                    hovertemplate=f"tile %{{customdata}} of {f}: {phase} "
                                  "%{base:.3f} .. +%{x:.3f} µs<extra></extra>"))
        skipped = [t for t in rows if t.get("skipped")]  # switched off: never loaded
        out.append(go.Scatter(
            name="skipped (not loaded)", mode="markers", marker=dict(
                color=IDLE_GREY, symbol="line-ns-open", size=12, line_width=2),
            x=[t["end"] * 1e6 for t in skipped], y=[f"slot {t['slot']}" for t in skipped],
            customdata=[(t["g"], t["family"]) for t in skipped],
            hovertemplate="tile %{customdata[0]} of %{customdata[1]}: skipped at %{x:.3f} "
                          "µs<extra></extra>"))
        return out

    labels = list(schedules)
    fig = go.Figure(data=traces(schedules[labels[0]]),
                    frames=[go.Frame(data=traces(schedules[k]), name=k) for k in labels])
    fig.update_layout(
        title=title, barmode="overlay", height=200 + 24 * depth,
        xaxis=dict(title="time (µs, modelled)"),
        yaxis=dict(title="ring slot", autorange="reversed", categoryorder="array",
                   categoryarray=[f"slot {s}" for s in range(depth)]),
        updatemenus=[dict(type="buttons", showactive=False, x=0, y=-0.25, buttons=[dict(
            label="play", method="animate",
            args=[None, dict(frame=dict(duration=1200, redraw=True), fromcurrent=True)])])],
        sliders=[dict(active=0, x=0.1, len=0.9, y=-0.15, steps=[dict(
            label=k, method="animate",
            args=[[k], dict(mode="immediate", frame=dict(duration=0, redraw=True),
                            transition=dict(duration=0))])  # a step jumps, no tween
            for k in labels])])
    return fig



def kv_tile_map(positions, rows: int, kv_tile: int, context: int, *, window: int = 0,
                title: str = "") -> go.Figure:
    """One row per sequence, one cell per KV tile of its cache: read (tiles 0, or with a
    sliding `window` its first (`mk.kernels.kv_stream.first_kv_tile`), .. the one holding
    its last new row), read and written back (those holding new rows), skipped (never
    loaded)."""
    cells = {k: ([], []) for k in KV_COLOURS}
    for b, p in enumerate(int(p) for p in positions):
        last, first_new = (p + rows - 1) // kv_tile, p // kv_tile
        first = first_kv_tile(p, kv_tile, window)
        for i in range(context // kv_tile):
            kind = ("skipped" if i > last or i < first else "read and written back"
                    if i >= first_new else "read")
            cells[kind][0].append(i)
            cells[kind][1].append(f"sequence {b} (p={p})")
    fig = go.Figure([go.Bar(name=k, orientation="h", x=[1] * len(xs), base=xs, y=ys,
                            marker_color=KV_COLOURS[k], marker_line_color="white",
                            marker_line_width=1,
                            hovertemplate="tile %{base}: " + k + "<extra></extra>")
                     for k, (xs, ys) in cells.items()])
    fig.update_layout(title=title or f"KV tiles of {kv_tile} positions per sequence",
                      barmode="overlay", height=180 + 30 * len(list(positions)),
                      xaxis_title="KV tile index (tiles of kv_tile positions)",
                      yaxis=dict(title="sequence", autorange="reversed"))
    return fig


# -- The machine ---------------------------------------------------------------------------
# Boxes of one TensorCore and its chip: (x0, y0, x1, y1), the fill, the label. Where each
# unit sits is a drawing choice; every number comes from the chip's row (mk.model.chips).
_MEMORY, _COMPUTE, _MOVE = "#dbe9f6", "#fde0c5", "#e2f0d9"
# Where each unit sits in `tpu_picture` (x0, y0, x1, y1) and its fill.
_TPU_BOXES = dict(hbm=(0.2, 0.2, 11.8, 1.6, _MEMORY), dma=(0.2, 2.2, 5.6, 3.2, _MOVE),
                  ici=(6.4, 2.2, 11.8, 3.2, _MOVE), vmem=(0.6, 3.9, 7.4, 5.0, _MEMORY),
                  smem=(7.8, 3.9, 11.4, 5.0, _MEMORY), vregs=(0.6, 5.6, 7.4, 6.4, _MEMORY),
                  scalar=(7.8, 5.6, 11.4, 6.4, _COMPUTE), mxu=(0.6, 7.0, 4.3, 8.6, _COMPUTE),
                  vpu=(4.7, 7.0, 7.4, 8.6, _COMPUTE))


def tpu_picture(spec) -> go.Figure:
    """One TPU chip (a `mk.model.chips.ChipSpec` of kind "tpu") as the kernels see it: HBM, the
    DMA engines, one TensorCore's VMEM, SMEM, vector registers, MXU, VPU and scalar unit,
    and ICI, each labelled with its number from data/chips.csv and the Pallas name a kernel
    uses to reach it. Arrows are the paths data takes."""
    if spec.kind != "tpu":
        raise ValueError(f"chip {spec.name}: kind={spec.kind!r}; tpu_picture draws a TPU")
    cores, r = spec.cores_per_chip, spec.mxu_rows
    per_core = f"{spec.bf16_flops / cores / TERA:,.0f} TFLOP/s bf16 per core"
    labels = dict(
        hbm=f"<b>HBM</b> {spec.hbm_bytes / 2**30:.0f} GiB, {spec.hbm_bw / GIGA:,.0f} GB/s "
            "per chip: weights, KV cache (refs in pl.ANY)",
        dma="<b>DMA engines</b>: async HBM <-> VMEM copies<br>"
            "pltpu.make_async_copy(...).start() / .wait(), DMA semaphores",
        ici=f"<b>ICI</b> {spec.ici_bw / GIGA:,.0f} GB/s per chip to other chips<br>"
            "pltpu.make_async_remote_copy (collectives)",
        vmem=f"<b>VMEM</b> {spec.vmem_bytes / 2**20:.0f} MiB per core: tiles, ring slots<br>"
             "pltpu.VMEM((slots, tk, tn), dtype) scratch",
        smem="<b>SMEM</b>: scalars (positions, expert ids,<br>counts) pltpu.SMEM, read in "
             "pl.when",
        vregs="<b>vector registers</b>: 8 sublanes x 128 lanes of 32 bits each",
        scalar="<b>scalar unit</b>: control flow, addresses",
        mxu=f"<b>MXU</b> {r} x {r}, weight-stationary:<br>loads a weight block, then streams "
            f"rows;<br>< {r} rows cost {r} (jnp.dot)",
        vpu="<b>VPU</b>: elementwise on vregs<br>(norms, RoPE, softmax, SwiGLU)")
    boxes = {name: (_TPU_BOXES[name][:4], _TPU_BOXES[name][4], label)
             for name, label in labels.items()}
    arrows = [("hbm", "dma"), ("dma", "vmem"), ("hbm", "ici"), ("ici", "vmem"),
              ("vmem", "vregs"), ("vregs", "mxu"), ("vregs", "vpu"), ("smem", "scalar")]
    fig = go.Figure()
    for (x0, y0, x1, y1), fill, _ in boxes.values():
        fig.add_shape(type="rect", x0=x0, y0=y0, x1=x1, y1=y1, fillcolor=fill,
                      line=dict(color="#555", width=1), layer="below")
    fig.add_shape(type="rect", x0=0.4, y0=3.6, x1=11.6, y1=9.2, line=dict(
        color="#333", width=2, dash="dot"))

    def centre(name):
        (x0, y0, x1, y1), _, _ = boxes[name]
        return (x0 + x1) / 2, (y0 + y1) / 2

    for a, b in arrows:
        (xa, ya), (xb, yb) = centre(a), centre(b)
        fig.add_annotation(x=xb, y=(boxes[b][0][1] if yb > ya else boxes[b][0][3]),
                           ax=xa, ay=(boxes[a][0][3] if yb > ya else boxes[a][0][1]),
                           xref="x", yref="y", axref="x", ayref="y", text="",
                           showarrow=True, arrowhead=2, arrowside="end+start",
                           arrowcolor="#555")
    fig.add_trace(go.Scatter(
        x=[centre(n)[0] for n in boxes], y=[centre(n)[1] for n in boxes], mode="text",
        text=[label for _, _, label in boxes.values()], textfont=dict(size=11),
        hoverinfo="skip", showlegend=False))
    fig.update_layout(
        title=f"{spec.name}: one TensorCore ({cores} per chip, {per_core}) and its chip",
        xaxis=dict(visible=False, range=[0, 12]), yaxis=dict(visible=False, range=[0, 9.6]),
        height=560, margin=dict(l=10, r=10, t=50, b=10), plot_bgcolor="white")
    fig.add_annotation(x=11.5, y=9.0, text=f"TensorCore (x{cores} per chip)", showarrow=False,
                       xanchor="right", font=dict(size=11))
    return fig


def lines(x: Sequence[float], series: Mapping[str, Sequence[float]], *, title: str,
          xaxis: str, yaxis: str) -> go.Figure:
    """One line per named series against the shared x values."""
    fig = go.Figure()
    for name, y in series.items():
        if len(y) != len(x):
            raise ValueError(f"series {name!r} has {len(y)} values for {len(x)} x values")
        fig.add_trace(go.Scatter(x=list(x), y=list(y), mode="lines+markers", name=name,
                                 hovertemplate=f"{name}: %{{y:.4g}} at %{{x}}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis)
    return fig
