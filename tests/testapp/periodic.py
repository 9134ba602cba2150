"""Tasks that declare schedules with ``@task(schedule=...)`` (Django 6.1). Not an app's
tasks module, so the workers of other tests never sync these; tests/test_schedules_db.py
imports it."""

from __future__ import annotations

from django.tasks import task

from django_leases.schedules import Periodic


@task(schedule=Periodic(every=60, args=[2, 3], name="tests.every-minute"))
def scheduled_add(a: int, b: int) -> int:
    return a + b


@task(
    schedule=[
        Periodic(cron="30 2 * * *", timezone="Europe/Paris", name="tests.nightly"),
        Periodic(every=3600, overlap="skip", misfire="skip", name="tests.hourly"),
    ]
)
def housekeeping() -> None:
    """Two schedules on one task."""
