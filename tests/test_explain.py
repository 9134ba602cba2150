"""The claim is served by indexes on a big table that is mostly finished jobs (PostgreSQL)."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from django_leases.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 200_000


def load_rows():
    """200,000 jobs: 97% finished, 2.5% pending (a tenth of them not yet due), 0.5% claimed."""
    table = Job._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {table} (queue_name, task_path, args, kwargs, priority, state,
                available_at, lease_seconds, lease_expires_at, claim_token, fence, attempts,
                max_attempts, leases_lost, claimed_by, enqueued_at, finished_at, on_lease_lost, dead_reason)
            SELECT CASE WHEN i % 3 = 0 THEN 'emails' ELSE 'default' END,
                   'tests.testapp.tasks.add', '[]', '{{}}', (i % 5) - 2,
                   CASE WHEN i % 200 = 0 THEN 'claimed'
                        WHEN i % 40 = 1 THEN 'pending' ELSE 'succeeded' END,
                   now() - interval '1 hour' + (CASE WHEN i % 400 = 1 THEN interval '2 hours' ELSE interval '0' END),
                   30,
                   CASE WHEN i % 200 = 0 THEN now() + (i % 60 - 30) * interval '1 second' END,
                   CASE WHEN i % 200 = 0 THEN md5(i::text)::uuid END,
                   1, 1, 5, 0, 'bench', now() - interval '2 hours',
                   CASE WHEN i % 200 <> 0 AND i % 40 <> 1 THEN now() END, 'retry', ''
            FROM generate_series(1, %s) AS i
        """.replace("%", "%%").replace("%%s", "%s"),
            [ROWS],
        )
        cursor.execute(f"ANALYZE {table}")


MYSQL_ROWS = f"""
    INSERT INTO {{table}} (queue_name, task_path, args, kwargs, priority, state, available_at,
        lease_seconds, lease_expires_at, claim_token, fence, attempts, max_attempts, leases_lost,
        claimed_by, enqueued_at, finished_at, on_lease_lost, dead_reason)
    SELECT CASE WHEN i % 3 = 0 THEN 'emails' ELSE 'default' END,
           'tests.testapp.tasks.add', '[]', '{{{{}}}}', (i % 5) - 2,
           CASE WHEN i % 200 = 0 THEN 'claimed' WHEN i % 40 = 1 THEN 'pending' ELSE 'succeeded' END,
           NOW(6) - INTERVAL 1 HOUR + INTERVAL (CASE WHEN i % 400 = 1 THEN 2 ELSE 0 END) HOUR,
           30,
           CASE WHEN i % 200 = 0 THEN NOW(6) + INTERVAL (i % 60 - 30) SECOND END,
           CASE WHEN i % 200 = 0 THEN {{uuid}} END,
           1, 1, 5, 0, 'bench', NOW(6) - INTERVAL 2 HOUR,
           CASE WHEN i % 200 <> 0 AND i % 40 <> 1 THEN NOW(6) END, 'retry', ''
    FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d + 1 AS i
          FROM {{digits}} a, {{digits}} b, {{digits}} c, {{digits}} e, {{digits}} f, {{digits}} g) s
    WHERE i <= {ROWS}
"""
DIGITS = (
    "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 "
    "UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)"
)


def test_the_claim_on_200000_rows_uses_indexes_and_no_full_scan_on_mysql():
    """MySQL/MariaDB build no partial indexes; migration 0005's composite ones serve the claim."""
    if connection.vendor != "mysql":
        pytest.skip("checked on MySQL/MariaDB")
    with connection.cursor() as cursor:
        # MariaDB has a native UUID column; MySQL stores Django's UUIDField as 32 hex characters.
        uuid = "UUID()" if connection.mysql_is_mariadb else "REPLACE(UUID(), '-', '')"
        cursor.execute(MYSQL_ROWS.format(table=Job._meta.db_table, digits=DIGITS, uuid=uuid))
        cursor.execute(f"ANALYZE TABLE {Job._meta.db_table}")
    assert Job.objects.count() == ROWS
    with transaction.atomic():
        query = Job.objects.claim_order(["default", "emails"]).select_for_update(skip_locked=True)[
            :10
        ]
        plan = query.explain()
    # EXPLAIN's access type column: ALL is a full table scan.
    assert " ALL " not in f" {plan} ", plan
    assert "leases_job_due_mysql_idx" in plan or "leases_job_lease_mysql_idx" in plan, plan
    assert len(Job.objects.claim("w", ["default", "emails"], limit=10)) == 10
    # A worker of every queue (--all-queues): no queue filter, the same indexes.
    with transaction.atomic():
        plan = Job.objects.claim_order(None).select_for_update(skip_locked=True)[:10].explain()
    assert " ALL " not in f" {plan} ", plan
    assert "leases_job_due_mysql_idx" in plan or "leases_job_lease_mysql_idx" in plan, plan
    assert len(Job.objects.claim("w", None, limit=10)) == 10


def pg_claim_statement(worker, queues, limit):
    """The claim statement as Job.objects.claim() sends it on PostgreSQL: query.py's own
    _PG_CLAIM rendered by its own helper, with the parameters bound client-side (Django's
    default on psycopg 3, so this is the text the server receives)."""
    from django_leases.query import JobQuerySet, _pg_sql

    sql = _pg_sql(JobQuerySet._PG_CLAIM, Job, connection.alias, all_queues=queues is None)
    params = {"worker": worker, "queues": queues, "limit": limit, "lease": None}
    return connection.ops.compose_sql(sql, params)


def explain(sql):
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def assert_claim_plan_uses_indexes(plan):
    table = Job._meta.db_table
    # No full scan of the job table anywhere (the candidate scans, the join back to the
    # job rows, the UPDATE's own join).
    assert f"Seq Scan on {table}" not in plan, plan
    # The due half is an ordered scan of the partial due index, the expired half a scan of
    # the partial claimed index (no sort of every pending job).
    assert "Index Scan using leases_job_due_idx" in plan, plan
    assert "leases_job_claimed_idx" in plan, plan


def test_the_claim_on_200000_rows_uses_indexes_and_no_sequential_scan():
    """The statement EXPLAINed is the one claim() really runs on PostgreSQL (the
    one-statement _PG_CLAIM, not the portable ORM query): checked by capturing what
    claim() sends. Invariant 3 at scale: the claim still finds the due jobs."""
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("the plan is checked on PostgreSQL, the production target")
    load_rows()
    assert Job.objects.count() == ROWS
    queues = ["default", "emails"]
    statement = pg_claim_statement("w", queues, 10)
    plan = explain(statement)
    assert_claim_plan_uses_indexes(plan)

    # It is the statement that runs: claim() sends exactly this text first, and it claims
    # a full batch on its own (no portable second pass).
    with CaptureQueriesContext(connection) as sent:
        claimed = Job.objects.claim("w", queues, limit=10)
    assert len(claimed) == 10
    assert [q["sql"] for q in sent.captured_queries] == [statement], sent.captured_queries

    # The claim of every queue (a worker started with --all-queues, or of a backend whose
    # QUEUES is empty) drops the queue filter: the same two partial indexes, the due one
    # still an ordered scan, and it too is the statement claim() sends.
    every = pg_claim_statement("w", None, 10)
    assert "queue_name" not in every.split("lost AS")[0], every
    assert_claim_plan_uses_indexes(explain(every))
    with CaptureQueriesContext(connection) as sent:
        claimed = Job.objects.claim("w", None, limit=10)
    assert len(claimed) == 10
    assert [q["sql"] for q in sent.captured_queries] == [every], sent.captured_queries

    # The check can fail. Without the claim indexes the planner falls back on other
    # indexes that lead with state and sorts every pending job; without any index but the
    # unique ones, it scans the whole table. (DROP INDEX is transactional: rolled back.)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX leases_job_due_idx")
            cursor.execute("DROP INDEX leases_job_claimed_idx")
            unindexed = explain(statement)
            with pytest.raises(AssertionError):
                assert_claim_plan_uses_indexes(unindexed)
            with pytest.raises(AssertionError):
                assert_claim_plan_uses_indexes(explain(every))
            cursor.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s "
                "AND indexdef NOT LIKE 'CREATE UNIQUE%%'",
                [Job._meta.db_table],
            )
            for (name,) in cursor.fetchall():
                cursor.execute(f'DROP INDEX "{name}"')
            unindexed = explain(statement)
            assert f"Seq Scan on {Job._meta.db_table}" in unindexed, unindexed
        transaction.set_rollback(True)
    assert "leases_job_due_idx" in explain(statement)
