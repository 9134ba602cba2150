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
    if value is None or isinstance(value, bool | str):
        return value
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
            out[key] = ensure_json(item, f"{path}[{key!r}]")
        return out
    raise InvalidJobArgument(
        path, f"is a {type(value).__module__}.{type(value).__qualname__}, which does not "
        "round-trip through JSON; pass its JSON form (e.g. an id or an ISO string)")
