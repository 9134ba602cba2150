"""The claims a worker process holds, and the one lock that orders what happens to each.

A claim moves RUNNING -> FINISHING (its ack or fail is being sent) -> forgotten, or
RUNNING -> LOST (a renewal missed it, or the watchdog saw its lease run out) or
RUNNING -> RELEASING (shutdown), or RUNNING -> ACKED (the handler acknowledged the job in
its own fenced transaction). Only a RUNNING claim can be declared lost, so a renewal that
misses a job because its ack just landed is never mistaken for a loss (in process isolation
the parent learns of a handler's own ack only with its outcome).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..api import JobHandle, Stamp
from .checkpoints import store_checkpoint

RUNNING = "running"
FINISHING = "finishing"
LOST = "lost"
RELEASING = "releasing"
# The handler acknowledged the job itself, in its fenced(ack=True) transaction: nothing is
# left to renew, and a renewal missing the row is no loss.
ACKED = "acked"


@dataclass
class Outcome:
    """What a handler came back with; picklable, so a child process can send it."""

    # "ok", "error", "lost", or "stopped": the handler's process died while the worker was
    # stopping (a stop signal sent to the whole process group), so its job is released.
    kind: str
    result: Any = None
    # False when the task lists the exception as non-retryable: dead-letter at once.
    retryable: bool = True
    # True when the handler acknowledged the job itself, inside fenced(ack=True).
    acked: bool = False
    exception_class_path: str = ""
    message: str = ""
    traceback: str = ""


class Claim:
    def __init__(
        self,
        job: Any,
        *,
        stamp: float,
        lease: float,
        worker_id: str,
        lost_flag: Any = None,
        shared_stamp: Any = None,
    ) -> None:
        self.job = job
        self.lease = lease
        self.state = RUNNING
        self.lost_reason = ""
        # Set once the handler's outcome says it acknowledged the job itself (fenced(ack=True)):
        # such a claim is not released at shutdown.
        self.outcome: Outcome | None = None
        self._lock = threading.Lock()
        self.lost_flag = lost_flag if lost_flag is not None else threading.Event()
        self.stamp: Any = shared_stamp if shared_stamp is not None else Stamp(stamp)
        self.stamp.value = stamp
        self.handle = JobHandle(
            job_id=job.pk,
            fence=job.fence,
            attempt=job.attempts,
            cursor=job.cursor,
            lease_seconds=lease,
            worker_id=worker_id,
            lost=self.lost_flag,
            stamp=self.stamp,
            checkpointer=self._checkpoint,
            claim_token=job.claim_token,
            database=job._state.db,
        )
        self.handle._on_acked = lambda: self._move(ACKED)
        # Set by the executor: the child process, in process isolation.
        self.process: Any = None
        # Times this claim's ack or fail failed over a connection that still answered
        # (loop.py: enough of them and the write counts as refused, not as an outage).
        self.write_strikes = 0
        self.exited = threading.Event()

    def _checkpoint(self, cursor: Any) -> bool:
        return store_checkpoint(self.handle, cursor)

    @property
    def pk(self) -> Any:
        return self.job.pk

    def expired_locally(self, now: float) -> bool:
        elapsed: float = now - self.stamp.value
        return elapsed > self.lease

    def _move(self, to: str, *, tell: bool = False, reason: str = "") -> bool:
        with self._lock:
            if self.state != RUNNING:
                return False
            self.state = to
            if reason:
                self.lost_reason = reason
        if tell:
            self.handle._mark_lost()
        return True

    def mark_lost(self, reason: str) -> bool:
        """Declare the claim lost and tell the handler; False if it was no longer running."""
        return self._move(LOST, tell=True, reason=reason)

    def begin_finish(self) -> bool:
        return self._move(FINISHING)

    def finish_failed(self) -> None:
        """The ack could not be sent (database trouble): the claim is held again."""
        with self._lock:
            if self.state == FINISHING:
                self.state = RUNNING

    def begin_release(self) -> bool:
        return self._move(RELEASING, tell=True, reason="released at shutdown")


class ClaimBook:
    """Claims held by this process, by job id; shared by the loop, heartbeat and watchdog."""

    def __init__(self) -> None:
        self._claims: dict[Any, Claim] = {}
        self._lock = threading.Lock()

    def add(self, claim: Claim) -> Claim | None:
        """Hold ``claim``; return the older claim of the same job it replaces, if any (its
        lease ran out and this process claimed the job again before noticing)."""
        with self._lock:
            replaced = self._claims.get(claim.pk)
            self._claims[claim.pk] = claim
        return replaced

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
