"""The record of the notebooks' runs on a chip (issue 62): `<chip>-notebooks.json` in
`mk.measure.measure.MEASURED`, written by benchmarks/tpu_notebooks.py a notebook at a time, read
back for the next part of a run and for the course map (tools/build_site.py).

A record is the run's provenance (`mk.measure.measure.provenance()`: chip, device kind, jax, libtpu,
commit, when) with a `label` and `rows`, one per notebook: its status (`STATUSES`), seconds,
how many of its code cells ran of how many, the failing cell (its number among the code
cells and its first line) and the error, cut to `MAX_TEXT` characters, and the row's own
commit, time and timeout. Records are untrusted input: read through `mk.model.untrusted.load_json`
and refused by `check` unless every field has its type and range (the `ValueError` names the
field); whoever shows them escapes them.

Here: `STATUSES`, `MAX_TEXT`, `FIELDS`, `ROW_FIELDS`, `path_for`, `check`, `load`,
`load_all`, `merged`, `write`. Not here: running notebooks (benchmarks/tpu_notebooks.py),
drawing the map (tools/build_site.py's `course_map`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from mk.model import untrusted
from mk.model.errors import brief, shown
from mk.measure.measure import MEASURED

SUFFIX = "-notebooks.json"
STATUSES = ("ok", "failed", "timeout")
MAX_TEXT = 600  # an error or a cell's first line; the executed notebook keeps the rest
NOTEBOOK = re.compile(r"[0-9][0-9][A-Za-z0-9_]{0,80}")  # a numbered notebook's stem
TEXT, OPTIONAL_TEXT = (str,), (str, type(None))
FIELDS = dict(chip=OPTIONAL_TEXT, device_kind=TEXT, jax=TEXT, libtpu=TEXT, commit=TEXT,
              when=TEXT, label=TEXT, rows=(list,))
ROW_FIELDS = dict(notebook=TEXT, status=TEXT, seconds=(int, float), cells_run=(int,),
                  cells=(int,), failing_cell=(int, type(None)), failing_line=TEXT,
                  error=TEXT, timeout_s=(int, float), commit=TEXT, when=TEXT)
VERSIONS = ("chip", "jax", "libtpu")  # rows of a record with other values are not kept


def path_for(chip: str) -> Path:
    """Where a chip's record lives: MEASURED/<chip>-notebooks.json."""
    return MEASURED / f"{chip}{SUFFIX}"


def _typed(where: str, at: str, data, fields: dict) -> None:
    """Refuse `data` (the field path `at` of the file `where`) unless it has exactly
    `fields`, each of its types, text within `MAX_TEXT`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {at or 'the record'} is a {type(data).__name__}, not an "
                         "object")
    missing, extra = sorted(set(fields) - set(data)), sorted(set(data) - set(fields))
    if missing or extra:
        raise ValueError(f"{where}: {at or 'the record'} has missing fields {missing}, "
                         f"unknown fields {brief(extra)}")
    for name, kinds in fields.items():
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"{where}: {at}{name}={shown(value)} must be of type "
                             f"{' or '.join(k.__name__ for k in kinds)}")
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise ValueError(f"{where}: {at}{name} has {len(value)} characters; the limit "
                             f"is {MAX_TEXT}")


def check(record, where: str = "record") -> dict:
    """`record` if it is a notebooks record (`FIELDS`, rows of `ROW_FIELDS`, one row per
    notebook); else `ValueError` naming `where`, the field, its value and what it must be."""
    _typed(where, "", record, FIELDS)
    seen = set()
    for i, row in enumerate(record["rows"]):
        at = f"rows[{i}]"
        _typed(where, f"{at}.", row, ROW_FIELDS)
        at = f"{where}: {at}"
        if not NOTEBOOK.fullmatch(row["notebook"]) or row["notebook"] in seen:
            raise ValueError(f"{at}.notebook={shown(row['notebook'])} must be a numbered "
                             "notebook's name, once per record")
        seen.add(row["notebook"])
        if row["status"] not in STATUSES:
            raise ValueError(f"{at}.status={shown(row['status'])} must be one of {STATUSES}")
        for name in ("seconds", "timeout_s"):
            if not (math.isfinite(row[name]) and row[name] >= 0):
                raise ValueError(f"{at}.{name}={shown(row[name])} must be a finite number "
                                 ">= 0")
        if not 0 <= row["cells_run"] <= row["cells"]:
            raise ValueError(f"{at}: cells_run={row['cells_run']} must be in [0, "
                             f"cells={row['cells']}]")
        failing = row["failing_cell"]
        if row["status"] == "ok" and failing is not None:
            raise ValueError(f"{at}.failing_cell={failing} given for a notebook that ran")
        if failing is not None and not 1 <= failing <= row["cells"]:
            raise ValueError(f"{at}.failing_cell={failing} must be in [1, "
                             f"cells={row['cells']}]")
    return record


def load(path: str | os.PathLike) -> dict:
    """The record at `path`, read with `mk.model.untrusted`'s limits and `check`ed."""
    return check(untrusted.load_json(path, "a notebooks record"), os.fspath(path))


def load_all(folder: Path | None = None) -> tuple[list[dict], list[str]]:
    """Every chip's `*-notebooks.json` record in `folder` (default `MEASURED`), and a line
    for each that was refused (an interpret record, `chip` null, is never a chip's)."""
    records, refused = [], []
    for path in sorted((folder or MEASURED).glob(f"*{SUFFIX}")):
        try:
            record = load(path)
            if record["chip"] is None:
                raise ValueError(f"{path}: chip=None, not a chip's record")
            records.append(record)
        except (OSError, ValueError) as err:
            refused.append(f"{path.name}: {str(err)[:MAX_TEXT]}")
    return records, refused


def merged(earlier: dict | None, made: dict, rows: list[dict]) -> dict:
    """The record `made` (provenance and label) with `rows`, and the rows of `earlier`
    for notebooks `rows` does not have when it is of the same chip and versions; rows in
    notebook order."""
    kept = {}
    if earlier is not None and all(earlier[f] == made[f] for f in VERSIONS):
        kept = {row["notebook"]: row for row in earlier["rows"]}
    kept |= {row["notebook"]: row for row in rows}
    return check(dict(made, rows=[kept[name] for name in sorted(kept)]))


def write(path: Path, record: dict) -> None:
    """`record` (checked) to `path`, written whole then renamed: a run killed at its time
    limit never leaves half a record."""
    text = json.dumps(check(record, os.fspath(path)), indent=1) + "\n"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
