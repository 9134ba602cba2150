"""Storage settings of the job table on PostgreSQL: room on each page for a row's next
version, and autovacuum that follows the churn of a big table.

Every step of a job's life is an UPDATE that changes an indexed column (the state, the
claim token, the lease end), so PostgreSQL writes a new row version and index entries each
time and leaves the old version dead. With the default settings autovacuum visits a table
after 20 % of its rows are dead: on a table that keeps five million finished jobs, a
million dead versions, in the heap and in the claim's indexes, before the first visit.
Here the thresholds are a fixed number of rows instead, whatever the table's size, and a
fillfactor below 100 lets the new version of a row land on its own page. Measured in
docs/scale.md.

Other databases: nothing to do (SQLite and InnoDB have no such settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import migrations

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

# Storage parameters of the job table (ALTER TABLE ... SET); docs/scale.md says why each.
JOB_STORAGE = {
    "fillfactor": "80",
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "20000",
    "autovacuum_vacuum_insert_scale_factor": "0",
    "autovacuum_vacuum_insert_threshold": "50000",
    "autovacuum_analyze_scale_factor": "0",
    "autovacuum_analyze_threshold": "50000",
    "autovacuum_vacuum_cost_delay": "1",
}


def _job_table(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> str:
    return schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)


def set_storage(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    options = ", ".join(f"{name} = {value}" for name, value in JOB_STORAGE.items())
    schema_editor.execute(f"ALTER TABLE {_job_table(apps, schema_editor)} SET ({options})")


def reset_storage(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"ALTER TABLE {_job_table(apps, schema_editor)} RESET ({', '.join(JOB_STORAGE)})"
    )


class Migration(migrations.Migration):
    dependencies = [("django_leases", "0002_mysql_indexes_postgresql_trigger")]
    operations = [migrations.RunPython(set_storage, reset_storage, elidable=False)]
