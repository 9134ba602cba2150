"""Wake idle workers on PostgreSQL from a statement-level trigger on job inserts.

The trigger sends one NOTIFY per queue per INSERT statement (a bulk enqueue included), in
the inserting transaction, so the wake-up arrives exactly when the jobs become visible and
costs the enqueuer no extra round trip. Other databases poll; this migration does nothing
there.
"""

from django.db import migrations

CHANNEL = "django_leases"


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)
    schema_editor.execute(f"""
        CREATE OR REPLACE FUNCTION django_leases_notify_enqueued() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', queue_name) FROM (
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


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("django_leases", "Job")._meta.db_table)
    schema_editor.execute(f"DROP TRIGGER IF EXISTS django_leases_job_enqueued ON {table}")
    schema_editor.execute("DROP FUNCTION IF EXISTS django_leases_notify_enqueued()")


class Migration(migrations.Migration):
    dependencies = [("django_leases", "0006_due_index_in_claim_order")]
    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
