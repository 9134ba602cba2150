"""PostgreSQL: drop the LIKE index Django built beside the unique key's constraint.

For a ``unique=True`` CharField Django's PostgreSQL backend builds two indexes: the unique
constraint's, and one with ``varchar_pattern_ops`` for ``LIKE 'prefix%'`` lookups. No query
looks ``active_key`` up that way. The state is indexed, so every step of a job's life
(enqueue, claim, ack, failure, release) is a new row version with an entry in each index
that holds the row: this one was one of eight, for nothing. The unique constraint stays
as it was, so the code of 0.1.0, whose ``ON CONFLICT (active_key)`` infers it, runs on the
migrated table.

``DROP INDEX CONCURRENTLY``, outside a transaction: a plain ``DROP INDEX`` would wait for
every open transaction on the job table, a handler's fenced one included, with every claim,
renewal and ack queued behind it meanwhile. Interrupted, the drop leaves the index invalid
and running this migration again drops it; an interrupted unapply leaves an invalid LIKE
index behind, to be dropped by hand (``DROP INDEX CONCURRENTLY``) before unapplying again.

Other databases: nothing to do (Django builds that index on PostgreSQL only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import migrations

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

COLUMN = "active_key"


def drop_like_index(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = apps.get_model("django_leases", "Job")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        # Found by what it is (the column alone, that operator class, no condition or
        # expression), not by the name Django hashed for it.
        cursor.execute(
            "SELECT i.indexrelid::regclass::text FROM pg_index i "
            "JOIN pg_opclass o ON o.oid = i.indclass[0] "
            "WHERE i.indrelid = %s::regclass AND i.indnatts = 1 AND NOT i.indisunique "
            "AND i.indpred IS NULL AND i.indexprs IS NULL "
            "AND pg_get_indexdef(i.indexrelid, 1, true) = %s "
            "AND o.opcname = 'varchar_pattern_ops'",
            [schema_editor.quote_name(table), COLUMN],
        )
        names = [row[0] for row in cursor.fetchall()]
    for name in names:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


def create_like_index(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    model = apps.get_model("django_leases", "Job")
    # The name and columns 0001 built it with (the PostgreSQL schema editor's own), built
    # CONCURRENTLY for the same reason as the drop.
    sql = schema_editor._create_like_index_sql(model, model._meta.get_field(COLUMN))  # type: ignore[attr-defined]
    if sql is not None:
        schema_editor.execute(str(sql).replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1))


class Migration(migrations.Migration):
    # CONCURRENTLY cannot run inside a transaction block.
    atomic = False
    dependencies = [("django_leases", "0004_job_storage")]
    operations = [
        migrations.RunPython(drop_like_index, create_like_index, atomic=False, elidable=False)
    ]
