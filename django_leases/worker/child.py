"""Entry point of a process-isolated handler (a 'spawn' child of the worker).

The child runs one job and reports back through its pipe; it writes nothing of the job's
own state. Checkpoints are forwarded to the parent, which sends the conditional UPDATE.
The parent sets the shared lost flag when the claim goes; a watcher thread turns that
into current_job().lost and cancels an async handler.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from .executors import KILL_GRACE_SECONDS


def child_main(conn: Any, payload: dict[str, Any], lost: Any, stamp: Any) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides when jobs stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import django

    django.setup()
    from django.db import connections

    from .. import registry
    from ..api import JobHandle
    from .claims import Outcome
    from .running import run_task, task_context

    def checkpoint(cursor: Any) -> bool:
        conn.send(("checkpoint", cursor))
        kind, answer = conn.recv()
        if kind == "error":
            from django.db import OperationalError

            raise OperationalError(answer)
        return bool(answer)

    handle = JobHandle(
        job_id=payload["job_id"], fence=payload["fence"], attempt=payload["attempt"],
        cursor=payload["cursor"], lease_seconds=payload["lease"],
        worker_id=payload["worker_id"], lost=lost, stamp=stamp, checkpointer=checkpoint,
        claim_token=payload["claim_token"], database=payload["database"],
    )

    parent = os.getppid()

    def watch() -> None:
        # A parent killed outright (kill -9, OOM) neither renews the claim nor kills this
        # child any more: its death counts as the loss, and the child ends after the same
        # grace the parent would have given it.
        while not lost.wait(0.2):
            if os.getppid() != parent:
                lost.set()
                handle._fire()
                threading.Event().wait(KILL_GRACE_SECONDS)
                os._exit(1)
        handle._fire()

    threading.Thread(target=watch, name="leases-lost-watcher", daemon=True).start()
    registry.discover()
    task = registry.lookup(payload["alias"], payload["task_path"])
    if task is None:
        outcome = Outcome("unrunnable", exception_class_path="django_leases.exceptions.UnknownTask",
                          message=f"{payload['task_path']!r} is not a declared task")
    else:
        # Django's task_started/task_finished are sent here, in the child that runs the
        # handler (running.run_task), so receivers see the handler's exception.
        outcome = run_task(task, payload["args"], payload["kwargs"], handle,
                           task_context(task, handle))
    try:
        conn.send(("done", outcome))
    except Exception as e:  # noqa: BLE001 -- an unpicklable result must still be reported
        conn.send(("done", Outcome("error", exception_class_path=type(e).__qualname__,
                                   message=f"cannot send the result to the worker: {e}")))
    conn.close()
    connections.close_all()
