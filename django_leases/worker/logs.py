"""The worker's log lines: one format for its own lines and Django's ``Task id=...`` lines.

Every worker record carries its facts as attributes (``extra=``): an ``event`` named in
EVENTS, and ``job_id``, ``task``, ``queue``, ``worker``, ``fence`` and the other FIELDS it
has. The text format shows the message, which repeats them in words free to change; the
JSON format writes them as fields, for log shippers and for the tests, which wait on events
rather than on wording. ``run_lease_worker`` installs a handler only on the loggers the project's
``LOGGING`` leaves alone.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any, cast

from ..api import current_job
from ..safe_logging import WORKER_LOGGER
from ..storable import MESSAGE_LIMIT, cut_middle

TASKS_LOGGER = "django.tasks"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# Every event a worker record can carry, and what it says; docs/worker.md lists the same,
# and tests/test_worker_logs.py holds the code, the docs and a worker's output to it.
EVENTS: dict[str, str] = {
    # Starting and stopping
    "db_wait": "the database does not answer at start; retrying (attempt, error)",
    "db_back": "the database answered after the wait at start",
    "migrations_unchecked": "the migrations could not be checked at start (error)",
    "limits_unread": "the connection limits could not be read at start (error)",
    "id_held": "another live process holds the worker id; waiting for it to stop or go "
    "silent (host, pid)",
    "id_taken": "the worker id was taken after that wait, or at once from a holder known dead",
    "id_replaced": "another process took the worker id over while this one was silent; "
    "stopping (host, pid: the new holder's)",
    "started": "the worker is registered and claiming (worker, queue)",
    "listening": "LISTEN for wake-ups is in place (PostgreSQL)",
    "listen_failed": "the wake-up connection failed; polling until it is back (error, repeats)",
    "stopping": "a stop signal came: claiming nothing more (signal)",
    "hurried": "a second stop signal with handlers still running: the rest of the grace is "
    "skipped (signal)",
    "handlers_running": "handlers still running at the end of the grace, released anyway (jobs)",
    "threads_left": "threads a handler started still ran a grace after the worker stopped; the process ended without them (threads)",
    "max_jobs": "the worker ran its --max-jobs",
    "burst_done": "nothing claimable under --burst; leaving",
    "thread_died": "a thread the worker needs died: releasing and exiting with status 1 (role)",
    "loop_failed": "the main loop raised (a bug, or a thread-isolated handler's change to the "
    "interpreter): releasing and exiting with status 1 (error, exc_info)",
    "thread_crashed": "a thread the worker needs ended on an exception (exc_info)",
    "thread_error": "an unexpected error in one round of a thread; it carries on (error)",
    "stopped": "the worker stopped",
    # One claim
    "claimed": "a job was claimed (job_id, fence, attempt)",
    "takeover": "a job whose lease ran out was claimed (previous_worker, previous_fence, lease)",
    "process_started": "a handler process was started (pid)",
    "process_killed": "a handler process was killed: its claim is lost or released, its "
    "handler ran past its timeout, or the handler acknowledged its job itself and its process "
    "ran on (pid, reason: lost, released, timeout or acked)",
    "timed_out": "a handler ran past its timeout: told to stop, its attempt fails (timeout)",
    "handler_abandoned": "a thread-isolated handler did not stop when told (a second after "
    "its timeout, a lease after its claim was lost): its slot is replaced, the thread runs on",
    "abandoned_returned": "an abandoned handler returned at last; its thread ends",
    "abandoned_limit": "more abandoned handlers still run than the worker has slots: it "
    "stops and exits with status 1, for a fresh process (held)",
    "orphaned": "a handler process found its worker gone; it ends after the grace (pid)",
    "checkpoint": "a checkpoint was written",
    "checkpoint_rejected": "a checkpoint matched no row: the claim is lost",
    "acked": "a job was acknowledged",
    "raised_after_ack": "a handler raised after acknowledging its job in fenced(); it stays succeeded (error)",
    "left_open_after_ack": "a handler returned inside a transaction after acknowledging its job in fenced(); it stays succeeded, its later writes there are rolled back (databases)",
    "async_teardown_cut": "an async handler's event loop was closed 2 s after its coroutine returned, with what it left still running (tasks that ignore cancellation, executor calls never awaited); its outcome stands",
    "ack_rejected": "an ack matched no row: the claim was lost first",
    "ack_refused": "the database refused a result; the attempt is failed instead (error)",
    "batch_ack_refused": "the database refused a batch of acks; sent one by one (error)",
    "failed": "an attempt failed and was recorded; the job runs again (error, attempt, retry_in)",
    "dead_lettered": "a job ended dead: its attempt failed for the last time (error, reason, "
    "attempt), or a claim found it must not run again (reason, previous_worker)",
    "parked": "a claim found a job whose lease ran out and whose task parks it: pending, "
    "due never, until an operator retries it (previous_worker)",
    "fail_rejected": "a failure matched no row: the claim was lost first",
    "failure_refused": "the database refused a failure record; a minimal one follows (error)",
    "failure_dropped": "the database refused even the minimal record; the lease runs out",
    "dropped": "a claim's write failed on something else than the database; the lease runs out",
    "lost": "a claim was lost: renewal matched no row, the watchdog gave it up or it was taken",
    "discarded": "a handler's result was discarded: its claim was lost",
    "handler_stopped": "a handler stopped when told; its job is to be released",
    "released": "a job went back to pending, the attempt not counted",
    "release_rejected": "a release matched no row: the claim was lost first",
    "release_failed": "a release never reached the database; the lease runs out",
    "outcome_unsent": "at exit, an ack or fail never reached the database; the lease runs out",
    "paused": "claiming paused: a handler could not connect; its job was released (error)",
    # Heartbeat and database
    "renewed": "one round of renewals (held, claims, statements, lost)",
    "renewal_failed": "a round of renewals failed; retrying (error, repeats)",
    "heartbeat_overdue": "no renewal went through for too long: claiming nothing",
    "heartbeat_back": "renewals go through again: claiming again",
    "db_trouble": "the database is unreachable during a write; retrying (error, repeats)",
    "trouble_over": "a trouble logged above ended: its first success (trouble, failures; "
    "schedule, for `schedule_failed`)",
    "db_refused": "the database refused a write that cannot succeed later (error)",
    "cleanup_failed": "the handler's connections could not be closed after its job (error)",
    "interpreter_restored": "a handler lowered the recursion limit, lengthened the switch "
    "interval, disabled logging or the worker's loggers, changed the working directory, set "
    "an asyncio event loop policy or left a closed stream in sys.stdout or sys.stderr: put "
    "back (job_id, restored)",
    "tidy_failed": "a connection could not be tidied after a job (error)",
    # Periodic schedules
    "schedules_synced": "synced with the code at start (added, changed, removed, unchanged, taken)",
    "schedule_contested": "taken at sync from another backend whose code declares it too (schedule, backend)",
    "schedules_trouble": "the database failed while ticking; the next look retries (error, repeats)",
    "schedule_ticked": "this worker decided a schedule's ticks (schedule, jobs, skipped, misfired)",
    "schedule_unrunnable": "this code cannot enqueue its task: left to others (schedule, error)",
    "schedule_unreadable": "this version cannot read its stored spec: left alone (schedule, error)",
    "schedule_failed": "its decision raised, rolled back alone; the others went on; told as a "
    "trouble, it stays due (schedule, error, repeats)",
    # Django's task signals
    "signal_read_failed": "the job could not be read for task_started/task_finished",
    "receiver_raised": "a receiver of task_started/task_finished raised",
    "task_enqueued": "Django's line: a task was enqueued",
    "task_running": "Django's line: a task started",
    "task_successful": "Django's line: a task succeeded",
    "task_failed": "Django's line: a task failed",
}

# Structured fields a record may carry, in the order the JSON format writes them.
FIELDS = (
    "event",
    "job_id",
    "task",
    "queue",
    "worker",
    "fence",
    "attempt",
    "previous_worker",
    "previous_fence",
    "lease",
    "error",
    "pid",
    "host",
    "reason",
    "retry_in",
    "timeout",
    "role",
    "signal",
    "jobs",
    "held",
    "claims",
    "statements",
    "lost",
    "schedule",
    "backend",
    "skipped",
    "misfired",
    "added",
    "changed",
    "removed",
    "unchanged",
    "taken",
    "databases",
    "threads",
    "repeats",
    "trouble",
    "failures",
    "restored",
)


def claim_fields(job: Any, worker: str, event: str, **more: Any) -> dict[str, Any]:
    """The ``extra=`` of a record about one job."""
    return {
        "event": event,
        "job_id": job.pk,
        "task": getattr(job, "task_path", None),
        "queue": getattr(job, "queue_name", None),
        "worker": worker,
        "fence": getattr(job, "fence", None),
        **more,
    }


class TaskSignalFields(logging.Filter):
    """Give Django's ``Task id=%s path=%s state=%s`` records (django/tasks/signals.py) the
    worker's fields, so both kinds of line carry the same ones. A line about the job this
    thread runs (current_job()) also names its claim: ``fence=... attempt=... worker=...``,
    so that at -v 1 Django's two lines per job say what the worker's own claimed and acked
    lines (-v 2) would. Leaves any other record alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Two records per job at -v 1, from ten handler threads at once: the checks are
        # ordered so that a record of another logger costs one comparison.
        if record.name != TASKS_LOGGER:
            return True
        if record.exc_info == (None, None, None):
            # Django 6.0 logs every finished task with exc_info=sys.exc_info(), printed
            # as "NoneType: None" under each success (6.0.x later and 6.1 pass None).
            record.exc_info = None
        msg, args = record.msg, cast(Any, record.args)
        if (
            type(args) is tuple
            and len(args) >= 3
            and isinstance(msg, str)
            and msg.startswith("Task id=")
            and not hasattr(record, "event")
        ):
            record.job_id = int(args[0]) if str(args[0]).isdigit() else args[0]
            record.task = args[1]
            if "state=" in msg:  # not the enqueued line: ids of other tables
                record.event = f"task_{str(args[2]).lower()}"
                _name_the_claim(record, args)
            else:
                record.event = "task_enqueued"
        return True


def _name_the_claim(record: logging.LogRecord, args: tuple[Any, ...]) -> None:
    handle = current_job()
    if handle is None or str(handle.job_id) != str(args[0]):
        return  # not a line about this thread's job (one it enqueued, say)
    record.fence, record.attempt, record.worker = handle.fence, handle.attempt, handle.worker_id
    record.msg = f"{record.msg} fence=%s attempt=%s worker=%s"
    record.args = (*args, handle.fence, handle.attempt, handle.worker_id)


class _BoundedTracebackFormatter(logging.Formatter):
    """A formatter whose tracebacks are cut to MESSAGE_LIMIT characters (before escapes),
    head and tail kept, as the worker's own messages are (docs/worker.md, JSON logs)."""

    def formatException(self, ei: Any) -> str:  # noqa: N802 -- logging's name
        return cut_middle(super().formatException(ei), MESSAGE_LIMIT)


class JsonFormatter(_BoundedTracebackFormatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, then the
    record's structured fields; a traceback as ``exc_info`` (cut to MESSAGE_LIMIT
    characters). Usable from LOGGING too:
    ``{"()": "django_leases.worker.logs.JsonFormatter"}``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        # ASCII: a lone surrogate (a handler's message, in Django's traceback line) is
        # written as its \u escape, which any stream or file encodes.
        return json.dumps(line, default=str, ensure_ascii=True)


class TextFormatter(_BoundedTracebackFormatter):
    """The text format (TEXT_FORMAT unless given another), with NUL and lone surrogates
    (a handler's message, in Django's traceback line) backslash-escaped, so that a log file
    stays text every reader and encoder takes. Usable from LOGGING too:
    ``{"()": "django_leases.worker.logs.TextFormatter"}``."""

    def __init__(self, fmt: str | None = TEXT_FORMAT, *args: Any, **kwargs: Any) -> None:
        super().__init__(fmt, *args, **kwargs)
        # The last second formatted, and its text: a burst of lines formats it once.
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None or self.default_msec_format is None:
            return super().formatTime(record, datefmt)
        second, text = self._second  # one tuple, swapped whole: safe across threads
        if second != int(record.created):
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, text)
        return self.default_msec_format % (text, record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        # logging caches the formatted traceback on the record: the cut one stays this
        # format's, and the project's other handlers still get the whole traceback.
        cached, record.exc_text = record.exc_text, None
        try:
            return printable(super().format(record))
        finally:
            record.exc_text = cached


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler for lines logged from many threads at once (at -v 1, two per job
    from ten handler threads): a record is formatted before any lock is taken, and the
    thread that holds the lock writes every line waiting in one write, its own and those
    other threads left meanwhile. The stock handler, which formats and writes each line
    under its lock, made the threads queue (docs/benchmarks.md). Whoever lets go of the
    lock through release() (logging.shutdown() and the interpreter guard take it too)
    writes what waits then, and flush() writes it before flushing: a line left waiting
    goes out with the next line or flush, or at exit. Past BACKLOG
    lines waiting, a thread waits for the lock as the stock handler does: a stream that
    stalls (a pipe nobody reads) holds the threads up instead of filling memory."""

    BACKLOG = 1000

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._pending: collections.deque[tuple[str, logging.LogRecord]] = collections.deque()

    def handle(self, record: logging.LogRecord) -> bool:
        passed = self.filter(record)
        if isinstance(passed, logging.LogRecord):
            record = passed
        if not passed:
            return False
        try:
            line = self.format(record) + self.terminator
        except RecursionError:  # as logging's own handlers do
            raise
        except Exception:  # noqa: BLE001 -- logging's way: reported on stderr, not raised
            self.handleError(record)
            return True
        self._pending.append((line, record))
        self._drain()
        return True

    def _drain(self) -> None:
        # A thread that finds the lock taken leaves its line to the holder, which looks
        # again after letting go (release()).
        while self._pending and self.lock.acquire(  # type: ignore[union-attr]
            blocking=len(self._pending) > self.BACKLOG
        ):
            try:
                self._write_pending()
            finally:
                self.lock.release()  # type: ignore[union-attr]

    def _write_pending(self) -> None:
        """Write the lines waiting (the lock held), in one write. If that write refuses
        them (a line the stream cannot encode, a closed stream), each goes on its own, so
        that a line that cannot be written is reported with its own record; if the stream
        failed (an OSError: the write or its flush may have taken part of them), each
        record is reported and none written again."""
        batch = []
        while self._pending:
            batch.append(self._pending.popleft())
        if not batch:
            return
        try:
            self.stream.write("".join(line for line, _ in batch))
            if flush := getattr(self.stream, "flush", None):
                flush()
            return
        except RecursionError:
            raise
        except (UnicodeError, ValueError):
            pass  # refused before anything was written: each line again, below
        except Exception:  # noqa: BLE001 -- logging's way: reported on stderr, not raised
            for _, record in batch:
                self.handleError(record)
            return
        for line, record in batch:
            try:
                self.stream.write(line)
            except RecursionError:
                raise
            except Exception:  # noqa: BLE001
                self.handleError(record)

    def release(self) -> None:
        super().release()
        self._drain()

    def flush(self) -> None:
        self.acquire()
        try:
            self._write_pending()
            with contextlib.suppress(ValueError, OSError):  # a stream closed under us
                super().flush()
        finally:
            self.release()  # writes what was left meanwhile

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging's name
        """logging's report on sys.stderr, unless it cannot be written either: a handler
        that closed sys.stderr (the stream this writes to) made the report raise
        ValueError out of the log call, failing the job that logged, or another thread's
        (a line that cannot be written never fails a job)."""
        with contextlib.suppress(Exception):
            super().handleError(record)

    def _at_fork_reinit(self) -> None:
        super()._at_fork_reinit()  # type: ignore[misc]
        self._pending.clear()


def printable(text: str) -> str:
    """``text`` with lone surrogates and NUL as backslash escapes (\\ud800, \\x00)."""
    if text.isascii():
        return text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def configured_by_project(name: str) -> bool:
    """Whether settings.LOGGING routes logger ``name`` (itself, a parent, or the root):
    its lines then go where the project said, in its format."""
    from django.conf import settings

    config = getattr(settings, "LOGGING", None) or {}
    if config.get("root") or "" in config.get("loggers", {}):
        return True
    return any(name == key or name.startswith(f"{key}.") for key in config.get("loggers", {}))


# What configure() was last called with: a process-isolated handler's child process
# (child.py) configures its own logging the same way, so that Django's task lines, which the
# child writes, come out as they do in thread isolation.
_configured: tuple[int, str] | None = None


def configured() -> tuple[int, str] | None:
    """The (verbosity, log_format) this process's worker logging was configured with."""
    return _configured


def configure(verbosity: int, log_format: str = "text") -> list[str]:
    """Give the worker's logger and Django's task logger one handler on stderr, in
    ``log_format`` ("text" or "json"), unless the project's LOGGING routes them; set their
    levels from ``verbosity`` either way (-v 0: warnings, 1: one line per event, 2: renewals
    too). Return the names of the loggers given the handler."""
    global _configured
    _configured = (verbosity, log_format)
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    handler = LineHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(TaskSignalFields())
    handler._leases_worker = True  # type: ignore[attr-defined]
    logging.getLogger(WORKER_LOGGER).setLevel(level)
    taken = []
    for name in (WORKER_LOGGER, TASKS_LOGGER):
        logger = logging.getLogger(name)
        if _routed_elsewhere(name, logger):
            continue
        # Django's task lines are INFO, ERROR for a failure (DEBUG for "enqueued").
        logger.setLevel(level)
        logger.addHandler(handler)
        # Not also through Django's default "django" handlers (console when DEBUG).
        logger.propagate = False
        taken.append(name)
    return taken


def _routed_elsewhere(name: str, logger: logging.Logger) -> bool:
    """The project's LOGGING routes it, a handler of the root logger would get it (basicConfig,
    a test runner's capture), or it has this module's handler already. Django's default
    handlers of the "django" logger do not count: they print only when DEBUG is on."""
    if configured_by_project(name) or logging.getLogger().handlers:
        return True
    if any(getattr(h, "_leases_worker", False) for h in logger.handlers):
        return True
    return name == WORKER_LOGGER and logger.hasHandlers()
