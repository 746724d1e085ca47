"""The text of error messages that echo untrusted values (a checkpoint's config.json, a
runs file): `shown` (a value's repr, bounded) and `brief` (a sequence cut short). Every
module that names a bad value in an error uses these. Not here: the checks themselves
(`mk.model.config`, `mk.kinds`, each module's own)."""

from __future__ import annotations


def shown(value, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters, for an error message echoing a value read
    from a checkpoint or a runs file: repr escapes newlines and control characters, the
    cut bounds its length; markup (`<`, backticks) is for whatever shows the message to
    escape (`mk.plots` on the site)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def brief(items, limit: int = 10) -> str:
    """A sequence for an error message: all of it when short, else its first `limit` items
    and how many more there are (a 10**6-layer config must not give a 10**6-item error);
    each item `shown`."""
    if len(items) <= limit:
        return shown(items, 40 * limit)
    head = ", ".join(shown(item) for item in list(items[:limit]))
    return f"({head}, ... {len(items) - limit} more, {len(items)} in all)"
