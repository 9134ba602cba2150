"""The claim is served by indexes on a big table that is mostly finished jobs (PostgreSQL)."""

from __future__ import annotations

import json
import re

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
    """MySQL/MariaDB build no partial indexes; migration 0002's composite ones serve the claim."""
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


def pg_claim_statement(worker, queues, limit, *, settle=True, rows=False):
    """The claim statement as Job.objects.claim() sends it on PostgreSQL (claim_rows() with
    ``rows``): claiming.py's own _PG_CLAIM (_PG_CLAIM_DUE when not settling) rendered by its own
    helper, with the parameters bound client-side (Django's default on psycopg 3, so this is
    the text the server receives)."""
    from django_leases.claiming import _ROW_RETURNING, ClaimVerbs
    from django_leases.lease_statements import pg_sql

    template = ClaimVerbs._PG_CLAIM if settle else ClaimVerbs._PG_CLAIM_DUE
    returning = _ROW_RETURNING if rows else "j.*"
    sql = pg_sql(template, Job, connection.alias, all_queues=queues is None, returning=returning)
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


def assert_due_claim_plan_uses_indexes(plan):
    assert f"Seq Scan on {Job._meta.db_table}" not in plan, plan
    assert "Index Scan using leases_job_due_idx" in plan, plan


def explain_generic(sql, values):
    """EXPLAIN of ``sql``'s generic plan: the plan PostgreSQL may keep for a prepared
    statement (a project's server_side_binding and prepare_threshold), made without the
    parameters' values. PREPAREd with $n for each named parameter and no declared types
    (the server infers them from the statement, as for psycopg's untyped parameters), then
    EXECUTEd under plan_cache_mode = force_generic_plan."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
    for n, name in enumerate(names, 1):
        sql = sql.replace(f"%({name})s", f"${n}")
    execute = connection.ops.compose_sql(
        f"EXPLAIN EXECUTE leases_generic ({', '.join(['%s'] * len(names))})",
        [values[name] for name in names],
    )
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute(f"PREPARE leases_generic AS {sql}")
            cursor.execute(execute)
            plan = "\n".join(row[0] for row in cursor.fetchall())
    finally:
        # Outside the atomic block, which a failed EXECUTE rolled back: PREPARE is not
        # undone by a rollback.
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_prepared_statements WHERE name = 'leases_generic'")
            if cursor.fetchone():
                cursor.execute("DEALLOCATE leases_generic")
    # Made without the values: its LIMIT is PostgreSQL's guess, not the one passed (which a
    # custom plan would show as its row estimate).
    limit_rows = re.search(r"Limit  \(cost=\S+ rows=(\d+)", plan)
    assert limit_rows and int(limit_rows.group(1)) != values["limit"], plan
    return plan


def test_the_woken_claim_on_200000_rows_is_an_ordered_scan_of_the_due_index():
    """A worker woken by NOTIFY claims with settle=False: on PostgreSQL the short
    _PG_CLAIM_DUE (due pending jobs only), the statement claim() then sends, served by the
    due index with no sequential scan. Invariant 3 at scale: it still finds the due jobs."""
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("the plan is checked on PostgreSQL, the production target")
    load_rows()
    for queues in (["default", "emails"], None):
        statement = pg_claim_statement("w", queues, 10, settle=False, rows=True)
        # Plain rows answer the columns a ClaimedJob holds, not every column of the row.
        assert "RETURNING j.*" not in statement and "j.result" not in statement
        assert "leases_job_claimed_idx" not in explain(statement)
        assert_due_claim_plan_uses_indexes(explain(statement))
        with CaptureQueriesContext(connection) as sent:
            claimed = Job.objects.claim_rows("w", queues, limit=10, settle=False)
        assert len(claimed) == 10
        assert {c.was_state for c in claimed} == {"pending"}
        assert [q["sql"] for q in sent.captured_queries] == [statement], sent.captured_queries
        # Prepared, the same statement may run on its generic plan: the same ordered scan.
        from django_leases.claiming import _ROW_RETURNING, ClaimVerbs
        from django_leases.lease_statements import pg_sql

        generic = explain_generic(
            pg_sql(
                ClaimVerbs._PG_CLAIM_DUE,
                Job,
                connection.alias,
                all_queues=queues is None,
                returning=_ROW_RETURNING,
            ),
            {"worker": "w", "queues": queues, "limit": 10, "lease": None},
        )
        assert_due_claim_plan_uses_indexes(generic)
    # The acks of a busy worker ride with its woken claim: one statement, whose ack finds
    # its rows by primary key and whose claim is the same ordered scan of the due index.
    held = Job.objects.claim_rows("w", ["default", "emails"], limit=10, settle=False)
    ack_claim = pg_ack_claim_statement(held, ["default", "emails"], 10)
    assert f"Index Scan using {Job._meta.db_table}_pkey" in explain(ack_claim)
    assert_due_claim_plan_uses_indexes(explain(ack_claim))
    with CaptureQueriesContext(connection) as sent:
        acked, claimed = Job.objects.ack_and_claim_rows(
            [(c, None) for c in held], "w", ["default", "emails"], limit=10
        )
    assert acked == {c.pk for c in held} and len(claimed) == 10
    assert [q["sql"] for q in sent.captured_queries] == [ack_claim], sent.captured_queries
    # The check can fail: without the due index the pending jobs are sorted, not scanned
    # in order (DROP INDEX is transactional: rolled back).
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX leases_job_due_idx")
            with pytest.raises(AssertionError):
                assert_due_claim_plan_uses_indexes(explain(statement))
            with pytest.raises(AssertionError):
                assert_due_claim_plan_uses_indexes(explain(ack_claim))
        transaction.set_rollback(True)


def pg_ack_claim_statement(claims, queues, limit):
    """The statement ack_and_claim_rows() sends on PostgreSQL for ``claims`` (results None)."""
    from django_leases.claiming import _ROW_RETURNING
    from django_leases.lease_statements import pg_sql
    from django_leases.owner_writes import OwnerVerbs, _ack_params

    sql = pg_sql(
        OwnerVerbs._PG_ACK_CLAIM_DUE,
        Job,
        connection.alias,
        all_queues=queues is None,
        returning=_ROW_RETURNING,
    )
    params = {"worker": "w", "queues": queues, "limit": limit, "lease": None}
    params.update(_ack_params([(c, None) for c in claims], {c.pk: None for c in claims}))
    return connection.ops.compose_sql(sql, params)


def load_jobs(pending, finished, claimed=0):
    """``finished`` jobs finished over the last 60 days (96 % succeeded, 3 % dead, 1 %
    cancelled), ``claimed`` claims of which half have expired, and ``pending`` due jobs."""
    table = Job._meta.db_table
    columns = (
        "queue_name, task_path, args, kwargs, priority, state, available_at, lease_seconds, "
        "lease_expires_at, claim_token, fence, attempts, max_attempts, leases_lost, claimed_by, "
        "heartbeat_at, enqueued_at, finished_at, on_lease_lost, dead_reason"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO {table} ({columns})
            SELECT 'default', 'tests.testapp.tasks.add', '[]', '{{}}', 0,
                CASE WHEN i %% 100 < 96 THEN 'succeeded' WHEN i %% 100 < 99 THEN 'dead'
                     ELSE 'cancelled' END,
                t, 30, NULL, NULL, 1, 1, 5, 0, 'w', t, t, t + interval '1 second', 'retry', ''
            FROM generate_series(1, %s) AS i,
                 LATERAL (SELECT now() - interval '60 days' * (1 - i::float8 / %s)) AS tt(t)""",
            [finished, max(finished, 1)],
        )
        cursor.execute(
            f"""INSERT INTO {table} ({columns})
            SELECT 'default', 'tests.testapp.tasks.add', '[]', '{{}}', 0, 'claimed', now(), 30,
                now() + (CASE WHEN i %% 2 = 0 THEN 1 ELSE -1 END) * interval '1 minute',
                md5(i::text)::uuid, 1, 1, 5, 0, 'w', now(), now(), NULL, 'retry', ''
            FROM generate_series(1, %s) AS i""",
            [claimed],
        )
        cursor.execute(
            f"""INSERT INTO {table} ({columns})
            SELECT 'default', 'tests.testapp.tasks.add', '[]', '{{}}', 0, 'pending',
                now() - interval '1 minute', 30, NULL, NULL, 0, 0, 5, 0, '', NULL, now(), NULL,
                'retry', ''
            FROM generate_series(1, %s) AS i""",
            [pending],
        )
        cursor.execute(f"VACUUM ANALYZE {table}")


def claim_profile(statement):
    """The claim's plan (node types and index names, in order) and the pages its scans read
    (shared buffers hit or read by every node that reads a relation), from EXPLAIN ANALYZE
    in a transaction that is rolled back."""

    def walk(node):
        yield node
        for child in node.get("Plans", []):
            yield from walk(child)

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}")
        raw = cursor.fetchone()[0]
        transaction.set_rollback(True)
    plan = (raw if isinstance(raw, list) else json.loads(raw))[0]["Plan"]
    nodes = [(n["Node Type"], n.get("Index Name")) for n in walk(plan)]
    # Scans only: a ModifyTable node's counts include the scans below it.
    pages = sum(
        n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0)
        for n in walk(plan)
        if n["Node Type"].endswith("Scan") and "Relation Name" in n
    )
    return nodes, pages


def test_the_claim_reads_as_few_pages_beside_200000_finished_jobs_as_without_them():
    """Invariant 3 at scale: months of finished jobs do not slow the claim. The claim of a
    table of 2,000 pending jobs and 20 claims, then of the same beside 200,000 finished
    jobs (with the statistics ANALYZE gives each): the same plan, node for node, and its
    scans read about as many pages. Pages, not milliseconds: the count does not depend on
    the machine, and it is what a scan of the finished jobs would multiply."""
    if connection.vendor != "postgresql":
        pytest.skip("the plan is checked on PostgreSQL, the production target")
    statement = pg_claim_statement("w", ["default"], 10)
    load_jobs(pending=2000, finished=0, claimed=20)
    small_nodes, small_pages = claim_profile(statement)
    load_jobs(pending=0, finished=ROWS, claimed=0)
    big_nodes, big_pages = claim_profile(statement)
    assert big_nodes == small_nodes, (small_nodes, big_nodes)
    assert ("Index Scan", "leases_job_due_idx") in big_nodes, big_nodes
    assert big_pages <= small_pages * 1.5 + 16, (small_pages, big_pages)

    # The check can fail: without the indexes that find pending jobs apart from finished
    # ones, the claim reads the finished jobs too (rolled back).
    with transaction.atomic():
        with connection.cursor() as cursor:
            for index in ("leases_job_due_idx", "leases_job_finished_idx", "leases_job_census_idx"):
                cursor.execute(f"DROP INDEX {index}")
        nodes, pages = claim_profile(statement)
        transaction.set_rollback(True)
    assert nodes != small_nodes
    assert pages > 5 * (small_pages * 1.5 + 16), (small_pages, pages)
