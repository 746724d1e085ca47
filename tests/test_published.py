"""mk.cost.published: the rows of data/published.csv parse, with their sources, step times and
contexts (tests/test_ledger.py sets them against the models)."""

import dataclasses
import os

import pytest

from mk.cost.published import PUBLISHED_CSV, published


def test_published_rows_parse_with_sources_and_consistent_step_times():
    rows = published()
    assert len(rows) == 15
    for r in rows:
        assert r.source and r.tokens_per_s > 0
        if r.step_ms is not None:
            tokens = r.acceptance_length or r.batch
            assert r.step_ms == pytest.approx(1e3 * tokens / r.tokens_per_s, abs=0.006)


def test_published_rows_carry_the_context_their_source_states():
    """The benchmark scripts' context is a column (1152 for Kimi, 2048 for Qwen), the same
    number the row's source quotes; a system whose setup is not stated has none."""
    rows = published()
    for r in rows:
        if r.system == "cerebras":
            assert r.context is None
            continue
        want = 1152 if r.model == "Kimi K3" else 2048
        assert r.context == want and f"context {want} (" in r.source, (r.model, r.system)
    with pytest.raises(ValueError, match="context=-1 must be >= 0"):
        dataclasses.replace(rows[0], context=-1)


def test_a_published_table_handed_in_is_read_with_limits_and_a_bad_row_named(tmp_path):
    """Issue 65: a number that is none was a bare ValueError naming no file or row, a
    pipe would block for ever."""
    text = PUBLISHED_CSV.read_text(encoding="utf-8")
    header = text.splitlines()[0]
    path, pipe = tmp_path / "published.csv", tmp_path / "pipe.csv"
    path.write_text(header + "\n" + ",".join("x" for _ in header.split(",")) + "\n")
    with pytest.raises(ValueError, match=r"published\.csv: row 1: ValueError invalid literal "
                                         r"for int\(\) with base 10: 'x'"):
        published(path)
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=r"published table '.*pipe\.csv' is a named pipe"):
        published(pipe)
