"""A signal a run_lease_worker sends itself inside a schedule's tick decision.

LEASES_TICK_FAULT=kill|stop: right after the decision's conditional UPDATE touched the
schedule's row (the process now owns the tick, its job not yet inserted, nothing
committed), the process sends itself SIGKILL or SIGSTOP, once, after writing a JSON
line of its own (logger "tests.tick_faults", event "tick_fault", the signal's name) that
tests wait on as on a worker's event. The tests then see what the other workers do with
that tick. Installed through Django's execute_wrappers, as
tests/worker_faults.py is; nothing of django_leases is replaced.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from typing import Any

from django.db.backends.signals import connection_created

_DECISION = re.compile(r'UPDATE [`"]django_leases_schedule[`"] SET [`"]last_tick_at[`"]')


def install(kind: str) -> None:
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[kind]
    left = [1]

    def fault(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if left[0] and _DECISION.search(sql) and context["cursor"].rowcount == 1:
            left[0] = 0
            marker = {"logger": "tests.tick_faults", "event": "tick_fault", "signal": sig.name}
            sys.stdout.write(json.dumps(marker) + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), sig)
        return result

    def on_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
        if fault not in connection.execute_wrappers:
            connection.execute_wrappers.insert(0, fault)

    connection_created.connect(on_connect, weak=False, dispatch_uid="tests.tick_faults")


if os.environ.get("LEASES_TICK_FAULT"):
    install(os.environ["LEASES_TICK_FAULT"])
