"""Reading a file a user hands in (a runs file, a routing trace, a checkpoint's config.json
and safetensors index, a measured, steps or exactness record, the recorded tables and csv
files a path may replace, a profile) with limits: `read_text` (a regular file only, at
most `max_bytes`, UTF-8 with a bad byte's offset named), `check_depth` (brackets nested at most
`max_depth` deep, counted in linear time before a recursive parser sees them) and
`load_json` (both, then `json.loads`; a key repeated in an object and an integer of more
than `MAX_DIGITS` digits refused), and `rows` (a record that is a list of rows: each an
object of the given keys, each value of its kind). Every refusal is a `ValueError` naming
the file, what was wrong and the limit.

A named pipe or a device is refused before it is opened (`os.stat`; `check_regular` for a
file another library opens, a checkpoint's safetensors), and opened non-blocking besides,
so a file swapped for a pipe between the two cannot hang the reader.
Not here: what the parsed value must hold (each reader checks its own fields) and YAML's
own limits (tools/run_notebooks.py's loader refuses aliases and deep nesting).
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np

from mk.model.errors import shown

MAX_BYTES = 16 * 2**20  # a routing trace of 100 layers x 512 experts is about 0.5 MiB
MAX_DEPTH = 32  # every file mk reads nests a few levels; a deeper one is hostile
MAX_DIGITS = 64  # of a JSON integer: a count or a size has a few dozen at most
CHUNK_BYTES = 2**20  # check_depth's arrays span this much of the text at a time


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (`what` names it in errors), at most
    `max_bytes` bytes; else `ValueError` naming the file and the limit (a missing file is
    `FileNotFoundError`, as `open` raises it)."""
    name = _path(path, what)
    check_regular(name, what)
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        _check_regular(os.fstat(fd), name, what)  # the file opened is the file checked
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {name!r} is larger than the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {name!r} is not UTF-8 text: byte offset {err.start} "
                         f"({data[err.start:err.start + 1]!r}) {err.reason}") from None


def _path(path, what: str) -> str:
    """`path` as a str; a ValueError naming `what` when it is no path (None, a number)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} path={shown(path)} must be a file's path (a str or a "
                         "pathlib.Path)")
    return os.fspath(path)


def check_regular(path: str | os.PathLike, what: str) -> None:
    """Refuse `path` unless it is a regular file (symlinks followed), before anything opens
    it: opening a named pipe blocks until a writer comes. A missing file is
    `FileNotFoundError`."""
    name = _path(path, what)
    _check_regular(os.stat(name), name, what)


def _check_regular(st: os.stat_result, name: str, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                "a named pipe" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
        raise ValueError(f"{what} {name!r} is {kind}; only a regular file is read")


def check_depth(text: str, name: str, what: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON `text` whose arrays and objects nest deeper than `max_depth` (brackets
    inside strings do not count), before a recursive parser would overflow the stack."""
    data = text.encode("utf-8")
    depth = deepest = quotes_before = backslashes_before = 0  # carried from chunk to chunk
    for start in range(0, len(data), CHUNK_BYTES):  # a few arrays of a chunk, not the file
        codes = np.frombuffer(data, np.uint8, min(CHUNK_BYTES, len(data) - start), start)
        # Vectorised, so linear in time: a quote is escaped after an odd run of backslashes;
        # a bracket is inside a string after an odd number of unescaped quotes. (A regular
        # expression for strings retried at every escaped quote: minutes for 100 kB of \".)
        index = np.arange(codes.size, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(codes == ord("\\"), -1, index))
        run = np.empty(codes.size, np.int32)  # the backslashes just before each byte
        run[0] = backslashes_before
        run[1:] = index[:-1] - last_other[:-1] + np.where(last_other[:-1] < 0,
                                                           backslashes_before, 0)
        quotes = (codes == ord('"')) & (run % 2 == 0)
        outside = (np.cumsum(quotes, dtype=np.int32) + quotes_before) % 2 == 0
        step = (((codes == ord("[")) | (codes == ord("{"))) & outside).astype(np.int8) - (
            ((codes == ord("]")) | (codes == ord("}"))) & outside)
        levels = depth + np.cumsum(step, dtype=np.int32)
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        quotes_before += int(quotes.sum())
        tail = codes.size - 1 - int(last_other[-1])  # backslashes ending the chunk
        backslashes_before = tail + (backslashes_before if last_other[-1] < 0 else 0)
    if deepest > max_depth:
        raise ValueError(f"{what} {name!r} nests {deepest} levels deep; the limit is "
                         f"{max_depth}")


def load_json(path: str | os.PathLike, what: str, max_bytes: int = MAX_BYTES,
              max_depth: int = MAX_DEPTH):
    """The JSON value of the file `path`, read with `read_text`'s limits and nested at
    most `max_depth` deep; `ValueError` naming the file for anything else, bad JSON
    included. Nothing in it is evaluated."""
    name = _path(path, what)
    text = read_text(name, what, max_bytes)
    check_depth(text, name, what, max_depth)
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_int=_integer)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {name!r} is not JSON: {err}") from None
    except ValueError as err:  # a repeated key, a long integer
        raise ValueError(f"{what} {name!r}: {err}") from None


INTS = "integers"  # a `rows` kind: a list of them (MXU ids); (INTS, n): n of them (a shape)


def rows(data, path: str | os.PathLike, what: str, fields: dict) -> list[dict]:
    """`data` (`load_json`'s value of the record `path`) as a list of objects, each with
    exactly the keys of `fields` and each value of its kind there (`int`, never a bool;
    `float`, an int too; `str`; `INTS`; `(INTS, n)`, n of them); else ValueError naming
    the file, the row, the field and its kind. What a value holds beyond its kind (a
    choice, a range) is the reader's to check."""
    name = os.fspath(path)
    if not isinstance(data, list):
        raise ValueError(f"{what} {name!r} holds a {type(data).__name__}; expected a list "
                         "of rows")
    for i, row in enumerate(data):
        if not isinstance(row, dict) or set(row) != set(fields):
            got = sorted(row) if isinstance(row, dict) else row
            raise ValueError(f"{what} {name!r}: row {i} must be an object with the keys "
                             f"{sorted(fields)}; got {shown(got, 300)}")
        for field, kind in fields.items():
            wanted = _unlike(row[field], kind)
            if wanted:
                raise ValueError(f"{what} {name!r}: row {i}'s {field}={shown(row[field])} "
                                 f"must be {wanted}")
    return data


def _unlike(value, kind) -> str:
    """What `value` must be when it is not of `rows`' `kind`; "" when it is."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind is int or kind is float:
        return "" if whole or (kind is float and isinstance(value, float)) else \
            ("an integer" if kind is int else "a number")
    if kind is str:
        return "" if isinstance(value, str) else "a string"
    count = kind[1] if isinstance(kind, tuple) else None  # INTS or (INTS, n)
    ok = isinstance(value, list) and count in (None, len(value)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)
    return "" if ok else f"a list of {count or 'any number of'} integers"


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is over the limit "
                         f"of {MAX_DIGITS}")
    return int(text)


def _unique(pairs: list) -> dict:
    """An object's pairs as a dict, refusing a key given twice (json keeps the last
    silently: which of two `counts` was meant?)."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {shown(twice)} appears more than once in one object")
    return out
