"""Tasks the tests enqueue through django.tasks."""

from __future__ import annotations

import django
from django.tasks import task


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_receipt(order_id: int) -> str:
    return f"receipt {order_id}"


def not_a_task() -> None:
    """A module-level function that was never declared with @task."""


# -- tasks for the worker tests (tests/test_worker_*.py) --------------------------------


def _effect(key: str, phase: str) -> None:
    import os

    from django_leases.api import current_job

    from .models import Effect

    job = current_job()
    Effect.objects.create(key=key, job_id=job.job_id, fence=job.fence,
                          worker_id=job.worker_id, pid=os.getpid(), phase=phase)


@task
def record(key: str, first_seconds: float = 0.0, later_seconds: float = 0.0) -> dict:
    """Write a start effect, sleep (stopping at once if the claim is lost), write a done
    effect. The first claim sleeps ``first_seconds``, later claims ``later_seconds``."""
    from django_leases.api import current_job

    job = current_job()
    _effect(key, "start")
    job.sleep(first_seconds if job.fence == 1 else later_seconds)
    _effect(key, "done")
    return {"fence": job.fence, "worker": job.worker_id}


@task
def stubborn(key: str, seconds: float) -> dict:
    """Ignore cancellation entirely, as a handler stuck in a C call would."""
    import time

    from django_leases.api import current_job

    _effect(key, "start")
    time.sleep(seconds)
    _effect(key, "done")
    return {"fence": current_job().fence}


@task
def hold(seconds: float) -> None:
    """Keep the claim for a while without touching the database."""
    from django_leases.api import current_job

    current_job().sleep(seconds)


@task
def noop() -> None:
    return None


@task
async def async_record(key: str, seconds: float) -> dict:
    """An async handler: cancelled (CancelledError) when its claim is lost."""
    import asyncio

    from asgiref.sync import sync_to_async

    await sync_to_async(_effect)(key, "start")
    await asyncio.sleep(seconds)
    await sync_to_async(_effect)(key, "done")
    return {"done": True}


@task
def boom() -> None:
    raise ValueError("boom")


def build_report(name: str) -> str:
    """Decorated inside tests with per-task lease options (Django 6.1+ passes them through)."""
    return name


@task
def count_up(steps: int, pause: float) -> int:
    """Checkpoint a counter every ``pause`` seconds, resuming from the stored cursor."""
    import time

    from django_leases.api import current_job

    job = current_job()
    start = job.cursor or 0
    for i in range(start + 1, steps + 1):
        time.sleep(pause)
        job.checkpoint(i)
    return steps


class CardDeclined(Exception):
    """Retrying cannot help: the task lists it as non-retryable (Django 6.1+)."""


def declined() -> None:
    raise CardDeclined("card declined")


if django.VERSION >= (6, 1):
    charge_card = task(non_retryable=(CardDeclined,))(declined)


@task
def refuse() -> None:
    from django_leases.exceptions import NonRetryable

    raise NonRetryable("the order was already refunded")


@task
def crash_worker() -> None:
    """Kill the whole worker process, as a segfaulting extension or an OOM kill would."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@task
def backfill(total: int, batch: int, pause: float) -> int:
    """Process items [cursor, total) in batches; each batch's rows and its checkpoint commit
    together in one fenced transaction, so a killed run resumes exactly where it stopped."""
    import time

    from django_leases.api import current_job
    from django_leases.fencing import fenced

    from .models import ItemLog

    job = current_job()
    start = (job.cursor or {}).get("next", 0)
    for lo in range(start, total, batch):
        hi = min(lo + batch, total)
        with fenced():
            ItemLog.objects.bulk_create([ItemLog(item=i, fence=job.fence) for i in range(lo, hi)])
            job.checkpoint({"next": hi})
        time.sleep(pause)
    return total


@task
def late_fenced_write(key: str, seconds: float) -> None:
    """Ignore cancellation for ``seconds``, then write an effect inside fenced(): a handler
    whose claim was taken over meanwhile must commit nothing."""
    import time

    from django_leases.fencing import fenced

    time.sleep(seconds)
    with fenced():
        _effect(key, "fenced")
