"""Time the job changelist over a million jobs on PostgreSQL. Run on demand, not by pytest.

    createdb -h 127.0.0.1 -U postgres leases_admin_perf
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/leases_admin_perf \\
        .venv/bin/python tests/perf_admin.py [--rows 1000000] [--reload] [--runs 7]

Loads the rows with one INSERT ... SELECT generate_series (about half a minute), VACUUM
ANALYZEs, then requests each page through Django's test Client as a superuser and prints
the median and the slowest of ``--runs`` requests. Exits 1 if a median is over the budget.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

BUDGET_MS = 500.0
TASKS = [f"shop.tasks.task_{n:02d}" for n in range(11)] + ["shop.tasks.rare"]

# One statement: states by i % 1000 (87 % succeeded, 5 % pending, 4 % dead, 3 % cancelled,
# 1 % claimed, of which a third expired and a third stalled), three queues plus a rare one.
LOAD_SQL = """
INSERT INTO django_leases_job (
    queue_name, task_path, args, kwargs, priority, state, available_at, lease_seconds,
    lease_expires_at, claim_token, fence, attempts, max_attempts, leases_lost, claimed_by,
    heartbeat_at, cursor, result, enqueued_at, started_at, last_attempted_at, finished_at)
SELECT
    CASE WHEN i %% 100000 = 0 THEN 'rare'
         WHEN i %% 7 < 4 THEN 'default' WHEN i %% 7 < 6 THEN 'emails' ELSE 'reports' END,
    CASE WHEN i %% 100000 = 1 THEN %(rare_task)s ELSE (%(tasks)s::text[])[1 + i %% 11] END,
    jsonb_build_array(i, 'order-' || i), '{}'::jsonb, (i %% 3) - 1, s.state,
    t0 - make_interval(secs => (%(rows)s - i) * 0.5),
    60,
    CASE s.state WHEN 'claimed' THEN
        CASE WHEN r < 994 THEN now() - interval '3 minutes' ELSE now() + interval '1 hour' END END,
    CASE s.state WHEN 'claimed' THEN md5(i::text)::uuid END,
    CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END,
    CASE WHEN s.state = 'pending' THEN 0 WHEN s.state = 'dead' THEN 5 ELSE 1 END,
    5, 0,
    CASE WHEN s.state = 'pending' THEN '' ELSE 'worker-' || (i %% 20) END,
    CASE s.state WHEN 'claimed' THEN
        CASE WHEN r < 997 THEN now() - interval '5 minutes' ELSE now() END END,
    NULL,
    CASE s.state WHEN 'succeeded' THEN jsonb_build_object('ok', i) END,
    t0 - make_interval(secs => (%(rows)s - i) * 0.5),
    CASE WHEN s.state <> 'pending' THEN t0 - make_interval(secs => (%(rows)s - i) * 0.5) END,
    CASE WHEN s.state <> 'pending' THEN t0 - make_interval(secs => (%(rows)s - i) * 0.5) END,
    CASE WHEN s.state IN ('succeeded', 'dead', 'cancelled')
         THEN t0 - make_interval(secs => (%(rows)s - i) * 0.5) + interval '2 seconds' END
FROM generate_series(1, %(rows)s) AS g(i)
CROSS JOIN LATERAL (SELECT i %% 1000 AS r) AS rr
CROSS JOIN LATERAL (SELECT CASE
    WHEN r < 870 THEN 'succeeded' WHEN r < 920 THEN 'pending' WHEN r < 960 THEN 'dead'
    WHEN r < 990 THEN 'cancelled' ELSE 'claimed' END AS state) AS s
CROSS JOIN (SELECT now() AS t0) AS t
"""


def load_sql(job_model, rows: int) -> tuple[str, dict]:
    """LOAD_SQL, plus a constant for each NOT NULL column the record has grown since, so the
    script keeps working as fields are added (their Python default, as a parameter)."""
    import json

    from django.db.models import NOT_PROVIDED, JSONField

    named = set(
        re.search(r"INSERT INTO \w+ \((.*?)\)", LOAD_SQL, re.S)
        .group(1)
        .replace(" ", "")
        .replace("\n", "")
        .split(",")
    )
    params = {"rows": rows, "tasks": TASKS[:11], "rare_task": TASKS[11]}
    extra = [
        f
        for f in job_model._meta.concrete_fields
        if f.column not in named
        and not f.primary_key
        and not f.null
        and not getattr(f, "generated", False)
        and f.db_default is NOT_PROVIDED
    ]
    sql = LOAD_SQL
    for f in extra:
        value = f.get_default()
        params[f"x_{f.column}"] = json.dumps(value) if isinstance(f, JSONField) else value
        sql = sql.replace(")\nSELECT", f", {f.column})\nSELECT", 1)
        sql = sql.replace(
            "\nFROM generate_series", f",\n    %(x_{f.column})s\nFROM generate_series", 1
        )
    return sql, params


PAGES = [
    ("jobs, no filter", "/admin/django_leases/job/"),
    ("jobs, page 50", "/admin/django_leases/job/?p=50"),
    ("jobs, page 201 (the last linked)", "/admin/django_leases/job/?p=201"),
    ("state = pending", "/admin/django_leases/job/?state__exact=pending"),
    ("state = dead, queue = emails", "/admin/django_leases/job/?state__exact=dead&queue=emails"),
    ("lease: claimed", "/admin/django_leases/job/?lease=claimed"),
    ("lease: expired", "/admin/django_leases/job/?lease=expired"),
    ("lease: stalled", "/admin/django_leases/job/?lease=stalled"),
    ("queue = reports", "/admin/django_leases/job/?queue=reports"),
    ("queue = rare (1 job in 100,000)", "/admin/django_leases/job/?queue=rare"),
    ("task = rare (1 job in 100,000)", "/admin/django_leases/job/?task=shop.tasks.rare"),
    ("search: job id", "/admin/django_leases/job/?q=777777"),
    ("search: worker id", "/admin/django_leases/job/?q=worker-7"),
    ("search: part of a task", "/admin/django_leases/job/?q=task_07"),
    ("search: part of a rare task", "/admin/django_leases/job/?q=rare"),
    ("job detail", None),
    ("workers", "/admin/django_leases/workerprocess/"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--reload", action="store_true", help="truncate and load again")
    args = parser.parse_args()

    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client, override_settings

    from django_leases.models import Job, WorkerProcess

    if connection.vendor != "postgresql":
        print("Set DATABASE_URL to a scratch PostgreSQL database.", file=sys.stderr)
        return 2
    call_command("migrate", verbosity=0)
    if args.reload or Job.objects.order_by().values("pk")[: args.rows + 1].count() != args.rows:
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE django_leases_jobeffect, django_leases_jobfailure, django_leases_job, "
                "django_leases_workerprocess RESTART IDENTITY CASCADE"
            )
            cursor.execute(*load_sql(Job, args.rows))
            cursor.execute(
                "INSERT INTO django_leases_workerprocess "
                "(worker_id, hostname, pid, queues, started_at, last_seen_at, stopped_at) "
                "SELECT 'worker-' || n, 'host-' || (n % 4), 1000 + n, '[\"default\", \"emails\"]', "
                "now() - interval '1 day', now() - CASE WHEN n < 15 THEN interval '1 second' "
                "ELSE interval '10 minutes' END, NULL FROM generate_series(0, 19) AS n"
            )
            cursor.execute("VACUUM ANALYZE django_leases_job")
            cursor.execute("VACUUM ANALYZE django_leases_workerprocess")
        print(f"loaded {args.rows:,} jobs in {time.perf_counter() - started:.1f} s")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_size_pretty(pg_total_relation_size('django_leases_job'))")
        size = cursor.fetchone()[0]
    print(
        f"{args.rows:,} jobs, table with indexes {size}, PostgreSQL "
        f"{connection.pg_version // 10000}, Django {django.get_version()}, {args.runs} runs each"
    )

    # How busy the machine is while the pages are timed: a page's figures mean little
    # without it (docs/scale.md).
    with connection.cursor() as cursor:
        pings = []
        for _ in range(21):
            t = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchone()
            pings.append((time.perf_counter() - t) * 1000)
    load = ", ".join(f"{n:.2f}" for n in os.getloadavg())
    print(f"bare SELECT 1: median {statistics.median(pings):.2f} ms; load average {load}")

    user, _ = get_user_model().objects.get_or_create(
        username="perf-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    detail = f"/admin/django_leases/job/{Job.objects.order_by('-pk').values_list('pk', flat=True)[:1][0]}/change/"
    slow = []
    print("| page | median ms | max ms | rows shown |\n|---|---:|---:|---|")
    with override_settings(ALLOWED_HOSTS=["testserver"], DEBUG=False):
        for label, url in PAGES:
            url = url or detail
            times = []
            for run in range(args.runs + 1):
                t = time.perf_counter()
                response = client.get(url)
                elapsed = (time.perf_counter() - t) * 1000
                if response.status_code != 200:
                    print(f"{url}: HTTP {response.status_code}", file=sys.stderr)
                    return 1
                if run:  # the first request warms caches
                    times.append(elapsed)
            page = response.content.decode()
            total = re.search(
                r"((?:about |more than )?\d+) (?:jobs?|worker process(?:es)?)\s*"
                r"(?:<a [^>]*showall[^>]*>[^<]*</a>\s*)?</nav>",
                page,
            )
            listed = page.count('name="_selected_action"') or page.count('class="field-worker_id"')
            shown = f"{listed} of {total.group(1)}" if total else ""
            median = statistics.median(times)
            if median > BUDGET_MS:
                slow.append(label)
            print(f"| {label} | {median:.0f} | {max(times):.0f} | {shown} |")
    assert WorkerProcess.objects.exists()
    if slow:
        print(f"over {BUDGET_MS:.0f} ms: {', '.join(slow)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
