"""Keeping a side effect from happening twice when a lease expired under a live handler.

A lease gives at-least-once execution. These helpers narrow what a second execution can do:

- ``fenced()``: the handler's own database writes commit only if its claim is still held at
  commit time; a handler that lost its claim (paused, partitioned) commits nothing.
- ``once(key)``: record that an effect happened, in the effect's own transaction, so a later
  attempt of the same job skips it.
- ``fenced_update()``: apply a write to a row only if the row's stored fence is not newer.
- ``current_job().idempotency_key``: the same for every attempt of a job, for APIs that
  deduplicate on their side (payment providers and the like).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import IntegrityError, models, transaction
from django.db.models import Q

from .api import JobHandle, current_job
from .exceptions import LeaseLost


def _handle(handle: JobHandle | None) -> JobHandle:
    handle = handle or current_job()
    if handle is None:
        raise RuntimeError("fenced()/once() must run inside a job handler (current_job() is None)")
    return handle


@contextmanager
def fenced(
    *, ack: bool = False, result: Any = None, handle: JobHandle | None = None
) -> Iterator[None]:
    """Run the block in a transaction on the jobs' database that commits only if the claim
    is still held when it ends; raise LeaseLost (and roll back) otherwise.

    At the end of the block the job row is updated conditionally on the claim token (a
    renewal, or the acknowledgement itself with ``ack=True``). That UPDATE both checks the
    claim and locks the row until commit, so no other worker can take the job over between
    the check and the commit. With ``ack=True`` the job is acknowledged with ``result`` in
    the same transaction as the block's writes, and the worker does not acknowledge again.
    """
    from .models import Job

    job = _handle(handle)
    job.raise_if_lost()
    jobs = Job.objects.using(job.database)
    with transaction.atomic(using=job.database):
        yield
        held = jobs.ack(job.claim, result) if ack else bool(jobs.renew([job.claim]))
        if not held:
            job._mark_lost()
            raise LeaseLost(
                f"job {job.job_id}: claim with fence {job.fence} was lost; "
                "the block's writes were rolled back"
            )
        if ack:
            # Acked only once the ack commits: inside the caller's own transaction it may
            # still roll back, and the worker must then record the outcome itself.
            transaction.on_commit(functools.partial(job._mark_acked, result), using=job.database)


def once(key: str, *, handle: JobHandle | None = None) -> bool:
    """Record effect ``key`` for this job; True the first time, False if an earlier attempt
    already recorded it. Call it inside the transaction that makes the effect (``fenced()``),
    so the record and the effect commit or roll back together."""
    from .models import JobEffect

    job = _handle(handle)
    try:
        with transaction.atomic(using=job.database):
            JobEffect.objects.using(job.database).create(
                job_id=job.job_id, key=key, fence=job.fence
            )
    except IntegrityError:
        return False
    return True


def fenced_update(
    queryset: models.QuerySet[Any], fence: int, *, fence_field: str = "fence", **values: Any
) -> int:
    """Update the rows of ``queryset`` whose stored fence is not newer than ``fence``, and
    store ``fence`` with the values; return how many rows changed (0: a newer writer won)."""
    newer_or_equal = Q(**{f"{fence_field}__lte": fence}) | Q(**{f"{fence_field}__isnull": True})
    return queryset.filter(newer_or_equal).update(**values, **{fence_field: fence})
