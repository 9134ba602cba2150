"""Enqueue-to-start latency of an idle worker, measured on the database clock (on demand).

    DATABASE_URL=mysql://root@127.0.0.1:3306/leases_latency python tests/perf_latency.py --poll 0.25
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/leases_latency python tests/perf_latency.py

The database must exist; the script migrates it, starts one run_lease_worker, enqueues jobs
one at a time at random intervals and reads last_attempted_at - enqueued_at (both written by
the database) for each. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--notify", choices=["on", "off"], default="on")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from django_leases.models import Job
    from django_leases.states import JobState

    call_command("migrate", verbosity=0)
    Job.objects.all().delete()
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        LEASES_WORKER_DB_NAME=connection.settings_dict["NAME"],
        LEASES_WORKER_NOTIFY="1" if args.notify == "on" else "0",
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "django",
            "run_lease_worker",
            "--settings=tests.worker_settings",
            "--poll",
            str(args.poll),
            "--concurrency",
            "4",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2)  # let it start and go idle
        ids = []
        for _ in range(args.jobs):
            ids.append(Job.objects.enqueue("tests.testapp.tasks.noop", []).pk)
            time.sleep(random.uniform(0.05, 2 * args.poll))
        deadline = time.monotonic() + 30
        while Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() < len(ids):
            if time.monotonic() > deadline:
                raise SystemExit("jobs did not finish")
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(30)
    waits = sorted(
        (j.last_attempted_at - j.enqueued_at).total_seconds() * 1000
        for j in Job.objects.filter(pk__in=ids)
    )
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    print(
        f"{connection.vendor} {connection.Database.__name__} poll={args.poll}s notify={args.notify} "
        f"jobs={len(waits)}: enqueue-to-start p50 {statistics.median(waits):.0f} ms, "
        f"p99 {p99:.0f} ms, max {waits[-1]:.0f} ms"
    )


if __name__ == "__main__":
    main()
