"""How many more connections a database server lets this session's role open.

Read at worker start, so a ``--concurrency`` the server cannot serve is refused with the
numbers instead of failing handlers with "too many connections" one by one. SQLite has no
such limit (None).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections


@dataclass(frozen=True)
class Limit:
    """One limit on connections: what sets it, its size, and how many of its connections
    other sessions hold now (this session excluded)."""

    what: str
    size: int
    in_use_by_others: int

    @property
    def free(self) -> int:
        return max(self.size - self.in_use_by_others, 0)


_PG_LIMITS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       COALESCE(current_setting('reserved_connections', true), '0')::int,
       EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pg_use_reserved_connections'
               AND pg_has_role(current_user, oid, 'MEMBER')),
       r.rolsuper, r.rolconnlimit, d.datconnlimit, current_user, current_database(),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'
        AND usesysid = r.oid),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'
        AND datid = d.oid)
FROM pg_roles AS r, pg_database AS d
WHERE r.rolname = current_user AND d.datname = current_database()
"""


def connection_limits(database: str) -> list[Limit] | None:
    """The limits that bind a new connection of ``database``'s role, tightest first
    (None: the database has none, SQLite). Opens the connection if need be."""
    connection = connections[database]
    if connection.vendor == "postgresql":
        return sorted(_postgresql(database), key=lambda limit: limit.free)
    if connection.vendor == "mysql":
        return sorted(_mysql(database), key=lambda limit: limit.free)
    return None


def _postgresql(database: str) -> list[Limit]:
    with connections[database].cursor() as cursor:
        cursor.execute(_PG_LIMITS)
        (
            max_connections,
            superuser_reserved,
            reserved,
            may_use_reserved,
            superuser,
            role_limit,
            database_limit,
            role,
            name,
            clients,
            role_clients,
            database_clients,
        ) = cursor.fetchone()
    # This session is one of the clients counted; it is the worker's own main connection.
    if superuser:
        # Superusers may use every slot, and no role or database limit applies to them.
        return [Limit("max_connections", max_connections, clients - 1)]
    held_back = superuser_reserved + (0 if may_use_reserved else reserved)
    limits = [
        Limit(
            f"max_connections {max_connections} - {held_back} reserved",
            max_connections - held_back,
            clients - 1,
        )
    ]
    if role_limit >= 0:
        limits.append(Limit(f"role {role!r} CONNECTION LIMIT", role_limit, role_clients - 1))
    if database_limit >= 0:
        limits.append(
            Limit(f"database {name!r} CONNECTION LIMIT", database_limit, database_clients - 1)
        )
    return limits


def _mysql(database: str) -> list[Limit]:
    with connections[database].cursor() as cursor:
        # The session value of max_user_connections is the account's own limit if it has
        # one, else the global one; 0 means none.
        cursor.execute(
            "SELECT @@GLOBAL.max_connections, @@SESSION.max_user_connections, "
            "CURRENT_USER(), SUBSTRING_INDEX(CURRENT_USER(), '@', 1)"
        )
        max_connections, user_limit, account, user = cursor.fetchone()
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Threads_connected'")
        clients = int(cursor.fetchone()[1])
        # Without the PROCESS privilege a session sees exactly its own user's threads.
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = %s "
            "AND COMMAND <> 'Daemon'",
            [user],
        )
        user_clients = cursor.fetchone()[0]
    limits = [Limit("max_connections", max_connections, clients - 1)]
    if user_limit and user_limit > 0:
        limits.append(Limit(f"max_user_connections of {account}", user_limit, user_clients - 1))
    return limits
