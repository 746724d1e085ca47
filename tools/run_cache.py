"""The execution cache of `make run`: an unchanged notebook is not executed again.

A configuration's key is a SHA-256 of everything its executed notebook depends on that this
checkout holds: the notebook file, its parameters, every file under `mk/`, `data/` and
`benchmarks/` (what notebooks import and read), `pyproject.toml` (the pins) and the Python
version. `OUT/cache/<key>.ipynb` is the executed notebook of a run that succeeded with that
key; a later run with the same key copies it instead of executing (its row says `cached`
and the seconds the execution took). Failed runs are never cached. `--no-cache` executes
everything; deleting `OUT/cache/` forgets it.

Not here: anything outside the checkout (the installed packages beyond the pins, the
machine): a changed environment with the same pins reuses results, `--no-cache` does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("mk", "data", "benchmarks")  # folders whose every file is part of the key
FILES = ("pyproject.toml",)
FOLDER = "cache"  # inside OUT


def _source_digest(root: Path = ROOT) -> str:
    digest = hashlib.sha256(sys.version.encode())
    paths = [p for folder in SOURCES for p in (root / folder).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    paths += [root / name for name in FILES if (root / name).is_file()]
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class Cache:
    """Executed notebooks by key, in `out/cache/`; the sources are hashed once."""

    def __init__(self, out: Path, root: Path = ROOT):
        self.folder = out / FOLDER
        self.sources = _source_digest(root)

    def key(self, notebook: Path, parameters: dict) -> str:
        digest = hashlib.sha256(self.sources.encode())
        digest.update(notebook.read_bytes())
        digest.update(json.dumps(parameters, sort_keys=True).encode())
        return digest.hexdigest()[:32]

    def get(self, key: str, target: Path) -> float | None:
        """Copy the cached notebook of `key` to `target`; its execution seconds, or None (a
        miss: no entry, or one whose record is not `put`'s, which is executed again)."""
        cached = self.folder / f"{key}.ipynb"
        meta = self.folder / f"{key}.json"
        if not (cached.is_file() and meta.is_file()):
            return None
        try:
            seconds = float(json.loads(meta.read_text(encoding="utf-8"))["seconds"])
        except (ValueError, KeyError, TypeError):  # edited or damaged by hand: not trusted
            return None
        if not math.isfinite(seconds) or seconds < 0:
            return None
        shutil.copyfile(cached, target)
        return seconds

    def put(self, key: str, executed: Path, seconds: float) -> None:
        """Keep `executed` (a successful run) under `key`; written whole, then renamed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f"{key}.ipynb.partial"
        shutil.copyfile(executed, partial)
        partial.replace(self.folder / f"{key}.ipynb")
        (self.folder / f"{key}.json.partial").write_text(json.dumps({"seconds": seconds}))
        (self.folder / f"{key}.json.partial").replace(self.folder / f"{key}.json")
