"""What only one database can build, so no model option can say it.

MySQL and MariaDB: claim indexes that lead with the state. Neither has partial indexes, so
Django builds those of 0001 without their condition (check warning models.W037), over every
row and in an order that cannot find the due or expired jobs without reading the others.
These two composite indexes serve both halves of the claim predicate instead.

PostgreSQL: a statement-level trigger on job inserts that wakes idle workers. It sends one
NOTIFY per queue per INSERT statement (a bulk enqueue included), in the inserting
transaction, so the wake-up arrives exactly when the jobs become visible and costs the
enqueuer no extra round trip. Workers LISTEN on the channel; other databases poll.

On SQLite both operations do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import migrations

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

MYSQL_INDEXES = {
    "leases_job_due_mysql_idx": "(state, available_at)",
    "leases_job_lease_mysql_idx": "(state, lease_expires_at)",
}
NOTIFY_CHANNEL = "django_leases"


def _job_table(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> str:
    return schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)


def create_mysql_indexes(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    table = _job_table(apps, schema_editor)
    for name, columns in MYSQL_INDEXES.items():
        schema_editor.execute(f"CREATE INDEX {schema_editor.quote_name(name)} ON {table} {columns}")


def drop_mysql_indexes(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    table = _job_table(apps, schema_editor)
    for name in MYSQL_INDEXES:
        schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(name)} ON {table}")


def create_notify_trigger(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = _job_table(apps, schema_editor)
    schema_editor.execute(f"""
        CREATE OR REPLACE FUNCTION django_leases_notify_enqueued() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{NOTIFY_CHANNEL}', queue_name) FROM (
                SELECT DISTINCT queue_name FROM enqueued WHERE state = 'pending'
            ) AS queues;
            RETURN NULL;
        END $$
    """)
    schema_editor.execute(f"""
        CREATE TRIGGER django_leases_job_enqueued AFTER INSERT ON {table}
        REFERENCING NEW TABLE AS enqueued
        FOR EACH STATEMENT EXECUTE FUNCTION django_leases_notify_enqueued()
    """)


def drop_notify_trigger(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = _job_table(apps, schema_editor)
    schema_editor.execute(f"DROP TRIGGER IF EXISTS django_leases_job_enqueued ON {table}")
    schema_editor.execute("DROP FUNCTION IF EXISTS django_leases_notify_enqueued()")


class Migration(migrations.Migration):
    dependencies = [("django_leases", "0001_initial")]
    operations = [
        migrations.RunPython(
            create_mysql_indexes, drop_mysql_indexes, atomic=False, elidable=False
        ),
        migrations.RunPython(create_notify_trigger, drop_notify_trigger, elidable=False),
    ]
