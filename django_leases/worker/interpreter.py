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

import logging
import sys
from typing import Any, TextIO

logger = logging.getLogger("django_leases.worker")


class InterpreterGuard:
    """The settings as the worker started with them, and what put them back."""

    def __init__(self) -> None:
        self.recursion_limit = sys.getrecursionlimit()
        self.switch_interval = sys.getswitchinterval()
        self.logging_disabled = logging.root.manager.disable

    def restore(self) -> list[str]:
        """Put back what a handler changed to the worker's harm; the names of what was."""
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
            if stream is not None and stream.closed:
                setattr(sys, name, _reopened(stream, fd))
                put_back.append(f"sys.{name}")
        return put_back


def _reopened(closed: TextIO, fd: int) -> TextIO:
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
    loggers: list[Any] = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for each in loggers:
        for handler in getattr(each, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is closed:
                # Not setStream(): it flushes the closed stream first, which raises.
                handler.acquire()
                try:
                    handler.stream = stream
                finally:
                    handler.release()
    return stream


def log_restored(put_back: list[str], job_id: Any, worker_id: str) -> None:
    logger.warning(
        "Handler of job=%s changed the interpreter for the whole worker (%s); put back "
        "worker=%s. In thread isolation handlers share the process: run such code with "
        "--isolation process",
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
