"""Where handlers run: a thread each (default), or a child process each.

A thread cannot be stopped from outside, so a thread-isolated handler that ignores
``current_job().lost`` runs on after its claim is lost (its result is still discarded).
In process isolation the parent kills the child once the claim is lost and the child has
not stopped within a short grace. Either way the parent's main loop, not the handler,
sends the ack or fail, so ownership writes happen in one place (a handler's checkpoints
and fenced() writes go out on its own connection).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from ..safe_logging import WorkerLogger
from ..storable import MESSAGE_LIMIT, describe_exception, storable_text
from .child import KILL_GRACE_SECONDS, STOP_SIGNALS
from .claims import LOST, RELEASING, RUNNING, Claim, Kind, Outcome
from .interpreter import InterpreterGuard, keep_streams_open, log_restored
from .logs import claim_fields, configured
from .running import connect_before_handler, left_in_transaction, run_task, task_context
from .timeouts import TIMEOUT_CLASS_PATH, timed_out_outcome

logger = WorkerLogger()

Done = Callable[[Claim, Outcome], None]

# The kill line's words for its ``reason`` field.
KILL_REASONS = {
    "lost": "lost",
    "released": "released",
    "timeout": "held, but its handler ran past its timeout",
    # The handler's own ack came first; the process ran on after the worker began to stop
    # or after a fenced write of its own was refused.
    "acked": "acknowledged by its handler, whose process ran on (the job is done)",
}


# A child's start-up (interpreter, Django's setup, the task's import) is not a handler's
# run time, unless it alone lasts this long and the timeout: then it hangs.
START_ALLOWANCE_SECONDS = 30.0


class _Slots:
    """A set of daemon threads fed through a queue: one per concurrent handler. A slot
    whose handler was told to stop and did not is retired and replaced (abandon())."""

    # Whether a handler's run time counts from when its slot takes the claim; a child
    # process says itself when its handler starts (its interpreter's start-up not counted).
    CLOCK_AT_SLOT = True

    def __init__(self, size: int, done: Done, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Claim, Any] | None] = queue.SimpleQueue()
        self._done = done
        self._name = name
        self._running = 0
        self._running_lock = threading.Lock()
        # The claim each slot thread's handler runs now (by thread ident), and the slots
        # retired: their thread ends once its handler returns, its outcome dropped.
        self._serving: dict[int, Claim] = {}
        self._retired: set[int] = set()
        self._replaced = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, claim: Claim, task: Any) -> None:
        self._queue.put((claim, task))

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                # Closed: this thread's connections go with it (in a test process that
                # lives on, an open one keeps the test database from being dropped).
                with contextlib.suppress(Exception):
                    connections.close_all()
                return
            claim, task = item
            outcome: Outcome | None = None
            retired = False
            if self.CLOCK_AT_SLOT:
                claim.running_since = time.monotonic()
            with self._running_lock:
                self._running += 1
                self._serving[me] = claim
            try:
                try:
                    outcome = self.execute(claim, task)
                except BaseException as e:  # noqa: BLE001 -- a slot must never die silently
                    outcome = _worker_error(e, "while running the handler")
                finally:
                    if claim.returned_at is None:  # a child's is when its outcome came
                        claim.returned_at = time.monotonic()
                    # The handler is done: a stop need not end the process at once for it.
                    with self._running_lock:
                        self._running -= 1
                        del self._serving[me]
                        # A thread started later may get this one's ident: forgotten here.
                        retired = me in self._retired
                        self._retired.discard(me)
                if _timed_out_unsaid(claim, outcome):
                    outcome = timed_out_outcome(claim)
                # Before the outcome goes out: a transaction the handler left open may hold
                # the lock on the row the main loop is about to ack or fail.
                _drop_broken_connections()
            except BaseException as e:  # noqa: BLE001 -- a raising cleanup must not kill the slot
                logger.warning(
                    "Could not clean up the handler's connections job=%s error=%s",
                    claim.job.pk,
                    e,
                    extra={"event": "cleanup_failed", "job_id": claim.job.pk, "error": str(e)},
                )
            finally:
                # Abandoned: its claim was written or dropped meanwhile. A lost one's
                # outcome still goes out, to be discarded and said so, as a lost claim's is.
                if not retired or claim.state == LOST:
                    self._done(
                        claim,
                        outcome
                        if outcome is not None
                        else _worker_error(RuntimeError("no outcome"), "while running the handler"),
                    )
                # After the outcome is in: a stop that waits on this finds it to write.
                claim.exited.set()
            if retired:
                # Abandoned: its claim was written or dropped meanwhile, and a new thread
                # serves in its place.
                logger.info(
                    "Abandoned handler of job=%s fence=%s returned after %.1f s; its thread ends",
                    claim.pk,
                    claim.job.fence,
                    time.monotonic() - (claim.running_since or 0.0),
                    extra={"event": "abandoned_returned", "job_id": claim.pk},
                )
                with contextlib.suppress(Exception):
                    connections.close_all()
                return

    def abandoned(self) -> int:
        """How many abandoned handlers still run (their threads end when they return)."""
        with self._running_lock:
            return len(self._retired)

    def abandon(self, claim: Claim) -> bool:
        """Retire the slot whose handler runs ``claim``, told to stop and deaf to it: a new
        thread serves in its place, the old one ends once its handler returns, its outcome
        dropped (the caller writes or drops the claim). False if no slot runs it now."""
        with self._running_lock:
            slot = next((i for i, c in self._serving.items() if c is claim), None)
            if slot is None or slot in self._retired:
                return False
            thread = threading.Thread(
                target=self._serve, name=f"{self._name}-r{self._replaced + 1}", daemon=True
            )
            # Started before the slot is retired, and under the lock (the new thread waits
            # on the queue, then for this lock): one that cannot start (too many threads)
            # raises with nothing changed, the handler's own outcome still to come.
            thread.start()
            self._replaced += 1
            self._retired.add(slot)
            self._threads = [t for t in self._threads if t.ident != slot] + [thread]
        return True

    def execute(self, claim: Claim, task: Any) -> Outcome:
        raise NotImplementedError

    def running(self) -> int:
        """How many handlers are running now, whatever became of their claims (lost,
        replaced, released)."""
        with self._running_lock:
            return self._running

    def new_flags(self) -> tuple[Any, Any, Any]:
        """The lost flag, the renewal stamp and the acked flag of a new claim: shared
        with a child process in process isolation (None: the claim makes its own)."""
        return None, None, None

    def kill_children(self) -> None:
        """Kill the handlers' processes still running, for a process about to end at once
        (run_lease_worker). A thread cannot be killed: it ends with the process."""

    def restore_interpreter(self) -> list[str]:
        """Put back what handlers sharing this interpreter changed to the worker's harm
        (interpreter.py), now rather than after their jobs; the names of what was."""
        return []

    def close(self, wait: float = 0.0) -> None:
        """Let each slot thread end once its handler is done (at once if idle), closing its
        connections; wait up to ``wait`` seconds for them."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))


class ThreadExecutor(_Slots):
    def __init__(
        self,
        size: int,
        done: Done,
        *,
        connect_first: bool = False,
    ) -> None:
        self._connect_first = connect_first
        # Handlers share this process's interpreter: what they change to its harm is put
        # back after each job, and the standard streams they see cannot be closed
        # (interpreter.py).
        self._interpreter = InterpreterGuard()
        self._put_streams_back = keep_streams_open()
        super().__init__(size, done, "leases-handler")

    def close(self, wait: float = 0.0) -> None:
        super().close(wait)
        # Not while a slot thread lives: its handler could still close the originals.
        if not any(thread.is_alive() for thread in self._threads) and self.abandoned() == 0:
            self._put_streams_back()

    def restore_interpreter(self) -> list[str]:
        return self._interpreter.restore()

    def execute(self, claim: Claim, task: Any) -> Outcome:
        job = claim.job
        refused = connect_before_handler(job.database) if self._connect_first else None
        if refused is not None:
            return refused
        context = task_context(task, claim.handle, claim.link)
        try:
            return run_task(task, job.args, job.kwargs, claim.handle, claim.link, context)
        finally:
            # Never in place of the job's outcome: the guard raises nothing, nor its line.
            with contextlib.suppress(Exception):
                if put_back := self._interpreter.restore():
                    log_restored(put_back, job.pk, claim.handle.worker_id)


def exit_text(exitcode: int | None, stopping: bool = False) -> str:
    """How a handler process ended, for its failure's message: a negative exit code is
    the signal that killed it (SIGKILL out of the blue: most often the kernel's
    out-of-memory killer; while the worker stops, maybe the supervisor's last word)."""
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = -exitcode == signal.SIGKILL and not stopping
        return f"was killed by {name}{' (out of memory, or kill -9)' if oom else ''}"
    return f"exited with code {exitcode}"


class ProcessExecutor(_Slots):
    """Run each job in a fresh 'spawn' child and watch it until it reports or dies.

    ``stopping`` tells whether the worker is stopping: a child that dies then (a stop signal
    sent to the whole process group or cgroup reached handler code that re-enabled it) is
    reported as "stopped", and its job released, not failed.
    """

    CLOCK_AT_SLOT = False  # the child's "started" message starts it

    def __init__(
        self,
        size: int,
        done: Done,
        *,
        alias: str,
        worker_id: str,
        stopping: Callable[[], bool],
        connect_first: bool = False,
    ) -> None:
        self._mp = multiprocessing.get_context("spawn")
        self._connect_first = connect_first
        self._alias = alias
        self._worker_id = worker_id
        self._stopping = stopping
        # The handler children started and not yet joined, and whether kill_children()
        # has come: no child starts after it.
        self._children: set[Any] = set()
        self._children_lock = threading.Lock()
        self._killing = False
        super().__init__(size, done, "leases-child")

    def kill_children(self) -> None:
        with self._children_lock:
            self._killing = True
            children = list(self._children)
        for process in children:
            with contextlib.suppress(Exception):  # one that ended meanwhile
                kill_handler(process)

    def new_flags(self) -> tuple[Any, Any, Any]:
        flag = functools.partial(self._mp.RawValue, "b", 0)
        return SharedFlag(flag()), self._mp.RawValue("d", 0.0), SharedFlag(flag())

    def execute(self, claim: Claim, task: Any) -> Outcome:
        from .child import child_main

        job = claim.job
        payload = {
            "alias": self._alias,
            "task_path": job.task_path,
            "queue_name": job.queue_name,
            "args": job.args,
            "kwargs": job.kwargs,
            "job_id": job.pk,
            "fence": job.fence,
            "attempt": job.attempts,
            "cursor": job.cursor,
            "lease": claim.lease,
            "worker_id": self._worker_id,
            "claim_token": job.claim_token,
            "database": job.database,
            "connect_first": self._connect_first,
            "logs": configured(),
        }
        ours, theirs = self._mp.Pipe()
        process = self._mp.Process(
            target=child_main,
            args=(theirs, payload, claim.lost_flag, claim.stamp, claim.acked_flag),
            name=f"leases-job-{job.pk}",
            daemon=True,
        )
        if self._killed():
            ours.close()
            theirs.close()
            return Outcome(Kind.STOPPED, message="not started: the worker is ending at once")
        # Started outside the lock: with arguments past the pipe's buffer start() waits
        # for the child's interpreter, and the other slots' starts must not queue behind
        # it. A kill_children() that came meanwhile could not see this child (unkillable
        # through its Process until start() returns): it is killed here. (A worker that
        # ends before that leaves a child that sees it gone and ends itself, child.py.)
        spawned = time.monotonic()
        with stop_signals_blocked():
            process.start()
        theirs.close()
        with self._children_lock:
            self._children.add(process)
        if self._killed():
            _kill(process)
            self._forget_child(process)
            ours.close()
            return Outcome(Kind.STOPPED, message="killed at start: the worker is ending at once")
        logger.debug(
            "Started handler process pid=%s job=%s fence=%s worker=%s",
            process.pid,
            job.pk,
            job.fence,
            self._worker_id,
            extra={"event": "process_started", "job_id": job.pk, "pid": process.pid},
        )
        try:
            return self._supervise(claim, process, ours, spawned)
        finally:
            ours.close()
            # Alive or not: what the handler started may outlive it (its group).
            kill_handler(process)
            process.join()
            self._forget_child(process)

    def _killed(self) -> bool:
        with self._children_lock:
            return self._killing

    def _forget_child(self, process: Any) -> None:
        with self._children_lock:
            self._children.discard(process)

    def _supervise(self, claim: Claim, process: Any, conn: Any, spawned: float) -> Outcome:
        """Wait for the child's outcome, or its end, killing it when its claim goes. Its
        run time counts from its "started" message (the interpreter's start-up, Django's
        setup and the task's import not counted; its connection to the database counted),
        or from its spawn once start-up alone has lasted the timeout and
        START_ALLOWANCE_SECONDS (a start that hangs), to its outcome: a result back in time
        stands however long the process takes to exit after it. Both ends are the child's
        own readings of the monotonic clock (one clock for the whole machine), not when
        this thread got round to reading its messages."""
        outcome: Outcome | None = None
        lost_at: float | None = None
        started = False
        while True:
            ready = multiprocessing.connection.wait([conn, process.sentinel], timeout=0.05)
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = None
                except Exception as e:  # noqa: BLE001 -- e.g. an outcome that cannot be unpickled
                    message = ("done", _worker_error(e, "reading the handler's outcome"))
                if message is not None and message[0] == "started":
                    started = True
                    claim.running_since = claim.running_since or _sent_at(message, 1)
                if message is not None and message[0] == "done":
                    claim.returned_at = _sent_at(message, 2)
                    outcome = message[1]
                if message is None and not process.is_alive():
                    break
                if outcome is not None:
                    break
                continue
            if process.sentinel in ready:
                break
            if (
                claim.running_since is None
                and claim.timeout is not None
                and time.monotonic() - spawned >= max(claim.timeout, START_ALLOWANCE_SECONDS)
            ):
                claim.running_since = spawned
            if claim.lost_flag.is_set():
                lost_at = lost_at or time.monotonic()
                # Released, or done by the handler's own ack while the worker stops. (A
                # handler that acked may set the flag itself, its later fenced() refused.)
                stopping = claim.state == RELEASING or claim.acked and self._stopping()
                grace = 0.0 if stopping else KILL_GRACE_SECONDS
                if time.monotonic() - lost_at >= grace:
                    reason = (
                        "acked"
                        if claim.acked
                        else "released"
                        if claim.state == RELEASING
                        else "timeout"
                        if claim.timed_out and claim.state == RUNNING
                        else "lost"
                    )
                    logger.warning(
                        "Killing handler process pid=%s job=%s fence=%s worker=%s: its claim is %s",
                        process.pid,
                        claim.pk,
                        claim.job.fence,
                        self._worker_id,
                        KILL_REASONS[reason],
                        extra=claim_fields(
                            claim.job,
                            self._worker_id,
                            "process_killed",
                            pid=process.pid,
                            reason=reason,
                        ),
                    )
                    _kill(process)
                    if reason == "timeout":
                        return timed_out_outcome(claim, "killed" if started else "unstarted")
                    return Outcome(Kind.LOST)
        process.join(5)
        if outcome is None:
            if claim.lost_flag.is_set():
                return Outcome(Kind.LOST)
            if self._died_of_stopping(process):
                return Outcome(
                    Kind.STOPPED,
                    message=f"handler process {exit_text(process.exitcode, stopping=True)} "
                    "while the worker stopped",
                )
            return Outcome(
                Kind.ERROR,
                exception_class_path="django_leases.exceptions.HandlerDied",
                message=f"handler process {exit_text(process.exitcode)} before returning",
            )
        if (
            outcome.kind is Kind.ERROR
            and outcome.exception_class_path == "builtins.KeyboardInterrupt"
            and self._stopping_within(KILL_GRACE_SECONDS)
        ):
            # SIGINT sent to every process of the service (a cgroup-wide kill) reached a
            # handler that had put Python's SIGINT handler back: the worker's stop, not the
            # job's failure.
            return Outcome(Kind.STOPPED, message="handler interrupted while the worker stopped")
        return outcome

    def _died_of_stopping(self, process: Any) -> bool:
        """Whether the worker is stopping. A child killed by a stop signal may die before
        the parent's own signal handler has run, so that case waits a moment for it."""
        stop_signals = (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
        return self._stopping_within(KILL_GRACE_SECONDS if process.exitcode in stop_signals else 0)

    def _stopping_within(self, seconds: float) -> bool:
        """Whether the worker is stopping, or starts to within ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self._stopping():
            if time.monotonic() >= deadline:
                return False
            threading.Event().wait(0.05)
        return True


class SharedFlag:
    """The lost flag shared with a handler's child process: a byte in shared memory.

    Not multiprocessing.Event: a child that exits (or is killed) while one of its threads
    waits on the Event stays counted as a sleeper, and the parent's next set() then waits
    for it forever (the heartbeat thread hung that way, renewing nothing again)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def is_set(self) -> bool:
        return bool(self._value.value)

    def set(self) -> None:
        self._value.value = 1

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._value.value:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            threading.Event().wait(left)
        return True


def _sent_at(message: tuple[Any, ...], index: int) -> float:
    """When a child read the monotonic clock for ``message``; now for a message without
    a stamp."""
    stamp = message[index] if len(message) > index else None
    return float(stamp) if isinstance(stamp, int | float) else time.monotonic()


def _timed_out_unsaid(claim: Claim, outcome: Outcome) -> bool:
    """Whether ``claim`` timed out and ``outcome`` (whatever its handler came back with
    after it was told) does not say so yet: the attempt fails as timed out. A handler that
    returned before its timeout (the watchdog looking just after) keeps its outcome, as do
    a release (the handler's process died of a stop) and an unconnected handler."""
    return (
        claim.timed_out
        and claim.timeout is not None
        and claim.running_since is not None
        and claim.returned_at is not None
        and claim.returned_at - claim.running_since >= claim.timeout
        and outcome.kind in (Kind.OK, Kind.ERROR, Kind.LOST)
        and outcome.exception_class_path != TIMEOUT_CLASS_PATH
    )


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this (slot) thread while it starts a child: the child
    inherits the mask through exec and unblocks them once its own handlers are in
    (child.py). A SIGTERM sent to every process of the service (systemd's control-group
    kill, a container runtime's) reached a child still starting, whose default
    disposition ended it: its job failed, an attempt counted. The main thread, where
    the worker handles them, blocks nothing."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing starts its resource tracker at a first start(), then unblocks SIGINT
    # and SIGTERM in the calling thread: started first, it is found running.
    with contextlib.suppress(Exception):
        multiprocessing.resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _worker_error(exc: BaseException, doing: str) -> Outcome:
    """The failed outcome of the worker's own error ``doing`` something for a job; never
    raises, or the slot thread would die with the claim unreported."""
    try:
        path, message, trace = describe_exception(exc)
    except BaseException:  # noqa: BLE001 -- e.g. MemoryError while formatting
        path, message, trace = "builtins.BaseException", "(could not be described)", ""
    return Outcome(
        Kind.ERROR,
        exception_class_path=path,
        traceback=trace,
        message=storable_text(f"worker error {doing}: {message}", MESSAGE_LIMIT),
    )


def _kill(process: Any) -> None:
    """SIGKILL: the child ignores SIGTERM (child.py), and has had its grace already."""
    kill_handler(process)
    process.join()


def kill_handler(process: Any) -> None:
    """SIGKILL a handler's process and what it started: its process group, which it leads
    (child.py), and the process itself, should it not have made the group yet. Also once
    the process has ended: the group's id is its pid, which no new process gets while the
    group has members, nor soon after (Linux hands pids out in turn)."""
    pid = process.pid
    if pid is not None and hasattr(os, "killpg"):
        with contextlib.suppress(OSError):  # no such group: not made yet, or all ended
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):  # ended and reaped meanwhile
        process.kill()


def _drop_broken_connections() -> None:
    """After each job, close this slot's connections that the handler left unfit for the
    next one, as Django does at the end of a request: one that failed and no longer
    answers, and one left inside a transaction (an atomic block never exited, autocommit
    turned off, a BEGIN of its own), whose row locks would make the main loop's ack or
    fail and the heartbeat wait forever. Closing rolls the transaction back. Healthy ones
    stay open whatever CONN_MAX_AGE says, so a busy worker does not reconnect per job."""
    for conn in connections.all(initialized_only=True):
        try:
            _tidy(conn)
        except Exception as e:  # noqa: BLE001 -- one connection's trouble must not spare the others
            logger.warning(
                "Could not tidy connection %s after a job: %s",
                conn.alias,
                e,
                extra={"event": "tidy_failed", "error": str(e)},
            )


def _tidy(conn: Any) -> None:
    if conn.connection is None:
        return
    if left_in_transaction(conn) or conn.errors_occurred and not conn.is_usable():
        _close(conn)
        return
    conn.errors_occurred = False
    # With CONN_HEALTH_CHECKS the next job's first query checks the connection first.
    conn.health_check_done = False


def _close(conn: Any) -> None:
    """Close ``conn``, rolling back what it holds, even from inside an atomic block the
    handler never left (Django keeps such a connection half-closed until the block exits,
    which here it never will); the next job's first query reconnects."""
    conn.in_atomic_block = False
    conn.atomic_blocks = []
    conn.savepoint_ids = []
    conn.needs_rollback = False
    conn.closed_in_transaction = False
    try:
        conn.close()
    finally:
        conn.connection = None
