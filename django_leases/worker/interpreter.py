"""The interpreter's settings a handler shares with the worker in thread isolation.

A handler that lowers the recursion limit, lengthens the thread switch interval, closes
sys.stdout or sys.stderr, disables logging (or the worker's loggers, by setting up logging
again), changes the working directory or sets an asyncio event loop policy changes them
for the worker's own threads too: the main loop's next statement raised RecursionError and
the process ended, the heartbeat waited seconds for its turn and leases ran out, the log
lines stopped, the next handler's connection opened another SQLite file (a relative NAME),
every later async handler ran on the policy's loops (or failed, its loops refused). What
endangers the worker is put back after each job (a raised limit, a shorter interval or a
stream the handler replaced are left as they are: the project may want them); a child
process's interpreter is its own.

A closed sys.stderr cannot wait for the job's end: while it is closed, logging's report of
any line that fails (the project's own StreamHandler on it, say) raises out of the log
call, in whichever thread logged, the main loop's too. So the standard streams handlers
see are ones whose close() only flushes (keep_streams_open()), as Celery's stand-ins are.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from ..safe_logging import WORKER_LOGGER, WorkerLogger
from .logs import TASKS_LOGGER

logger = WorkerLogger()


class InterpreterGuard:
    """The settings as the worker started with them, and what puts them back."""

    def __init__(self) -> None:
        self.recursion_limit = sys.getrecursionlimit()
        self.switch_interval = sys.getswitchinterval()
        self.logging_disabled = logging.root.manager.disable
        # The loggers the worker writes to that were on (a project's logging set up again,
        # dictConfig's disable_existing_loggers, turns them off for good).
        self.loggers_on = [
            name for name in (WORKER_LOGGER, TASKS_LOGGER) if not logging.getLogger(name).disabled
        ]
        # Where relative paths lead (a relative SQLite NAME, the project's own files).
        self.cwd = _cwd()
        # Where each async handler's event loop comes from (asyncio.run asks the policy).
        self.loop_policy = _loop_policy()
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
            for name in self.loggers_on:
                if logging.getLogger(name).disabled:
                    logging.getLogger(name).disabled = False
                    put_back.append(f"logger {name}")
            if self.cwd is not None and _cwd() != self.cwd:
                with contextlib.suppress(OSError):  # the directory is gone: nowhere to go back
                    os.chdir(self.cwd)
                    put_back.append("working directory")
            if _loop_policy() is not self.loop_policy:
                with warnings.catch_warnings():
                    # Python 3.14 deprecates the policy functions; still what asyncio asks.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    asyncio.set_event_loop_policy(self.loop_policy)
                put_back.append("asyncio event loop policy")
            for name, fd in (("stdout", 1), ("stderr", 2)):
                stream = getattr(sys, name)
                # A project's own stream object may have no ``closed``: not a file's.
                with contextlib.suppress(Exception):
                    if stream is not None and getattr(stream, "closed", False) is True:
                        setattr(sys, name, _reopened(stream, fd, name))
                        put_back.append(f"sys.{name}")
            return put_back


def _loop_policy() -> Any:
    """The policy in force, as asyncio holds it (get_event_loop_policy() warns on Python
    3.14); the default one made first, as asyncio's first loop would (not a change)."""
    if getattr(asyncio.events, "_event_loop_policy", None) is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.get_event_loop_policy()
    return getattr(asyncio.events, "_event_loop_policy", None)


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None


class _OpenFile(io.FileIO):
    def close(self) -> None:
        pass  # the descriptor is the process's (closefd=False): nothing to give back


class _OpenBuffer(io.BufferedWriter):
    def close(self) -> None:
        self.flush()  # the stock close() frees the buffer: any later write raised


class _OpenText(io.TextIOWrapper):
    """A standard stream whose close() flushes and leaves it open, down to its buffer and
    file: a handler that closes sys.stderr, or sys.stderr.buffer, closes nothing."""

    def close(self) -> None:
        self.flush()


def _kept_open(like: Any, fd: int, name: str, line_buffering: bool | None = None) -> TextIO:
    """A stream on ``fd`` that stays open, encoding (and unless told, buffering) as ``like``
    did."""
    raw = _OpenFile(fd, "w", closefd=False)
    raw.name = f"<{name}>"  # as the interpreter names its own
    text = _OpenText(
        _OpenBuffer(raw),
        encoding=getattr(like, "encoding", None),
        errors=getattr(like, "errors", None) or "backslashreplace",
        line_buffering=bool(
            getattr(like, "line_buffering", True) if line_buffering is None else line_buffering
        ),
        write_through=bool(getattr(like, "write_through", False)),
    )
    text.mode = "w"  # type: ignore[misc]  # as open() sets it
    return text


def _hand_over(old: Any, new: Any) -> None:
    """Point every logging handler that writes to ``old`` at ``new``: those of loggers, and
    those only another reaches (a MemoryHandler's target, a QueueListener's); logging keeps
    weak references to them all."""
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref()
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            # Not setStream(): it flushes the old stream first, which raises if closed.
            with contextlib.suppress(Exception):
                handler.acquire()
                try:
                    handler.stream = new
                finally:
                    handler.release()


def keep_streams_open() -> Callable[[], None]:
    """Put in sys.stdout and sys.stderr, where they are the process's own (not a project's
    or a test runner's replacement), streams on the same descriptors that close() cannot
    close, and point the logging handlers that wrote to the originals at them (a handler
    closing ``sys.__stderr__`` then closes nothing logging writes to); return what puts
    the originals back, unless a handler closed them."""
    swapped: list[tuple[str, Any, Any]] = []
    for name, fd in (("stdout", 1), ("stderr", 2)):
        original = getattr(sys, name)
        with contextlib.suppress(Exception):  # no descriptor, another one, closed already
            if original is getattr(sys, f"__{name}__") and original.fileno() == fd:
                original.flush()
                kept = _kept_open(original, fd, name)
                setattr(sys, name, kept)
                _hand_over(original, kept)
                swapped.append((name, original, kept))

    def put_back() -> None:
        for name, original, kept in swapped:
            with contextlib.suppress(Exception):
                if original.closed:
                    continue  # closed by a handler: the stand-in stays
                kept.flush()
                _hand_over(kept, original)
                if getattr(sys, name) is kept:  # not one a handler put there since
                    setattr(sys, name, original)

    return put_back


def _reopened(closed: Any, fd: int, name: str) -> TextIO:
    """A new stream on ``fd`` (a standard stream's close leaves its descriptor open), given
    to every logging handler that wrote to ``closed``."""
    stream = _kept_open(closed, fd, name, line_buffering=True)
    _hand_over(closed, stream)
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
