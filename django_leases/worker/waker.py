"""A self-pipe: the one thing the main loop waits on.

Signal handlers, finished handlers and NOTIFY all write a byte; the main loop sleeps in
select() until one arrives or its poll interval passes. Writing to a pipe takes no lock, so
it is safe from a signal handler (a threading.Event is not: its lock may already be held by
the interrupted main thread).
"""

from __future__ import annotations

import contextlib
import os
import select


class Waker:
    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        # A full pipe already holds a wake-up; a closed one means the loop is gone.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; return True if woken early."""
        ready, _, _ = select.select([self._read], [], [], max(timeout, 0.0))
        if not ready:
            return False
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
