"""The worker's main loop, readable top to bottom: claim, hand out, settle, wait, stop.

The main thread alone claims, acknowledges, fails and releases; handlers only compute.
Every database call goes through a Job.objects / WorkerProcess.objects verb.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import socket
import time
from typing import Any

from django.db import DatabaseError, InterfaceError, connections

from .. import registry
from ..exceptions import InvalidJobArgument
from ..jsonsafe import ensure_json
from ..states import FailureKind
from .claims import FINISHING, RELEASING, RUNNING, Claim, ClaimBook, Outcome
from .executors import KILL_GRACE_SECONDS, ProcessExecutor, ThreadExecutor
from .heartbeat import Heartbeat, Watchdog
from .listener import Listener
from .running import task_context
from .shutdown import StopRequest
from .vetting import unrunnable
from .waker import Waker

logger = logging.getLogger("django_leases.worker")

DB_ERRORS = (DatabaseError, InterfaceError)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Backoff:
    """Exponential back-off with jitter, for database trouble."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.current = first, cap, 0.0

    def next(self) -> float:
        self.current = self.first if not self.current else min(self.current * 2, self.cap)
        return self.current * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.current = 0.0


class Worker:
    """Run jobs of one lease backend until stopped by a signal, --burst or --max-jobs."""

    def __init__(
        self,
        *,
        alias: str,
        database: str,
        queues: list[str],
        concurrency: int = 1,
        isolation: str = "thread",
        lease: float | None = None,
        heartbeat: float = 10.0,
        poll: float = 1.0,
        burst: bool = False,
        max_jobs: int | None = None,
        grace: float = 20.0,
        worker_id: str | None = None,
        notify: bool = True,
    ) -> None:
        self.alias = alias
        self.database = database
        self.queues = list(queues)
        self.concurrency = concurrency
        self.isolation = isolation
        self.lease = lease
        self.heartbeat_seconds = heartbeat
        self.poll = poll
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.worker_id = worker_id or default_worker_id()
        self.notify = notify
        self.book = ClaimBook()
        self.waker = Waker()
        self.stop_request = StopRequest(self.waker)
        self._done: queue.SimpleQueue[tuple[Claim, Outcome]] = queue.SimpleQueue()
        self._unsent: list[tuple[Claim, Outcome]] = []
        self._claimed = 0
        self._backoff = Backoff()
        self._settled_at = float("-inf")

    # -- public ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask for a graceful stop (a second call stops at once); safe from any thread."""
        self.stop_request.request()

    def run(self) -> int:
        from ..models import Job, WorkerProcess

        self.Job, self.WorkerProcess = Job, WorkerProcess
        registry.discover()
        self.stop_request.install()
        threads: list[Any] = []
        try:
            if not self._register():
                return 0
            self.executor = self._executor()
            threads = self._start_threads()
            logger.info("Worker started worker=%s queues=%s concurrency=%d isolation=%s "
                        "lease=%s heartbeat=%gs poll=%gs", self.worker_id, ",".join(self.queues),
                        self.concurrency, self.isolation,
                        "per job" if self.lease is None else f"{self.lease:g}s",
                        self.heartbeat_seconds, self.poll)
            self._loop()
            self._shutdown()
        finally:
            for thread in threads:
                thread.stop()
            self.stop_request.restore()
            self.waker.close()
        return 0

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stop_request.stopping:
            self._settle()
            if self._claims_left() == 0 and not self.book:
                logger.info("Worker ran its %d jobs worker=%s", self._claimed, self.worker_id)
                return
            free = min(self.concurrency - len(self.book), self._claims_left())
            got = 0
            if free > 0:
                try:
                    got = self._claim(free)
                    self._backoff.reset()
                except DB_ERRORS as e:
                    self._db_trouble("claim", e)
                    continue
                if self.burst and not got and not self.book and not self._unsent:
                    logger.info("Nothing claimable; leaving (--burst) worker=%s", self.worker_id)
                    return
                if got == free and self._claims_left():
                    # There may be more due jobs; look again once a slot frees up.
                    self.waker.wait(self.poll if len(self.book) >= self.concurrency else 0)
                    continue
            # Jitter keeps a fleet of idle workers from polling in lockstep.
            self.waker.wait(self.poll * random.uniform(0.9, 1.1))

    def _claims_left(self) -> int:
        if self.max_jobs is None:
            return self.concurrency
        return max(self.max_jobs - self._claimed, 0)

    def _claim(self, free: int) -> int:
        started = time.monotonic()
        # Settling (dead-lettering what must not run again) once per poll interval is
        # enough; a claim woken by NOTIFY skips it and stays one statement.
        settle = started - self._settled_at >= self.poll
        jobs = self.Job.objects.using(self.database).claim(
            self.worker_id, self.queues, limit=free, lease=self.lease, settle=settle)
        if settle:
            self._settled_at = started
        results = self._results_at_start(jobs)
        for job in jobs:
            self._claimed += 1
            lost_flag, shared_stamp = self.executor.new_flags()
            claim = Claim(job, stamp=started, lease=self.lease or job.lease_seconds,
                          worker_id=self.worker_id, lost_flag=lost_flag, shared_stamp=shared_stamp)
            claim.handle._checkpointer = lambda cursor, c=claim: self._checkpoint(c, cursor)
            logger.info("Claimed job=%s task=%s fence=%s attempt=%s/%s worker=%s", job.pk,
                        job.task_path, job.fence, job.attempts, job.max_attempts, self.worker_id)
            task = registry.lookup(self.alias, job.task_path)
            if self.isolation == "thread":
                claim.handle._task_result = results.get(job.pk)  # type: ignore[attr-defined]
            replaced = self.book.add(claim)
            if replaced is not None and replaced.mark_lost("the job was claimed again"):
                # Untracked from here on, the old claim would be neither renewed nor watched.
                logger.warning("Lost claim job=%s fence=%s worker=%s: its lease ran out and the "
                               "job was claimed again; telling its handler to stop", replaced.pk,
                               replaced.job.fence, self.worker_id)
            refusal = unrunnable(job, task, self.alias)
            if refusal is not None:
                self._done.put((claim, Outcome(
                    "unrunnable", exception_class_path=refusal[0], message=refusal[1])))
                continue
            self.executor.submit(claim, task)
        return len(jobs)

    def _results_at_start(self, jobs: list[Any]) -> dict[Any, Any]:
        """The TaskResults that task_started and contexts carry, built for the whole claim
        batch here (from the claimed rows, plus one read of earlier failures when a job was
        claimed before) rather than one connection per handler thread. Empty on trouble:
        the handlers then run without task_started/task_finished."""
        if self.isolation != "thread" or not jobs:
            return {}
        from django.tasks import task_backends

        known = [j for j in jobs if registry.lookup(self.alias, j.task_path) is not None]
        try:
            return task_backends[self.alias].results_of_claims(known) if known else {}
        except Exception as e:  # noqa: BLE001 -- a missed signal must not cost a claim
            logger.warning("Could not read the claimed jobs for task_started worker=%s "
                           "error=%s", self.worker_id, e)
            return {}

    def _checkpoint(self, claim: Claim, cursor: Any) -> bool:
        """Store a handler's cursor and renew its lease (called from its slot thread)."""
        started = time.monotonic()
        ok = self.Job.objects.using(self.database).checkpoint(claim.job, cursor, self.lease)
        if ok:
            claim.stamp.value = started
            logger.debug("Checkpoint job=%s fence=%s worker=%s", claim.pk, claim.job.fence,
                         self.worker_id)
        else:
            logger.warning("Checkpoint rejected job=%s fence=%s worker=%s: the claim is lost",
                           claim.pk, claim.job.fence, self.worker_id)
        return ok

    def _finished(self, claim: Claim, outcome: Outcome) -> None:
        """Called on a slot thread when a handler returns: queue it for the main loop."""
        self._done.put((claim, outcome))
        self.waker.wake()

    # -- settling: the owner's writes --------------------------------------------------

    def _settle(self) -> None:
        """Acknowledge or fail the handlers that returned, in as few statements as possible."""
        items, self._unsent = self._unsent, []
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        oks: list[tuple[Claim, Any]] = []
        others: list[tuple[Claim, Outcome]] = []
        for claim, outcome in items:
            if outcome.acked:
                self.book.forget(claim)
                logger.info("Acked job=%s fence=%s worker=%s in the handler's fenced "
                            "transaction", claim.pk, claim.job.fence, self.worker_id)
                continue
            if claim.state not in (RUNNING, FINISHING) or outcome.kind == "lost":
                self._discard(claim, outcome)
                continue
            if claim.state == RUNNING and not claim.begin_finish():
                self._discard(claim, outcome)
                continue
            if outcome.kind == "ok":
                try:
                    oks.append((claim, ensure_json(outcome.result, "result")))
                except InvalidJobArgument as e:
                    others.append((claim, Outcome(
                        "bad_result", exception_class_path="django_leases.exceptions.InvalidJobArgument",
                        message=f"the handler returned a value JSON cannot hold: {e}")))
            else:
                others.append((claim, outcome))
        try:
            if oks:
                self._ack(oks)
            while others:
                self._fail(*others[0])
                others.pop(0)
        except DB_ERRORS as e:
            pending = [(c, Outcome("ok", result=r)) for c, r in oks if c.state == FINISHING]
            pending += [(c, o) for c, o in others if c.state == FINISHING]
            for claim, _ in pending:
                claim.finish_failed()
            self._unsent = pending
            self._db_trouble("acknowledge", e)

    def _discard(self, claim: Claim, outcome: Outcome) -> None:
        self.book.forget(claim)
        if claim.state == RELEASING:
            return
        logger.warning("Discarded result of job=%s fence=%s worker=%s: the claim was lost "
                       "(%s)", claim.pk, claim.job.fence, self.worker_id,
                       claim.lost_reason or "handler stopped on LeaseLost")

    def _ack(self, oks: list[tuple[Claim, Any]]) -> None:
        manager = self.Job.objects.using(self.database)
        if len(oks) == 1:
            claim, result = oks[0]
            acked = {claim.pk} if manager.ack(claim.job, result) else set()
        else:
            acked = manager.ack_many([(c.job, r) for c, r in oks])
        for claim, _ in oks:
            self.book.forget(claim)
            if claim.pk in acked:
                logger.info("Acked job=%s fence=%s worker=%s", claim.pk, claim.job.fence,
                            self.worker_id)
            else:
                logger.warning("Ack rejected job=%s fence=%s worker=%s: the claim was lost "
                               "before the ack; result discarded", claim.pk, claim.job.fence,
                               self.worker_id)

    def _fail(self, claim: Claim, outcome: Outcome) -> None:
        unrunnable = outcome.kind in ("unrunnable", "bad_result")
        ok = self.Job.objects.using(self.database).fail(
            claim.job, exception_class_path=outcome.exception_class_path,
            message=outcome.message, traceback=outcome.traceback,
            # The delay before the next attempt is the job's own retry ladder (query.py).
            retry=outcome.retryable and not unrunnable,
            kind=FailureKind.UNRUNNABLE if outcome.kind == "unrunnable" else FailureKind.EXCEPTION,
        )
        self.book.forget(claim)
        if ok:
            logger.info("Failed job=%s fence=%s worker=%s error=%s: %s", claim.pk,
                        claim.job.fence, self.worker_id,
                        outcome.exception_class_path or outcome.kind, outcome.message)
        else:
            logger.warning("Fail rejected job=%s fence=%s worker=%s: the claim was lost first",
                           claim.pk, claim.job.fence, self.worker_id)

    # -- stopping ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        if self.stop_request.stopping:
            logger.info("Stopping on %s worker=%s: claiming nothing more; %d running, "
                        "waiting up to %gs", self.stop_request.signal_name, self.worker_id,
                        len(self.book), self.grace)
        deadline = time.monotonic() + self.grace
        while self.book and not self.stop_request.hurry and time.monotonic() < deadline:
            self._settle()
            if self.book:
                self.waker.wait(min(self.poll, max(deadline - time.monotonic(), 0.0)))
        self._settle()
        if self.book:
            self._release_all()
        self._call_until_done("mark stopped", lambda: self.WorkerProcess.objects.using(
            self.database).stopped(self.worker_id))
        logger.info("Worker stopped worker=%s", self.worker_id)

    def _release_all(self) -> None:
        """Give unfinished jobs back to pending, after their handlers were told (and, in
        process isolation, killed) so no two handlers run one job before its lease ends."""
        claims = [c for c in self.book.all() if c.begin_release()]
        deadline = time.monotonic() + 3 * KILL_GRACE_SECONDS
        for claim in claims:
            if self.isolation == "process":
                claim.exited.wait(max(deadline - time.monotonic(), 0.0))
        for claim in claims:
            ok = self._call_until_done(
                "release", lambda c=claim: self.Job.objects.using(self.database).release(c.job))
            self.book.forget(claim)
            if ok:
                logger.info("Released job=%s fence=%s worker=%s: back to pending, attempt not "
                            "counted", claim.pk, claim.job.fence, self.worker_id)
            elif ok is None:
                logger.error("Could not release job=%s fence=%s worker=%s: the database is "
                             "unreachable; the job is claimable again when its lease ends",
                             claim.pk, claim.job.fence, self.worker_id)
            else:
                logger.warning("Release rejected job=%s fence=%s worker=%s: the claim was "
                               "already lost", claim.pk, claim.job.fence, self.worker_id)

    def _call_until_done(self, what: str, call: Any, tries: int = 5) -> Any:
        """Retry ``call`` through database trouble a few times; None if it never went."""
        for _ in range(tries):
            try:
                return call()
            except DB_ERRORS as e:
                self._db_trouble(what, e, wait=not self.stop_request.hurry)
        return None

    # -- plumbing ----------------------------------------------------------------------

    def _register(self) -> bool:
        while True:
            try:
                self.WorkerProcess.objects.using(self.database).register(
                    self.worker_id, hostname=socket.gethostname(), pid=os.getpid(),
                    queues=self.queues)
                return True
            except DB_ERRORS as e:
                self._db_trouble("register", e)
                if self.stop_request.stopping:
                    return False

    def _executor(self) -> Any:
        if self.isolation == "process":
            return ProcessExecutor(self.concurrency, self._finished, alias=self.alias,
                                   worker_id=self.worker_id, checkpoint=self._checkpoint)
        return ThreadExecutor(self.concurrency, self._finished, self._task_context)

    def _task_context(self, claim: Claim, task: Any) -> Any:
        return task_context(task, claim.handle)

    def _start_threads(self) -> list[Any]:
        threads: list[Any] = [
            Heartbeat(book=self.book, database=self.database, worker_id=self.worker_id,
                      period=self.heartbeat_seconds, lease=self.lease),
            Watchdog(book=self.book, worker_id=self.worker_id, period=self.heartbeat_seconds),
        ]
        if self.notify and connections[self.database].vendor == "postgresql":
            threads.append(Listener(database=self.database, queues=self.queues,
                                    waker=self.waker, worker_id=self.worker_id))
        for thread in threads:
            thread.start()
        return threads

    def _db_trouble(self, what: str, error: Exception, *, wait: bool = True) -> None:
        """Log, drop the broken connection, back off; the next call reconnects."""
        delay = self._backoff.next()
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        logger.warning("Database trouble during %s worker=%s error=%s; retrying in %.1fs",
                       what, self.worker_id, first_line, delay)
        with contextlib.suppress(DB_ERRORS):
            connections[self.database].close()
        if wait:
            self.waker.wait(delay)
