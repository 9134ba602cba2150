"""System checks for lease backends; one id per problem, listed in docs/reference.md."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.db import connections

from .conf import check_id_for, validate_options


def check_backend(alias: str, options: Any) -> list[checks.CheckMessage]:
    """Problems with TASKS[alias]: its OPTIONS, and the database they point at."""
    messages: list[checks.CheckMessage] = [
        checks.Error(
            f"TASKS[{alias!r}]['OPTIONS'][{problem.option!r}] {problem.reason}",
            obj=f"TASKS[{alias!r}]",
            id=check_id_for(problem),
        )
        for problem in validate_options(options)
    ]
    if any(m.id == "django_leases.E010" for m in messages):
        return messages
    database = options.get("DATABASE", "default") if isinstance(options, dict) else "default"
    messages.extend(check_database(alias, database))
    return messages


def check_database(alias: str, database: str) -> list[checks.CheckMessage]:
    connection = connections[database]
    if connection.vendor == "sqlite":
        mode = connection.settings_dict.get("OPTIONS", {}).get("transaction_mode")
        if str(mode).upper() != "IMMEDIATE":
            return [checks.Warning(
                f"TASKS[{alias!r}] keeps jobs in SQLite database {database!r} without "
                "DATABASES[...]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                hint="Several worker processes then fail with 'database is locked' instead "
                     "of waiting; also set 'timeout' (e.g. 20) and WAL journal mode.",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.W001",
            )]
        return []
    if not connection.features.has_select_for_update_skip_locked:
        return [checks.Error(
            f"TASKS[{alias!r}]['OPTIONS']['DATABASE'] is {database!r}, a "
            f"{connection.display_name} database without SELECT ... FOR UPDATE SKIP LOCKED.",
            hint="Use PostgreSQL, MySQL 8.0+, MariaDB 10.6+ or SQLite for the job table.",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.E004",
        )]
    return []
