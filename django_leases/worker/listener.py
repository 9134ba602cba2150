"""LISTEN for enqueue wake-ups on PostgreSQL so an idle worker starts a new job at once.

Only a hint: the main loop still polls, so a lost notification, a broken LISTEN
connection or NOTIFY=False (PgBouncer transaction pooling) costs latency, never a job.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from django.db import connections

from ..safe_logging import WorkerLogger
from ..storable import first_line
from .repeats import Trouble
from .waker import Waker

logger = WorkerLogger()

# Enqueue wake-ups on PostgreSQL (sent by the trigger of migration 0002): the payload is the
# queue name.
NOTIFY_CHANNEL = "django_leases"

# How long a new LISTEN connection stays up before its trouble is over and the back-off
# starts again from its shortest: one the server ends at once is no recovery.
STEADY_SECONDS = 5.0


def listen(database: str) -> Any:
    """Open a dedicated autocommit connection that LISTENs for enqueue wake-ups.

    Return the psycopg connection (iterate ``.notifies(timeout=...)``; payloads are
    queue names; ``.close()`` it when done), or None unless the database is PostgreSQL.
    It stands apart from Django's connections, so CONN_MAX_AGE and transactions never
    touch it.
    """
    if connections[database].vendor != "postgresql":
        return None
    wrapper = connections.create_connection(database)
    wrapper.ensure_connection()
    raw = wrapper.connection
    raw.autocommit = True
    raw.execute(f'LISTEN "{NOTIFY_CHANNEL}"')
    return raw


class Listener(threading.Thread):
    def __init__(
        self, *, database: str, queues: list[str] | None, waker: Waker, worker_id: str
    ) -> None:
        super().__init__(name="leases-listener", daemon=True)
        self.database = database
        # None: every queue, so any notification wakes the worker.
        self.queues = None if queues is None else set(queues)
        self.waker = waker
        self.worker_id = worker_id
        self._stop_event = threading.Event()
        self._conn: Any = None
        self.failing = Trouble("listen_failed", worker_id)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        backoff = 0.5
        while not self._stop_event.is_set():
            try:
                self._conn = listen(self.database)
                if self._conn is None:
                    return
                logger.debug(
                    "Listening for wake-ups worker=%s",
                    self.worker_id,
                    extra={"event": "listening", "worker": self.worker_id},
                )
                up_at, steady = time.monotonic(), False
                while not self._stop_event.is_set():
                    for note in self._conn.notifies(timeout=0.5):
                        if self.queues is None or note.payload in self.queues:
                            self.waker.wake()
                    if not steady and time.monotonic() - up_at >= STEADY_SECONDS:
                        # Back for good, not a connection the server ends at once again.
                        steady, backoff = True, 0.5
                        self.failing.over()
            except Exception as e:  # noqa: BLE001 -- any failure here only costs latency
                self.failing.warn(
                    "Wake-up connection failed worker=%s error=%s; polling until it is back",
                    self.worker_id,
                    first_line(e),
                    error=first_line(e),
                )
                self._stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                self._close()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
