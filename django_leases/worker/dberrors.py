"""Tell the database refusing a statement from the database being out of reach.

An owner's write that fails because the connection broke, the server went away or a lock
or statement timed out is an outage: the same statement goes again once the database
answers. Any other database error (DataError, IntegrityError, ProgrammingError, ...) is the
database refusing that statement, which no retry changes: the worker ends the attempt
instead (settling.py), or it would retry a poison write forever.
"""

from __future__ import annotations

import threading

from django.db import DatabaseError, InterfaceError, OperationalError

# Every error a statement can end with: an outage or a refusal, told apart below.
DB_ERRORS = (DatabaseError, InterfaceError)
CONNECTION_ERRORS = (OperationalError, InterfaceError)

# What a driver's error code says of an OperationalError. Outages and contention pass, so
# the write goes again once they have: PostgreSQL's connection exceptions (08), transaction
# rollbacks (40: serialization failure, deadlock), insufficient resources (53: disk full,
# out of memory, too many connections), operator intervention (57: a lock or statement
# timeout, a shutdown), system errors (58: I/O) and lock_not_available; MySQL's and
# MariaDB's too many connections, lock wait timeout, deadlock and lost or refused
# connections; SQLite's busy, locked, I/O error and disk full. Refusals do not: PostgreSQL's
# data exceptions (22) and integrity violations (23); MySQL's and MariaDB's incorrect value
# (1366), data too long (1406), out of range (1264), incorrect date or time (1292), a
# trigger's SIGNAL (1644) and a check constraint (3819, 4025). Other codes are unknown.
_PG_OUTAGE = ("08", "40", "53", "57", "58", "55P03")
_PG_REFUSAL = ("22", "23")
_MYSQL_OUTAGE = frozenset({1040, 1053, 1205, 1213, 1927, 2002, 2003, 2006, 2013, 2055})
_MYSQL_REFUSAL = frozenset({1264, 1292, 1366, 1406, 1644, 3819, 4025})
_SQLITE_OUTAGE = frozenset({5, 6, 10, 13})  # BUSY, LOCKED, IOERR, FULL


def refused_by_database(error: BaseException) -> bool:
    """Whether ``error`` is the database refusing a statement, not the connection failing."""
    return isinstance(error, DatabaseError) and not isinstance(error, CONNECTION_ERRORS)


def error_kind(error: BaseException) -> str | None:
    """ "outage" or "refusal" as the driver's error code under ``error`` tells; None for a
    code not known here (settling.py then counts strikes)."""
    cause = error.__cause__
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        if sqlstate.startswith(_PG_OUTAGE):
            return "outage"
        return "refusal" if sqlstate.startswith(_PG_REFUSAL) else None
    code = getattr(cause, "sqlite_errorcode", None)
    if isinstance(code, int):
        return "outage" if code & 0xFF in _SQLITE_OUTAGE else None  # the primary code
    code = error.args[0] if error.args else None
    if isinstance(code, int) and not isinstance(code, bool):
        if code in _MYSQL_OUTAGE:
            return "outage"
        if code in _MYSQL_REFUSAL:
            return "refusal"
    return None


def contention(error: BaseException) -> bool:
    """Whether ``error`` is a lock or statement timeout, a deadlock, a serialization
    failure or the server short of a resource: an OperationalError that says nothing
    against the statement itself."""
    return error_kind(error) == "outage"


# How many lost connections the worker's own threads have met (the loop's statements, the
# heartbeat's renewals). A failover or a restart of the server ends every session, the
# connections the handler slots keep between jobs with them: a slot that has not checked
# its connection since the last one does before its next handler (running.py).
_outages = 0
_outages_lock = threading.Lock()
# What an OperationalError may be without the connection being gone: PostgreSQL's
# transaction rollbacks (40: deadlock, serialization), insufficient resources (53), a lock
# not available and a statement cancelled (a timeout); MySQL's and MariaDB's lock wait
# timeout, deadlock and too many connections; SQLite's errors (no connection to lose).
_PG_CONTENTION = ("40", "53", "55P03", "57014")
_MYSQL_CONTENTION = frozenset({1040, 1205, 1213})


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` may mean the connection itself is gone: any OperationalError or
    InterfaceError but contention (a deadlock, a timeout: the session lives on). A wrong
    yes costs each slot one round trip before its next handler; a wrong no, a failed job."""
    if isinstance(error, InterfaceError):
        return True
    if not isinstance(error, OperationalError):
        return False
    cause = error.__cause__
    if isinstance(getattr(cause, "sqlite_errorcode", None), int):
        return False
    # psycopg's sqlstate, psycopg2's pgcode; None from psycopg for a closed connection.
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if isinstance(sqlstate, str):
        return not sqlstate.startswith(_PG_CONTENTION)
    code = error.args[0] if error.args else None
    if isinstance(code, int) and not isinstance(code, bool):
        return code not in _MYSQL_CONTENTION
    return True


def outage_met(error: BaseException) -> None:
    """Count ``error`` if the connection may be gone."""
    global _outages
    if connection_lost(error):
        with _outages_lock:
            _outages += 1


def outages_met() -> int:
    return _outages
