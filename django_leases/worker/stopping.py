"""Stopping: the grace, the notice to handlers still running, the last writes and the
releases, in that order (a mixin of Worker, on top of its settling).

Every other write comes first, so a handler the process cannot kill (a thread) runs on
after its job is released only until the process exits, right after.
"""

from __future__ import annotations

import contextlib
import queue
import time
from typing import TYPE_CHECKING, Any

from ..safe_logging import WorkerLogger
from ..storable import class_path, first_line
from .child import KILL_GRACE_SECONDS
from .claims import RELEASING, Claim
from .dberrors import DB_ERRORS, refused_by_database
from .logs import claim_fields
from .settling import Settling
from .timeouts import timed_out_outcome

if TYPE_CHECKING:
    from ..models import WorkerProcess as WorkerProcessModel
    from .heartbeat import Heartbeat
    from .shutdown import StopRequest
    from .vital import VitalThread
    from .waker import Waker

logger = WorkerLogger()

# How long thread-isolated handlers told to stop at release may take to return before
# their jobs are released anyway (a thread cannot be killed; it ends with the process).
RELEASE_NOTICE_SECONDS = 1.0

# How long the last writes (outcomes, releases, the worker row) are retried through a
# database outage once the grace is over: a stop stays within what a process manager's
# stop timeout allows (the grace plus a few seconds), not five backed-off tries per write.
LAST_WRITES_SECONDS = 8.0


class Stopping(Settling):
    """Worker's shutdown: what run() does once the loop has ended."""

    # Until when (time.monotonic()) the last writes are retried; None before the stop.
    _writes_until: float | None = None
    # Stopping because more abandoned handlers ran than the worker has slots: exit 1.
    abandoned_limit = False
    # What the main loop raised, if it did: stop at once, exit 1.
    loop_error: Exception | None = None

    def handlers_running(self) -> bool:
        """Whether a handler still runs now that run() has returned: told to stop and deaf
        to it, or one whose claim was lost or taken before the stop. The process must then
        end at once (run_lease_worker does), or a thread Python waits for at exit (an async
        handler's event loop, asgiref's) keeps it running a released job."""
        executor = getattr(self, "executor", None)
        return executor is not None and executor.running() > 0

    def kill_handler_processes(self) -> None:
        """Kill the handler children still running (process isolation), for a process
        about to end at once: a killed worker's children would otherwise see it gone only
        after their grace (child.py), running on meanwhile."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.kill_children()

    if TYPE_CHECKING:
        WorkerProcess: type[WorkerProcessModel]
        instance: str
        grace: float
        poll: float
        isolation: str
        heartbeat: Heartbeat
        stop_request: StopRequest
        waker: Waker

        def _dead_thread(self) -> VitalThread | None: ...

        def _release_unconnected(self) -> None: ...

    def _loop_failed(self, error: Exception) -> None:
        """The main loop raised: a bug, or what a thread-isolated handler changed in the
        interpreter it shares with the loop (a recursion limit lowered while it runs, a
        descriptor it closed). Before, the worker died with its jobs claimed until their
        leases ran out, a finished handler's result lost; its attempt, and those of the
        jobs beside it, then counted as expired. What can be put back is, and the stop
        that follows writes what came back and releases the rest at once, as for a dead
        heartbeat: exit status 1, for the process manager to start a fresh worker."""
        self.loop_error = error
        executor = getattr(self, "executor", None)
        with contextlib.suppress(Exception):
            if executor is not None:
                executor.restore_interpreter()
        try:
            said = first_line(error)
        except Exception:  # noqa: BLE001 -- an error whose text cannot be read
            said = "(its message could not be read)"
        logger.critical(
            "Main loop failed worker=%s error=%s: %s; stopping at once, its %d jobs "
            "released, exit status 1",
            self.worker_id,
            class_path(type(error)),
            said,
            len(self.book),
            exc_info=error,
            extra={
                "event": "loop_failed",
                "worker": self.worker_id,
                "error": class_path(type(error)),
            },
        )
        if not self.stop_request.stopping:  # a stop under way: not a second signal
            self.stop_request.request("the main loop failed")

    def _shutdown(self) -> int:
        """Let handlers finish within the grace; then tell the rest to stop, write what
        came back, mark the worker stopped and release their jobs, in that order, within
        LAST_WRITES_SECONDS of database trouble: every other write comes first, so a
        handler the process cannot kill (a thread) runs on after its job is released only
        until the process exits, right after. 1 if a vital thread died, a last write never
        went (a job left claimed until its lease ends) or too many handlers were abandoned,
        else 0."""
        dead = self._dead_thread()
        if dead is not None:
            self._log_death(dead)
        elif self.stop_request.stopping and self.loop_error is None:
            logger.info(
                "Stopping on %s worker=%s: claiming nothing more; %d running, waiting up to %gs",
                self.stop_request.signal_name,
                self.worker_id,
                len(self.book),
                self.grace,
                extra={
                    "event": "stopping",
                    "worker": self.worker_id,
                    "signal": self.stop_request.signal_name,
                },
            )
        deadline = time.monotonic() + (0 if dead or self.loop_error else self.grace)
        while self.book and not self.stop_request.hurry and time.monotonic() < deadline:
            self._settle()
            self._release_unconnected()
            if (dead := self._dead_thread()) is not None:
                # No renewals any more (or no watch on them): release now.
                self._log_death(dead)
                break
            if self.book:
                self.waker.wait(min(self.poll, max(deadline - time.monotonic(), 0.0)))
        if self.stop_request.hurry and self.book:
            logger.info(
                "Second %s worker=%s: the rest of the grace skipped; %d running told to stop",
                self.stop_request.signal_name,
                self.worker_id,
                len(self.book),
                extra={
                    "event": "hurried",
                    "worker": self.worker_id,
                    "signal": self.stop_request.signal_name,
                },
            )
        self._writes_until = time.monotonic() + LAST_WRITES_SECONDS
        self._settle()
        unfinished = self._tell_to_stop()
        unwritten = self._settle_before_exit()
        # Tried once: the row's heartbeat going stale says as much, and the releases are
        # what the time is kept for. Not written, it is a last write that never went:
        # with no claim left to release (the watchdog gave them up in the outage), the
        # status was 0, as after a clean stop.
        marked = self._call_until_done(
            "mark stopped",
            lambda: self.WorkerProcess.objects.using(self.database).stopped(
                self.worker_id, self.instance
            ),
            tries=1,
        )
        unwritten += marked is None
        unwritten += self._release_all(unfinished)
        logger.info(
            "Worker stopped worker=%s",
            self.worker_id,
            extra={"event": "stopped", "worker": self.worker_id},
        )
        failed = dead is not None or self.loop_error is not None or self.abandoned_limit
        return 1 if failed or unwritten else 0

    def _may_retry(self) -> bool:
        """Whether a last write that met database trouble is tried again: not past
        LAST_WRITES_SECONDS (after a second signal too, but at once, with no back-off)."""
        until = self._writes_until
        return until is None or time.monotonic() < until

    def _last_writes_left(self) -> float | None:
        """Seconds left to the last writes (None before the stop): no back-off waits longer."""
        until = self._writes_until
        return None if until is None else max(0.0, until - time.monotonic())

    def _log_death(self, thread: VitalThread) -> None:
        consequence = (
            "its claims are no longer renewed"
            if thread is self.heartbeat
            else "lost leases are no longer noticed"
        )
        logger.error(
            "The %s thread died worker=%s: %s; claiming nothing more, releasing %d "
            "claim(s) and exiting with status 1",
            thread.role,
            self.worker_id,
            consequence,
            len(self.book),
            extra={"event": "thread_died", "worker": self.worker_id, "role": thread.role},
        )

    def _tell_to_stop(self) -> list[Claim]:
        """Tell the unfinished handlers their claims are going, as a lost claim does
        (LeaseLost, cancellation of async handlers), and wait a moment for them to return;
        in process isolation their children are killed at once. Return those claims.
        A claim whose handler already came back keeps its outcome, to be written: a job
        that succeeded must not be released to run again."""
        while True:
            try:
                self._unsent.append(self._done.get_nowait())
            except queue.Empty:
                break
        produced = {id(c) for c, _ in self._unsent}
        # A handler past its timeout is not released (its attempt not counted, a job that
        # always hangs would never spend its attempts on a worker often restarted): its
        # attempt fails now, the retry waiting the lease, as its abandonment would have.
        # (Not one whose handler came back meanwhile: its own outcome is on its way.)
        for claim in self.book.all():
            if (
                id(claim) not in produced
                and claim.timed_out
                and claim.returned_at is None
                and claim.begin_finish()
            ):
                claim.decided = timed_out_outcome(claim, "stopping")
                self._unsent.append((claim, claim.decided))
                produced.add(id(claim))
        # A handler that acknowledged its job itself and runs on is told too; its job
        # is done, not released (_release_all).
        claims = [
            c
            for c in self.book.all()
            if id(c) not in produced and (c.begin_release() or c.stop_acked())
        ]
        if not claims:
            return []
        notice = 3 * KILL_GRACE_SECONDS if self.isolation == "process" else RELEASE_NOTICE_SECONDS
        deadline = time.monotonic() + notice
        for claim in claims:
            claim.exited.wait(max(deadline - time.monotonic(), 0.0))
        # A job its handler acknowledged is done whatever the handler does now: not released,
        # so not named here.
        running = [c.pk for c in claims if not c.exited.is_set() and not c.acked]
        if running:
            logger.warning(
                "Handlers of jobs %s still running worker=%s; releasing them anyway: "
                "they end with this process",
                ",".join(map(str, running)),
                self.worker_id,
                extra={"event": "handlers_running", "worker": self.worker_id, "jobs": running},
            )
        return claims

    def _settle_before_exit(self, tries: int = 5) -> int:
        """Write the outcomes the handlers came back with, retried through database trouble
        as a release is; one never sent leaves its job claimed until the lease ends. The
        number never sent."""
        for _ in range(tries):
            self._settle()
            if not self._unsent or self.stop_request.hurry or not self._may_retry():
                break
        unsent = 0
        for claim, _ in self._unsent:
            if claim.state == RELEASING:
                continue  # its ack never went (finish_released()): released, as it was to be
            unsent += 1
            self.book.forget(claim)
            logger.error(
                "Could not write the outcome of job=%s fence=%s worker=%s: the database is "
                "unreachable; the job is claimable again when its lease ends",
                claim.pk,
                claim.job.fence,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "outcome_unsent"),
            )
        self._unsent = []
        return unsent

    def _release_all(self, claims: list[Claim]) -> int:
        """Release the jobs of ``claims``; the number that could not be."""
        failed = 0
        for claim in claims:
            if claim.acked or claim.state != RELEASING:
                # Its handler acknowledged it meanwhile (fenced(ack=True)), or returned a
                # result that was acknowledged (finish_released()).
                continue
            if self._call_until_done("release", lambda c=claim: self._release(c)) is None:
                failed += 1
                self.book.forget(claim)
                logger.error(
                    "Could not release job=%s fence=%s worker=%s: the database is "
                    "unreachable; the job is claimable again when its lease ends",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    extra=claim_fields(claim.job, self.worker_id, "release_failed"),
                )
        return failed

    def _call_until_done(self, what: str, call: Any, tries: int = 5) -> Any:
        """Retry ``call`` through database trouble a few times, while _may_retry(); None
        if it never went."""
        for attempt in range(tries):
            if attempt and not self._may_retry():
                return None
            try:
                return call()
            except DB_ERRORS as e:
                if refused_by_database(e):
                    logger.error(
                        "The database refused %s worker=%s error=%s",
                        what,
                        self.worker_id,
                        first_line(e),
                        extra={
                            "event": "db_refused",
                            "worker": self.worker_id,
                            "error": first_line(e),
                        },
                    )
                    return None
                # No wait after the last try, nor after a second signal.
                again = attempt + 1 < tries and self._may_retry()
                self._db_trouble(
                    what,
                    e,
                    wait=again and not self.stop_request.hurry,
                    most=self._last_writes_left(),
                )
        return None
