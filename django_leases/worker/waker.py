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
        self._closed = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        # A full pipe already holds a wake-up; a closed one means the loop is gone.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; return True if woken early."""
        if self._closed:  # the read end's number may be another file's by now
            raise RuntimeError("this Waker is closed")
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
        """Close the read end; point the write end at /dev/null, in one step, and close it
        only with this object. Other threads may still wake() after the loop is gone (a
        handler's slot thread handing back its outcome, the listener, stop()): between
        reading the number and writing to it, a closed number could become a file or
        socket opened since, and get the byte."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._write, inheritable=False)
            finally:
                os.close(null)
        with contextlib.suppress(OSError):
            os.close(self._read)

    def __del__(self) -> None:
        # No thread can wake() an object nothing refers to: the write end goes now.
        if hasattr(self, "_write"):
            self.close()
            with contextlib.suppress(OSError):
                os.close(self._write)
