"""Run the notebooks with their kernel on the chip (issue 62), each in its default
configuration, and record how each went: data/measured/<chip>-notebooks.json (or
$MK_MEASURED; tools/chip_record.py holds its fields), which the course map shows.

Each notebook runs as `make run` runs it (tools/run_notebooks.py's `load_runs`,
`default_runs` and `execute`: papermill, the kernel over ipc sockets, headless), but with
MK_TPU=1 and no JAX_PLATFORMS, so the kernel's JAX is the TPU's and `backend="auto"` is
Mosaic; no site is built. Each runs in a process of its own, stopped with its kernel after
`--timeout` seconds (one program holds the chip: the next notebook's kernel needs it back).
The record is rewritten after every notebook, keeping the rows of earlier calls with the
same chip and versions, so a run fits 600-s calls a few notebooks at a time (`--budget`:
start a notebook only while its timeout fits; `--missing`: skip those with a row of this
commit; the same command again, the record carried back, goes on where it stopped):

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_notebooks.py [notebooks/NN_x.ipynb ...]
        [--timeout 540] [--budget 520] [--missing]

A row holds the status (ok, failed, timeout), seconds, the code cells that ran of the
notebook's own (papermill's injected parameters not counted; a notebook stopped at its
timeout counts what papermill last saved), the failing cell's number and first line, and
the error. The executed notebooks go to `--out` (build/chip-notebooks/). $MK_MEASURED is
this script's alone: the notebooks read the committed records.

On a CPU it refuses (nothing here would be a chip's); --interpret runs the notebooks in
interpret mode into the record --json names, never a TPU's file nor under data/measured.
Not here: the wheels the chip machine lacks (tools/chip_wheels.py), the map
(tools/build_site.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make `mk` and the tools importable
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import nbformat  # noqa: E402
import psutil  # noqa: E402

import chip_record  # noqa: E402
import run_notebooks  # noqa: E402
from mk.measure import measure  # noqa: E402

PROVENANCE = ("commit", "when")  # a row's own: rows of earlier calls are kept
TIMEOUT_S = 540.0  # a notebook's, within one 600-s call
GRACE_S = 20.0  # for a stopped notebook's process to end before it is killed
INJECTED = "injected-parameters"


def code_cells(nb) -> list:
    """The notebook's own code cells (not papermill's injected parameters)."""
    return [c for c in nb.cells if c.cell_type == "code"
            and INJECTED not in c.get("metadata", {}).get("tags", [])]


def cells_row(source: Path, executed: Path) -> dict:
    """cells, cells_run, failing_cell and failing_line of an executed notebook, from
    papermill's per-cell status (the source's cells if it wrote none): the failing cell is
    the first code cell not completed (1-based), where an error or a timeout stopped it."""
    nb = nbformat.read(executed if executed.is_file() else source, as_version=4)
    cells = code_cells(nb)
    status = [c.get("metadata", {}).get("papermill", {}).get("status") for c in cells]
    failing = next((i for i, s in enumerate(status) if s != "completed"), None)
    return dict(cells=len(cells), cells_run=status.count("completed"),
                failing_cell=None if failing is None else failing + 1,
                failing_line="" if failing is None else _cut(
                    cells[failing].source.strip().partition("\n")[0]))


def _cut(text: str) -> str:
    limit = chip_record.MAX_TEXT
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_child(run: run_notebooks.Run, executed: Path, timeout: float) -> dict:
    """One notebook executed by this script's `--one` in a process of its own, stopped
    with its kernel after `timeout` seconds: its row (no provenance)."""
    argv = [sys.executable, __file__, "--one", str(run.notebook), "--executed",
            str(executed), "--parameters", json.dumps(run.parameters)]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=notebook_env())
    try:
        out, err = child.communicate(timeout=timeout)
        status = "ok"
    except subprocess.TimeoutExpired:
        stop(child)
        out, err = child.communicate()
        status = "timeout"
    seconds = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.startswith("{")]
    error = json.loads(lines[-1])["error"] if lines else (
        f"exit {child.returncode}: {err.strip()[-400:]}")
    row = dict(notebook=run.notebook.stem, seconds=round(seconds, 1), timeout_s=timeout)
    row |= cells_row(run.notebook, executed)
    if status == "timeout":
        error = f"no result within {timeout:.0f} s"
    elif error or row["cells_run"] < row["cells"]:
        status = "failed"
    return row | dict(status=status, error=_cut(error))


def notebook_env() -> dict:
    """The notebooks' environment: this one without MK_MEASURED, which says where this
    script's record goes. A notebook reads the committed records (notebook 09 the steps
    record): pointed at the call's output folder, it found none there on the chip."""
    return {k: v for k, v in os.environ.items() if k != "MK_MEASURED"}


def stop(child: subprocess.Popen) -> None:
    """End `child` and the processes it started (its kernel runs in a session of its
    own), each by its id: SIGTERM, then SIGKILL after `GRACE_S`."""
    try:
        family = [psutil.Process(child.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)


def _one(notebook: Path, executed: Path, parameters: dict) -> None:
    """`--one`: execute `notebook` into `executed`; print {"error": ...} ("" if it ran)."""
    try:
        run_notebooks.execute(notebook, executed, parameters)
        error = ""
    except Exception as err:  # noqa: BLE001 - a failed notebook is a result
        error = run_notebooks.failure(err)
    print(json.dumps(dict(error=error)), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path,
                   help=f"notebooks to run (default: notebooks/{run_notebooks.PATTERN})")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per notebook")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds of this call: a notebook starts only if its timeout fits")
    p.add_argument("--missing", action="store_true",
                   help="only notebooks the record has no row of this commit for")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: interpret mode, into --json (not a chip's record)")
    p.add_argument("--json", type=Path, help="where the record goes")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "chip-notebooks",
                   help="folder of the executed notebooks")
    p.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a notebook's own process
    p.add_argument("--executed", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--parameters", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        _one(args.one, args.executed, args.parameters)
        return 0
    if not args.timeout > 0:
        p.error(f"--timeout={args.timeout} must be > 0")
    start = time.perf_counter()
    try:  # this process never opens the chip
        made = measure.labelled(measure.provenance_apart(), interpret=args.interpret,
                                json_path=args.json, verb="ran")
    except ValueError as err:
        p.error(str(err))
    notebooks = [n.resolve() for n in args.notebooks] or sorted(
        (ROOT / "notebooks").glob(run_notebooks.PATTERN))
    try:
        runs = run_notebooks.default_runs(run_notebooks.load_runs(run_notebooks.RUNS_FILE,
                                                                  notebooks))
    except ValueError as err:
        p.error(str(err))
    run_notebooks.check_kernel()
    path = args.json or chip_record.path_for(made["chip"])
    path.parent.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = chip_record.load(path) if path.exists() else None
    if args.missing and earlier is not None:
        done = {r["notebook"] for r in chip_record.merged(earlier, made, [])["rows"]
                if r["commit"] == made["commit"]}
        runs = [run for run in runs if run.notebook.stem not in done]
    rows = []
    for i, run in enumerate(runs, 1):
        if time.perf_counter() - start + args.timeout > args.budget:
            print(f"budget of {args.budget:.0f} s spent; left: "
                  f"{' '.join(r.notebook.stem for r in runs[i - 1:])}", flush=True)
            break
        print(f"[{i}/{len(runs)}] {run.notebook.stem}: running", flush=True)
        row = run_child(run, args.out / run.notebook.name, args.timeout)
        rows.append(row | {f: made[f] for f in PROVENANCE})
        print(f"[{i}/{len(runs)}] {run.notebook.stem}: {row['status']} in "
              f"{row['seconds']} s, {row['cells_run']}/{row['cells']} cells"
              + (f" ({row['error']})" if row["error"] else ""), flush=True)
        earlier = chip_record.merged(earlier, made, rows)
        chip_record.write(path, earlier)
    print(f"wrote {path}" if rows else f"nothing run; {path} is as it was")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
