"""Refuse values that would not come back from a JSON column as they went in."""

from __future__ import annotations

import math
from typing import Any

from .exceptions import InvalidJobArgument


def ensure_json(value: Any, path: str) -> Any:
    """Return ``value`` with tuples as lists, or raise InvalidJobArgument naming ``path``.

    Tuples become lists (as django.tasks normalizes them); anything else that JSON would
    change or cannot hold (dates, sets, objects, non-string keys, NaN) is refused, so a
    handler never receives something other than what its caller passed.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value, path)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobArgument(path, f"{value!r} has no JSON form")
        return value
    if isinstance(value, list | tuple):
        return [ensure_json(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidJobArgument(
                    f"{path}[{key!r}]",
                    f"has a {type(key).__name__} key, which JSON would turn into a string")
            _text(key, f"{path}[{key!r}]")
            out[key] = ensure_json(item, f"{path}[{key!r}]")
        return out
    raise InvalidJobArgument(
        path, f"is a {type(value).__module__}.{type(value).__qualname__}, which does not "
        "round-trip through JSON; pass its JSON form (e.g. an id or an ISO string)")


def _text(value: str, path: str) -> str:
    """PostgreSQL's jsonb cannot hold a NUL character, and no database a lone surrogate
    (it has no UTF-8 form): refuse both here rather than as an error the database names
    in its own words, which would also abort the caller's transaction."""
    if "\x00" in value:
        raise InvalidJobArgument(path, "contains a NUL character (\\u0000), which PostgreSQL's "
                                       "jsonb cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidJobArgument(path, f"is not valid Unicode ({e.reason} at index {e.start})") from None
    return value
