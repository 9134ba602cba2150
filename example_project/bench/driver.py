"""Enqueue side of one system, run inside that system's own virtualenv.

    BENCH_SYSTEM=leases DJANGO_SETTINGS_MODULE=sys_leases.settings python driver.py prefill 10000

Commands print one JSON line on stdout. The harness (run.py) never imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import django  # noqa: E402

django.setup()

SYSTEM = os.environ["BENCH_SYSTEM"]


def _tasks():
    import importlib

    return importlib.import_module(f"sys_{SYSTEM}.tasks")


def enqueue_one(name: str, *args) -> None:
    """One job through the system's public enqueue API, in its own transaction."""
    task = getattr(_tasks(), name)
    if SYSTEM == "procrastinate":
        params = dict(
            zip(
                {"stamp": ["sent"], "sleep_stamp": ["seconds", "tag"]}.get(name, []),
                args,
                strict=True,
            )
        )
        task.defer(**params)
    else:
        task.enqueue(*args)


def enqueue_bulk(count: int) -> str:
    """``count`` no-op jobs in one transaction; answer which API did it."""
    from django.db import transaction
    from django.utils import timezone

    tasks = _tasks()
    if SYSTEM == "procrastinate":
        tasks.noop.batch_defer(*[{} for _ in range(count)])
        return "task.batch_defer (public API)"
    if SYSTEM == "ox":
        from django_ox.bulk import enqueue_many

        enqueue_many(tasks.noop, [((), {}) for _ in range(count)])
        return "django_ox.bulk.enqueue_many (public API)"
    if SYSTEM == "leases" and hasattr(tasks.noop, "enqueue_many"):
        with transaction.atomic():
            tasks.noop.enqueue_many([((), {}) for _ in range(count)])
        return "LeaseTask.enqueue_many (public API)"
    if SYSTEM == "leases":
        from django_leases import conf
        from django_leases.models import Job

        lease, attempts = conf.get_options(None).for_queue("default")
        with transaction.atomic():
            Job.objects.bulk_create(
                [
                    Job(
                        task_path=tasks.noop.module_path,
                        queue_name="default",
                        args=[],
                        kwargs={},
                        lease_seconds=lease,
                        max_attempts=attempts,
                    )
                    for _ in range(count)
                ],
                batch_size=2000,
            )
        return "Job.objects.bulk_create (no public bulk API)"
    if SYSTEM == "tasksdb":
        import uuid

        from django_tasks_db.models import DBTaskResult, get_date_max

        with transaction.atomic():
            DBTaskResult.objects.bulk_create(
                [
                    DBTaskResult(
                        id=uuid.uuid4(),
                        args_kwargs={"args": [], "kwargs": {}},
                        priority=0,
                        task_path=tasks.noop.module_path,
                        queue_name="default",
                        run_after=get_date_max(),
                        backend_name="default",
                        exception_class_path="",
                        traceback="",
                        enqueued_at=timezone.now(),
                    )
                    for _ in range(count)
                ],
                batch_size=2000,
            )
        return "DBTaskResult.objects.bulk_create (no public bulk API)"
    raise SystemExit(f"unknown system {SYSTEM}")


def cmd_prefill(a) -> dict:
    started = time.perf_counter()
    api = enqueue_bulk(a.count)
    return {"count": a.count, "seconds": time.perf_counter() - started, "api": api}


def cmd_enqueue_rate(a) -> dict:
    enqueue_one("noop")  # warm up: imports, first connection
    started = time.perf_counter()
    for _ in range(a.single):
        enqueue_one("noop")
    single = time.perf_counter() - started
    started = time.perf_counter()
    api = enqueue_bulk(a.bulk)
    bulk = time.perf_counter() - started
    return {"single_per_s": a.single / single, "bulk_per_s": a.bulk / bulk, "bulk_api": api}


def cmd_enqueue_profile(a) -> dict:
    """cProfile of ``count`` one-per-transaction enqueues: where an enqueue's time goes."""
    import cProfile
    import pstats

    from django.db import connection

    enqueue_one("noop")
    statements = []

    def count(execute, sql, params, many, context):
        statements.append(sql.split()[0])
        return execute(sql, params, many, context)

    profiler = cProfile.Profile()
    with connection.execute_wrapper(count):
        profiler.enable()
        for _ in range(a.count):
            enqueue_one("noop")
        profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = []
    for (file, line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        where = file.rsplit("site-packages/", 1)[-1].replace(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/", ""
        )
        rows.append((ct, f"{func} ({where}:{line})"))
    rows.sort(reverse=True)
    return {
        "per_enqueue_ms": 1000 * total / a.count,
        "statements_per_enqueue": len(statements) / a.count,
        "statement_kinds": sorted(set(statements)),
        "top_cumulative": [(name, round(100 * ct / total, 1)) for ct, name in rows[:25]],
    }


def cmd_enqueue_breakdown(a) -> dict:
    """Where a one-per-transaction enqueue's time goes: the same INSERT taken from the raw
    loop to task.enqueue() one layer at a time, interleaved, median microseconds per job."""
    import statistics

    import psycopg
    from common import dsn
    from django.db import connection
    from limit import INSERT as LIMIT_INSERT
    from psycopg.types.json import Jsonb

    from django_leases import enqueue
    from django_leases.models import Job

    task = _tasks().noop
    fields = task.get_backend()._job_fields(task)
    # The statement task.enqueue() sends for this task: its options bound in, the args and
    # kwargs as parameters, id and enqueued_at returned.
    ours = enqueue._pg_bound_sql(Job, "default", fields, enqueue._RETURNED[:2])
    params = ["[]", "{}"]
    limit = psycopg.connect(
        dsn(os.environ.get("BENCH_DB_PREFIX", "bench_") + "limit"), autocommit=True
    )
    own = psycopg.connect(dsn(os.environ["BENCH_DB"]), autocommit=True)
    prepared, client = own.cursor(), psycopg.ClientCursor(own)

    def django_cursor() -> None:
        with connection.cursor() as cursor:
            cursor.execute(ours, params)
            cursor.fetchone()

    steps = {
        "raw INSERT into limit_job, prepared (the limit)": lambda: limit.execute(
            LIMIT_INSERT, (task.module_path, Jsonb([]))
        ),
        "raw INSERT of the same columns into django_leases_job, prepared": lambda: prepared.execute(
            LEASES_PLAIN_INSERT, (task.module_path,)
        ),
        "the statement task.enqueue() sends, raw, prepared": lambda: (
            prepared.execute(ours, params),
            prepared.fetchone(),
        ),
        "the same, bound client-side and not prepared (Django's default)": lambda: (
            client.execute(ours, params),
            client.fetchone(),
        ),
        "the same through Django's cursor": django_cursor,
        "task.enqueue()": task.enqueue,
    }
    spent: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, step in steps.items():
            for _ in range(10):
                step()
            started = time.perf_counter()
            for _ in range(a.count):
                step()
            spent[name].append(1e6 * (time.perf_counter() - started) / a.count)
    return {
        "us_per_job": {name: round(statistics.median(v), 1) for name, v in spent.items()},
        "count": a.count,
        "rounds": a.rounds,
    }


LEASES_PLAIN_INSERT = """
INSERT INTO django_leases_job (queue_name, task_path, args, kwargs, priority, state,
    lease_seconds, fence, attempts, max_attempts, leases_lost, claimed_by, on_lease_lost, dead_reason)
VALUES ('default', %s, '[]'::jsonb, '{}'::jsonb, 0, 'pending', 30, 0, 0, 5, 0, '', 'retry', '')
"""


def cmd_feed(a) -> dict:
    """Enqueue one latency job at a time, each stamped with the moment before enqueue()."""
    enqueue_one("noop")
    for _ in range(a.count):
        time.sleep(random.uniform(a.gap * 0.5, a.gap * 1.5))
        enqueue_one("stamp", time.time())
    return {"sent": a.count}


def cmd_submit_sleep(a) -> dict:
    enqueue_one("sleep_stamp", a.seconds, a.tag)
    return {"submitted": a.tag}


def cmd_hold(a) -> dict:
    """Claim ``count`` jobs as one holder and renew them every ``period`` seconds, the way a
    worker's heartbeat does (one Job.objects.renew call), until SIGTERM."""
    from django.db import connection, transaction

    from django_leases import conf
    from django_leases.models import Job

    lease, attempts = conf.get_options(None).for_queue("held")
    with transaction.atomic():
        Job.objects.bulk_create(
            [
                Job(
                    task_path=_tasks().noop.module_path,
                    queue_name="held",
                    args=[],
                    kwargs={},
                    lease_seconds=lease,
                    max_attempts=attempts,
                )
                for _ in range(a.count)
            ],
            batch_size=2000,
        )
    started = time.perf_counter()
    jobs = Job.objects.claim("bench-holder", ["held"], limit=a.count)
    claim_seconds = time.perf_counter() - started
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sys.stdout.write(json.dumps({"ready": len(jobs)}) + "\n")
    sys.stdout.flush()
    renewals = []
    while not stop:
        deadline = time.monotonic() + a.period
        while not stop and time.monotonic() < deadline:
            time.sleep(0.05)
        if stop:
            break
        statements: list[str] = []

        def count(execute, sql, params, many, context, statements=statements):
            statements.append(sql)
            return execute(sql, params, many, context)

        started = time.perf_counter()
        with connection.execute_wrapper(count):
            held = Job.objects.renew(jobs)
        renewals.append(
            {
                "seconds": time.perf_counter() - started,
                "statements": len(statements),
                "held": len(held),
                "at": time.time(),
            }
        )
    return {
        "claimed": len(jobs),
        "claim_seconds": claim_seconds,
        "period": a.period,
        "renewals": renewals,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("count", type=int)
    p = sub.add_parser("enqueue-rate")
    p.add_argument("--single", type=int, default=2000)
    p.add_argument("--bulk", type=int, default=10000)
    p = sub.add_parser("enqueue-profile")
    p.add_argument("--count", type=int, default=1000)
    p = sub.add_parser("enqueue-breakdown")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--rounds", type=int, default=9)
    p = sub.add_parser("feed")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--gap", type=float, default=0.05)
    p = sub.add_parser("submit-sleep")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--tag", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--period", type=float, default=10.0)
    a = parser.parse_args()
    out = globals()["cmd_" + a.cmd.replace("-", "_")](a)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
