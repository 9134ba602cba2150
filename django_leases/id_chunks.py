"""Ids in lists one statement can take: a statement takes at most so many parameters.

SQLite's limit is the connection's (32,766 by default, 999 before 3.32, lowered with
setlimit()); PostgreSQL's protocol takes 65,535 with server-side binding. A selection
across the admin's pages, or a purge, can hold more jobs than that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from django.db import connections

# At most this many ids in one statement, and room left for its other parameters.
MOST_IDS = 10_000
OTHER_PARAMETERS = 100


def id_chunks[T](db: str, ids: Sequence[T]) -> Iterator[Sequence[T]]:
    """``ids`` in consecutive slices, each small enough for one statement on ``db``."""
    limit: Any = connections[db].features.max_query_params
    size = MOST_IDS if limit is None else max(min(MOST_IDS, limit - OTHER_PARAMETERS), 1)
    for at in range(0, len(ids), size):
        yield ids[at : at + size]
