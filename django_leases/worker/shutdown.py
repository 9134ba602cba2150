"""SIGTERM/SIGINT/SIGHUP: the first asks for a graceful stop, the second for an immediate one.

SIGHUP is a closed terminal (or an SSH session gone): stopping as on SIGTERM releases the
running jobs at once instead of leaving them to their leases, unless the worker was
started under ``nohup`` (SIGHUP ignored) or by a program with a SIGHUP handler of its
own, which are left as they are. The handler only counts and wakes the main loop; the
loop does the work. Handlers are installed on the main thread only and the previous ones
are restored afterwards.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from typing import Any

from .waker import Waker

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    def __init__(self, waker: Waker) -> None:
        self._waker = waker
        self.count = 0
        self.signal_name = ""
        # The first signal that asked for the stop, if one did (testing.run_burst() sends
        # it on to the caller).
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def stopping(self) -> bool:
        return self.count >= 1

    @property
    def hurry(self) -> bool:
        return self.count >= 2

    def request(self, name: str = "stop()") -> None:
        self.count += 1
        self.signal_name = name
        self._waker.wake()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        self.request(signal.Signals(signum).name)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) != signal.SIG_DFL:
                continue  # nohup ignores it, or a program running the worker handles it
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def exit_status(error: BaseException) -> int:
    """The status Python would end with for ``error`` uncaught, printing what it would
    (130 for Ctrl-C, as a shell reports Python's death by SIGINT): for a worker that ends
    at once, and for a child a handler forked that raised out of it."""
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        sys.stderr.write(f"{error.code}\n")
        return 1
    traceback.print_exception(error)
    return 130 if isinstance(error, KeyboardInterrupt) else 1
