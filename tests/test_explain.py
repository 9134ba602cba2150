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
        cursor.execute(f"""
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
        """.replace("%", "%%").replace("%%s", "%s"), [ROWS])
        cursor.execute(f"ANALYZE {table}")


def test_the_claim_on_200000_rows_uses_indexes_and_no_sequential_scan():
    if connection.vendor != "postgresql":
        pytest.skip("the plan is checked on PostgreSQL, the production target")
    load_rows()
    assert Job.objects.count() == ROWS
    with transaction.atomic():
        query = Job.objects.claim_order(["default", "emails"]).select_for_update(skip_locked=True)[:10]
        plan = query.explain()
    assert "Seq Scan" not in plan, plan
    # Both halves of the predicate come from partial or state indexes.
    assert "leases_job_claimed_idx" in plan, plan
    assert "Index Cond: ((state)::text = 'pending'::text)" in plan or "leases_job_pending_idx" in plan, plan
    # And the claim itself works at that size.
    assert len(Job.objects.claim("w", ["default", "emails"], limit=10)) == 10
