"""Execute the numbered notebooks headless on CPU and publish them as static HTML.

`make run` calls this. Each `notebooks/NN_*.ipynb` runs with papermill on the `python3`
kernel, which must start the interpreter running this script (checked, not assumed). The
executed notebook and its HTML export land in `build/notebooks/`, and `build/index.html`
lists every notebook with its status and run time. A failed notebook keeps its partial
output and is marked failed; the exit code is non-zero if any notebook failed.

Not here: per-notebook parameter sets, skipping unchanged notebooks.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import nbformat  # noqa: E402
import papermill  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402
from nbconvert import HTMLExporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "python3"
PATTERN = "notebooks/[0-9][0-9]*_*.ipynb"


def check_kernel(kernel_name: str = KERNEL) -> None:
    """Raise unless `kernel_name` starts this interpreter, as jupyter_client resolves it."""
    exe = KernelManager(kernel_name=kernel_name).format_kernel_cmd()[0]
    if os.path.abspath(exe) != os.path.abspath(sys.executable):
        raise RuntimeError(
            f"kernel {kernel_name!r} starts {exe}, not {sys.executable}; install one into "
            f"this environment: {sys.executable} -m ipykernel install --sys-prefix "
            f"--name {kernel_name}")


def execute(notebook: Path, output: Path, parameters: dict | None = None) -> None:
    """Run `notebook` into `output`; on failure papermill keeps the partial output."""
    papermill.execute_notebook(str(notebook), str(output), parameters=parameters or {},
                               kernel_name=KERNEL, cwd=str(notebook.parent),
                               progress_bar=False)


def _failure(err: Exception) -> str:
    # A failed cell carries its exception name and value; anything else (a kernel that
    # died, a missing file) is summarised by its own type.
    if isinstance(err, papermill.PapermillExecutionError):
        text = f"{err.ename}: {err.evalue}"
    else:
        text = f"{type(err).__name__}: {err}"
    return text if len(text) <= 300 else text[:297] + "..."


def run_one(notebook: Path, out_dir: Path) -> dict:
    """Execute one notebook and export it to HTML; return its row of the index."""
    executed = out_dir / notebook.name
    start = time.perf_counter()
    error = ""
    try:
        execute(notebook, executed)
    except Exception as err:  # noqa: BLE001 - a failed notebook is a result, not a crash
        error = _failure(err)
    seconds = time.perf_counter() - start
    page = executed.with_suffix(".html")
    if executed.exists():
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
        page.write_text(body, encoding="utf-8")
    return {"name": notebook.stem, "ok": not error, "error": error, "seconds": seconds,
            "page": page if page.exists() else None}


def write_index(rows: list[dict], index: Path) -> None:
    """A plain static page: one row per notebook with a link, its status and run time."""
    lines = []
    for row in rows:
        name = html.escape(row["name"])
        link = (f'<a href="{html.escape(row["page"].relative_to(index.parent).as_posix())}">'
                f"{name}</a>" if row["page"] else name)
        status = "ok" if row["ok"] else f"failed: {html.escape(row['error'])}"
        css = "ok" if row["ok"] else "failed"
        lines.append(f'<tr><td>{link}</td><td class="{css}">{status}</td>'
                     f'<td>{row["seconds"]:.1f} s</td></tr>')
    index.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>mk notebooks</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:.3em 1em;text-align:left}}
.ok{{color:#070}} .failed{{color:#b00}}</style></head>
<body><h1>mk notebooks</h1>
<p>Executed headless on CPU ({html.escape(time.strftime("%Y-%m-%d %H:%M"))}). Run times are
wall-clock times on this machine, with any Pallas kernel in interpret mode: they say nothing
about TPU time.</p>
<table><tr><th>notebook</th><th>status</th><th>run time</th></tr>
{chr(10).join(lines)}
</table></body></html>
""", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help=f"notebooks to run (default: {PATTERN})")
    parser.add_argument("--out", type=Path, default=ROOT / "build",
                        help="output folder (default: build/)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(ROOT.glob(PATTERN))
    if not notebooks:
        parser.error(f"no notebooks match {PATTERN}")
    check_kernel()
    out_dir = args.out / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for notebook in notebooks:
        row = run_one(notebook.resolve(), out_dir)
        rows.append(row)
        status = "ok" if row["ok"] else f"FAILED ({row['error'].splitlines()[0]})"
        print(f"{row['name']:<40} {row['seconds']:7.1f} s  {status}", flush=True)
    write_index(rows, args.out / "index.html")
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed} ok, {failed} failed; index: {args.out / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
