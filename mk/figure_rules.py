"""The course's figure rules, checked over a figure's plotly JSON (what `mk.plots.show` and
`fig.show()` write into a notebook's outputs under `PLOTLY_MIME`), so a test can check every
figure a notebook displays, however the cell built it.

`check(fig)` returns the rules a figure breaks (an empty list when it keeps them all):
- **Axes.** Every axis that carries data (a cartesian trace is drawn on it, it is not
  `visible=False`) has a title; an axis that `matches` another may leave the title to that
  one. A *quantity* axis (its type is linear or log, or its trace data on it are numbers,
  including a heatmap's or a y-only trace's implicit index) names its unit in parentheses
  or brackets: "time (µs, simulated)", "HBM floor [ms]", "KV tile (index)",
  "accepted (tokens)", "share of the step (fraction)". A *categorical* axis (type
  category, or string data) needs a title but no unit.
- **Legend.** At most `LEGEND_ENTRIES` entries, so the legend never scrolls: the traces
  with a name whose `showlegend` is not False (True for the trace types whose default is
  off, e.g. heatmaps) and `visible` is not False, one entry per trace, as plotly lists
  them (a `legendgroup` toggles its traces together but lists each); none when the layout
  hides the legend or plotly hides a lone trace's; the most over the states a slider or
  button step sets with `update`/`restyle` of `visible`.
- **Family colours.** A trace named after a weight family (its first word, before any
  "[i]", is a key of `mk.colours.WEIGHT_COLOURS`) is drawn in that weight's colour
  (`marker.color`, or `line.color` for a line), in the figure and in every frame; a
  trace named "skipped ..." is `mk.colours.IDLE_GREY`.

`notebook_figures(nb)` lists the figures of an executed notebook's outputs. Not here:
drawing figures (`mk.plots`), whether a figure's values are right (tests/test_figures.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mk.colours import IDLE_GREY, WEIGHT_COLOURS, weight_colour
from mk.plots import LEGEND_ENTRIES

PLOTLY_MIME = "application/vnd.plotly.v1+json"
CARTESIAN = frozenset({"scatter", "scattergl", "bar", "heatmap", "histogram", "box",
                       "violin", "contour", "waterfall", "funnel", "histogram2d",
                       "histogram2dcontour", "image", "candlestick", "ohlc"})
NO_LEGEND_BY_DEFAULT = frozenset({"heatmap", "contour", "histogram2d",
                                  "histogram2dcontour", "image"})
_UNIT = re.compile(r"\([^()]*\S[^()]*\)|\[[^\[\]]*\S[^\[\]]*\]")


def _title(part: Mapping) -> str:
    title = part.get("title", "")
    return (title.get("text") or "") if isinstance(title, Mapping) else str(title)


def _numeric(values) -> bool | None:
    """Whether trace data are numbers (None when absent); plotly may pack them binary."""
    if values is None:
        return None
    if isinstance(values, Mapping):
        return "bdata" in values or "dtype" in values
    flat = [v for v in values if v is not None]
    while flat and isinstance(flat[0], (list, tuple)):
        flat = [v for row in flat for v in row if v is not None]
    return bool(flat) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                              for v in flat)


def _axes_of(trace: Mapping) -> dict[str, bool]:
    """{layout axis key: whether the trace's data on it are numbers} for a cartesian trace."""
    out = {}
    for letter in "xy":
        key = letter + "axis" + trace.get(letter + "axis", letter)[1:]
        numeric = _numeric(trace.get(letter))
        if numeric is None:  # no data given: plotly draws the index (a number)
            numeric = True
        out[key] = numeric
    return out


def _visibility(fig: Mapping) -> list[list]:
    """Each trace's `visible` as drawn, then after each slider or button step that restyles
    it (a list of per-trace values in the step's first argument)."""
    data = fig.get("data", [])
    states = [[t.get("visible", True) for t in data]]
    layout = fig.get("layout", {})
    for control in [*layout.get("sliders", []), *layout.get("updatemenus", [])]:
        for step in control.get("steps", control.get("buttons", [])):
            args = step.get("args") or [None]
            if step.get("method") in ("update", "restyle") and isinstance(args[0], Mapping):
                visible = args[0].get("visible")
                if isinstance(visible, list) and len(visible) == len(data):
                    states.append(visible)
    return states


def legend(fig: Mapping) -> list[str]:
    """The legend's longest list of entries over the figure's slider and button states:
    one per shown trace that is not `visible=False` (plotly lists every trace of a legend
    group; the group only toggles them together)."""
    if fig.get("layout", {}).get("showlegend") is False:
        return []
    data = fig.get("data", [])
    if len(data) == 1 and "showlegend" not in data[0]:
        return []  # plotly hides the legend of a lone trace
    listed = [bool(t.get("name")) and (
        t.get("showlegend") is True or (t.get("showlegend") is not False
                                        and t.get("type", "scatter") not in NO_LEGEND_BY_DEFAULT))
        for t in data]
    return max(([t["name"] for t, shown, v in zip(data, listed, state) if shown and v is not False]
                for state in _visibility(fig)), key=len)


def _colour_problems(trace: Mapping, where: str) -> list[str]:
    name = trace.get("name") or ""
    weight = name.split()[0].split("[")[0] if name.split() else ""
    if name.startswith("skipped"):
        want = IDLE_GREY
    elif weight in WEIGHT_COLOURS:
        want = weight_colour(weight)
    else:
        return []
    set_ = [c for c in (trace.get("marker", {}).get("color"), trace.get("line", {}).get("color"))
            if isinstance(c, str)]
    if not set_:
        return [f"{where}trace {name!r} has no colour of its own: it must be {want}"]
    return [f"{where}trace {name!r} is drawn in {c}, not its colour {want}"
            for c in set_ if c.lower() != want.lower()]


def check(fig) -> list[str]:
    """The rules (module docstring) `fig` breaks: a plotly figure or its JSON dict."""
    if hasattr(fig, "to_plotly_json"):
        fig = fig.to_plotly_json()
    layout, data = fig.get("layout", {}), fig.get("data", [])
    problems, axes = [], {}
    for t in data:
        kind = t.get("type", "scatter")
        if kind not in CARTESIAN:
            problems.append(f"trace {t.get('name')!r} is a {kind!r}: these rules cover only "
                            f"cartesian traces ({', '.join(sorted(CARTESIAN))})")
            continue
        for key, numeric in _axes_of(t).items():
            axes[key] = axes.get(key, False) or numeric
    for key, numeric in sorted(axes.items()):
        axis = layout.get(key, {})
        if axis.get("visible") is False:
            continue
        title = _title(axis)
        if not title and axis.get("matches"):
            title = _title(layout.get(axis["matches"][0] + "axis" + axis["matches"][1:], {}))
        kind = axis.get("type")
        quantity = kind in ("linear", "log") or (kind not in ("category", "multicategory",
                                                              "date") and numeric)
        if not title:
            problems.append(f"{key} carries data but has no title")
        elif quantity and not _UNIT.search(title):
            problems.append(f"{key} is a quantity but its title {title!r} names no unit "
                            "in parentheses or brackets")
    entries = legend(fig)
    if len(entries) > LEGEND_ENTRIES:
        problems.append(f"the legend has {len(entries)} entries, more than "
                        f"{LEGEND_ENTRIES}: {entries}")
    for t in data:
        problems += _colour_problems(t, "")
    for i, frame in enumerate(fig.get("frames", [])):
        for t in frame.get("data", []):
            problems += _colour_problems(t, f"frame {frame.get('name', i)!r}: ")
    return problems


def notebook_figures(nb: Mapping) -> list[tuple[int, dict]]:
    """(cell index, figure JSON) of every plotly figure an executed notebook displays."""
    return [(i, out["data"][PLOTLY_MIME]) for i, cell in enumerate(nb.get("cells", []))
            for out in cell.get("outputs", []) if PLOTLY_MIME in out.get("data", {})]
