r"""Check a site written by tools/run_notebooks.py in headless Chromium, as a reader sees it.

`make check-site` runs it on `build/`; tests/test_site.py runs it on a small site it builds.
A static server on 127.0.0.1 serves the site; Debian's Chromium (no browser download),
driven by Playwright, opens `index.html` and every page it links to, run indexes included.
On each page it reports:
- JavaScript errors (uncaught exceptions and console errors, failed loads included), local
  requests that fail, and any request leaving the site (refused: the pages must work
  offline);
- every plotly figure that did not render (no `.js-plotly-plot`, no visible trace in its
  data, or no drawn trace in its SVG);
- every animated figure clipped at some frame: a frame's trace extents (bars from base to
  base + length, points as given) measured against the axis ranges plotly holds through
  the animation;
- for every figure with a slider: a click on the next step's tick must make the slider
  active there and change the drawn plot (the slider works without a kernel);
- a missing or empty `<title>`; a page file over `PAGE_BUDGET_MB`;
- an unrendered Markdown table: a pipe row (`| a | b |`) in text outside `<table>`,
  `<pre>` and `<code>`;
- math left raw once MathJax has finished (`\(`, `\[` or `$...$` in text outside code), a
  MathJax error, or MathJax never finishing;
- an invisible output: a widget view with no widget manager to draw it, or a cell output
  with nothing in it to see;
- a link to a local target that does not exist, or to a folder without an index.html (a
  static server answers 200 with a listing, an empty page to a reader);
- an inline event handler (`onerror=`, `onload=`, ...) inside a cell's output: content
  that scripts the page (untrusted text escaped nowhere).

Not here: whether a page's content is right (the notebooks' own checks), how it looks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import http.server
import os
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

CHROMIUM = "/usr/bin/chromium"
# What Chromium needs on this closed-network machine, as root (see docs/site.md).
# Every host but 127.0.0.1 is made unresolvable: a page that needs the network fails here.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
PAGE_TIMEOUT_MS = 60_000
PAGE_BUDGET_MB = 25.0  # a page with plotly.js (4.6 MB) and its figures stays well under it
MATHJAX_TIMEOUT_MS = 30_000

# Per figure: is it a plotly plot, how many traces are visible in its data and drawn in its
# SVG, and its sliders (steps, active step). Drawn trace groups by type: scatter/bar/pie
# ("trace"), heatmap ("hm"), images.
FIGURES_JS = """() => Array.from(document.querySelectorAll('div.plotly-graph-div'), gd => ({
  id: gd.id,
  plotted: gd.classList.contains('js-plotly-plot'),
  visible: (gd._fullData || []).filter(t => t.visible === true).length,
  drawn: gd.querySelectorAll('g.trace, g.hm, g.imagelayer image').length,
  sliders: ((gd._fullLayout || {}).sliders || []).map(s => ({steps: s.steps.length,
                                                            active: s.active})),
}))"""
# The drawn plot without its slider, to compare before and after a slider step.
SIGNATURE_JS = """id => Array.from(document.getElementById(id).querySelectorAll('svg.main-svg'),
  svg => { const c = svg.cloneNode(true);
           c.querySelectorAll('.slider-container').forEach(e => e.remove());
           return c.innerHTML; }).join('')"""
# Viewport point of step `k`'s tick on the first slider, at the rail's height.
TICK_JS = """([id, k]) => { const gd = document.getElementById(id);
  const group = gd.querySelector('.slider-container .slider-group');
  group.scrollIntoView({block: 'center'});
  const ticks = group.querySelectorAll('rect.slider-tick-rect');
  const rail = group.querySelector('rect.slider-rail-rect').getBoundingClientRect();
  if (ticks.length <= k) return null;
  const t = ticks[k].getBoundingClientRect();
  return [t.left + t.width / 2, rail.top + rail.height / 2]; }"""
ACTIVE_JS = "id => document.getElementById(id)._fullLayout.sliders[0].active"
# Per animated figure (one with frames): each frame's traces whose drawn extent leaves the
# axis's range, as plotly holds that range through the animation. Extent on an axis: a
# bar's base and base + length along its value axis (stacked bars: positions only), other
# traces' data as given; categories by their index in the axis's categories (one the axis
# does not list is outside). Numbers packed binary ({dtype, bdata}) are unpacked.
CLIPPED_JS = """id => { const gd = document.getElementById(id), L = gd._fullLayout;
  const frames = ((gd._transitionData || {})._frames) || [], out = [];
  const TYPES = {f8: Float64Array, f4: Float32Array, i4: Int32Array, u4: Uint32Array,
                 i2: Int16Array, u2: Uint16Array, i1: Int8Array, u1: Uint8Array};
  const arr = v => v == null ? [] : v.bdata ? Array.from(new TYPES[v.dtype](
      Uint8Array.from(atob(v.bdata), c => c.charCodeAt(0)).buffer))
    : (Array.isArray(v) || ArrayBuffer.isView(v)) ? Array.from(v) : [v];
  for (const frame of frames) {
    (frame.data || []).forEach((t, k) => {
      const i = frame.traces ? frame.traces[k] : k, full = gd._fullData[i];
      if (!full || !full.xaxis) return;
      const ext = {x: arr(t.x !== undefined ? t.x : gd.data[i].x),
                   y: arr(t.y !== undefined ? t.y : gd.data[i].y)};
      if (full.type === 'bar') {
        const along = full.orientation === 'h' ? 'x' : 'y';
        const stacked = ['stack', 'relative'].includes(L.barmode);
        let base = arr(t.base !== undefined ? t.base : gd.data[i].base);
        if (!base.length) base = [0];
        ext[along] = stacked ? [] : ext[along].flatMap(
          (v, j) => { const b = base.length === 1 ? base[0] : base[j]; return [b, b + v]; });
      }
      for (const letter of ['x', 'y']) {
        const ax = L[letter + 'axis' + full[letter + 'axis'].slice(1)];
        if (!ax || !ext[letter].length) continue;
        const toL = ['category', 'multicategory'].includes(ax.type) ? ax.d2l_noadd : ax.d2l;
        const r = ax.range.map(ax.r2l), lo = Math.min(...r), hi = Math.max(...r);
        const eps = 1e-6 * (hi - lo);
        const at = ext[letter].filter(v => v != null).map(v => toL(v));
        const bad = at.filter(v => !(v >= lo - eps && v <= hi + eps));
        if (bad.length) out.push({frame: frame.name, trace: full.name || String(i),
          axis: ax._name, range: [lo, hi], outside: bad.length, of: at.length});
      }
    });
  }
  return out; }"""
# Resolves once MathJax has typeset the page ("none" without MathJax on the page); false
# (keep waiting) while only its configuration is there.
MATHJAX_DONE_JS = """() => { const M = window.MathJax;
  if (!M) return 'none';
  if (M.startup && M.startup.promise) return M.startup.promise.then(() => 'done');
  if (M.Hub) return new Promise(done => M.Hub.Queue(() => done('done')));
  return false; }"""
# What the reader sees: text outside tables, code and scripts, then the problems in it.
TEXT_JS = r"""() => { const out = {pipes: [], math: [], errors: 0, empty: 0, widgets: 0,
                                 handlers: []};
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const skip = 'table,pre,code,script,style,textarea,mjx-container,.MathJax,' +
               '.MathJax_Preview';
  while (walk.nextNode()) {
    const node = walk.currentNode, text = node.textContent;
    if (!node.parentElement || node.parentElement.closest(skip)) continue;
    if (/(^|\n)\s*\|[^\n]*\|[^\n]*\|\s*(\n|$)/.test(text))
      out.pipes.push(text.trim().slice(0, 80));
    if (/\\\(|\\\[|\$[^$\s][^$\n]*\$/.test(text)) out.math.push(text.trim().slice(0, 80));
  }
  out.errors = document.querySelectorAll('.MathJax_Error, merror, mjx-merror').length;
  out.widgets = document.querySelectorAll(
    'script[type="application/vnd.jupyter.widget-view+json"]').length;
  const shown = 'img,svg,canvas,iframe,table,video,.plotly-graph-div';
  for (const o of document.querySelectorAll('.cell_output .output')) {
    // a folded output (a worked answer in a closed <details>) shows its text when opened
    const text = o.closest('details:not([open])') ? o.textContent : o.innerText;
    if (!text.trim() && !o.querySelector(shown)) out.empty += 1;
  }
  for (const e of document.querySelectorAll('.cell_output, .cell_output *')) {
    for (const a of e.attributes)
      if (/^on/i.test(a.name)) out.handlers.push(`<${e.tagName.toLowerCase()} ${a.name}>`);
  }
  return out; }"""


@dataclasses.dataclass
class Report:
    pages: list[str] = dataclasses.field(default_factory=list)
    figures: int = 0
    sliders_stepped: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"{len(self.pages)} pages, {self.figures} plotly figures, "
                 f"{self.sliders_stepped} slider steps checked, "
                 f"{len(self.problems)} problems"]
        return "\n".join(lines + [f"  {p}" for p in self.problems])


def find_chromium() -> str | None:
    """Debian's chromium, or whatever `chromium` is on PATH; None if there is none."""
    return CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/favicon.ico":  # the browser asks by itself; the site has none
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(root: Path):
    """Serve `root` on 127.0.0.1 (a free port) in a thread; yield the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def check_site(root: Path, *, chromium: str | None = None, start: str = "index.html",
               budget_mb: float = PAGE_BUDGET_MB) -> Report:
    """Crawl `root` from `start` in headless Chromium and report what a reader would hit."""
    from playwright.sync_api import sync_playwright  # only the browser check needs it

    chromium = chromium or find_chromium()
    if not chromium:
        raise FileNotFoundError(f"no chromium at {CHROMIUM} or on PATH: "
                                f"apt-get install -y chromium")
    report = Report()
    with serve(root) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=CHROMIUM_ARGS)
        try:
            todo, seen = [urljoin(base, start)], set()
            while todo:
                url = todo.pop(0)
                if url in seen:
                    continue
                seen.add(url)
                todo += _check_page(browser, base, url, report, root, budget_mb)
        finally:
            browser.close()
    return report


def _check_page(browser, base: str, url: str, report: Report, root: Path,
                budget_mb: float) -> list[str]:
    """Check one page; return the site pages it links to."""
    name = url[len(base):]
    report.pages.append(name)
    problems = []
    path = root / unquote(urlparse(url).path.lstrip("/"))
    if path.is_file() and path.stat().st_size > budget_mb * 2**20:
        problems.append(f"page is {path.stat().st_size / 2**20:.1f} MB, over the budget of "
                        f"{budget_mb:g} MB")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(PAGE_TIMEOUT_MS)

    page.on("request", lambda r: r.url.startswith((base, "data:", "blob:")) or problems.append(
        f"request leaves the site: {r.url[:120]}"))
    page.on("pageerror", lambda err: problems.append(f"JavaScript error: {err}"))
    page.on("console", lambda msg: msg.type == "error" and problems.append(
        f"console error: {msg.text[:300]}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(
        f"HTTP {r.status}: {r.url[len(base):]}"))
    try:
        page.goto(url, wait_until="networkidle")
        links = page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)")
        if not page.title().strip():
            problems.append("the page has no title")
        problems += _link_problems(root, base, links)
        try:
            page.wait_for_function(MATHJAX_DONE_JS, timeout=MATHJAX_TIMEOUT_MS)
        except Exception:  # noqa: BLE001 - reported, the rest of the page is still checked
            problems.append(f"MathJax did not finish in {MATHJAX_TIMEOUT_MS / 1000:g} s")
        problems += _text_problems(page.evaluate(TEXT_JS))
        figures = page.evaluate(FIGURES_JS)
        report.figures += len(figures)
        for fig in figures:
            problems += _figure_problems(fig)
            if fig["plotted"]:
                problems += _clipped(page.evaluate(CLIPPED_JS, fig["id"]), fig["id"])
            if fig["plotted"] and fig["sliders"] and fig["sliders"][0]["steps"] > 1:
                problem = _step_slider(page, fig)
                if problem:
                    problems.append(problem)
                else:
                    report.sliders_stepped += 1
    except Exception as err:  # noqa: BLE001 - a page that cannot be checked is a problem
        problems.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
        links = []
    finally:
        page.close()
    report.problems += [f"{name}: {p}" for p in problems]
    return [_without_fragment(link) for link in links
            if link.startswith(base) and urlparse(link).path.endswith(".html")]


def _text_problems(seen: dict) -> list[str]:
    problems = [f"unrendered Markdown table: {t!r}" for t in seen["pipes"][:3]]
    problems += [f"math left untypeset: {t!r}" for t in seen["math"][:3]]
    if seen["errors"]:
        problems.append(f"{seen['errors']} MathJax errors")
    if seen["widgets"]:
        problems.append(f"{seen['widgets']} widget outputs show nothing (no widget manager "
                        "on a static page: show their text form)")
    if seen["empty"]:
        problems.append(f"{seen['empty']} cell outputs show nothing")
    problems += [f"inline event handler in a cell output: {h}" for h in seen["handlers"][:3]]
    return problems


def _link_problems(root: Path, base: str, links: list[str]) -> list[str]:
    """Local links whose target is missing, or a folder with no index.html."""
    problems = []
    for link in sorted(set(links)):
        if not link.startswith(base):
            continue
        target = root / unquote(urlparse(link).path.lstrip("/"))
        if target.is_dir() and not (target / "index.html").is_file():
            problems.append(f"link to a folder with no page: {link[len(base):]}")
        elif not target.exists():
            problems.append(f"link to nothing: {link[len(base):]}")
    return problems


def _figure_problems(fig: dict) -> list[str]:
    if not fig["plotted"]:
        return [f"figure {fig['id']} was not drawn by plotly"]
    if fig["visible"] == 0 or fig["drawn"] == 0:
        return [f"figure {fig['id']} has {fig['visible']} visible and {fig['drawn']} "
                f"drawn traces"]
    return []


def _clipped(found: list[dict], figure: str) -> list[str]:
    """A problem per animated figure's axis that a frame's traces leave (CLIPPED_JS)."""
    by_axis: dict[str, list[dict]] = {}
    for f in found:
        by_axis.setdefault(f["axis"], []).append(f)
    return [f"figure {figure}: {len(fs)} trace(s) leave {axis}'s range "
            f"[{fs[0]['range'][0]:.4g}, {fs[0]['range'][1]:.4g}] in frame(s) "
            f"{sorted({str(f['frame']) for f in fs})[:4]} (e.g. {fs[0]['outside']} of "
            f"{fs[0]['of']} points of {fs[0]['trace']!r}): the figure is clipped there"
            for axis, fs in by_axis.items()]


def _step_slider(page, fig: dict) -> str:
    """Click the first slider's next step; '' if the plot changed, else the problem."""
    slider = fig["sliders"][0]
    target = (slider["active"] + 1) % slider["steps"]
    before = page.evaluate(SIGNATURE_JS, fig["id"])
    point = page.evaluate(TICK_JS, [fig["id"], target])
    if point is None:
        return f"figure {fig['id']}: slider step {target} has no tick to click"
    page.mouse.click(*point)
    try:
        page.wait_for_function(f"() => ({ACTIVE_JS})({fig['id']!r}) === {target}",
                               timeout=5_000)
    except Exception:  # noqa: BLE001 - reported below with what the slider shows
        return (f"figure {fig['id']}: clicking slider step {target} left it at "
                f"{page.evaluate(ACTIVE_JS, fig['id'])}")
    page.wait_for_timeout(300)  # a step may animate; plotly's default transition is 150 ms
    if page.evaluate(SIGNATURE_JS, fig["id"]) == before:
        return f"figure {fig['id']}: slider step {target} did not change the plot"
    return ""


def _without_fragment(url: str) -> str:
    return url.split("#", 1)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("build"),
                        help="site folder with index.html (default: build/)")
    parser.add_argument("--budget-mb", type=float, default=PAGE_BUDGET_MB,
                        help=f"largest page file in MB (default {PAGE_BUDGET_MB:g})")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        parser.error(f"{args.site / 'index.html'} does not exist: make run first")
    report = check_site(args.site, budget_mb=args.budget_mb)
    print(report)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
