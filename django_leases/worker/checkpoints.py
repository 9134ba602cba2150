"""A handler's checkpoint, sent from the thread or child process that runs the handler.

The conditional UPDATE goes out on the handler's own connection, so inside ``fenced()`` the
cursor commits or rolls back with the handler's writes: a kill between them can neither
skip items nor, on SQLite, leave the handler waiting for a lock it holds itself. The stamp
the watchdog reads moves only once the UPDATE has committed, since a rolled-back
checkpoint renewed nothing: the watchdog may underestimate a lease, never overestimate it.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from django.db import transaction

from ..api import JobHandle

logger = logging.getLogger("django_leases.worker")


def store_checkpoint(handle: JobHandle, cursor: Any) -> bool:
    """Store ``cursor`` and renew the lease if the claim still holds; False if it is lost."""
    from ..models import Job

    started = time.monotonic()
    held = Job.objects.using(handle.database).checkpoint(handle.claim, cursor)
    if held:
        transaction.on_commit(functools.partial(_renewed, handle, started), using=handle.database)
        logger.debug(
            "Checkpoint job=%s fence=%s worker=%s",
            handle.job_id,
            handle.fence,
            handle.worker_id,
            extra={
                "event": "checkpoint",
                "job_id": handle.job_id,
                "fence": handle.fence,
                "worker": handle.worker_id,
            },
        )
    else:
        logger.warning(
            "Checkpoint rejected job=%s fence=%s worker=%s: the claim is lost",
            handle.job_id,
            handle.fence,
            handle.worker_id,
            extra={
                "event": "checkpoint_rejected",
                "job_id": handle.job_id,
                "fence": handle.fence,
                "worker": handle.worker_id,
            },
        )
    return held


def _renewed(handle: JobHandle, started: float) -> None:
    handle._stamp.value = started
