"""The interpreter's settings a handler shares with the worker in thread isolation.

A handler that lowers the recursion limit, lengthens the thread switch interval, closes
sys.stdout or sys.stderr, or disables logging changes them for the worker's own threads
too: the main loop's next statement raised RecursionError and the process ended, the
heartbeat waited seconds for its turn and leases ran out, the log lines stopped. What
endangers the worker is put back after each job (a raised limit, a shorter interval or a
stream the handler replaced are left as they are: the project may want them); a child
process's interpreter is its own.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any, TextIO

logger = logging.getLogger("django_leases.worker")


class InterpreterGuard:
    """The settings as the worker started with them, and what puts them back."""

    def __init__(self) -> None:
        self.recursion_limit = sys.getrecursionlimit()
        self.switch_interval = sys.getswitchinterval()
        self.logging_disabled = logging.root.manager.disable
        # Slots finish together: one of them puts back, the other finds nothing to.
        self._lock = threading.Lock()

    def restore(self) -> list[str]:
        """Put back what a handler changed to the worker's harm; the names of what was.
        Never raises: what cannot be put back (a stream of the project's own whose
        descriptor is gone) is left as it is."""
        with self._lock:
            put_back = []
            if sys.getrecursionlimit() < self.recursion_limit:
                sys.setrecursionlimit(self.recursion_limit)
                put_back.append("recursion limit")
            if sys.getswitchinterval() > self.switch_interval:
                sys.setswitchinterval(self.switch_interval)
                put_back.append("switch interval")
            if logging.root.manager.disable > self.logging_disabled:
                logging.disable(self.logging_disabled)
                put_back.append("logging.disable")
            for name, fd in (("stdout", 1), ("stderr", 2)):
                stream = getattr(sys, name)
                # A project's own stream object may have no ``closed``: not a file's.
                with contextlib.suppress(Exception):
                    if stream is not None and getattr(stream, "closed", False) is True:
                        setattr(sys, name, _reopened(stream, fd))
                        put_back.append(f"sys.{name}")
            return put_back


def _reopened(closed: Any, fd: int) -> TextIO:
    """A new stream on ``fd`` (a standard stream's close leaves its descriptor open), given
    to every logging handler that wrote to ``closed``."""
    stream = open(  # noqa: SIM115 -- the process's own standard stream, never closed
        fd,
        "w",
        encoding=getattr(closed, "encoding", None),
        errors=getattr(closed, "errors", None) or "backslashreplace",
        closefd=False,
        buffering=1,
    )
    # Every handler alive (logging keeps weak references to them all): those of loggers,
    # and those only another reaches (a MemoryHandler's target, a QueueListener's).
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref()
        if isinstance(handler, logging.StreamHandler) and handler.stream is closed:
            # Not setStream(): it flushes the closed stream first, which raises.
            with contextlib.suppress(Exception):
                handler.acquire()
                try:
                    handler.stream = stream
                finally:
                    handler.release()
    return stream


def log_restored(put_back: list[str], job_id: Any, worker_id: str) -> None:
    """Say what was put back, and after which job it was found."""
    logger.warning(
        "The interpreter the handlers share was found changed after job=%s (%s; this "
        "job's handler, or another running beside it); put back worker=%s. In thread "
        "isolation handlers share the worker's process: run such code with --isolation "
        "process",
        job_id,
        ", ".join(put_back),
        worker_id,
        extra={
            "event": "interpreter_restored",
            "worker": worker_id,
            "job_id": job_id,
            "restored": put_back,
        },
    )
