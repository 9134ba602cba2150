"""The claims a worker process holds, and the one lock that orders what happens to each.

A claim moves RUNNING -> FINISHING (its ack or fail is being sent) -> SETTLED (sent), or
RUNNING -> LOST (a renewal missed it, or the watchdog saw its lease run out) or
RUNNING -> RELEASING (shutdown) -> FINISHING (its handler returned a result before the
release went: acked instead), or RUNNING -> ACKED (the handler acknowledged the job in
its own fenced transaction). Only a RUNNING claim can be declared lost, so a renewal that
misses a job because its ack just landed is never mistaken for a loss.

A handler's own ack sets the claim's acked flag once it commits (shared memory, for a
child process), and a claim whose flag is set moves to ACKED at its next move: a stop then
does not release the job. The flag is set just after the commit, so a renewal or release
can still miss the row before it is: read_back_acks() reads such jobs back before either
says the claim was lost.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from ..api import JobHandle, Stamp, WorkerLink
from ..safe_logging import WorkerLogger
from .dberrors import DB_ERRORS

logger = WorkerLogger()

RUNNING = "running"
FINISHING = "finishing"
LOST = "lost"
RELEASING = "releasing"
# The handler acknowledged the job itself, in its fenced(ack=True) transaction: nothing is
# left to renew, and a renewal missing the row is no loss.
ACKED = "acked"
# Its ack, fail or release went through (or the claim was dropped): nothing left to send.
SETTLED = "settled"


class Kind(enum.Enum):
    """What became of a handler, and so which write its job gets (settling.py's outbox)."""

    OK = "ok"  # returned: ack with the result
    ACKED = "acked"  # acknowledged itself in fenced(ack=True): nothing left to write
    ERROR = "error"  # raised: fail the attempt (retried unless not retryable)
    UNRUNNABLE = "unrunnable"  # the row cannot run as its task: dead at once
    LOST = "lost"  # the claim went meanwhile: write nothing
    # The handler's process died while the worker was stopping (a stop signal sent to the
    # whole process group): release, the attempt not counted.
    STOPPED = "stopped"
    # The handler could not open its database connection: release, claiming paused.
    UNCONNECTED = "unconnected"


@dataclass
class Outcome:
    """What a handler came back with; picklable, so a child process can send it."""

    kind: Kind
    result: Any = None
    # False when the task lists the exception as non-retryable: dead-letter at once.
    retryable: bool = True
    exception_class_path: str = ""
    message: str = ""
    traceback: str = ""
    # The least delay before the job's next attempt (a failure whose handler still runs,
    # abandoned: the retry waits a lease, as a takeover would).
    min_retry_in: float = 0.0


class Claim:
    """One claim this process holds: the claimed row (ClaimedJob, plain values), its
    TaskResult as claimed, the handle its handler sees and the link the worker keeps to it."""

    def __init__(
        self,
        job: Any,
        *,
        stamp: float,
        lease: float,
        worker_id: str,
        lost_flag: Any = None,
        shared_stamp: Any = None,
        acked_flag: Any = None,
        task_result: Any = None,
        timeout: float | None = None,
        timeout_retryable: bool = True,
    ) -> None:
        self.job = job
        # time.monotonic() just before the claim statement was sent (stamp moves on with
        # each renewal; this does not).
        self.claimed_at = stamp
        self.state = RUNNING
        self.lost_reason = ""
        # Whether a FINISHING claim came from RELEASING (finish_released()).
        self._finishing_released = False
        self._lock = threading.Lock()
        self.lost_flag = lost_flag if lost_flag is not None else threading.Event()
        # Set once the handler's fenced(ack=True) has committed, from whichever thread or
        # process ran it: the job is done, and not to be released at shutdown.
        self.acked_flag = acked_flag if acked_flag is not None else threading.Event()
        self.stamp: Any = shared_stamp if shared_stamp is not None else Stamp(stamp)
        self.stamp.value = stamp
        self.link = WorkerLink(
            lost=self.lost_flag,
            stamp=self.stamp,
            lease_seconds=lease,
            checkpointer=self._checkpoint,
            task_result=task_result,
            on_acked=self.mark_acked,
        )
        self.handle = JobHandle(
            job_id=job.pk,
            fence=job.fence,
            attempt=job.attempts,
            cursor=job.cursor,
            worker_id=worker_id,
            claim_token=job.claim_token,
            database=job.database,
            link=self.link,
        )
        # Times this claim's ack or fail failed over a connection that still answered
        # (settling.py: enough of them and the write counts as refused, not as an outage).
        self.write_strikes = 0
        self.exited = threading.Event()
        # How long its handler may run (None: no limit); when it began (time.monotonic(),
        # set by its slot, or from its child's message); whether it ran past it (told to stop, its attempt to fail,
        # retried unless the task lists HandlerTimeout as non-retryable).
        self.timeout = timeout
        self.timeout_retryable = timeout_retryable
        self.running_since: float | None = None
        self.timed_out = False
        # When its handler was told to stop (time.monotonic()): lost, released, timed out.
        self.told_at: float | None = None
        # When its handler came back (time.monotonic(), as running_since), and the outcome
        # the worker gave it itself at a stop (a later one from its slot is dropped).
        self.returned_at: float | None = None
        self.decided: Outcome | None = None

    def _checkpoint(self, cursor: Any) -> bool:
        return store_checkpoint(self.handle, self.link, cursor)

    @property
    def pk(self) -> Any:
        return self.job.pk

    @property
    def lease(self) -> float:
        """The lease this claim is renewed by: its link's, the one value the handle and the
        watchdog read too."""
        return self.link.lease_seconds

    def _move(self, to: str, *, tell: bool = False, reason: str = "") -> bool:
        with self._lock:
            if self.state == RUNNING and self.acked_flag.is_set():
                self.state = ACKED  # the handler's own ack, committed meanwhile
            if self.state != RUNNING:
                return False
            self.state = to
            if reason:
                self.lost_reason = reason
        if tell:
            self.told_at = self.told_at or time.monotonic()
            self.link.mark_lost(releasing=to == RELEASING)
        return True

    def mark_lost(self, reason: str) -> bool:
        """Declare the claim lost and tell the handler; False if it was no longer running."""
        return self._move(LOST, tell=True, reason=reason)

    def time_out(self, now: float) -> bool:
        """Its handler ran past its timeout: tell it to stop, as a lost claim does, but hold
        the claim (renewed as before) so that the worker can fail the attempt under its
        token; a handler that acknowledged its job itself and runs on is told too (its job
        stays done). False if the claim is in any other state, or timed out already."""
        with self._lock:
            if self.state == RUNNING and self.acked_flag.is_set():
                self.state = ACKED
            if self.state not in (RUNNING, ACKED) or self.timed_out:
                return False
            self.timed_out = True
            self.told_at = self.told_at or now
        self.link.mark_lost()
        return True

    def mark_acked(self) -> None:
        """The handler acknowledged the job itself (its fenced(ack=True) committed)."""
        self.acked_flag.set()
        self._move(ACKED)

    def stop_acked(self) -> bool:
        """Tell a handler that acknowledged its job itself, and may run on, to stop (the
        worker is stopping); False if the claim is in any other state."""
        with self._lock:
            if self.state != ACKED:
                return False
        self.link.mark_lost()
        return True

    def begin_finish(self) -> bool:
        return self._move(FINISHING)

    def finish_released(self) -> bool:
        """A handler told to stop at shutdown returned a result before its release was sent:
        its ack goes out under the claim's token instead (rowcount still decides), so done
        work is not run again. False if the claim is not being released."""
        with self._lock:
            if self.state != RELEASING:
                return False
            self.state = FINISHING
            self._finishing_released = True
        return True

    def finish_failed(self) -> None:
        """The ack could not be sent (database trouble): the claim is held again, or is to
        be released again if it was (finish_released())."""
        with self._lock:
            if self.state == FINISHING:
                self.state = RELEASING if self._finishing_released else RUNNING

    def settle(self) -> None:
        """Its write went through: a finishing claim is settled, never sent again."""
        with self._lock:
            if self.state == FINISHING:
                self.state = SETTLED

    def begin_release(self) -> bool:
        return self._move(RELEASING, tell=True, reason="released at shutdown")

    @property
    def acked(self) -> bool:
        """Whether the handler acknowledged the job itself: not to be released."""
        return self.state == ACKED or self.acked_flag.is_set()


class ClaimBook:
    """Claims held by this process, by job id; shared by the loop, heartbeat and watchdog."""

    def __init__(self) -> None:
        self._claims: dict[Any, Claim] = {}
        self._lock = threading.Lock()
        # Claims replaced by a claim of the same job whose handler still ran then: out of
        # the book, yet a hung one must still be abandoned (worker/timeouts.py).
        self._replaced: list[Claim] = []

    def add(self, claim: Claim) -> Claim | None:
        """Hold ``claim``; return the older claim of the same job it replaces, if any (its
        lease ran out and this process claimed the job again before noticing)."""
        with self._lock:
            replaced = self._claims.get(claim.pk)
            self._claims[claim.pk] = claim
            if replaced is not None and not replaced.exited.is_set():
                self._replaced.append(replaced)
        return replaced

    def replaced_running(self) -> list[Claim]:
        """The replaced claims whose handler has not come back yet."""
        with self._lock:
            self._replaced = [c for c in self._replaced if not c.exited.is_set()]
            return list(self._replaced)

    def forget(self, claim: Claim) -> None:
        with self._lock:
            if self._claims.get(claim.pk) is claim:
                del self._claims[claim.pk]

    def all(self) -> list[Claim]:
        with self._lock:
            return list(self._claims.values())

    def renewable(self) -> list[Claim]:
        """Claims whose lease must be kept: running, or finishing (the ack may still fail)."""
        return [c for c in self.all() if c.state in (RUNNING, FINISHING)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)


def read_back_acks(Job: Any, database: str, claims: list[Claim]) -> set[Any]:
    """The ids of ``claims`` whose jobs succeeded at their claim's fence: a renewal or a
    release that missed such a row met the handler's own fenced(ack=True) commit, just
    before its acked flag was set; the claim was not lost. Database trouble answers none
    (the claims are said lost, as a miss was before this read, which only spares a false
    alarm) and drops this thread's broken connection."""
    return _read_back(Job, database, claims, "acked_by_their_claims") or set()


def read_back_held(Job: Any, database: str, claims: list[Claim]) -> set[Any] | None:
    """The ids of ``claims`` still theirs though a renewal skipped them: their rows locked
    by a transaction still open (PostgreSQL's heartbeat renewal skips locked rows). None
    on database trouble, which tells neither: a claim only locked must not be stopped, and
    one lost is given up by the watchdog once its lease has run out by this clock."""
    return _read_back(Job, database, claims, "held_by_their_claims")


def _read_back(Job: Any, database: str, claims: list[Claim], verb: str) -> set[Any] | None:
    """The ids the read ``verb`` answers for ``claims``' jobs; None on database trouble,
    this thread's broken connection dropped."""
    if not claims:
        return set()
    try:
        ids: set[Any] = getattr(Job.objects.using(database), verb)([c.job for c in claims])
    except DB_ERRORS:
        with contextlib.suppress(Exception):
            connections[database].close()
        return None
    return ids


# -- checkpoints ---------------------------------------------------------------------------
# Sent from the thread or child process that runs the handler, on the handler's own
# connection, so that inside fenced() the cursor commits or rolls back with the handler's
# writes: a kill between them can neither skip items nor, on SQLite, leave the handler
# waiting for a lock it holds itself. The stamp the watchdog reads moves only once the
# UPDATE has committed, since a rolled-back checkpoint renewed nothing: the watchdog may
# underestimate a lease, never overestimate it.


def _moved(cursor: Any, before: Any) -> bool:
    """Whether ``cursor`` differs from ``before``; a value that cannot say (an array's
    comparison, one that raises) counts as moved, and the checkpoint judges it."""
    try:
        return bool(cursor != before)
    except Exception:  # noqa: BLE001 -- the handler's value: stored_json() names its fault
        return True


def store_checkpoint(handle: JobHandle, link: WorkerLink, cursor: Any) -> bool:
    """Store ``cursor`` and renew the lease if the claim still holds; False if it is lost."""
    from ..models import Job

    started = time.monotonic()
    # handle.cursor: the one stored before (the claim's, or the last checkpoint's).
    held = Job.objects.using(handle.database).checkpoint(
        handle.claim, cursor, moved=_moved(cursor, handle.cursor)
    )
    if held:
        transaction.on_commit(functools.partial(link.renewed, started), using=handle.database)
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
