"""What the app's management commands share."""

from __future__ import annotations

import django
from django.core.management.base import BaseCommand, CommandError

from .. import __version__


class LeasesCommand(BaseCommand):
    """A command of this app: ``--version`` names django-leases' version (BaseCommand's
    names Django's alone)."""

    def get_version(self) -> str:
        return f"django-leases {__version__} (Django {django.get_version()})"


def unapplied_migrations(database: str) -> list[str]:
    """The names of django_leases' migrations not applied on ``database``; raises the
    DatabaseError of a database that cannot be read."""
    from django.db import connections
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[database])
    leaves = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "django_leases"]
    return [
        migration.name
        for migration, _ in executor.migration_plan(leaves)
        if migration.app_label == "django_leases"
    ]


def require_migrated(database: str) -> None:
    """CommandError before a command writes anything to a database that lacks some of
    django_leases' migrations (a prune that deleted jobs, then failed on a missing table)."""
    if missing := unapplied_migrations(database):
        raise unmigrated(database, missing)


def unmigrated(database: str, missing: list[str]) -> CommandError:
    """The error of a command run on a database that lacks ``missing`` migrations."""
    return CommandError(
        f"database {database!r} lacks django_leases migrations {', '.join(missing)}; "
        f"run: manage.py migrate django_leases --database {database}"
    )
