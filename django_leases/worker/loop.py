"""The worker's main loop, readable top to bottom: claim, hand out, settle, wait, stop.

The main thread alone claims, acknowledges, fails and releases; handlers only compute.
Every database call goes through a Job.objects / WorkerProcess.objects verb. What the
handlers came back with is written by settling.py's Settling, the shutdown is
stopping.py's Stopping: Worker is built on both.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import time
from typing import TYPE_CHECKING, Any, cast

from django.db import connections

from .. import conf, registry
from ..safe_logging import WorkerLogger
from ..storable import (
    first_line,
)
from .claims import SETTLED, Claim, ClaimBook, Kind, Outcome
from .dberrors import DB_ERRORS, contention, outage_met
from .executors import ProcessExecutor, ThreadExecutor
from .heartbeat import Heartbeat, Watchdog
from .identity import (
    HELD_LOG_EVERY,
    default_worker_id,
    died,
    log_id_held,
    log_id_replaced,
    new_instance,
    process_key,
    silent_for,
)
from .listener import Listener
from .logs import claim_fields
from .repeats import Trouble
from .running import unrunnable
from .shutdown import StopRequest
from .stopping import Stopping
from .ticker import Ticker
from .timeouts import RunTimeouts, timeout_of, timeout_retryable
from .vital import VitalThread
from .waker import Waker

if TYPE_CHECKING:
    from ..backends import LeaseBackend

logger = WorkerLogger()

# How long a worker woken by a finished handler waits for the others still running, so
# that their acks and the claim for their slots go out together: short beside any real
# handler, long beside the hand-off of one that does nothing.
GATHER_SECONDS = 0.001


class Backoff:
    """Exponential back-off with jitter, for database trouble."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.current = first, cap, 0.0

    def next(self) -> float:
        self.current = self.first if not self.current else min(self.current * 2, self.cap)
        return self.current * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.current = 0.0


class Worker(Stopping):
    """Run jobs of one lease backend until stopped by a signal, --burst or --max-jobs."""

    def __init__(
        self,
        *,
        alias: str,
        database: str,
        queues: list[str] | None,
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
        listen_database: str | None = None,
        connect_handlers: bool = True,
    ) -> None:
        self.alias = alias
        self.database = database
        # None: every queue (the claim filters on none).
        self.queues = None if queues is None else list(queues)
        self.concurrency = concurrency
        self.isolation = isolation
        self.lease = lease
        self.heartbeat_seconds = heartbeat
        self.poll = poll
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.worker_id = worker_id or default_worker_id()
        self.instance = new_instance()
        self.notify = notify
        # LISTEN_DATABASE: a direct connection when ``database`` goes through a pooler.
        self.listen_database = listen_database or database
        # Open each handler's connection before it runs: one refused is a release, not a
        # failure (off with --skip-connection-check: handlers that use no database).
        self.connect_handlers = connect_handlers
        self.book = ClaimBook()
        self.waker = Waker()
        self.stop_request = StopRequest(self.waker)
        self._done: queue.SimpleQueue[tuple[Claim, Outcome]] = queue.SimpleQueue()
        self._unsent: list[tuple[Claim, Outcome]] = []
        self._claimed = 0
        self._backoff = Backoff()
        # The main loop's writes (claims, acks, fails) in an outage: one line when it
        # starts, then once a minute; over once a claim goes through with nothing unsent.
        self._writes_trouble = Trouble("db_trouble", self.worker_id)
        # A release, a registration, the last writes at a stop: each failure said.
        self._each_trouble = Trouble("db_trouble", self.worker_id, every=0.0)
        self._settled_at = float("-inf")
        self._vital: list[VitalThread] = []
        self._overdue_logged = False
        # Handlers that could not open a database connection before they ran: released
        # by the main loop, the attempt not counted, and claiming paused a moment.
        self._unconnected: queue.SimpleQueue[tuple[Claim, Outcome]] = queue.SimpleQueue()
        self._connect_backoff = Backoff(first=0.5, cap=10.0)
        self._paused_until = float("-inf")

    # -- public ------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask for a graceful stop (a second call stops at once); safe from any thread."""
        self.stop_request.request()

    def run(self) -> int:
        """Serve until stopped; 0, or 1 if the heartbeat or the watchdog thread died. What
        the loop itself raises is raised once its jobs are released (at once, as for a
        dead thread): run_lease_worker then exits with status 1."""
        from ..models import Job, WorkerProcess

        self.Job, self.WorkerProcess = Job, WorkerProcess
        registry.discover()
        self.stop_request.install()
        threads: list[Any] = []
        status = 0
        try:
            if not self._register():
                return 0
            self.executor = self._executor()
            self.ticker = Ticker(self.alias, self.database, self.worker_id, every=self.poll)
            threads = self._start_threads()
            logger.info(
                "Worker started worker=%s queues=%s concurrency=%d isolation=%s "
                "lease=%s heartbeat=%gs poll=%gs",
                self.worker_id,
                self.queues_text,
                self.concurrency,
                self.isolation,
                "per job" if self.lease is None else f"{self.lease:g}s",
                self.heartbeat_seconds,
                self.poll,
                extra={"event": "started", "worker": self.worker_id, "queue": self.queues_text},
            )
            try:
                self._loop()
            except Exception as e:  # noqa: BLE001 -- its claims are released, not left to run out
                self._loop_failed(e)
            status = self._shutdown()
            if self.loop_error is not None:
                # Released: now raised to the caller (run_burst()'s test, call_command()).
                raise self.loop_error
        finally:
            for thread in threads:
                thread.stop()
            executor = getattr(self, "executor", None)
            if executor is not None:
                # Idle slots end at once, closing their connections (run_burst() returns to
                # a test that then drops its database); a handler still running (a stop whose
                # grace ran out) is not waited for: its thread ends with the process.
                idle = executor.running() == 0 and not self.book
                executor.close(wait=5.0 if idle else 0.0)
            self.stop_request.restore()
            self.waker.close()
        return status

    @property
    def _options(self) -> conf.LeaseOptions:
        """The backend's validated OPTIONS (read once per settings)."""
        return conf.get_options(self.alias)

    @property
    def queues_text(self) -> str:
        """The queues served, as logged and recorded: "*" for every queue."""
        return "*" if self.queues is None else ",".join(self.queues)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        woken = False
        while not self.stop_request.stopping and self._dead_thread() is None:
            self.ticker.maybe_tick()  # periodic schedules' due ticks (worker/ticker.py)
            # Woken (NOTIFY, a handler done), the due jobs claimed start before the settling
            # pass due once per poll interval runs: it waits for a wake-up that claims
            # nothing, so that it never holds up a handler that just started. Only a
            # settling claim takes over expired claims, so one whose pass has waited a whole
            # interval more (a busy worker, woken each time a handler finishes) goes first.
            # A --burst worker leaves only after a settling claim found nothing.
            if woken:
                self._gather(GATHER_SECONDS)
                if self.stop_request.stopping or self._dead_thread() is not None:
                    continue  # the wait took the stop's wake-up: the loop ends here
            since = time.monotonic() - self._settled_at
            settle = since >= self.poll
            first = settle and (not woken or since >= 2 * self.poll)
            claiming = self._claims_left() > 0 and time.monotonic() >= self._paused_until
            # The acks of finished handlers ride with a woken claim: one commit, not two.
            acks = self._settle(hold_acks=claiming and not first)
            self._release_unconnected()
            if self._claims_left() == 0 and not self.book:
                logger.info(
                    "Worker ran its %d jobs worker=%s",
                    self._claimed,
                    self.worker_id,
                    extra={"event": "max_jobs", "worker": self.worker_id},
                )
                return
            free = min(self.concurrency - len(self.book) + len(acks), self._claims_left())
            got = 0
            can_claim = (
                free > 0 and self._heartbeat_on_time() and time.monotonic() >= self._paused_until
            )
            if acks and not can_claim:
                self._send_held(acks)  # no claim to ride with after all
                acks = []
            if can_claim:
                left = True
                try:
                    got = self._claim(free, settle=first, acks=acks)
                    if not got and not first and (settle or self.burst):
                        # The slots the acks freed, should they not all have gone out.
                        free = min(self.concurrency - len(self.book), self._claims_left())
                        got = self._claim(free, settle=True) if free > 0 else 0
                    if self.burst and not got and not self.book and not self._unsent:
                        # A claim that took nothing may have lost every row to another
                        # worker's (SQLite, MariaDB: read, then taken if still as read):
                        # only no claimable job at all means done.
                        left = (
                            self.Job.objects.using(self.database).claim_order(self.queues).exists()
                        )
                    self._backoff.reset()
                    if not self._unsent:
                        self._writes_trouble.over()
                except DB_ERRORS as e:
                    what = "acknowledge and claim" if acks else "claim"
                    self._db_trouble(what, e, trouble=self._writes_trouble)
                    continue
                if self.burst and not got and not self.book and not self._unsent and not left:
                    logger.info(
                        "Nothing claimable; leaving (--burst) worker=%s",
                        self.worker_id,
                        extra={"event": "burst_done", "worker": self.worker_id},
                    )
                    return
                if got == free and self._claims_left():
                    # There may be more due jobs; look again once a slot frees up.
                    full = len(self.book) >= self.concurrency
                    woken = self._wait(self.poll) if full else self.waker.wait(0)
                    continue
            # Jitter keeps a fleet of idle workers from polling in lockstep.
            woken = self._wait(self.poll * random.uniform(0.9, 1.1))

    def _wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a wake-up (True if one came), looking at the
        schedules meanwhile whenever a look falls due before the end (a schedule's grace
        shorter than two polls): a look claims nothing, so claims keep the poll's pace."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            look = self.ticker.due_in()
            if look >= left or not self.ticker.looks_between_polls:
                return self.waker.wait(max(left, 0.0))
            if self.waker.wait(look):
                return True
            self.ticker.maybe_tick()

    def _gather(self, window: float) -> None:
        """Woken by a finished handler while others still run, wait up to ``window`` for
        them: their acks then ride with one claim instead of one each. A wake-up with no
        outcome (NOTIFY, a stop) starts no wait, nor does one once every handler is done."""
        deadline = time.monotonic() + window
        while True:
            done = self._done.qsize()
            running = len(self.book) - done - len(self._unsent)
            left = deadline - time.monotonic()
            if not done or running <= 0 or left <= 0 or self.stop_request.stopping:
                return
            self.waker.wait(left)

    def _dead_thread(self) -> VitalThread | None:
        return next((t for t in self._vital if t.died or not t.is_alive()), None)

    def _heartbeat_on_time(self) -> bool:
        """False while no renewal has gone through for longer than the lease (a renewal
        hanging on a half-open connection, the database unreachable): a job claimed now
        could not be renewed either, so the loop claims nothing until the heartbeat is back."""
        late = self.heartbeat.overdue(time.monotonic())
        if late is not None and not self._overdue_logged:
            logger.warning(
                "Heartbeat overdue worker=%s: no renewal went through for %.1f s "
                "(lease %g s); claiming nothing until one does",
                self.worker_id,
                *late,
                extra={"event": "heartbeat_overdue", "worker": self.worker_id},
            )
        elif late is None and self._overdue_logged:
            logger.info(
                "Heartbeat back worker=%s: claiming again",
                self.worker_id,
                extra={"event": "heartbeat_back", "worker": self.worker_id},
            )
        self._overdue_logged = late is not None
        return late is None

    def _claims_left(self) -> int:
        if self.max_jobs is None:
            return self.concurrency
        return max(self.max_jobs - self._claimed, 0)

    def _claim(
        self, free: int, *, settle: bool, acks: list[tuple[Claim, Outcome]] | None = None
    ) -> int:
        started = time.monotonic()
        # Settling (dead-lettering what must not run again) once per poll interval is
        # enough (the caller decides); a claim without it stays one statement. Plain rows
        # (ClaimedJob), no model instance per job. Acks ride only with a claim that does
        # not settle (the caller holds them only then).
        if acks:
            jobs = self._ack_and_claim(acks, free)
        else:
            jobs = self.Job.objects.using(self.database).claim_rows(
                self.worker_id, self.queues, limit=free, lease=self.lease, settle=settle
            )
        if settle:
            self._settled_at = started
        tasks = [registry.runnable(self.alias, j.task_path, j.queue_name) for j in jobs]
        results = self._results_at_start([j for j, t in zip(jobs, tasks, strict=True) if t])
        for job, task in zip(jobs, tasks, strict=True):
            self._claimed += 1
            lost_flag, shared_stamp, acked_flag = self.executor.new_flags()
            claim = Claim(
                job,
                stamp=started,
                lease=self.lease or job.lease_seconds,
                worker_id=self.worker_id,
                lost_flag=lost_flag,
                shared_stamp=shared_stamp,
                acked_flag=acked_flag,
                task_result=results.get(job.pk),
                timeout=timeout_of(task, self._options, job.queue_name),
                timeout_retryable=timeout_retryable(task),
            )
            self._log_claim(job)
            replaced = self.book.add(claim)
            if replaced is not None and replaced.mark_lost("the job was claimed again"):
                # Untracked from here on, the old claim would be neither renewed nor watched.
                logger.warning(
                    "Lost claim job=%s fence=%s worker=%s: its lease ran out and the "
                    "job was claimed again; telling its handler to stop",
                    replaced.pk,
                    replaced.job.fence,
                    self.worker_id,
                    extra=claim_fields(replaced.job, self.worker_id, "lost"),
                )
            refusal = unrunnable(job, task, self.alias)
            if refusal is not None:
                outcome = Outcome(
                    Kind.UNRUNNABLE, exception_class_path=refusal[0], message=refusal[1]
                )
                self._done.put((claim, outcome))
                continue
            self.executor.submit(claim, task)
        return len(jobs)

    def _ack_and_claim(self, oks: list[tuple[Claim, Outcome]], free: int) -> list[Any]:
        """Acknowledge ``oks`` and claim up to ``free`` due jobs in one statement.

        Should the database refuse it (a result it cannot store refuses the claim with it),
        or anything but the database fail, the acks go out on their own as _settle sends
        them (refused results failing their attempts), and the claim follows for the slots
        they freed, only once all of them went out. Connection trouble or contention leaves
        the acks in the outbox and raises: the claim's trouble, retried after a back-off."""
        try:
            acked, jobs = self.Job.objects.using(self.database).ack_and_claim_rows(
                [(c.job, o.result) for c, o in oks],
                self.worker_id,
                self.queues,
                limit=free,
                lease=self.lease,
            )
        except Exception as e:  # noqa: BLE001 -- sent apart, each with its own handling
            if isinstance(e, DB_ERRORS) and (contention(e) or not self._connection_answers()):
                for claim, _ in oks:
                    claim.finish_failed()
                self._unsent.extend(oks)
                raise
            self._send_held(oks)
            free = min(free, self.concurrency - len(self.book))
            if free < 1 or any(claim.state != SETTLED for claim, _ in oks):
                return []
            return self.Job.objects.using(self.database).claim_rows(
                self.worker_id, self.queues, limit=free, lease=self.lease, settle=False
            )
        self._acked(oks, acked)
        return jobs

    def _send_held(self, oks: list[tuple[Claim, Outcome]]) -> None:
        """Send acks held for a claim that is not coming, as _settle sends them (still
        finishing: never taken for running, so never declared lost meanwhile)."""
        self._unsent.extend(oks)
        self._settle()

    def _log_claim(self, job: Any) -> None:
        """One line per claim: at -v 2 for a due job (at -v 1 Django's ``state=RUNNING`` line
        says the same, with the fence, attempt and worker: logs.py); a warning for a takeover
        of an expired claim, naming the claim it ended (the claim verb reports the row as it
        was: ``was_state``, ``was_claimed_by``, ``was_fence``, ``was_lease``)."""
        if getattr(job, "was_state", None) != "claimed":
            logger.debug(
                "Claimed job=%s task=%s fence=%s attempt=%s/%s worker=%s",
                job.pk,
                job.task_path,
                job.fence,
                job.attempts,
                job.max_attempts,
                self.worker_id,
                extra=claim_fields(job, self.worker_id, "claimed", attempt=job.attempts),
            )
            return
        previous = job.was_claimed_by or "an unnamed worker"
        lease = job.was_lease
        logger.warning(
            "Took over job=%s task=%s fence=%s attempt=%s/%s worker=%s from "
            "worker %s (fence %s): %s",
            job.pk,
            job.task_path,
            job.fence,
            job.attempts,
            job.max_attempts,
            self.worker_id,
            previous,
            job.was_fence,
            # As its failure record says (claiming._expiry_message()).
            "its lease was ended early"
            if lease is None or conf.ended_early(lease)
            else f"its lease of {float(lease):g} s ran out",
            extra=claim_fields(
                job,
                self.worker_id,
                "takeover",
                attempt=job.attempts,
                previous_worker=previous,
                previous_fence=job.was_fence,
                lease=job.was_lease,
            ),
        )

    def _release_unconnected(self) -> None:
        """Release the jobs whose handlers could not open a database connection before
        they ran (too many connections, the database gone): no attempt was spent, so none
        is counted, nor is the claim among --max-jobs (a worker that ran none of its jobs
        has not run them). Claiming pauses for a growing moment, or the worker would claim
        the same job again at once."""
        while True:
            try:
                claim, outcome = self._unconnected.get_nowait()
            except queue.Empty:
                return
            pause = self._connect_backoff.next()
            self._paused_until = time.monotonic() + pause
            if not claim.begin_finish():
                self.book.forget(claim)  # lost or being released meanwhile
                self._claimed -= 1  # its handler never ran here either
                continue
            reason = f"; its handler could not connect to the database ({outcome.message})"
            try:
                self._release(claim, reason, at_stop=False)
            except DB_ERRORS as e:
                claim.finish_failed()
                self._unconnected.put((claim, outcome))
                self._db_trouble("release", e)
                return
            self._claimed -= 1
            logger.warning(
                "Claiming paused for %.1fs worker=%s: a handler could not connect",
                pause,
                self.worker_id,
                extra=claim_fields(claim.job, self.worker_id, "paused", error=outcome.message),
            )

    def _results_at_start(self, jobs: list[Any]) -> dict[Any, Any]:
        """The TaskResults that task_started, task_finished and contexts carry, built for
        the whole claim batch here (from the claimed rows, plus one read of earlier failures
        when a job was claimed before) rather than one query per handler. Empty on trouble:
        the handlers then read their own. A child process reads its own too (a TaskResult
        holds the task, which is not sent to it)."""
        if self.isolation != "thread" or not jobs:
            return {}
        from django.tasks import task_backends

        try:
            backend = cast(
                "LeaseBackend", task_backends[self.alias]
            )  # the worker serves a lease backend
            return backend.results_of_claims(jobs)
        except BaseException as e:  # noqa: BLE001 -- a missed signal must not cost a claim,
            # and nothing a row holds may stop the loop
            logger.warning(
                "Could not read the claimed jobs for task_started worker=%s error=%s",
                self.worker_id,
                e,
                extra={"event": "signal_read_failed", "worker": self.worker_id},
            )
            return {}

    def _abandoned(self) -> None:
        """A handler was abandoned (worker/timeouts.py). Once more still run than the
        worker has slots, it stops and exits with status 1, for its process manager to
        start a fresh one: only the process's end takes their threads, and the database
        connections they hold, with it (without a bound, a task that always hangs took a
        connection per timeout until max_connections)."""
        running = self.executor.abandoned()
        if running <= self.concurrency or self.abandoned_limit:
            return
        self.abandoned_limit = True
        logger.error(
            "%d abandoned handlers still running worker=%s, more than its slots: stopping, "
            "exit status 1, for a fresh process to take over",
            running,
            self.worker_id,
            extra={"event": "abandoned_limit", "worker": self.worker_id, "held": running},
        )
        if not self.stop_request.stopping:  # a stop under way keeps its grace: exit 1 at its end
            self.stop_request.request("too many abandoned handlers")

    def _finished(self, claim: Claim, outcome: Outcome) -> None:
        """Called on a slot thread when a handler returns: queue it for the main loop."""
        if outcome.kind is Kind.UNCONNECTED:
            self._unconnected.put((claim, outcome))
        else:
            self._connect_backoff.reset()
            self._done.put((claim, outcome))
        self.waker.wake()

    # -- plumbing ----------------------------------------------------------------------

    def _register(self) -> bool:
        """Take the worker id (identity.py), waiting while a live process holds it;
        False if a stop came first."""
        held_since: float | None = None
        logged_at = float("-inf")
        dead: str | None = None
        key = process_key()
        while not self.stop_request.stopping:
            try:
                holder = self.WorkerProcess.objects.using(self.database).register(
                    self.worker_id,
                    instance=self.instance,
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                    queues=["*"] if self.queues is None else self.queues,
                    heartbeat_seconds=self.heartbeat_seconds,
                    process_key=key,
                    dead=dead,
                )
            except DB_ERRORS as e:
                self._db_trouble("register", e)
                continue
            if holder is None:
                if held_since is not None:
                    logger.info(
                        "Worker id %r taken after %.1f s",
                        self.worker_id,
                        time.monotonic() - held_since,
                        extra={"event": "id_taken", "worker": self.worker_id},
                    )
                return True
            now = time.monotonic()
            held_since = now if held_since is None else held_since
            if holder.instance != dead and died(holder):
                # Its process died on this machine (kill -9): no silence to wait out.
                dead = holder.instance
                continue
            gone_after = conf.silent_after(getattr(holder, "period", holder.heartbeat_seconds))
            if now - logged_at >= HELD_LOG_EVERY:
                log_id_held(self.worker_id, holder, gone_after)
                logged_at = now
            # Look again within a second (a holder that stops is followed at once), or when
            # it would have been silent long enough.
            self.waker.wait(min(max(gone_after - silent_for(holder), 0.1), 1.0))
        logger.info(
            "Stopping on %s worker=%s before the worker id was taken; nothing was claimed",
            self.stop_request.signal_name,
            self.worker_id,
            extra={
                "event": "stopped",
                "worker": self.worker_id,
                "signal": self.stop_request.signal_name,
            },
        )
        return False

    def _replaced(self, holder: Any) -> None:
        """The heartbeat found the worker row another process's (``holder``: its hostname
        and pid, None if the row is gone): stop as on SIGTERM. A stop under way goes on as
        it was, not hurried as by a second signal; its row, marked stopped, may be taken
        by a waiting process meanwhile, which is no news."""
        if not self.stop_request.stopping:
            log_id_replaced(self.worker_id, holder)
            self.stop_request.request("worker id taken over")

    def _executor(self) -> Any:
        if self.isolation == "process":
            return ProcessExecutor(
                self.concurrency,
                self._finished,
                alias=self.alias,
                worker_id=self.worker_id,
                stopping=lambda: self.stop_request.stopping,
                connect_first=self.connect_handlers,
            )
        return ThreadExecutor(self.concurrency, self._finished, connect_first=self.connect_handlers)

    def _start_threads(self) -> list[Any]:
        self.heartbeat = Heartbeat(
            book=self.book,
            database=self.database,
            worker_id=self.worker_id,
            instance=self.instance,
            period=self.heartbeat_seconds,
            lease=self.lease,
            waker=self.waker,
            on_replaced=self._replaced,
        )
        watchdog = Watchdog(
            book=self.book,
            worker_id=self.worker_id,
            period=self.heartbeat_seconds,
            waker=self.waker,
            timeouts=RunTimeouts(
                worker_id=self.worker_id,
                # A process-isolated handler that does not stop is killed instead.
                abandon=self.executor.abandon if self.isolation == "thread" else None,
                deliver=self._finished,
                forget=self.book.forget,
                abandoned=self._abandoned,
            ),
        )
        self._vital = [self.heartbeat, watchdog]
        threads: list[Any] = list(self._vital)
        if self.notify and connections[self.listen_database].vendor == "postgresql":
            threads.append(
                Listener(
                    database=self.listen_database,
                    queues=self.queues,
                    waker=self.waker,
                    worker_id=self.worker_id,
                )
            )
        for thread in threads:
            thread.start()
        return threads

    def _db_trouble(
        self,
        what: str,
        error: Exception,
        *,
        wait: bool = True,
        most: float | None = None,
        trouble: Trouble | None = None,
    ) -> None:
        """Log (through ``trouble``, which may hold repeats back; by default each is said),
        drop the broken connection, back off (``most`` seconds at most); the next call
        reconnects."""
        delay = self._backoff.next()
        if most is not None:
            delay = max(0.0, min(delay, most))
        said = first_line(error)
        outage_met(error)  # the slots' kept connections checked before their next handler
        (trouble or self._each_trouble).warn(
            "Database trouble during %s worker=%s error=%s; retrying in %.1fs",
            what,
            self.worker_id,
            said,
            delay,
            error=said,
        )
        with contextlib.suppress(*DB_ERRORS):
            connections[self.database].close()
        if wait:
            self.waker.wait(delay)
