"""What a running task may ask of its worker: ``current_job()``, the handle of its own claim.

The handle answers whether the claim is still held. A claim can be lost while the handler
runs (a renewal that matched no row, or a database unreachable for longer than the lease
could last); from then on another worker may run the same job, so the handler should stop,
and whatever it returns is discarded.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .exceptions import LeaseLost

_current: contextvars.ContextVar[JobHandle | None] = contextvars.ContextVar(
    "django_leases_current_job", default=None
)


def current_job() -> JobHandle | None:
    """Return the handle of the job the calling code runs for, or None outside a worker."""
    return _current.get()


class _Flag(Protocol):
    def is_set(self) -> bool: ...
    def set(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class _Stamp(Protocol):
    value: float


class _ClaimRef:
    """pk + claim token (+ the lease to renew by), as the manager's verbs expect."""

    __slots__ = ("pk", "claim_token", "lease_seconds")

    def __init__(self, pk: Any, claim_token: Any, lease_seconds: float) -> None:
        self.pk, self.claim_token, self.lease_seconds = pk, claim_token, lease_seconds


# Why a claim is gone when the handler's own side is the first to know: its lease ran out by
# this process's estimate (WorkerLink.expired), or a checkpoint or fenced write of the
# handler's touched no row (the worker's reason, when it had one, is the claim's own).
LEASE_RAN_OUT = "no renewal succeeded for longer than the lease"
FOUND_TAKEN = "a checkpoint or fenced write found the claim taken over or cancelled"


class Stamp:
    """A time.monotonic() reading shared by the worker's threads (a float in a box)."""

    def __init__(self, value: float) -> None:
        self.value = value


class WorkerLink:
    """The worker's side of one JobHandle: the lost flag and the renewal stamp it shares
    with the worker's threads (or, in process isolation, with the parent), how a checkpoint
    is stored, the TaskResult the claim read, and who to tell when the claim is lost or
    the handler acknowledged its job itself. The worker talks to the link, never to the
    handle's private state; the handle only reads it."""

    def __init__(
        self,
        *,
        lost: _Flag,
        stamp: _Stamp,
        lease_seconds: float,
        checkpointer: Callable[[Any], bool],
        task_result: Any = None,
        on_acked: Callable[[], Any] | None = None,
    ) -> None:
        self.lost = lost
        self.stamp = stamp
        self.lease_seconds = lease_seconds
        self.checkpointer = checkpointer
        # The claim's TaskResult (RUNNING, as the claim left the row), read with the claim
        # itself: task_started, task_finished and a task's context need no query of their own.
        self.task_result = task_result
        self.acked = False
        self.acked_result: Any = None
        # Told to stop because the worker is stopping and releasing the job, not because the
        # claim was lost: a result returned now can still be acknowledged under the claim.
        self.releasing = False
        self._on_acked = on_acked or (lambda: None)
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def renewed(self, at: float) -> None:
        """A renewal or checkpoint sent at ``at`` (time.monotonic()) went through."""
        self.stamp.value = at

    def remaining(self, now: float) -> float:
        """Seconds the lease still lasts at ``now`` (time.monotonic()) by this process's
        estimate: counted from just before the last claim or renewal statement was sent, so
        it runs out no later than the database's."""
        return self.lease_seconds - (now - self.stamp.value)

    def expired(self, now: float) -> bool:
        """The lease has run out by the estimate: the watchdog declares the claim lost."""
        return self.remaining(now) <= 0

    def gone(self, now: float) -> str:
        """Why a result returned at ``now`` is discarded, "" if it is not: lost, or expired
        by the estimate though the watchdog has not said so yet (a handler that held the GIL
        through its lease). A lost flag reads as FOUND_TAKEN, which is true only where the
        handler's own checkpoint or fenced write set it: the flag carries no reason across
        processes, so the worker's side gives its own reason first when it set the flag
        (Claim.lost_reason, settling._discard)."""
        if self.lost.is_set():
            return FOUND_TAKEN
        return LEASE_RAN_OUT if self.expired(now) else ""

    def mark_acked(self, result: Any) -> None:
        """The handler acknowledged its job itself (fenced(ack=True)); the worker must not."""
        self.acked, self.acked_result = True, result
        self._on_acked()

    def mark_lost(self, *, releasing: bool = False) -> None:
        """Tell the handler its claim is going: lost, or (``releasing``) to be released
        at the worker's stop."""
        if not self.lost.is_set():  # a loss the handler already heard of stays one
            self.releasing = releasing
        self.lost.set()
        self.fire()

    def fire(self) -> None:
        """Call the loss callbacks registered so far (once each)."""
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) when the claim is lost, at once if it is."""
        with self._callbacks_lock:
            if not self.lost.is_set():
                self._callbacks.append(callback)
                return
        callback()

    @contextlib.contextmanager
    def current(self, handle: JobHandle) -> Iterator[None]:
        """Make ``handle`` what current_job() returns while the block runs."""
        token = _current.set(handle)
        try:
            yield
        finally:
            _current.reset(token)


class JobHandle:
    """A handler's view of its claim.

    ``fence`` grows by one at every claim of the job: pass it to stores outside the queue so
    they can refuse a writer whose claim was taken over. ``lost`` turns true within one
    heartbeat period of the worker learning that the claim is gone.

    ``checkpoint()``, ``sleep()`` and ``fenced()`` are synchronous, as the ORM is: from an
    ``async def`` handler, call them through ``asgiref.sync.sync_to_async`` (``await
    sync_to_async(job.checkpoint)(cursor)``; a ``with fenced():`` block goes whole into a
    sync function called so), which runs them on the slot's thread and its connection
    (called directly, a write raises ``SynchronousOnlyOperation`` and ``sleep()`` blocks
    the event loop).
    """

    def __init__(
        self,
        *,
        job_id: Any,
        fence: int,
        attempt: int,
        cursor: Any,
        worker_id: str,
        lease_seconds: float | None = None,
        lost: _Flag | None = None,
        stamp: _Stamp | None = None,
        checkpointer: Callable[[Any], bool] | None = None,
        claim_token: Any = None,
        database: str = "default",
        link: WorkerLink | None = None,
    ) -> None:
        self.job_id = job_id
        self.fence = fence
        self.attempt = attempt
        self.cursor = cursor
        self.worker_id = worker_id
        self.claim_token = claim_token
        # The alias of the jobs' database: fenced() and once() write there.
        self.database = database
        if link is None:
            if lease_seconds is None:
                raise TypeError("JobHandle() needs lease_seconds, or a link that holds it")
            link = WorkerLink(
                lost=lost if lost is not None else threading.Event(),
                stamp=stamp if stamp is not None else Stamp(time.monotonic()),
                lease_seconds=lease_seconds,
                checkpointer=checkpointer or (lambda cursor: True),
            )
        elif lease_seconds is not None and lease_seconds != link.lease_seconds:
            raise ValueError(
                f"JobHandle(lease_seconds={lease_seconds!r}) disagrees with its link's "
                f"{link.lease_seconds!r}: pass one or the other"
            )
        self._link = link

    @property
    def lease_seconds(self) -> float:
        """The lease this claim is renewed by (the link's: one value per claim)."""
        return self._link.lease_seconds

    def __repr__(self) -> str:
        return f"<JobHandle job={self.job_id} fence={self.fence} lost={self.lost}>"

    @property
    def lost(self) -> bool:
        """True once the claim is known to be lost; the result will be discarded."""
        return self._link.lost.is_set()

    @property
    def acked(self) -> bool:
        """True once the handler acknowledged the job itself, in fenced(ack=True)."""
        return self._link.acked

    @property
    def acked_result(self) -> Any:
        return self._link.acked_result

    def raise_if_lost(self) -> None:
        """Raise LeaseLost if the claim is lost."""
        if self._link.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: claim with fence {self.fence} was lost")

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early to raise LeaseLost if the claim is lost meanwhile."""
        if self._link.lost.wait(max(seconds, 0.0)):
            self.raise_if_lost()

    @property
    def lease_remaining(self) -> float:
        """Seconds the lease still lasts by this process's monotonic clock (an estimate from
        the moment just before the last claim or renewal statement was sent)."""
        return self._link.remaining(time.monotonic())

    def checkpoint(self, cursor: Any) -> None:
        """Commit ``cursor`` and renew the lease; raise LeaseLost if the claim is gone."""
        self.raise_if_lost()
        if not self._link.checkpointer(cursor):
            self._link.mark_lost()
            self.raise_if_lost()
        self.cursor = cursor

    @property
    def idempotency_key(self) -> str:
        """The same for every attempt of this job: give it to APIs that deduplicate requests."""
        return f"django-leases-job-{self.job_id}"

    @property
    def claim(self) -> Any:
        """What proves this claim to the manager's conditional verbs (pk and claim token)."""
        return _ClaimRef(self.job_id, self.claim_token, self.lease_seconds)

    # -- used by fencing.py, on the handler's side ------------------------------------

    def _mark_acked(self, result: Any) -> None:
        self._link.mark_acked(result)

    def _mark_lost(self) -> None:
        self._link.mark_lost()
