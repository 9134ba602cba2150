"""Renewals and the watchdog, each on its own thread, never on a handler's.

The heartbeat renews every claim the process holds in one statement per period (and
touches the worker's own row); a claim missing from the answer is lost. The watchdog
covers the case the heartbeat cannot: renewals failing or hanging while the database is
unreachable. It compares time.monotonic() with the moment just before the last claim or
renewal statement was sent, so its estimate of the lease errs on the short side.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from django.db import DatabaseError, connections

from .claims import ClaimBook

logger = logging.getLogger("django_leases.worker")

# Longest the heartbeat thread sleeps before looking at the claims it must renew again.
_SLICE = 0.25


class Heartbeat(threading.Thread):
    def __init__(self, *, book: ClaimBook, database: str, worker_id: str, period: float,
                 lease: float | None) -> None:
        super().__init__(name="leases-heartbeat", daemon=True)
        self.book = book
        self.database = database
        self.worker_id = worker_id
        self.period = period
        self.lease = lease
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        from ..models import Job, WorkerProcess

        delay = self.period
        last = time.monotonic()
        try:
            # Wake in short slices: a claim with a lease shorter than the period may arrive
            # mid-wait, and must be renewed within a third of its own lease.
            while not self._stop_event.wait(min(delay, self._period(), _SLICE)):
                if time.monotonic() - last < min(delay, self._period()):
                    continue
                last = time.monotonic()
                try:
                    self.beat(Job, WorkerProcess)
                    delay = self._period()
                except DatabaseError as e:
                    logger.warning("Renewal failed worker=%s error=%s; retrying", self.worker_id,
                                   str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                    _reset(self.database)
                    # Retry sooner than a full period: every missed beat eats into the lease.
                    delay = min(self._period(), max(0.2, self.period / 4))
        finally:
            connections[self.database].close()

    def _period(self) -> float:
        """The configured period, shortened to a third of the shortest lease held (jobs of
        a queue or task with its own, shorter lease must not expire between beats)."""
        leases = [c.lease for c in self.book.renewable()]
        return min([self.period, *(lease / 3 for lease in leases)])

    def beat(self, Job: Any, WorkerProcess: Any) -> None:
        claims = self.book.renewable()
        started = time.monotonic()
        statements = 0

        def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            nonlocal statements
            statements += 1
            return execute(sql, params, many, context)

        held: set[Any] = set()
        if claims:
            # Connect first: a fresh connection's own setup statements are not renewals.
            connections[self.database].ensure_connection()
            with connections[self.database].execute_wrapper(count):
                held = Job.objects.using(self.database).renew([c.job for c in claims], self.lease)
        WorkerProcess.objects.using(self.database).seen(self.worker_id)
        lost = 0
        for claim in claims:
            if claim.pk in held:
                claim.stamp.value = started
            elif claim.mark_lost("renewal matched no row: the lease ran out and the job was "
                                 "claimed again, or it was cancelled"):
                lost += 1
                logger.warning("Lost claim job=%s fence=%s worker=%s: renewal matched no row; "
                               "telling its handler to stop", claim.pk, claim.job.fence,
                               self.worker_id)
        if claims:
            logger.debug("Renewed %d of %d claims in %d statement(s) worker=%s lost=%d",
                         len(held), len(claims), statements, self.worker_id, lost)


class Watchdog(threading.Thread):
    """Declare a claim lost once its lease has run out by the local monotonic estimate."""

    def __init__(self, *, book: ClaimBook, worker_id: str, period: float) -> None:
        super().__init__(name="leases-watchdog", daemon=True)
        self.book = book
        self.worker_id = worker_id
        self.period = period
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        # Checking a few times per heartbeat period keeps the notice well within one period.
        while not self._stop_event.wait(self.period / 4):
            now = time.monotonic()
            for claim in self.book.all():
                if claim.expired_locally(now) and claim.mark_lost(
                        "no renewal succeeded for longer than the lease"):
                    logger.warning("Lost claim job=%s fence=%s worker=%s: no renewal succeeded "
                                   "for %.1f s (lease %g s); telling its handler to stop",
                                   claim.pk, claim.job.fence, self.worker_id,
                                   now - claim.stamp.value, claim.lease)


def _reset(database: str) -> None:
    """Drop this thread's broken connection; the next query opens a fresh one."""
    with contextlib.suppress(DatabaseError):
        connections[database].close()
