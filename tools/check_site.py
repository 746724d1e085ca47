"""Check a site written by tools/run_notebooks.py in headless Chromium, as a reader sees it.

`make check-site` runs it on `build/`; tests/test_site.py runs it on a small site it builds.
A static server on 127.0.0.1 serves the site; Debian's Chromium (no browser download),
driven by Playwright, opens `index.html` and every page it links to, run indexes included.
On each page it reports:
- JavaScript errors (uncaught exceptions and console errors, failed loads included), local
  requests that fail, and any request leaving the site (refused: the pages must work
  offline);
- every plotly figure that did not render (no `.js-plotly-plot`, no visible trace in its
  data, or no drawn trace in its SVG);
- for every figure with a slider: a click on the next step's tick must make the slider
  active there and change the drawn plot (the slider works without a kernel).

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
from urllib.parse import urljoin, urlparse

CHROMIUM = "/usr/bin/chromium"
# What Chromium needs on this closed-network machine, as root (see the README).
# Every host but 127.0.0.1 is made unresolvable: a page that needs the network fails here.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
PAGE_TIMEOUT_MS = 60_000

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


def check_site(root: Path, *, chromium: str | None = None, start: str = "index.html"
               ) -> Report:
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
                todo += _check_page(browser, base, url, report)
        finally:
            browser.close()
    return report


def _check_page(browser, base: str, url: str, report: Report) -> list[str]:
    """Check one page; return the site pages it links to."""
    name = url[len(base):]
    report.pages.append(name)
    problems = []
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
        figures = page.evaluate(FIGURES_JS)
        report.figures += len(figures)
        for fig in figures:
            problems += _figure_problems(fig)
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


def _figure_problems(fig: dict) -> list[str]:
    if not fig["plotted"]:
        return [f"figure {fig['id']} was not drawn by plotly"]
    if fig["visible"] == 0 or fig["drawn"] == 0:
        return [f"figure {fig['id']} has {fig['visible']} visible and {fig['drawn']} "
                f"drawn traces"]
    return []


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
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        parser.error(f"{args.site / 'index.html'} does not exist: make run first")
    report = check_site(args.site)
    print(report)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
