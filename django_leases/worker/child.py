"""Entry point of a process-isolated handler (a 'spawn' child of the worker).

The child runs one job and reports its outcome back through its pipe; the parent writes
the ack or fail. Checkpoints the child sends itself, on its own connection, so that inside
fenced() they commit with the handler's writes (checkpoints.py). The parent sets the shared
lost flag when the claim goes; a watcher thread turns that into current_job().lost and
cancels an async handler.

Stop signals go to more than the worker: systemd (KillMode=control-group) and container
runtimes signal every process of the unit. Only the parent decides when a job stops, so
the child ignores SIGINT, SIGTERM and SIGHUP; the parent kills it with SIGKILL when it must, with
the processes the handler started: the child leads its own process group (so Ctrl-C in
a terminal, sent to the worker's group, does not reach it either).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, NoReturn

from ..safe_logging import WorkerLogger

logger = WorkerLogger()

# How long a child whose claim is lost may take to stop on its own before SIGKILL.
KILL_GRACE_SECONDS = 1.0
# What the child does not stop for: the worker decides (the parent blocks them in the
# thread that starts a child, which unblocks them here once its handler is in).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _ignore_stop_signal(signum: int, frame: Any) -> None:
    """A no-op handler rather than SIG_IGN: an ignored disposition survives exec, so the
    processes a job starts could not be stopped with SIGTERM either; a handler is reset."""


def _end_group() -> NoReturn:
    """End this process and the processes the handler started (its group, which it leads):
    a worker gone leaves no grandchild running the job on, but for one that left the group
    (setsid). Killed, not exited: SIGKILL to the group reaches this process too."""
    if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)
    os._exit(1)


def child_main(conn: Any, payload: dict[str, Any], lost: Any, stamp: Any, acked: Any) -> None:
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, _ignore_stop_signal)
    if hasattr(signal, "pthread_sigmask"):
        # Blocked since the parent started this process: one sent meanwhile lands now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if hasattr(os, "setpgid"):
        # Its own process group, so that the worker's kill (executors.kill_handler) ends
        # the processes the handler starts too: a subprocess left running would go on
        # with the job after its claim was lost or released. Out of the terminal's
        # foreground group, stdin is /dev/null: a subprocess that read the terminal (a
        # prompt, stty) would be stopped by the kernel, holding its job.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
    import django

    django.setup()
    if payload.get("logs") is not None:
        from .logs import configure

        # As the worker's: Django's task lines, written here, in its format and level.
        configure(*payload["logs"])
    from django.db import connections

    from .. import registry
    from ..api import JobHandle, WorkerLink
    from ..storable import MESSAGE_LIMIT, describe_exception, storable_text
    from .claims import Kind, Outcome, store_checkpoint
    from .running import connect_before_handler, run_task, task_context

    # The acked flag is set once the handler's fenced(ack=True) commits: the worker then
    # knows the job is done before the outcome comes (a stop does not release it).
    link = WorkerLink(
        lost=lost,
        stamp=stamp,
        lease_seconds=payload["lease"],
        checkpointer=lambda cursor: store_checkpoint(handle, link, cursor),
        on_acked=acked.set,
    )
    handle = JobHandle(
        job_id=payload["job_id"],
        fence=payload["fence"],
        attempt=payload["attempt"],
        cursor=payload["cursor"],
        worker_id=payload["worker_id"],
        claim_token=payload["claim_token"],
        database=payload["database"],
        link=link,
    )

    parent = multiprocessing.parent_process()
    # Whether os.getppid() names the worker at all (not so under a launcher that starts
    # Python as its own child): if not, only the pipe can tell.
    pid_says = parent is not None and os.getppid() == parent.pid
    ending = threading.Lock()

    def orphaned() -> bool:
        # The worker holds its end of a pipe to this process until it dies, however it
        # dies. os.getppid() alone would not do: read after the worker died (even before
        # this line ran) it names whoever adopted this process. It stands in when the
        # handler closed the pipe's descriptor, and confirms the pipe when the handler may
        # have reused that descriptor's number.
        if parent is None:
            return False
        adopted = os.getppid() != parent.pid
        try:
            return adopted and not parent.is_alive()
        except (OSError, ValueError):
            return adopted and pid_says

    def end_orphaned(grace: float) -> NoReturn:
        # A worker killed outright (kill -9, OOM) neither renews the claim nor kills this
        # process any more: its death counts as the loss, and a handler that runs gets the
        # grace the worker would have given it.
        if ending.acquire(blocking=False):
            # Armed first: a loss callback or the log write that blocks must not keep
            # this process alive.
            threading.Timer(grace + 1.0, _end_group).start()
            lost.set()
            link.fire()
            logger.warning(
                "Handler process pid=%s job=%s fence=%s worker=%s ending in %gs: its worker "
                "is gone",
                os.getpid(),
                payload["job_id"],
                payload["fence"],
                payload["worker_id"],
                grace,
                extra={
                    "event": "orphaned",
                    "job_id": payload["job_id"],
                    "fence": payload["fence"],
                    "worker": payload["worker_id"],
                    "pid": os.getpid(),
                },
            )
            threading.Event().wait(grace)
            _end_group()
        while True:  # the other caller ends the process
            threading.Event().wait(60)

    def watch() -> None:
        told = False
        while not orphaned():
            if told:
                threading.Event().wait(0.2)
            elif lost.wait(0.2):
                link.fire()
                told = True
        end_orphaned(KILL_GRACE_SECONDS)

    threading.Thread(target=watch, name="leases-lost-watcher", daemon=True).start()
    # Orphaned while it started: nobody renews the claim; import and run nothing more.
    if orphaned():
        end_orphaned(0)
    registry.discover()
    # No queue_name from a worker started before an upgrade: only what it declares.
    queue_name = payload.get("queue_name")
    task = (
        registry.lookup(payload["alias"], payload["task_path"])
        if queue_name is None
        else registry.runnable(payload["alias"], payload["task_path"], queue_name)
    )
    if orphaned():
        end_orphaned(0)
    try:
        # The handler's run time (its timeout) counts from here, on the machine's one
        # monotonic clock.
        conn.send(("started", time.monotonic()))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        end_orphaned(0)
    refused = connect_before_handler(payload["database"]) if payload.get("connect_first") else None
    if refused is not None:
        outcome = refused
    elif task is None:
        outcome = Outcome(
            Kind.UNRUNNABLE,
            exception_class_path="django_leases.exceptions.UnknownTask",
            message=f"{payload['task_path']!r} is not a declared task",
        )
    else:
        # Django's task_started/task_finished are sent here, in the child that runs the
        # handler (running.run_task), so receivers see the handler's exception.
        context = task_context(task, handle, link)
        outcome = run_task(task, payload["args"], payload["kwargs"], handle, link, context)
    if orphaned():
        # Nobody to send the outcome to: end as an orphan does, quietly (the send would
        # fail on the broken pipe, and its traceback land in the worker's log).
        end_orphaned(0)
    try:
        conn.send(("done", outcome, time.monotonic()))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        end_orphaned(0)  # the worker died between the look above and the send
    except Exception as e:  # noqa: BLE001 -- an outcome that cannot be sent must still be reported
        # run_task hands back plain text and JSON, so this is the pipe, or memory, failing.
        path, message, trace = describe_exception(e)
        conn.send(
            (
                "done",
                Outcome(
                    Kind.ERROR,
                    exception_class_path=path,
                    traceback=trace,
                    message=storable_text(
                        f"cannot send the outcome to the worker: {message}", MESSAGE_LIMIT
                    ),
                ),
                time.monotonic(),
            )
        )
    conn.close()
    connections.close_all()
