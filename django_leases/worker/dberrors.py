"""Tell the database refusing a statement from the database being out of reach.

An owner's write that fails because the connection broke, the server went away or a lock
or statement timed out is an outage: the same statement goes again once the database
answers. Any other database error (DataError, IntegrityError, ProgrammingError, ...) is the
database refusing that statement, which no retry changes: the worker ends the attempt
instead (loop.py), or it would retry a poison write forever.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from django.db import DatabaseError, InterfaceError, OperationalError, connections

if TYPE_CHECKING:
    from .claims import Outcome

# Every error a statement can end with: an outage or a refusal, told apart below.
DB_ERRORS = (DatabaseError, InterfaceError)
CONNECTION_ERRORS = (OperationalError, InterfaceError)

# Contention, which passes: PostgreSQL's transaction rollbacks (40xxx: serialization
# failure, deadlock), lock_not_available and query_canceled (a lock or statement timeout);
# MySQL's lock wait timeout and deadlock; SQLite's busy and locked.
_PG_TRANSIENT = ("40", "55P03", "57014")
_MYSQL_TRANSIENT = (1205, 1213)
_SQLITE_TRANSIENT = (5, 6)


def refused_by_database(error: BaseException) -> bool:
    """Whether ``error`` is the database refusing a statement, not the connection failing."""
    return isinstance(error, DatabaseError) and not isinstance(error, CONNECTION_ERRORS)


def contention(error: BaseException) -> bool:
    """Whether ``error`` is a lock or statement timeout, a deadlock or a serialization
    failure: an OperationalError that says nothing against the statement itself."""
    cause = error.__cause__
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_PG_TRANSIENT)
    code = getattr(cause, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _SQLITE_TRANSIENT  # the primary code of an extended one
    return bool(error.args) and error.args[0] in _MYSQL_TRANSIENT


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message (its class name if it has none), for a log line."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def connect_before_handler(database: str) -> Outcome | None:
    """Open this thread's connection to the job's database before the handler runs; an
    "unconnected" outcome if the database refuses it (too many connections, unreachable).
    The worker then releases the job, the attempt not counted: the handler never ran, and
    the worker's own over-subscription is no failure of the job."""
    from .claims import Outcome

    try:
        connections[database].ensure_connection()
    except DB_ERRORS as e:
        with contextlib.suppress(*DB_ERRORS):
            connections[database].close()
        return Outcome("unconnected", message=first_line(e))
    return None
