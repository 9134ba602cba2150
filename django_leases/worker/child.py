"""Entry point of a process-isolated handler (a 'spawn' child of the worker).

The child runs one job and reports back through its pipe; it writes nothing of the job's
own state. Checkpoints are forwarded to the parent, which sends the conditional UPDATE.
The parent sets the shared lost flag when the claim goes; a watcher thread turns that
into current_job().lost and cancels an async handler.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def child_main(conn: Any, payload: dict[str, Any], lost: Any, stamp: Any) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides when jobs stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import django

    django.setup()
    from django.db import connections

    from .. import registry
    from ..api import JobHandle
    from .claims import Outcome
    from .running import run_task

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

    def watch() -> None:
        lost.wait()
        handle._fire()

    threading.Thread(target=watch, name="leases-lost-watcher", daemon=True).start()
    registry.discover()
    task = registry.lookup(payload["alias"], payload["task_path"])
    if task is None:
        outcome = Outcome("error", exception_class_path="django_leases.worker.UnknownTask",
                          message=f"{payload['task_path']!r} is not a declared task")
    else:
        context = None
        if task.takes_context:
            from django.tasks import TaskContext, task_backends

            context = TaskContext(task_result=task_backends[payload["alias"]].get_result(
                payload["job_id"]))
        outcome = run_task(task, payload["args"], payload["kwargs"], handle, context)
    try:
        conn.send(("done", outcome))
    except Exception as e:  # noqa: BLE001 -- an unpicklable result must still be reported
        conn.send(("done", Outcome("error", exception_class_path=type(e).__qualname__,
                                   message=f"cannot send the result to the worker: {e}")))
    conn.close()
    connections.close_all()
