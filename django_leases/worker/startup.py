"""Before the worker starts: wait for a database that is down or full, as for any outage.

Django's system checks and the migration check query the database, so the command waits
here first. SIGTERM/SIGINT/SIGHUP while waiting ends the wait, and the command exits 0.
"""

from __future__ import annotations

import contextlib
import time

from django.db import connections

from ..safe_logging import WorkerLogger
from ..storable import first_line
from .dberrors import DB_ERRORS
from .loop import Backoff
from .shutdown import StopRequest
from .waker import Waker

logger = WorkerLogger()

# Waits between attempts: 0.5 s doubling to 10 s, with jitter.
FIRST_WAIT, LONGEST_WAIT = 0.5, 10.0


def wait_for_database(database: str, worker_id: str) -> bool:
    """Open a connection to ``database``, retrying with a warning per failed attempt until
    it answers (True) or a stop signal arrives (False)."""
    waker = Waker()
    stop = StopRequest(waker)
    stop.install()
    backoff = Backoff(first=FIRST_WAIT, cap=LONGEST_WAIT)
    started = time.monotonic()
    attempt = 0
    try:
        while not stop.stopping:
            attempt += 1
            try:
                connections[database].ensure_connection()
            except DB_ERRORS as e:
                delay = backoff.next()
                logger.warning(
                    "Database %r not answering at start worker=%s attempt=%d error=%s; "
                    "retrying in %.1fs",
                    database,
                    worker_id,
                    attempt,
                    first_line(e),
                    delay,
                    extra={
                        "event": "db_wait",
                        "worker": worker_id,
                        "attempt": attempt,
                        "error": first_line(e),
                    },
                )
                with contextlib.suppress(*DB_ERRORS):
                    connections[database].close()
                waker.wait(delay)
                continue
            if attempt > 1:
                logger.info(
                    "Database %r answered after %.1f s worker=%s; starting",
                    database,
                    time.monotonic() - started,
                    worker_id,
                    extra={"event": "db_back", "worker": worker_id},
                )
            return True
        logger.info(
            "Stopping on %s worker=%s: the database never answered; nothing was claimed",
            stop.signal_name,
            worker_id,
            extra={"event": "stopped", "worker": worker_id, "signal": stop.signal_name},
        )
        return False
    finally:
        stop.restore()
        waker.close()
