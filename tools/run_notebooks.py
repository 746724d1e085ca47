"""Execute the numbered notebooks headless on CPU and publish them as a static site.

`make run` calls this. Each `notebooks/NN_*.ipynb` runs with papermill on the `python3`
kernel, which must start the interpreter running this script (checked, not assumed), in
its default configuration: the first that `notebooks/runs.yaml` lists for it (its own
parameters cell if it is not listed), with the file's `every_run` parameters under its own
(the file documents its format); `--all` (`make run-all`) runs every configuration
listed. An unchanged configuration is copied from the execution cache, not executed again
(tools/run_cache.py; `--no-cache`).

Nothing is overwritten: every invocation writes a new folder `OUT/runs/<YYYYmmdd-HHMMSS>/`
with the executed notebooks, `runs.json`, and the run's site in `site/`, built by Sphinx
from the executed notebooks once they have all run (tools/build_site.py, docs/conf.py);
`OUT/index.html` shows the newest run's table and lists every earlier run. Delete old runs
by hand, or all of `build/` with `make clean-runs` (`make clean` keeps them).

A progress line per notebook reports it starting, still running (every minute), and done
with its time and status. A failed notebook keeps its partial output (papermill writes the
cells run so far and marks the failing one) and is marked failed in the index. Exit
status: 0 all ran and the site is built; 1 a notebook failed or the site could not be
built (the record's `site_error` says why); 2 a bad runs file or command line, or another
run holds `--out`; 3 `--out` cannot be written (read-only, a full disk; the message names
the file); 128 + N a signal N (SIGINT, SIGTERM: the record says `interrupted` and when).

The pages work offline, also when a run's `site/` is copied elsewhere: plotly figures
carry plotly.js once per page (`mk.plots.show`), plotly's own sliders need no kernel,
MathJax is copied into each site (tools/build_site.py), and no widget manager is loaded
(a widget needs a live kernel; the page shows its text form). The kernels talk over local
sockets (ipc). `tools/check_site.py` checks the pages in headless Chromium.

Runs that cannot lie or collide: the runs file is untrusted text, read with limits (a
regular file of at most `RUNS_MAX_BYTES`, UTF-8: `mk.model.untrusted.read_text`; no YAML alias,
nesting at most `mk.model.untrusted.MAX_DEPTH` deep, integers of at most
`mk.model.untrusted.MAX_DIGITS` digits, keys that are names; a refusal quotes a value cut short:
`mk.model.errors.shown`); a runs.yaml value must be a YAML scalar (or a list or map of them) of the
type the notebook's parameters cell annotates, checked before anything runs; the record
(`runs.json`) says `finished` only once the site is built, and those last steps hold
SIGINT/SIGTERM until they are done; one run at a time per output folder (a lock file; a
second is refused with exit code 2).

Not here: running notebooks in parallel (2 cores); running them with their kernel on a TPU
(benchmarks/tpu_notebooks.py, through `execute`, with MK_TPU=1).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fcntl
import html
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# On the CPU, also on a TPU machine; MK_TPU=1 (benchmarks/tpu_notebooks.py) leaves the
# kernels the chip.
if os.environ.get("MK_TPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("MK_PROFILES", str(ROOT / "profiles"))  # the kernels inherit it

import nbformat  # noqa: E402
import papermill  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_site  # noqa: E402
import chip_record  # noqa: E402
import run_cache  # noqa: E402
import mk.model.errors  # noqa: E402
import mk.course.run  # noqa: E402
import mk.model.untrusted  # noqa: E402
from mk.model.errors import brief, shown  # noqa: E402
from mk.plots import HEADLESS, escape  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from traitlets import default  # noqa: E402

KERNEL = "python3"
PATTERN = "[0-9][0-9]*_*.ipynb"
RUNS_FILE = ROOT / "notebooks" / "runs.yaml"
EVERY_RUN = "every_run"  # runs.yaml's parameters for every run of a notebook assigning them
RUNS_MAX_BYTES = 2**20  # a runs file is a page of configurations, not a data set
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")
HEARTBEAT_SECONDS = 60.0
LOCK = ".make-run.lock"  # in OUT: one `make run` at a time writes there
# The types a runs.yaml value may have: YAML's scalars, and lists and maps of them.
YAML_SCALARS = (str, int, float, bool, type(None))
# -- What to run ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    """One execution of one notebook: a row of the index."""

    notebook: Path
    label: str = ""  # "" when the notebook runs once, unlabelled
    parameters: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The output files' stem: NN_topic or NN_topic-LABEL."""
        stem = self.notebook.stem
        return f"{stem}-{self.label}" if self.label else stem


def notebook_parameters(notebook: Path) -> dict[str, str | None]:
    """{name: annotation text or None} of what the notebook's `parameters` cell assigns at
    top level, in order.

    Read with `ast`, not papermill's line parser, which skips a line whose comment it
    cannot parse (an apostrophe is enough) and would make a real parameter unknown.
    """
    nb = nbformat.read(notebook, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        return {}
    names = {}
    for node in ast.parse(cells[0].source).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        annotation = (ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign)
                      else None)
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and name.id not in names:
                    names[name.id] = annotation
    return names


def _plain(field: str, value) -> None:
    """Refuse a runs.yaml value that is not a YAML scalar (str, int, float, bool, null) or a
    list or map of them: a date, bytes (`!!binary`), a set, ... never reach papermill."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            _plain(f"{field}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{field} has the key {shown(k)}; keys must be strings")
            _plain(f"{field}.{k}", v)
    elif not isinstance(value, YAML_SCALARS):
        raise ValueError(f"{field}={shown(value)} is a {type(value).__name__}; a parameter "
                         "may be a string, integer, float, true/false, null, or a list or "
                         "mapping of them (quote a date to pass it as a string)")


def load_runs(runs_file: Path, notebooks: list[Path], known: list[Path] | None = None
              ) -> list[Run]:
    """The runs of `notebooks`, in their order, as `runs_file` configures them.

    Every key of the file must name a notebook of `known` (default: the numbered notebooks
    beside the file, plus `notebooks`), so a typo cannot silently drop a configuration.
    Raise `ValueError` naming the entry, the value and what is allowed.
    """
    where = str(runs_file)
    if not runs_file.exists():
        raise ValueError(f"runs file {runs_file} does not exist (--runs names a file of "
                         "configurations)")
    text = mk.model.untrusted.read_text(runs_file, "runs file", RUNS_MAX_BYTES)
    try:
        config = yaml.load(text, _UniqueKeyLoader) or {}
    except (yaml.YAMLError, ValueError) as err:  # ValueError: a date such as 2026-02-30
        raise ValueError(f"{where}: not valid YAML ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the top level must map notebook names to lists of "
                         f"configurations, not {type(config).__name__}")
    known = list(known if known is not None else sorted(runs_file.parent.glob(PATTERN)))
    by_stem = {p.stem: p for p in known + list(notebooks)}
    every = config.pop(EVERY_RUN, None)
    unknown = sorted(str(k) for k in config if k not in by_stem)
    if unknown:
        raise ValueError(f"{where}: {brief(unknown)} name no notebook; known notebooks: "
                         f"{brief(sorted(by_stem), 40)}")
    listed = {stem: _entries(where, stem, entries, by_stem[stem])
              for stem, entries in config.items()}
    runs = []
    for notebook in notebooks:
        runs += listed.get(notebook.stem) or [Run(notebook)]
    if every is None:
        return runs
    defaults = _every_run(where, every, list(by_stem.values()))
    return [dataclasses.replace(r, parameters=defaults[r.notebook.stem] | r.parameters)
            for r in runs]


def _every_run(where: str, every, notebooks: list[Path]) -> dict[str, dict]:
    """{notebook stem: the `every_run` parameters its parameters cell assigns}; each
    value checked against that notebook's annotation. A name that no notebook assigns is a
    ValueError (a typo would otherwise reach nothing, silently)."""
    field = f"{where}: {EVERY_RUN}"
    if not isinstance(every, dict) or set(every) != {"parameters"} or not isinstance(
            every["parameters"], dict):
        raise ValueError(f"{field}={shown(every)} must be a mapping with the one key "
                         "'parameters', a mapping of names to values")
    parameters = every["parameters"]
    for key, value in parameters.items():
        _plain(f"{field}.parameters.{key}", value)
    out, used = {}, set()
    for notebook in notebooks:
        allowed = notebook_parameters(notebook)
        mine = {k: v for k, v in parameters.items() if k in allowed}
        for key, value in mine.items():
            if allowed[key] is not None:
                try:
                    mk.course.run.check_parameter(key, value, allowed[key])
                except ValueError as err:
                    raise ValueError(f"{field}.parameters ({notebook.stem}): {err}") from None
        out[notebook.stem], used = mine, used | set(mine)
    unused = sorted(set(parameters) - used)
    if unused:
        raise ValueError(f"{field}.parameters has {brief(unused)}, which no notebook's "
                         "parameters cell assigns")
    return out


def default_runs(runs: list[Run]) -> list[Run]:
    """Each notebook's default configuration: its first run."""
    return [r for i, r in enumerate(runs) if r.notebook not in {q.notebook for q in runs[:i]}]


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key repeated in one mapping (YAML keeps the last silently,
    which would drop a notebook's first configurations), any alias (`*name`: nested ones
    make a "billion laughs", a self-referencing one recursion without end; a runs file
    needs none) and nesting deeper than `mk.model.untrusted.MAX_DEPTH`, before any of it is
    built."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"the alias {mk.model.errors.shown('*' + event.anchor)} is refused "
                            f"(line "
                f"{event.start_mark.line + 1}); a runs file spells every value out",
                event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > mk.model.untrusted.MAX_DEPTH:
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"nesting deeper than the limit of "
                    f"{mk.model.untrusted.MAX_DEPTH} levels (line {event.start_mark.line + 1})",
                    event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, YAML_SCALARS):  # `? [a]`: a list is no name
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a name, not a {type(key).__name__} (line "
                    f"{key_node.start_mark.line + 1})", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is repeated (line "
                    f"{key_node.start_mark.line + 1}); each may appear once",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        digits = len(str(node.value).lstrip("+-").replace("_", ""))
        if digits > mk.model.untrusted.MAX_DIGITS:  # int() of 10**5 digits takes seconds
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits is over the limit of "
                f"{mk.model.untrusted.MAX_DIGITS} (line {node.start_mark.line + 1})",
                node.start_mark)
        return super().construct_yaml_int(node)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def _entries(where: str, stem: str, entries, notebook: Path) -> list[Run]:
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: {stem} must be a non-empty list of configurations, "
                         f"not {shown(entries)}")
    allowed = None  # the notebook's parameter names, read once when first needed
    runs, labels = [], set()
    for i, entry in enumerate(entries):
        field = f"{where}: {stem}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"label", "parameters"}:
            raise ValueError(f"{field}={shown(entry)} must be a mapping with the keys 'label' "
                             f"and 'parameters' only")
        label = entry.get("label", "")
        if label == "" and len(entries) > 1:
            raise ValueError(f"{field} has no label; {stem} has {len(entries)} "
                             f"configurations, each needs one")
        if label != "" and not (isinstance(label, str) and LABEL.fullmatch(label)):
            raise ValueError(f"{field}.label={shown(label)} must be 1-40 letters, digits, '.', "
                             f"'_' or '-', starting with a letter or digit")
        if label in labels:
            raise ValueError(f"{field}.label={label!r} is repeated; labels name the output "
                             f"files, so each must be unique within {stem}")
        labels.add(label)
        parameters = entry.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise ValueError(f"{field}.parameters={shown(parameters)} must be a mapping")
        allowed = allowed if allowed is not None else notebook_parameters(notebook)
        extra = sorted(set(parameters) - set(allowed))
        if extra:
            raise ValueError(f"{field}.parameters has {brief(extra)}, which {notebook.name}'s "
                             f"parameters cell does not assign (it assigns {list(allowed)})")
        for key, value in parameters.items():
            _plain(f"{field}.parameters.{key}", value)
            if allowed[key] is not None:
                try:
                    mk.course.run.check_parameter(key, value, allowed[key])
                except ValueError as err:
                    raise ValueError(f"{field}.parameters: {err}") from None
        runs.append(Run(notebook, label, dict(parameters)))
    return runs


# -- Running one notebook -------------------------------------------------------------------
def check_kernel(kernel_name: str = KERNEL) -> None:
    """Raise unless `kernel_name` starts this interpreter, as jupyter_client resolves it
    (and ipykernel in it: `_PatientKernelManager` starts that through
    tools/kernel_launcher.py)."""
    exe = _PatientKernelManager(kernel_name=kernel_name).format_kernel_cmd()[0]
    if os.path.abspath(exe) != os.path.abspath(sys.executable):
        raise RuntimeError(
            f"kernel {kernel_name!r} starts {exe}, not {sys.executable}; install one into "
            f"this environment: {sys.executable} -m ipykernel install --sys-prefix "
            f"--name {kernel_name}")


class _PatientKernelManager(AsyncKernelManager):
    """Gives a finished kernel 30 s, not 5, to exit: with jax and libtpu loaded on a busy
    machine it can take longer, and libtpu answers the SIGTERM that follows with a
    crash-like stack trace in make run's output. Talks to it over local (ipc) sockets: over
    TCP every kernel warns, rightly, that its traffic is unencrypted. Starts ipykernel
    through tools/kernel_launcher.py, which also runs where there are no IP sockets."""

    @default("shutdown_wait_time")
    def _shutdown_wait_time_default(self):
        return 30.0

    @default("transport")
    def _transport_default(self):
        return "ipc"

    # An ipc socket is a file named <ip>-<port>, and jupyter_client's default ip is
    # "kernel-ipc" in the working directory: two kernels started at once there (make test's
    # two workers) pick the same files and read each other's messages ("Invalid
    # Signature", "Kernel didn't respond"). One private folder per kernel.
    @default("ip")
    def _ip_default(self):
        return os.path.join(tempfile.mkdtemp(prefix="mk-kernel-"), "ipc")

    def cleanup_ipc_files(self) -> None:
        super().cleanup_ipc_files()
        shutil.rmtree(os.path.dirname(self.ip), ignore_errors=True)

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        at = next((i for i in range(1, len(cmd) - 1)
                   if cmd[i:i + 2] == ["-m", "ipykernel_launcher"]), None)
        if at is None:
            raise RuntimeError(f"kernel {self.kernel_name!r} runs {cmd}, not "
                               "python ... -m ipykernel_launcher ...: reinstall it with "
                               f"{sys.executable} -m ipykernel install --sys-prefix "
                               f"--name {self.kernel_name}")
        return cmd[:at] + [str(Path(__file__).resolve().parent / "kernel_launcher.py"),
                           *cmd[at + 2:]]


# No cell of any configuration takes more than a few minutes on this CPU; a cell past this
# is stuck (a kernel once sat idle for 9 minutes at 09's widget cell) and fails the run.
CELL_TIMEOUT_S = 900


def execute(notebook: Path, output: Path, parameters: dict | None = None) -> None:
    """Run `notebook` into `output`; on failure papermill keeps the partial output. Its
    kernel runs headless (`mk.plots.HEADLESS`: a panel of knobs shows its defaults)."""
    os.environ[HEADLESS] = "1"  # the kernel inherits this process's environment
    papermill.execute_notebook(str(notebook), str(output), parameters=parameters or {},
                               kernel_name=KERNEL, cwd=str(notebook.parent),
                               progress_bar=False, kernel_manager_class=_PatientKernelManager,
                               execution_timeout=CELL_TIMEOUT_S)


def failure(err: BaseException) -> str:
    """A failed run's one-line cause, at most 300 characters."""
    # A failed cell carries its exception name and value; anything else (a kernel that
    # died, a missing file) is summarised by its own type.
    if isinstance(err, papermill.PapermillExecutionError):
        text = f"{err.ename}: {err.evalue}"
    else:
        text = f"{type(err).__name__}: {err}"
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def _heartbeat(prefix: str, start: float, every: float = HEARTBEAT_SECONDS):
    """Print `prefix: still running, N s` every `every` seconds until the block ends."""
    done = threading.Event()

    def beat():
        while not done.wait(every):
            print(f"{prefix}: still running, {time.perf_counter() - start:.0f} s", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_one(run: Run, run_dir: Path, prefix: str = "",
            cache: run_cache.Cache | None = None) -> dict:
    """Execute one configuration, or copy its executed notebook from `cache` when nothing it
    depends on changed; return its row of the index (its page is built with the run's
    site, `build_site`)."""
    executed = run_dir / f"{run.name}.ipynb"
    key = cache.key(run.notebook, run.parameters) if cache else None
    cached = cache.get(key, executed) if cache else None
    if cached is not None:
        print(f"{prefix}: ok, cached (executed in {cached:.1f} s)", flush=True)
        build_site.prepare(executed, run.label)
        return _row(run, "ok", "", cached, build_site.page(run.name), cached=True)
    start = time.perf_counter()
    error = ""
    print(f"{prefix}: running", flush=True)
    with _heartbeat(prefix, start):
        try:
            execute(run.notebook, executed, run.parameters)
        except Exception as err:  # noqa: BLE001 - a failed notebook is a result, not a crash
            error = failure(err)
    seconds = time.perf_counter() - start
    status = "failed" if error else "ok"
    print(f"{prefix}: {status} in {seconds:.1f} s" + (f" ({error.splitlines()[0]})"
                                                      if error else ""), flush=True)
    if cache and not error:
        cache.put(key, executed, seconds)
    page = None
    if executed.exists():
        build_site.prepare(executed, run.label)
        page = build_site.page(run.name)
    return _row(run, status, error, seconds, page)


def _row(run: Run, status: str, error: str, seconds: float, page: str | None,
         cached: bool = False) -> dict:
    return {"name": run.name, "notebook": run.notebook.stem, "label": run.label,
            "parameters": run.parameters, "status": status, "error": error,
            "seconds": round(seconds, 2), "page": page, "cached": cached}


# -- The site -------------------------------------------------------------------------------
def new_run_dir(out: Path) -> Path:
    """A new folder `out/runs/<stamp>[-k]`; never one that exists."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, 1000):
        path = runs / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"{runs} has 999 runs stamped {stamp}")


def source_version() -> str:
    """The commit the notebooks ran from, `+changes` if the work tree differs from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + (" +changes" if git("status", "--porcelain", "--untracked-files=no")
                         else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _summary(record: dict, *, building: bool = False) -> str:
    """One line on a run; `building`: said by the run's own site, built once every notebook
    ran (`executed`), before the record is `finished` (which it is only with its site)."""
    rows = record["rows"]
    failed = sum(r["status"] != "ok" for r in rows)
    state = "" if record.get("finished") or (building and record.get("executed")) else (
        f", interrupted ({record['interrupted']})" if record.get("interrupted")
        else ", site not built" if record.get("executed") else ", did not finish")
    return (f"{len(rows) - failed} ok, {failed} failed, "
            f"{sum(r['seconds'] for r in rows):.0f} s{state}; source {record.get('source')}")


def _page(title: str, body: str) -> str:
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:.3em 1em;text-align:left}}
.ok{{color:#070}} .failed,.interrupted{{color:#b00}} code{{font-size:90%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Executed headless on CPU. Run times are wall-clock times on the machine that ran them,
with every Pallas kernel in TPU interpret mode: they say nothing about TPU time.</p>
{body}
</body></html>
"""


def _write_atomic(path: Path, text: str) -> None:
    """Written whole then renamed: an interrupted write never leaves a truncated file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def write_record(run_dir: Path, record: dict) -> None:
    """The run's runs.json."""
    _write_atomic(run_dir / "runs.json", json.dumps(record, indent=1, default=str))


def write_site_index(out: Path) -> None:
    """`out/index.html`: the course map (notebooks/course.yaml: each notebook in course
    order, what it teaches, its configurations, status and time from the newest run that
    ran it, and its run on each chip from the records of `chip_record.load_all`), the
    newest run's table, then every run, newest first."""
    records, unreadable = [], []
    for path in sorted((out / "runs").glob("*/runs.json"), reverse=True):
        try:  # a regular file, bounded; its rows as `_row` writes them
            record = check_record(mk.model.untrusted.load_json(path, "run record"))
        except (OSError, ValueError) as err:  # one bad old run folder
            print(f"warning: {path} is unreadable ({err}); it is listed, not shown",
                  file=sys.stderr, flush=True)
            unreadable.append(f"<li>{escape(path.parent.name)}: runs.json unreadable "
                              f"({escape(str(err)[:200])})</li>")
            continue
        records.append((path.parent.name, record))
    chip_runs, refused = chip_record.load_all()
    for line in refused:
        print(f"warning: a chip record is unreadable ({line}); it is not shown",
              file=sys.stderr, flush=True)

    def course(runs):
        return (build_site.course_map(build_site.load_course(), runs, ROOT / "notebooks",
                                      chip_runs) if build_site.COURSE.is_file() else "") + (
            "".join(f"\n<p>Unreadable chip record: {escape(line)}</p>" for line in refused))
    if not records:
        body = f"{course([])}\n<p>No runs yet: <code>make run</code>.</p>"
    else:
        def site(name):
            return out / "runs" / name / build_site.SITE / "index.html"

        def link(name):
            return (f'<a href="runs/{html.escape(name)}/{build_site.SITE}/index.html">'
                    f"{escape(name)}</a>" if site(name).exists() else escape(name))
        # A run whose site was not built links no page.
        records = [(n, r if site(n).exists() else dict(r, rows=[dict(row, page=None)
                                                              for row in r["rows"]]))
                   for n, r in records]
        name, newest = records[0]
        rows = newest["rows"]
        listing = "\n".join(f"<li>{link(n)}: {escape(_summary(r))}</li>" for n, r in records)
        body = (f"{course(records)}\n<h2>Newest run: {escape(name)} "
                f"({escape(_summary(newest))})</h2>\n"
                f"{build_site.table(rows, f'runs/{name}/')}\n<h2>All runs</h2>\n"
                f"<ul>\n{listing}\n</ul>")
    if unreadable:
        body += "\n<h2>Unreadable runs</h2>\n<ul>\n" + "\n".join(unreadable) + "\n</ul>"
    _write_atomic(out / "index.html", _page("mk notebooks", body))


# What `_row` writes, by type: an older run's record is read back only if it holds these.
ROW_TYPES = {"name": str, "notebook": str, "label": str, "parameters": dict, "status": str,
             "error": str, "seconds": (int, float), "page": (str, type(None)),
             "cached": bool}
STATUSES = ("ok", "failed", "interrupted")


def check_record(record) -> dict:
    """`record` (an older run's runs.json, read back) if its rows are `_row`'s: the index
    puts a row's status in an HTML attribute and sums its seconds. ValueError otherwise."""
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise ValueError("no list of rows")
    for i, row in enumerate(record["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"rows[{i}] is a {type(row).__name__}, not a row")
        for key, kind in ROW_TYPES.items():
            if key != "cached" and key not in row or not isinstance(row.get(key, False), kind):
                raise ValueError(f"rows[{i}].{key}={shown(row.get(key))} is not a "
                                 f"{getattr(kind, '__name__', 'number')}")
        if row["status"] not in STATUSES or isinstance(row["seconds"], bool) or not (
                math.isfinite(row["seconds"])):
            raise ValueError(f"rows[{i}]: status={shown(row['status'])} must be one of "
                             f"{STATUSES}, seconds={shown(row['seconds'])} a finite number")
    return record


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT and SIGTERM until the block ends, then act on the first one (as Ctrl-C
    or SystemExit), also when the block failed because of it (a signal sent to the whole
    process group kills sphinx-build too): the record, the site and the index are written
    whole or not at all. Yields the list of signals caught so far."""
    caught = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            print(f"{signal.Signals(caught[0]).name} arrived while the site was written; "
                  "stopping now", file=sys.stderr, flush=True)
            if caught[0] == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + caught[0])


def run_all(runs: list[Run], out: Path, argv: list[str], cache: run_cache.Cache | None = None
            ) -> tuple[Path, list[dict]]:
    """Run every configuration into a new run folder, then build its site and the index.
    The record says `finished` only once the site is built; those final steps hold
    SIGINT/SIGTERM until they are done."""
    run_dir = new_run_dir(out)
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "executed": None,
              "finished": None, "source": source_version(), "argv": argv, "rows": []}
    width = max(len(run.name) for run in runs)
    try:
        for i, run in enumerate(runs, 1):
            prefix = f"[{i}/{len(runs)}] {run.name:<{width}}"
            start = time.perf_counter()
            try:
                record["rows"].append(run_one(run, run_dir, prefix, cache))
            except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C or SIGTERM
                record["interrupted"] = f"{type(stop).__name__} during {run.name}"
                record["rows"].append(_row(run, "interrupted", record["interrupted"],
                                           time.perf_counter() - start, None))
                raise
            write_record(run_dir, record)
        record["executed"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    finally:
        with deferred_signals() as caught:
            write_record(run_dir, record)
            build_site.write_index(run_dir, record, _summary(record, building=True))
            print(f"building the site: {run_dir / build_site.SITE}", flush=True)
            try:
                build_site.build(run_dir)
                if record["executed"]:
                    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
            except Exception as err:  # the record says why the site is missing
                record["site_error"] = failure(err)
                raise
            finally:
                if caught and not record.get("interrupted"):
                    record["interrupted"] = (f"{signal.Signals(caught[0]).name} during the "
                                             "site build")
                write_record(run_dir, record)
                write_site_index(out)
    return run_dir, record["rows"]


class Busy(RuntimeError):
    """Another run holds the output folder's lock."""


@contextlib.contextmanager
def locked(out: Path):
    """Hold `out`'s lock file for the block; raise `Busy` if another run holds it
    (two runs at once would share the index and the kernels' profiles folder)."""
    handle = open(out / LOCK, "a+")  # noqa: SIM115 - closed below
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise Busy(f"another run is writing to {out} (process "
                               f"{handle.read().strip() or '?'}; lock file {out / LOCK}); "
                               f"wait for it, or pass another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help=f"notebooks to run (default: notebooks/{PATTERN})")
    parser.add_argument("--out", type=Path, default=ROOT / "build",
                        help="site folder (default: build/)")
    parser.add_argument("--runs", type=Path, default=RUNS_FILE,
                        help="configurations per notebook (default: notebooks/runs.yaml)")
    parser.add_argument("--all", action="store_true",
                        help="every configuration (default: each notebook's first)")
    parser.add_argument("--no-cache", action="store_true",
                        help="execute every notebook, even one unchanged since it last ran")
    args = parser.parse_args(argv)
    notebooks = [p.resolve() for p in args.notebooks] or sorted(
        (ROOT / "notebooks").glob(PATTERN))
    if not notebooks:
        parser.error(f"no notebooks match notebooks/{PATTERN}")
    try:
        missing = [str(p) for p in notebooks if not p.is_file()]
        if missing:
            raise ValueError(f"notebooks {missing} named on the command line are not files; "
                             f"name numbered notebooks such as notebooks/{PATTERN}")
        other = [str(p) for p in notebooks if p.suffix != ".ipynb"]
        if other:  # a pair's .py is its jupytext source: papermill runs the .ipynb
            raise ValueError(f"notebooks {other} named on the command line are not .ipynb "
                             f"files; name numbered notebooks such as notebooks/{PATTERN}")
        runs = load_runs(args.runs, notebooks)
        if not args.all:
            runs = default_runs(runs)
        args.out.mkdir(parents=True, exist_ok=True)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: --out {args.out} must be a folder (or a path where one can be made): "
              f"{err.strerror}: {err.filename}", file=sys.stderr)
        return 2
    check_kernel()
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: the interrupted row is
    # marked and both indexes are rewritten before the process exits.
    previous = signal.signal(signal.SIGTERM, _terminate)
    start = time.perf_counter()
    try:
        with locked(args.out):
            run_dir, rows = run_all(runs, args.out, argv,
                                    None if args.no_cache else run_cache.Cache(args.out))
    except Busy as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a read-only or full --out: no traceback, a documented code
        print(f"error: writing under --out {args.out} failed: {err.strerror or err}"
              f"{f': {err.filename}' if err.filename else ''}; the newest run folder "
              "(if any) is not finished", file=sys.stderr)
        return 3
    except build_site.BuildFailed as err:
        print(f"error: the site was not built ({err}); the run's notebooks are in "
              f"{args.out / 'runs'}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = sum(row["status"] != "ok" for row in rows)
    print(f"{len(rows) - failed} ok, {failed} failed in {time.perf_counter() - start:.0f} s; "
          f"outputs: {run_dir}; index: {args.out / 'index.html'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the record says `interrupted`; no traceback
        print("interrupted (SIGINT); the run's record says where", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
