"""Threads the worker cannot do without: the heartbeat and the watchdog.

Each works in rounds. An exception in one round (an InterfaceError from a dead connection,
a bug) is logged and the next round comes after a back-off: one error must not end
renewals for good while the main loop goes on claiming jobs nobody renews. If the thread
ends anyway (a BaseException such as SystemExit), ``died`` turns true and the main loop is
woken: it claims nothing more, lets go of its claims and exits non-zero.
"""

from __future__ import annotations

import contextlib
import threading

from ..safe_logging import WorkerLogger
from .waker import Waker

logger = WorkerLogger()


class VitalThread(threading.Thread):
    """Subclasses implement ``serve()``, which returns once ``stopping`` is set."""

    # What the thread is, for log lines: "heartbeat", "watchdog".
    role = "vital"

    def __init__(self, *, worker_id: str, waker: Waker) -> None:
        super().__init__(name=f"leases-{self.role}", daemon=True)
        self.worker_id = worker_id
        self._waker = waker
        self._stop_event = threading.Event()
        self._ended = False

    def stop(self) -> None:
        self._stop_event.set()

    @property
    def died(self) -> bool:
        """True once the thread ended without being asked to."""
        return self._ended and not self._stop_event.is_set()

    def run(self) -> None:
        try:
            self.serve()
        except BaseException:
            logger.critical(
                "The %s thread ended on an exception worker=%s",
                self.role,
                self.worker_id,
                exc_info=True,
                extra={"event": "thread_crashed", "worker": self.worker_id},
            )
            raise
        finally:
            self._ended = True
            if not self._stop_event.is_set():
                self._waker.wake()

    def serve(self) -> None:
        raise NotImplementedError

    def round_failed(self, error: Exception) -> None:
        """Log an exception that ended one round; the thread carries on (even if logging
        fails too)."""
        with contextlib.suppress(Exception):
            logger.error(
                "Unexpected error in the %s thread worker=%s error=%s: %s; carrying on",
                self.role,
                self.worker_id,
                type(error).__qualname__,
                error,
                exc_info=True,
                extra={"event": "thread_error", "worker": self.worker_id, "error": str(error)},
            )
