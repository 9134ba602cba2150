"""Driver faults injected into run_lease_worker processes by the worker tests.

LEASES_WORKER_FAULT="<thread name>:<exception>:<count>:<SQL fragment>" makes the first
<count> statements containing <SQL fragment> (or any of its ``|``-separated alternatives)
that the thread named <thread name> sends raise <exception> instead of reaching the
database, as the driver would raise it:

- ``InterfaceError``: what MySQLdb raised on a dead connection, and psycopg raises for a
  connection in an unexpected state; not a DatabaseError.
- ``SystemExit``: ends the thread outright, past any ``except Exception``.

With LEASES_WORKER_FAULT_FROM naming a file, statements count only once that file
exists: a test arms the fault when the worker is where it wants it (a handler running).

The fault sits in Django's execute_wrappers of that thread's connection (installed when it
connects), the hook Django offers for instrumenting queries: nothing of django_leases is
replaced.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from django.db import InterfaceError
from django.db.backends.signals import connection_created

_EXCEPTIONS: dict[str, Any] = {
    "InterfaceError": lambda: InterfaceError("(0, '') injected by tests/worker_faults.py"),
    "SystemExit": lambda: SystemExit("injected by tests/worker_faults.py"),
}


def install(spec: str, armed_by: str | None = None) -> None:
    thread_name, exception, count, fragment = spec.split(":", 3)
    make = _EXCEPTIONS[exception]
    left = [int(count)]
    fragments = fragment.split("|")

    def fault(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        armed = armed_by is None or os.path.exists(armed_by)
        if armed and left[0] > 0 and any(f in sql for f in fragments):
            left[0] -= 1
            raise make()
        return execute(sql, params, many, context)

    def on_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
        if (
            threading.current_thread().name == thread_name
            and fault not in connection.execute_wrappers
        ):
            connection.execute_wrappers.insert(0, fault)

    connection_created.connect(on_connect, weak=False, dispatch_uid="tests.worker_faults")


if os.environ.get("LEASES_WORKER_FAULT"):
    install(os.environ["LEASES_WORKER_FAULT"], os.environ.get("LEASES_WORKER_FAULT_FROM"))
