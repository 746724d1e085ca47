"""The course's figure rules, checked over a figure's plotly JSON (what `mk.plots.show` and
`fig.show()` write into a notebook's outputs under `PLOTLY_MIME`), so a test can check every
figure a notebook displays, however the cell built it.

`check(fig)` returns the rules a figure breaks (an empty list when it keeps them all):
every axis that carries data has a title, a quantity axis names its unit; the legend has
at most `LEGEND_ENTRIES` entries in any state a slider or button sets; a trace named after
a weight family is drawn in that family's colour (`mk.colours`). `notebook_figures(nb)`
lists the figures of an executed notebook's outputs.

Not here: drawing figures (`mk.plots`), whether a figure's values are right
(tests/test_figures.py). Each rule exactly: docs/design/mk.figure_rules.md.
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
