"""Refuse values that would not come back from a JSON column as they went in.

The limits are the narrowest of the supported databases, so that a value accepted on one
comes back the same from every other:

- nesting: MariaDB's JSON check refuses a document nested 32 deep, so a stored document
  (the args list, the kwargs dict, a result, a cursor) nests at most ``MAX_DEPTH`` lists
  and dicts, itself included;
- integers: MySQL's JSON type keeps integers outside 64 bits as doubles, so ints must lie
  within ``MIN_INT``..``MAX_INT``;
- floats: PostgreSQL's jsonb prints a float of magnitude 1e16 or more without an exponent,
  so it comes back as an int; such floats are refused (``MAX_FLOAT``). It gives -0.0 back
  as 0.0 (equal in Python), so -0.0 is stored as 0.0 everywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from itertools import islice
from typing import Any

from .exceptions import InvalidJobArgument

MAX_DEPTH = 30
MIN_INT, MAX_INT = -(2**63), 2**63 - 1
MAX_FLOAT = 1e16

# The most a stored document (one call's args and kwargs together, a result) takes as sent
# (sent_length()), and the most the documents of one statement take together: MariaDB drops
# the connection for a statement past its max_allowed_packet (16 MiB by default), and half
# of it leaves room for the statement's other columns. PostgreSQL and SQLite would take
# more, but a value accepted on one database must be on every other.
SENT_LIMIT = 8 * 2**20

# Documents whose upper bound (ensure_json's, which counts a character as up to 14) passes
# this are measured (size_as_sent()): against SENT_LIMIT, and so that statements carrying
# many (enqueue_many(), ack_many()) are grouped by their size, not by a bound up to 14 times
# it. Smaller ones are not: a dumps() of each would cost more than the grouping gains.
MEASURED_PAST = 64 * 2**10


def ensure_json(
    value: Any, path: str, size: list[int] | None = None, *, as_django_stores: bool = False
) -> Any:
    """Return ``value`` with tuples as lists, or raise InvalidJobArgument naming ``path``.

    Tuples become lists (as django.tasks normalizes them), a subclass of str, int or float
    its plain value (as the database gives it back: an IntEnum member is its int);
    anything else that JSON would
    change or cannot hold (dates, sets, objects, non-string keys, NaN, ints past 64 bits,
    nesting deeper than MAX_DEPTH) is refused, so a handler never receives something other
    than what its caller passed. ``size[0]`` grows by at least the size of ``value``'s
    JSON form as a database is sent it (sent_length()), read on the way: no dumps() is
    spent on small values.
    """
    tally = _Tally()
    try:
        checked = _checked(value, path, 1, tally, as_django_stores)
    except _PastTheLimit:
        raise TooLargeDocument(
            path,
            f"has a JSON form over twice the limit of {SENT_LIMIT:,} characters as sent "
            "(read no further than that)",
        ) from None
    if size is not None:
        size[0] += tally.most
    return checked


def stored_json(value: Any, path: str, size: list[int] | None = None) -> Any:
    """ensure_json(), refusing too (InvalidJobArgument naming ``path``) a value whose JSON
    form as sent passes SENT_LIMIT: a result, a checkpoint's cursor. ``size[0]``, if
    given, grows by its size as sent: measured past MEASURED_PAST, ensure_json's upper
    bound of it below (size_as_sent())."""
    bound = [0]
    checked = ensure_json(value, path, bound)
    length = size_as_sent(bound[0], checked)
    if length > SENT_LIMIT:
        raise InvalidJobArgument(path, too_large(length))
    if size is not None:
        size[0] += length
    return checked


def size_as_sent(bound: int, *documents: Any) -> int:
    """The size as sent of ``documents`` (checked by ensure_json, which read ``bound`` for
    them): ``bound`` itself up to MEASURED_PAST, an upper bound; their measure past it."""
    if bound <= MEASURED_PAST:
        return bound
    return sum(sent_length(json.dumps(document)) for document in documents)


def too_large(length: int, whose: str = "its") -> str:
    """Why a document of ``length`` characters as sent is refused."""
    return (
        f"{whose} JSON form is {length:,} characters as sent (a backslash or quote counts "
        f"twice), over the limit of {SENT_LIMIT:,}"
    )


# Upper bounds of the size of a value's JSON form as sent (json.dumps's ASCII text, each
# backslash and quote counted twice, as MySQL's client escapes them): a character at most
# 14 (an astral one is two \uXXXX, whose backslashes count twice), a string's quotes 4, a
# scalar other than a string at most 24 (a float's repr), an item of a list or dict at most
# 4 more (", " and ": "), a list or dict 2 (its brackets, under the scalar's 24). Lengths
# are str's and the items made, not what a caller's subclass says of itself.
_PER_CHARACTER, _PER_STRING, _PER_SCALAR, _PER_ITEM = 14, 4, 24, 4


class TooLargeDocument(InvalidJobArgument):
    """A value whose JSON form passes SENT_LIMIT, found so before it was all read."""


class _PastTheLimit(Exception):
    """The lower bound of a value's size as sent passed twice SENT_LIMIT: stop reading."""


class _Tally:
    """What _checked() counts on the way: an upper bound of the size as sent (``most``),
    and a lower one (``least``), which stops the read once past twice SENT_LIMIT (a value
    nearer the limit is read whole, and measured: its refusal names its size). And the
    lists and dicts read so far, by identity and depth, with their copy and counts: a list
    holding one list twice at each of 23 levels is 2**23 copies of its leaf as JSON, read
    once each (gigabytes, and the heartbeat starved) unless a list met again is counted
    again without being read again, when the lower bound doubles at each level."""

    def __init__(self) -> None:
        self.most = 0
        self.least = 0
        self.seen: dict[tuple[int, int], tuple[Any, Any, int, int]] = {}

    def count(self, most: int, least: int) -> None:
        self.most += most
        self.least += least
        if self.least > 2 * SENT_LIMIT:
            raise _PastTheLimit


def _checked(value: Any, path: str, depth: int, tally: _Tally, lenient: bool = False) -> Any:
    # Lower bounds as sent: a string its characters and 4 (its quotes count twice), null
    # and true 4, a number 1, a list or dict 2 (its brackets), and 2 between two items.
    if value is None or isinstance(value, bool):
        tally.count(_PER_SCALAR, 4)
        return value
    if isinstance(value, str):
        length = str.__len__(value)
        tally.count(_PER_CHARACTER * length + _PER_STRING, length + 4)
        return _text(value, path)
    if isinstance(value, int):
        tally.count(_PER_SCALAR, 1)
        if type(value) is not int:
            value = int.__int__(value)  # a plain int: an IntEnum member comes back as one
        if not MIN_INT <= value <= MAX_INT:
            raise InvalidJobArgument(
                path,
                "is an integer outside the 64-bit range (-2**63 to 2**63 - 1), which "
                "MySQL's JSON would keep only approximately; pass it as a string",
            )
        return value
    if isinstance(value, float):
        tally.count(_PER_SCALAR, 1)
        if type(value) is not float:
            value = float.__float__(value)
        if not math.isfinite(value):
            raise InvalidJobArgument(path, f"is the float {value!r}, which has no JSON form")
        if abs(value) >= MAX_FLOAT:
            raise InvalidJobArgument(
                path,
                f"is the float {value!r}, which PostgreSQL's jsonb would give back as an "
                "integer; pass int(value) or a string",
            )
        return 0.0 if value == 0 else value
    if isinstance(value, list | tuple | dict):
        if depth > MAX_DEPTH:
            raise InvalidJobArgument(
                path,
                f"nests lists and dicts more than {MAX_DEPTH} deep (the limit every "
                "supported database's JSON holds)",
            )
        key = (id(value), depth)
        if (met := tally.seen.get(key)) is not None:
            # value itself is kept in the entry, so its id is not another's meanwhile.
            _, copy, most, least = met
            tally.count(most, least)
            return copy
        before = tally.most, tally.least
        tally.count(_PER_SCALAR, 2)
        try:
            if isinstance(value, dict):
                copy = _checked_dict(value, path, depth, tally, lenient)
            else:
                copy = [
                    _checked(item, f"{path}[{i}]", depth + 1, tally, lenient)
                    for i, item in enumerate(value)
                ]
        except (InvalidJobArgument, _PastTheLimit):
            raise
        except Exception as e:  # noqa: BLE001 -- a caller's subclass whose items() or __iter__ raises
            raise InvalidJobArgument(
                path, f"raised {type(e).__qualname__} when it was read"
            ) from None
        if not isinstance(value, dict):
            tally.count(_PER_ITEM * len(copy), 2 * max(len(copy) - 1, 0))  # ", " between
        tally.seen[key] = (value, copy, tally.most - before[0], tally.least - before[1])
        return copy
    if lenient and isinstance(value, bytes | Mapping | Sequence):
        try:
            normalized = _as_django_stores(value, path)
        except InvalidJobArgument:
            raise
        except Exception as e:  # noqa: BLE001 -- what a caller's mapping or sequence raises
            raise InvalidJobArgument(
                path, f"raised {type(e).__qualname__} when it was read"
            ) from None
        return _checked(normalized, path, depth, tally, lenient)
    raise InvalidJobArgument(
        path,
        f"is of type {type(value).__module__}.{type(value).__qualname__}, which does not "
        "round-trip through JSON; pass its JSON form (e.g. an id or an ISO string)",
    )


def _as_django_stores(value: bytes | Mapping[Any, Any] | Sequence[Any], path: str) -> Any:
    """What django.utils.json.normalize_json makes of ``value`` at this level (UTF-8 bytes
    a str, a mapping a dict, a sequence a list), read no further than SENT_LIMIT could hold
    (``range(10**10)`` is 48 bytes; a sequence's own ``__len__`` is not taken at its word),
    each of its methods called once."""
    if isinstance(value, bytes):
        if bytes.__len__(value) > SENT_LIMIT:  # each byte at least a character as sent
            raise InvalidJobArgument(path, "is more bytes than a document stores")
        try:
            return bytes.decode(value, "utf-8")
        except UnicodeDecodeError:
            raise InvalidJobArgument(path, "is bytes that are not UTF-8") from None
    most = SENT_LIMIT // 2  # each item at least two characters as sent
    items = list(islice(iter(value.items() if isinstance(value, Mapping) else value), most + 1))
    if len(items) > most:
        raise InvalidJobArgument(
            path, f"holds more than {most:,} items, more than a document stores"
        )
    return dict(items) if isinstance(value, Mapping) else items


def _checked_dict(
    value: dict[Any, Any], path: str, depth: int, tally: _Tally, lenient: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if lenient and isinstance(key, bytes):
            key = _as_django_stores(key, f"{path}[{shown(key)}]")  # as Django decodes it
        if not isinstance(key, str):
            raise InvalidJobArgument(
                f"{path}[{shown(key)}]",
                f"is a key of type {type(key).__name__}, which JSON would turn into a string",
            )
        where = f"{path}[{str.__repr__(key)}]"  # str's own: a subclass's may raise
        key = _text(key, where)
        if key in out:
            # Keys of a caller's str subclass, unequal to it, equal as the plain str stored.
            raise InvalidJobArgument(where, "is a key given twice")
        length = str.__len__(key)
        # As sent: its quotes (4), the colon and the space after it.
        tally.count(_PER_CHARACTER * length + _PER_STRING + _PER_ITEM, length + 6)
        out[key] = _checked(item, where, depth + 1, tally, lenient)
    return out


def sent_length(document: str) -> int:
    """The size of JSON text ``document`` as a database is sent it: each backslash and quote
    (double or single) counted twice, as MySQL's client escapes them in the statement it
    builds (MariaDB's max_allowed_packet counts those bytes). JSON text holds no other
    character it escapes: NUL, newlines and control characters are \\u escapes already."""
    return len(document) + document.count("\\") + document.count('"') + document.count("'")


def statement_runs[Item](items: Sequence[Item], sizes: Sequence[int]) -> Iterator[list[Item]]:
    """``items`` in order, in runs whose ``sizes`` (one per item, as sent) add up to at most
    SENT_LIMIT, or of one item: what one statement may carry of them."""
    run: list[Item] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if run and total + size > SENT_LIMIT:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about hostile input
    (the repr of an int of 4,300+ digits raises ValueError; a megabyte string is no help)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, int) and value.bit_length() > 640:  # repr() raises past 4,300 digits
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1:,} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- a hostile __repr__
        text = f"<{type(value).__qualname__}>"
    if len(text) <= limit:
        return text
    size = f" ({len(value):,} characters)" if isinstance(value, str) else ""
    return f"{text[: limit - 20]}...{size}"


def _text(value: str, path: str) -> str:
    """PostgreSQL's jsonb cannot hold a NUL character, and no database a lone surrogate
    (it has no UTF-8 form): refuse both here rather than as an error the database names
    in its own words, which would also abort the caller's transaction."""
    # str's own methods: a caller's subclass may answer for itself otherwise.
    if str.__contains__(value, "\x00"):
        raise InvalidJobArgument(
            path, "contains a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
        )
    try:
        str.encode(value, "utf-8")
    except UnicodeEncodeError as e:
        raise InvalidJobArgument(
            path, f"is not valid Unicode ({e.reason} at index {e.start})"
        ) from None
    return value if type(value) is str else str.__str__(value)
