"""Owner writes that the database picked as a deadlock victim are sent again.

On MySQL/MariaDB an owner's UPDATE can reach the row through the claim-token index while a
takeover holds the row and wants that index entry: InnoDB breaks the cycle by rolling one
statement back. The victim changed nothing, so sending it again is safe, and the second try
gives the real answer (usually 0 rows: the takeover won). Without this the stale owner's
handler would see an OperationalError instead of LeaseLost.

Only a write outside the caller's own transaction (no atomic block, autocommit on) is retried:
inside one, the rollback took the caller's earlier statements with it, and only the caller can
redo those. Operator verbs that are one UPDATE (cancel, expire_now, retry_now) race claims the
same way and are retried alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate

from django.db import OperationalError, connections, models, router

# ER_LOCK_DEADLOCK; PostgreSQL's deadlock_detected SQLSTATE.
MYSQL_DEADLOCK = 1213
POSTGRES_DEADLOCK = "40P01"
TRIES = 3


def is_deadlock(error: OperationalError) -> bool:
    cause = error.__cause__
    if getattr(cause, "sqlstate", None) == POSTGRES_DEADLOCK:
        return True
    return bool(error.args) and error.args[0] == MYSQL_DEADLOCK


def retry_deadlock_victims[S: models.QuerySet[Any], **P, R](
    method: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], R]:
    """Wrap a queryset verb whose writes are one statement or one atomic block of its own."""

    @functools.wraps(method)
    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        db = getattr(self, "_db", None) or router.db_for_write(self.model)
        for tries_left in range(TRIES - 1, -1, -1):
            try:
                return method(self, *args, **kwargs)
            except OperationalError as error:
                conn = connections[db]
                # Inside the caller's own transaction (an atomic block, or autocommit turned
                # off) the rollback took the caller's earlier writes too: only it can redo them.
                if (
                    not tries_left
                    or conn.in_atomic_block
                    or not conn.get_autocommit()
                    or not is_deadlock(error)
                ):
                    raise
        raise AssertionError("unreachable")

    return wrapper
