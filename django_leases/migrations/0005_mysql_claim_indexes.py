"""Claim indexes for MySQL and MariaDB, which cannot build the partial indexes of 0001.

Django skips an Index with a condition on MySQL, so the claim there would read every row.
These plain composite indexes serve both halves of the claim predicate instead; on
PostgreSQL and SQLite the partial indexes already do, and this migration does nothing.
"""

from django.db import migrations

INDEXES = {
    "leases_job_due_mysql_idx": "(state, available_at)",
    "leases_job_lease_mysql_idx": "(state, lease_expires_at)",
}


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    table = schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)
    for name, columns in INDEXES.items():
        schema_editor.execute(f"CREATE INDEX {schema_editor.quote_name(name)} ON {table} {columns}")


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    table = schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(name)} ON {table}")


class Migration(migrations.Migration):
    dependencies = [("django_leases", "0004_job_effect")]
    operations = [migrations.RunPython(forwards, backwards, atomic=False, elidable=False)]
