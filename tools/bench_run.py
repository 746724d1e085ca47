"""Time `make run` to a first page: a cold run into an empty folder, then a second with
nothing changed (every configuration from the execution cache).

    python tools/bench_run.py                      # the default `make run` (minutes)
    python tools/bench_run.py notebooks/00b_*.ipynb notebooks/13_*.ipynb
    python tools/bench_run.py --all                # `make run-all`

Prints one line per pass (wall-clock seconds, rows ok/failed, site size in MB) and
`--json` writes them to a file. Runs into a temporary folder (`--out` to keep it); the
times are those of this machine, with every kernel in TPU interpret mode: never TPU time.

Not here: what the notebooks compute (they run as `make run` runs them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_notebooks  # noqa: E402


def one_pass(notebooks: list[str], out: Path, all_configurations: bool) -> dict:
    argv = [*notebooks, "--out", str(out)] + (["--all"] if all_configurations else [])
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_notebooks.main(argv)
    seconds = time.perf_counter() - start
    newest = sorted((out / "runs").iterdir())[-1]
    rows = json.loads((newest / "runs.json").read_text(encoding="utf-8"))["rows"]
    site_mb = sum(p.stat().st_size for p in (newest / "site").rglob("*") if p.is_file()) / 2**20
    return {"seconds": round(seconds, 1), "exit": code, "rows": len(rows),
            "ok": sum(r["status"] == "ok" for r in rows),
            "cached": sum(bool(r.get("cached")) for r in rows), "site_mb": round(site_mb, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebooks (default: all of them)")
    parser.add_argument("--all", action="store_true", help="every configuration")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp folder)")
    parser.add_argument("--json", type=Path, help="write the two passes here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mk-bench-") as tmp:
        out = args.out or Path(tmp)
        passes = {}
        for name in ("cold", "unchanged"):
            passes[name] = one_pass(args.notebooks, out, args.all)
            p = passes[name]
            print(f"{name}: {p['seconds']:.1f} s, {p['ok']}/{p['rows']} ok, {p['cached']} "
                  f"cached, site {p['site_mb']:.1f} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(passes, indent=1))
    return max(p["exit"] for p in passes.values())


if __name__ == "__main__":
    sys.exit(main())
