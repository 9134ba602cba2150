"""Renewals and the watchdog, each on its own thread, never on a handler's.

The heartbeat renews every claim the process holds in one statement per period (and
touches the worker's own row); a claim missing from the answer is lost. The watchdog
covers the case the heartbeat cannot: renewals failing or hanging while the database is
unreachable. It compares time.monotonic() with the moment just before the last claim or
renewal statement was sent, so its estimate of the lease errs on the short side. Both
survive any exception of one round (vital.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from ..api import LEASE_RAN_OUT
from ..safe_logging import WorkerLogger
from ..storable import first_line
from .claims import RUNNING, ClaimBook, read_back_acks, read_back_held
from .dberrors import DB_ERRORS, outage_met
from .logs import claim_fields
from .repeats import Trouble
from .timeouts import RunTimeouts
from .vital import VitalThread
from .waker import Waker

logger = WorkerLogger()


# Longest the heartbeat thread sleeps before looking at the claims it must renew again.
_SLICE = 0.25
# Longest the watchdog sleeps between looks: how late a run timeout may be noticed.
TIMEOUT_LOOK_SECONDS = 0.5


class Heartbeat(VitalThread):
    role = "heartbeat"

    def __init__(
        self,
        *,
        book: ClaimBook,
        database: str,
        worker_id: str,
        instance: str,
        period: float,
        lease: float | None,
        waker: Waker,
        on_replaced: Callable[[Any], None],
    ) -> None:
        super().__init__(worker_id=worker_id, waker=waker)
        self.book = book
        self.database = database
        self.instance = instance
        # Called once when the worker's row names another process (identity.py), with
        # the row's (hostname, pid) now, or None if the row is gone.
        self.on_replaced: Callable[[Any], None] | None = on_replaced
        self.period = period
        self.lease = lease
        # time.monotonic() just before the last beat that went through began.
        self.beat_ok_at = time.monotonic()
        # When the first beat since then began that has not gone through (failing, or
        # hanging on a half-open connection); None while none has.
        self.trying_since: float | None = None
        self.failing = Trouble("renewal_failed", worker_id)

    def serve(self) -> None:
        from ..models import Job, WorkerProcess

        delay = self.period
        last = time.monotonic()
        nap = min(delay, _SLICE)
        try:
            # Wake in short slices: a claim with a lease shorter than the period may arrive
            # mid-wait, and must be renewed within a third of its own lease.
            while not self._stop_event.wait(nap):
                try:
                    # Wake when the beat is due, not at the next slice: slices of 0.25 s made a
                    # 0.3 s period beat every 0.5 s, and the row says 0.3 s (who looks gone).
                    due = last + min(delay, self._period())
                    if (now := time.monotonic()) < due:
                        nap = min(due - now, _SLICE)
                        continue
                    last = now
                    if self.trying_since is None:
                        self.trying_since = now
                    self.beat(Job, WorkerProcess)
                    self.failing.over()
                    delay = self._period()
                    nap = min(delay, _SLICE)
                except Exception as e:  # noqa: BLE001 -- renewals must outlive any one error
                    if isinstance(e, DB_ERRORS):
                        outage_met(e)
                        self.failing.warn(
                            "Renewal failed worker=%s error=%s; retrying",
                            self.worker_id,
                            first_line(e),
                            error=first_line(e),
                        )
                    else:
                        self.round_failed(e)
                    _reset(self.database)
                    # Retry sooner than a full period: every missed beat eats into the lease.
                    delay = min(self.period, max(0.2, self.period / 4))
                    nap = min(delay, _SLICE)
        finally:
            _reset(self.database)

    def _period(self) -> float:
        """The configured period, shortened to a third of the shortest lease held (jobs of
        a queue or task with its own, shorter lease must not expire between beats)."""
        leases = [c.lease for c in self.book.renewable()]
        return min([self.period, *(lease / 3 for lease in leases)])

    def overdue(self, now: float) -> tuple[float, float] | None:
        """(seconds without a good beat, the lease they outlived) once no beat has gone
        through for longer than the lease: --lease, else the shortest lease held, else
        three periods (the default period is a third of LEASE_SECONDS). None otherwise.

        Counted from the last good beat, or from the oldest claim held if it came later
        and no beat has failed or hung since it: an idle heartbeat beats at its own
        period, and a claim with a shorter lease that arrives mid-wait had nothing to
        renew before it (a 3 s lease claimed 7 s into a 10 s wait is not 7 s overdue).
        A beat tried since the last good one and not through counts from its start, so
        fresh claims never hide a hung or failing heartbeat."""
        claims = self.book.renewable()
        limit = self.lease or min((c.lease for c in claims), default=3 * self.period)
        since = self.beat_ok_at
        if claims:
            excused = min(c.claimed_at for c in claims)
            if (trying := self.trying_since) is not None:
                excused = min(excused, trying)
            since = max(since, excused)
        silent = now - since
        return (silent, limit) if silent > limit else None

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
                held = Job.objects.using(self.database).renew(
                    [c.job for c in claims], self.lease, skip_locked=True
                )
        if not WorkerProcess.objects.using(self.database).seen(self.worker_id, self.instance):
            self._replaced(WorkerProcess)
        self.beat_ok_at, self.trying_since = started, None
        missed = []
        for claim in claims:
            if claim.pk in held:
                claim.link.renewed(started)
            else:
                missed.append(claim)
        # A handler's own fenced ack is no loss: known from its flag, or read back when the
        # renewal came between its commit and the flag. (A finishing claim missed is the
        # worker's ack landing: nothing to read.)
        unheard = [c for c in missed if c.state == RUNNING and not c.acked]
        acked = read_back_acks(Job, self.database, unheard)
        # Skipped, locked by a transaction still open (its handler's fenced() block): still
        # its claim, unrenewed; the watchdog gives it up should its lease run out meanwhile.
        # Unread (database trouble): each is left to the watchdog alike.
        skipped = [c for c in unheard if c.pk not in acked]
        busy = read_back_held(Job, self.database, skipped)
        if busy is None:
            busy = {c.pk for c in skipped}
        lost = 0
        for claim in missed:
            if claim.pk in acked:
                claim.mark_acked()
            elif claim.pk in busy:
                continue
            elif claim.mark_lost(
                "renewal matched no row: the lease ran out and the job was "
                "claimed again, or it was cancelled"
            ):
                lost += 1
                logger.warning(
                    "Lost claim job=%s fence=%s worker=%s: renewal matched no row; "
                    "telling its handler to stop",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    extra=claim_fields(claim.job, self.worker_id, "lost"),
                )
        if claims:
            logger.debug(
                "Renewed %d of %d claims in %d statement(s) worker=%s lost=%d",
                len(held),
                len(claims),
                statements,
                self.worker_id,
                lost,
                extra={
                    "event": "renewed",
                    "worker": self.worker_id,
                    "held": len(held),
                    "claims": len(claims),
                    "statements": statements,
                    "lost": lost,
                },
            )

    def _replaced(self, WorkerProcess: Any) -> None:
        if self.on_replaced is not None:
            holder = (
                WorkerProcess.objects.using(self.database)
                .filter(worker_id=self.worker_id)
                .values_list("hostname", "pid")
                .first()
            )
            self.on_replaced(holder)
            self.on_replaced = None


class Watchdog(VitalThread):
    """Declare a claim lost once its lease has run out by the local monotonic estimate."""

    role = "watchdog"

    def __init__(
        self,
        *,
        book: ClaimBook,
        worker_id: str,
        period: float,
        waker: Waker,
        timeouts: RunTimeouts | None = None,
    ) -> None:
        super().__init__(worker_id=worker_id, waker=waker)
        self.book = book
        self.period = period
        self.timeouts = timeouts

    def serve(self) -> None:
        # Checking a few times per heartbeat period keeps the notice well within one period;
        # a run timeout is noticed within half a second.
        while not self._stop_event.wait(min(self.period / 4, TIMEOUT_LOOK_SECONDS)):
            try:
                self.watch(time.monotonic())
            except Exception as e:  # noqa: BLE001 -- the watch must outlive any one error
                self.round_failed(e)

    def watch(self, now: float) -> None:
        if self.timeouts is not None:
            try:
                self.timeouts.watch([*self.book.all(), *self.book.replaced_running()], now)
            except Exception as e:  # noqa: BLE001 -- leases must be watched whatever it raised
                self.round_failed(e)
        for claim in self.book.all():
            if claim.link.expired(now) and claim.mark_lost(LEASE_RAN_OUT):
                logger.warning(
                    "Lost claim job=%s fence=%s worker=%s: no renewal succeeded "
                    "for %.1f s (lease %g s); telling its handler to stop",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    now - claim.stamp.value,
                    claim.lease,
                    extra=claim_fields(claim.job, self.worker_id, "lost"),
                )


def _reset(database: str) -> None:
    """Drop this thread's broken connection; the next query opens a fresh one."""
    with contextlib.suppress(Exception):
        connections[database].close()
