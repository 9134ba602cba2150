"""Call a task's function for one claim, in whichever thread or process runs it, once the
claimed row is known to fit it.

Rows enqueued through the backend always fit (enqueue() refuses a task declared where
workers do not look). ``unrunnable`` catches rows written straight into the table, or by an
older deploy whose task took other arguments: such a row could never succeed, so it ends
dead at once with a message naming the field, instead of spending every attempt on the same
error or breaking the worker loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from asgiref.sync import async_to_sync
from django.db import connections
from django.tasks import TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.tasks.signals import task_finished, task_started

from ..api import LEASE_RAN_OUT, JobHandle, WorkerLink
from ..exceptions import LeaseLost, NonRetryable, TransactionLeftOpen
from ..fits import task_misfit
from ..safe_logging import WorkerLogger
from ..storable import (
    class_path,
    describe_exception,
    first_line,
    readable_class_path,
    storable_result,
)
from .claims import Kind, Outcome
from .dberrors import DB_ERRORS, outages_met
from .shutdown import exit_status

logger = WorkerLogger()

UNKNOWN_TASK = "django_leases.exceptions.UnknownTask"
INVALID_ARGUMENT = "django_leases.exceptions.InvalidJobArgument"
INVALID_OPTION = "django_leases.exceptions.InvalidLeaseOption"


def unrunnable(job: Any, task: Any, alias: str) -> tuple[str, str] | None:
    """(exception class path, message) when ``job`` cannot be run as ``task``; else None."""
    if task is None:
        return UNKNOWN_TASK, (
            f"{job.task_path!r} is not a task declared for backend {alias!r} (nor for another "
            "lease backend); its dotted path is "
            "never imported on a row's say-so. If it is a @task, declare it in an installed "
            f"app's tasks module or list its module in TASKS[{alias!r}]['OPTIONS']['TASK_MODULES'], "
            "then restart the workers and requeue the job."
        )
    if not isinstance(job.args, list):
        return INVALID_ARGUMENT, f"args: must be a JSON array, the row holds {_shown(job.args)}"
    if not isinstance(job.kwargs, dict):
        return (
            INVALID_ARGUMENT,
            f"kwargs: must be a JSON object, the row holds {_shown(job.kwargs)}",
        )
    if job.retry:
        from ..retry import Retry

        try:
            Retry.from_json(job.retry)
        except Exception as e:  # noqa: BLE001 -- InvalidLeaseOption, or TypeError from its parts
            return INVALID_OPTION, (
                f"retry: cannot be read as a retry ladder, the row holds {_shown(job.retry)}: {e}"
            )
    why = task_misfit(task, job.args, job.kwargs, named=job.task_path)
    return None if why is None else (INVALID_ARGUMENT, f"args/kwargs: {why}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def run_task(
    task: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    handle: JobHandle,
    link: WorkerLink,
    context: Any = None,
) -> Outcome:
    """Run ``task`` with ``handle`` as current_job(); never raise.

    A handler that stops because its claim was lost (LeaseLost, a cancelled coroutine, or
    any exception raised after the loss) comes back as a LOST outcome: nothing of it is
    recorded against the job, since the job may already belong to another worker.

    Django's task_started and task_finished are sent here, in the thread or process that
    runs the handler, with current_job() set, carrying the TaskResult the claim read
    (``link.task_result``; read here only when there is none, in a child process);
    task_finished for a failure is sent inside the exception handler, as Django's own
    backends do, so receivers see sys.exc_info(). A lost claim sends no task_finished: its
    attempt is abandoned, not finished. A handler that acknowledged its job in
    fenced(ack=True) finished it, whatever it raised or was told afterwards: SUCCESSFUL.
    """
    with link.current(handle):
        return _run(task, args, kwargs, handle, link, context)


def task_context(task: Any, handle: JobHandle, link: WorkerLink) -> Any:
    """The context of a ``takes_context=True`` task (None otherwise): Django's TaskContext
    with ``job``, this claim's JobHandle."""
    if not task.takes_context:
        return None
    from ..task import LeaseTaskContext

    if link.task_result is None:
        link.task_result = task.get_backend().get_result(handle.job_id)
    return LeaseTaskContext(task_result=link.task_result, job=handle)


def _run(
    task: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    handle: JobHandle,
    link: WorkerLink,
    context: Any,
) -> Outcome:
    if why := link.gone(time.monotonic()):
        # Lost, or run out by this process's clock, before its handler started (a worker
        # paused between its claim and the start, a cancel meanwhile): the job may be
        # another worker's now, or done. Nothing runs and no task_started is sent: a
        # handler's unfenced effects would run again for a job already done.
        if link.releasing:
            return Outcome(Kind.STOPPED, message="not started: the worker is stopping")
        return Outcome(Kind.LOST, message=why)
    started = link.task_result
    if started is None:
        started = link.task_result = _result_at_start(task, handle)
    try:
        if context is not None:
            args = [context, *args]
        _send(task_started, task, started)
        if inspect.iscoroutinefunction(task.func):
            # As Django's Task.call() runs it: the handler's sync_to_async calls (the
            # async ORM's) come back to this slot thread and its own connection, which
            # is tidied after each job, not to one thread shared by every handler.
            result = _call_async(task.func, args, kwargs, link, handle)
        else:
            with _forked_children_end_here():
                result = task.func(*args, **kwargs)
    # Whatever the handler raises, BaseException included (SystemExit, KeyboardInterrupt,
    # GeneratorExit, a class of its own), fails its job, not the worker: no stop signal
    # lands here, since Python runs signal handlers on the main thread, and a handler runs
    # on a slot thread, or in a child process that ignores SIGINT, SIGTERM and SIGHUP (child.py).
    # CancelledError and LeaseLost mean "lost" only when the claim really was lost; raised
    # by the handler's own code on a claim still held, they are an error like any other,
    # or the job would sit claimed, unrenewed, until its lease ran out.
    except BaseException as e:  # noqa: BLE001
        if link.acked:
            # It acknowledged its job in fenced(ack=True), then raised: the success is
            # committed and stands (get_result() shows it), so task_finished says so too.
            # Told to stop after its ack (a worker's stop), it stops as asked: no warning.
            if not (handle.lost and isinstance(e, (LeaseLost, asyncio.CancelledError))):
                _raised_after_ack(handle, e)
        elif why := link.gone(time.monotonic()):
            return Outcome(Kind.LOST, message=why)
        else:
            return _failed(task, started, e)
    if link.acked:
        # Committed with the handler's own writes; a loss noticed afterwards changes nothing.
        outcome = Outcome(Kind.ACKED, result=link.acked_result)
        if aliases := _left_open():
            _left_open_after_ack(handle, aliases)
    elif why := _discarded(link, time.monotonic()):
        return Outcome(Kind.LOST, message=why)
    else:
        try:
            # What it left uncommitted is rolled back when its connection is tidied (or its
            # process ends): the job did not do its work, and must not read as succeeded.
            if aliases := _left_open():
                raise TransactionLeftOpen(
                    f"the handler returned inside a transaction on database "
                    f"{', '.join(map(repr, aliases))} (an atomic block it never left, "
                    f"autocommit turned off, a BEGIN of its own): its uncommitted writes "
                    f"are rolled back"
                )
        except TransactionLeftOpen as e:
            return _failed(task, started, e)
        try:
            # Checked here, on the handler's side: task_finished must tell the truth, and
            # in process isolation only plain JSON travels back to the worker.
            result = storable_result(result)
        except BaseException as e:  # noqa: BLE001 -- TypeError, or what a hostile value's methods raise
            # Not retried (docs/reliability.md, hostile handlers): a retry repeats what the
            # handler did and returns a value of the same kind.
            return _failed(task, started, e, retryable=False)
        outcome = Outcome(Kind.OK, result=result)
    _send(
        task_finished,
        task,
        _finished(started, TaskResultStatus.SUCCESSFUL, return_value=outcome.result),
    )
    return outcome


def _discarded(link: WorkerLink, now: float) -> str:
    """Why a result returned at ``now`` is discarded, "" if it stands. Told to stop by the
    worker's stop (releasing), a result is still acknowledged under its claim, unless the
    lease ran out meanwhile by this process's clock: a worker paused past its lease, then
    signalled, sent task_finished SUCCESSFUL for a job another worker had taken over."""
    if link.releasing:
        return LEASE_RAN_OUT if link.expired(now) else ""
    return link.gone(now)


def _failed(
    task: Any,
    started: TaskResult[..., Any] | None,
    exc: BaseException,
    *,
    retryable: bool | None = None,
) -> Outcome:
    """The failed outcome of ``exc``, every field storable; sends task_finished (FAILED).
    Called inside the except block, so that receivers see sys.exc_info(). ``retryable``
    None: as the task's ``non_retryable`` says."""
    path, message, trace = describe_exception(exc)
    outcome = Outcome(
        Kind.ERROR,
        exception_class_path=path,
        message=message,
        traceback=trace,
        retryable=_retryable(task, exc) if retryable is None else retryable,
    )
    _send(
        task_finished,
        task,
        _finished(
            started,
            TaskResultStatus.FAILED,
            error=TaskError(exception_class_path=readable_class_path(path), traceback=trace),
        ),
    )
    return outcome


def _left_open_after_ack(handle: JobHandle, aliases: list[str]) -> None:
    """Log a handler that acknowledged its job, then returned inside a transaction: the
    job stays succeeded, but what it wrote there after the ack is rolled back with its
    connection, and should not be so without a word."""
    logger.warning(
        "Handler returned inside a transaction on database %s after acknowledging job=%s "
        "fence=%s; the job stays succeeded, what it wrote there after the ack is rolled back",
        ", ".join(map(repr, aliases)),
        handle.job_id,
        handle.fence,
        extra={
            "event": "left_open_after_ack",
            "job_id": handle.job_id,
            "fence": handle.fence,
            "worker": handle.worker_id,
            "databases": aliases,
        },
    )


def _raised_after_ack(handle: JobHandle, exc: BaseException) -> None:
    """Log what a handler raised after its own ack: not a failure of the job, which
    succeeded, but not to be swallowed either. Never raises."""
    path, message, _ = describe_exception(exc)  # never raises, whatever the class
    # With its traceback, or without it should logging fail to format that.
    for exc_info in (exc, None):
        try:
            logger.warning(
                "Handler raised after acknowledging job=%s fence=%s: %s: %s; the job stays "
                "succeeded",
                handle.job_id,
                handle.fence,
                path,
                message,
                exc_info=exc_info,
                extra={
                    "event": "raised_after_ack",
                    "job_id": handle.job_id,
                    "fence": handle.fence,
                    "worker": handle.worker_id,
                    "error": path,
                },
            )
            return
        except BaseException:  # noqa: BLE001, S112 -- the line without the traceback next
            continue


def _retryable(task: Any, exc: BaseException) -> bool:
    """False when the task lists the exception as non-retryable (or it is NonRetryable)."""
    try:
        return not isinstance(exc, (NonRetryable, *getattr(task, "non_retryable", ())))
    except Exception:  # noqa: BLE001 -- a hostile __class__ is retried like any failure
        return True


def _result_at_start(task: Any, handle: JobHandle) -> TaskResult[..., Any] | None:
    """The job as get_result() sees it once claimed (RUNNING, database times), or None if
    it cannot be read now: signals are then skipped rather than the job failed."""
    try:
        result: TaskResult[..., Any] = task.get_backend().get_result(handle.job_id)
        return result
    except Exception:  # noqa: BLE001 -- a missed signal must not cost the job an attempt
        logger.warning(
            "Could not read job=%s for task_started/task_finished; not sent",
            handle.job_id,
            exc_info=True,
            extra={"event": "signal_read_failed", "job_id": handle.job_id},
        )
        return None


def _finished(
    started: TaskResult[..., Any] | None,
    status: TaskResultStatus,
    *,
    error: TaskError | None = None,
    return_value: Any = None,
) -> TaskResult[..., Any] | None:
    """``started`` as the handler left it. finished_at stays None: the worker records the
    outcome afterwards, on the database clock, and get_result() shows it from then on."""
    if started is None:
        return None
    errors = [*started.errors, error] if error is not None else list(started.errors)
    result = replace(started, status=status, errors=errors, worker_ids=list(started.worker_ids))
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", return_value)
    return result


def _send(signal: Any, task: Any, task_result: TaskResult[..., Any] | None) -> None:
    """Send a Django task signal; a receiver that raises is logged, never fails the job."""
    if task_result is None:
        return
    name = "task_started" if signal is task_started else "task_finished"
    try:
        responses = signal.send_robust(type(task.get_backend()), task_result=task_result)
    except BaseException as e:  # noqa: BLE001
        # send_robust catches Exception only: a receiver's SystemExit or KeyboardInterrupt
        # ends the sending, with the receivers after it not called, but fails no job.
        responses = [("a receiver (the receivers after it were not called)", e)]
    for receiver, response in responses:
        if not isinstance(response, BaseException):
            continue
        try:
            logger.error(
                "Receiver %r of %s raised for job=%s",
                receiver,
                name,
                task_result.id,
                exc_info=response,
                extra={"event": "receiver_raised", "job_id": task_result.id},
            )
        except Exception:  # noqa: BLE001
            # Logging raises when no traceback of the chain can be formatted (a handler's
            # exception whose class names raise, e.g. as the context of the receiver's
            # own error): logging.Handler.handleError lets all but OSError through.
            logger.error(
                "Receiver %r of %s raised for job=%s: %s (traceback not printable)",
                receiver,
                name,
                task_result.id,
                class_path(type(response)),
                extra={"event": "receiver_raised", "job_id": task_result.id},
            )


# Once an async handler's coroutine is done, its event loop's teardown (asyncio.run's:
# the tasks it left cancelled and awaited, the default executor's calls waited for) may
# take this long; past it the loop is stopped and closed, what still runs left behind, and
# the coroutine's own outcome stands. Unbounded, a task that swallows its cancellation, or
# a run_in_executor() call the handler never awaited, kept the job claimed for as long.
ASYNC_TEARDOWN_SECONDS = 2.0


class _Returned:
    """What an async handler's coroutine came back with, and whether its loop's teardown
    was cut short after it."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.cut = False

    def cut_short(self, loop: asyncio.AbstractEventLoop) -> None:
        self.cut = True
        loop.stop()  # asyncio.run's run_until_complete raises; the loop is then closed
        # A stop that the teardown phase under way outlives by finishing in the same turn
        # is spent: the next phase (the default executor's wait) is cut too. Closing the
        # loop drops this timer.
        loop.call_later(0.1, self.cut_short, loop)


def _call_async(
    func: Any, args: list[Any], kwargs: dict[str, Any], link: WorkerLink, handle: JobHandle
) -> Any:
    """Run an ``async def`` handler as Django's Task.call() does (async_to_sync), its
    loop's teardown bounded by ASYNC_TEARDOWN_SECONDS."""
    returned = _Returned()
    try:
        return async_to_sync(_run_async)(func, args, kwargs, link, returned)
    except BaseException:
        if not returned.cut:
            raise
    _teardown_cut(handle)
    if returned.error is not None:
        raise returned.error
    return returned.value


async def _run_async(
    func: Any, args: list[Any], kwargs: dict[str, Any], link: WorkerLink, returned: _Returned
) -> Any:
    """Await the handler in a task that is cancelled as soon as the claim is lost."""
    loop = asyncio.get_running_loop()
    inner = asyncio.ensure_future(_forked_children_end_in(func(*args, **kwargs)))

    def cancel() -> None:
        # RuntimeError: the loop already closed, the handler finished first.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(inner.cancel)

    link.on_lost(cancel)
    try:
        returned.value = await inner
    except BaseException as e:
        # SystemExit and KeyboardInterrupt leave the handler's task through the loop, and
        # the teardown then cancels this one: the handler's own error is the outcome.
        own = inner.exception() if inner.done() and not inner.cancelled() else None
        returned.error = own if own is not None else e
        raise
    finally:
        # Never fires when the teardown ends first: the loop is closed by then.
        loop.call_later(ASYNC_TEARDOWN_SECONDS, returned.cut_short, loop)
    return returned.value


def _teardown_cut(handle: JobHandle) -> None:
    """Say that an async handler's loop was closed with what it left still running."""
    logger.warning(
        "The event loop of job=%s fence=%s was closed %gs after its handler returned, "
        "with what the handler left still running (a task that ignores cancellation, a "
        "run_in_executor() call never awaited); the handler's outcome stands worker=%s",
        handle.job_id,
        handle.fence,
        ASYNC_TEARDOWN_SECONDS,
        handle.worker_id,
        extra={
            "event": "async_teardown_cut",
            "job_id": handle.job_id,
            "fence": handle.fence,
            "worker": handle.worker_id,
        },
    )


async def _forked_children_end_in(handler: Any) -> Any:
    """Await the handler inside its task: a SystemExit leaves an asyncio task through
    the event loop, not through what awaits the task, so a forked child is ended here."""
    with _forked_children_end_here():
        return await handler


@contextlib.contextmanager
def _forked_children_end_here() -> Iterator[None]:
    """Around the handler: a process it forked that returns or raises out of it ends."""
    parent = os.getpid()
    try:
        yield
    except BaseException as e:
        _end_if_forked(parent, e)
        raise
    _end_if_forked(parent, None)


def _end_if_forked(parent: int, error: BaseException | None) -> None:
    """End at once a child the handler forked (os.fork()) that came back out of it, as
    multiprocessing ends its children: it would report the job's outcome as its parent's
    (process isolation) or wait forever on the worker's locks, holding its sockets (a slot
    thread). Its status tells its parent how it ended, as Python's exit would: 0 returned,
    a SystemExit's code, 1 raised (the traceback on stderr)."""
    if os.getpid() == parent:
        return
    code = 0
    if error is not None:
        with contextlib.suppress(BaseException):
            code = 1
            code = exit_status(error)
    os._exit(code)


# A slot's kept connection is checked (one round trip) before a handler when its last job
# started this long before: a server's idle_session_timeout, a pooler's or a firewall's
# idle limit may have ended it meanwhile.
IDLE_CHECK_SECONDS = 30.0
# Per slot thread: the outages the worker had met at its last check, when its last job started.
_slot = threading.local()


def connect_before_handler(database: str) -> Outcome | None:
    """Open this thread's connection to the job's database before the handler runs; an
    UNCONNECTED outcome if the database refuses it (too many connections, unreachable).
    The worker then releases the job, the attempt not counted: the handler never ran, and
    the worker's own over-subscription is no failure of the job.

    A kept connection is checked first when the worker's own threads met a lost
    connection since this slot's last check (a failover ends every session), or when this
    slot's last job started more than IDLE_CHECK_SECONDS before: handed to the handler
    dead, its first query failed the job and spent an attempt. Closed if it does not
    answer; the next one is opened here."""
    connection = connections[database]
    now, outages = time.monotonic(), outages_met()
    if connection.connection is not None and (
        getattr(_slot, "outages", 0) != outages
        or now - getattr(_slot, "used_at", now) > IDLE_CHECK_SECONDS
    ):
        usable = False
        with contextlib.suppress(Exception):
            usable = connection.is_usable()
        if not usable:
            with contextlib.suppress(*DB_ERRORS):
                connection.close()
    _slot.outages, _slot.used_at = outages, now
    try:
        connection.ensure_connection()
    except DB_ERRORS as e:
        with contextlib.suppress(*DB_ERRORS):
            connection.close()
        return Outcome(Kind.UNCONNECTED, message=first_line(e))
    return None


def _left_open() -> list[str]:
    """The aliases of this thread's connections that the handler left inside a transaction
    whose work the tidy-up will roll back; never raises (a connection that cannot say is
    the tidy-up's to close, and no reason to fail the job)."""
    aliases = []
    for conn in connections.all(initialized_only=True):
        with contextlib.suppress(Exception):
            if conn.connection is not None and _holds_work(conn):
                aliases.append(conn.alias)
    return aliases


def _holds_work(conn: Any) -> bool:
    """Whether ``conn`` holds work the tidy-up would roll back: an atomic block never
    exited, or a transaction the driver says is open (a connection that broke is in none).
    A connection the project runs with ``AUTOCOMMIT: False`` is in a transaction by design:
    only an atomic block counts there."""
    if conn.in_atomic_block:
        return True
    if not conn.settings_dict["AUTOCOMMIT"]:
        return False
    return _in_transaction(conn) is True


def left_in_transaction(conn: Any) -> bool:
    """Whether ``conn`` is inside a transaction between jobs, where it never should be
    (a connection whose state cannot be told is counted in: the tidy-up closes it)."""
    if conn.in_atomic_block or conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
        return True
    return _in_transaction(conn) is not False


def _in_transaction(conn: Any) -> bool | None:
    """What the driver says of ``conn``'s transaction: True open, False none, None when
    it cannot tell (a connection that broke). SQLite and libpq keep the status on the
    connection; MariaDB answers ``@@in_transaction`` (set by a write or a ``START
    TRANSACTION``), asked only with autocommit off: one query after a job whose handler
    turned it off, or after every job on an ``AUTOCOMMIT: False`` alias. MySQL has no such
    answer, so autocommit off counts as open there."""
    raw = conn.connection
    if conn.vendor == "sqlite":
        return bool(raw.in_transaction)
    if conn.vendor == "postgresql":
        info = getattr(raw, "info", None)  # psycopg 3
        status = int(info.transaction_status if info is not None else raw.get_transaction_status())
        return None if status == _PG_UNKNOWN else status != _PG_IDLE
    if conn.get_autocommit():
        return False
    if not conn.mysql_is_mariadb:
        return True
    # On the driver's own cursor: no execute_wrapper of the project's, no DEBUG query log.
    try:
        with raw.cursor() as cursor:
            cursor.execute("SELECT @@in_transaction")
            return bool(cursor.fetchone()[0])
    except Exception:  # noqa: BLE001 -- a connection that broke cannot tell
        return None


# libpq's transaction statuses, the same numbers in psycopg 3 and psycopg2: IDLE, then
# ACTIVE, INTRANS and INERROR (inside a transaction), and UNKNOWN (a broken connection).
_PG_IDLE, _PG_UNKNOWN = 0, 4
