"""The backend's task class: django.tasks' Task plus per-task lease options.

On Django 6.1+ ``@task(lease=120, max_attempts=10)`` reaches these fields; Django 6.0's
decorator passes no extra arguments, so there the options come from
``OPTIONS["QUEUE_OPTIONS"]`` per queue (see conf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.tasks import Task


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTask(Task):
    # Seconds a claim of this task's jobs stays valid without renewal (None: queue/backend).
    lease: float | None = None
    # Claims a job may use before it is dead-lettered (None: queue/backend default).
    max_attempts: int | None = None
