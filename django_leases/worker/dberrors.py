"""Tell the database refusing a statement from the database being out of reach.

An owner's write that fails because the connection broke, the server went away or a lock
or statement timed out is an outage: the same statement goes again once the database
answers. Any other database error (DataError, IntegrityError, ProgrammingError, ...) is the
database refusing that statement, which no retry changes: the worker ends the attempt
instead (loop.py), or it would retry a poison write forever.
"""

from __future__ import annotations

from django.db import DatabaseError, InterfaceError, OperationalError

CONNECTION_ERRORS = (OperationalError, InterfaceError)


def refused_by_database(error: BaseException) -> bool:
    """Whether ``error`` is the database refusing a statement, not the connection failing."""
    return isinstance(error, DatabaseError) and not isinstance(error, CONNECTION_ERRORS)
