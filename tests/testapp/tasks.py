"""Tasks the tests enqueue through django.tasks."""

from __future__ import annotations

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
