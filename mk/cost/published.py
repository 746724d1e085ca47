"""The published decode throughputs the models are set against: `Published` (one row of
data/published.csv, checked as it is read) and `published()` (every row, in file order).

Not here: the models (`mk.cost.perf`, `mk.cost.sim`), setting the rows against them and the words
for every step time (`mk.cost.ledger`).
"""

from __future__ import annotations

import csv
import dataclasses
import io

from mk.model import untrusted
from mk.model.chips import DATA
from mk.cost.perf import check_choice

PUBLISHED_CSV = DATA / "published.csv"
METRICS = ("per_user", "aggregate_as_published")


@dataclasses.dataclass(frozen=True)
class Published:
    """One row of data/published.csv; empty cells are None (batch, context and acceptance
    length None: not stated / not stated / no speculation)."""

    model: str
    preset: str
    system: str
    chips: int | None
    cores: int | None
    tp: int | None
    batch: int | None
    context: int | None  # cached positions of the benchmark run (its scripts, see source)
    acceptance_length: float | None
    tokens_per_s: float
    metric: str  # "per_user" or "aggregate_as_published"
    step_ms: float | None  # derived from tokens_per_s, see the row's notes
    source: str
    notes: str

    def __post_init__(self):
        check_choice("metric", self.metric, METRICS)
        if not self.source.strip():
            raise ValueError(f"published row {self.model} on {self.system} has no source")
        if self.context is not None and self.context < 0:
            raise ValueError(f"published row {self.model} on {self.system}: "
                             f"context={self.context} must be >= 0")


def published(path=PUBLISHED_CSV) -> tuple[Published, ...]:
    """Every row of data/published.csv, in file order (read with `mk.model.untrusted.read_text`'s
    limits; a column missing or a number that is none is named by file and row)."""
    def num(text, kind):
        return kind(text) if text.strip() else None

    rows = []
    text = untrusted.read_text(path, "published table")
    for i, r in enumerate(csv.DictReader(io.StringIO(text, newline=""))):
        try:
            rows.append(Published(
                model=r["model"], preset=r["preset"], system=r["system"],
                chips=num(r["chips"], int), cores=num(r["cores"], int), tp=num(r["tp"], int),
                batch=num(r["batch"], int), context=num(r["context"], int),
                acceptance_length=num(r["acceptance_length"], float),
                tokens_per_s=float(r["tokens_per_s"]), metric=r["metric"],
                step_ms=num(r["step_ms"], float), source=r["source"], notes=r["notes"]))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: row {i + 1}: {type(err).__name__} {err}") from None
    return tuple(rows)
