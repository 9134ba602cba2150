"""The worker's logger, whose calls never raise.

In thread isolation a handler shares the logging module with the worker: a filter or a
handler it adds to the worker's logger that raises (or anything else logging raises, a
recursion limit lowered under it) made the main loop's next log call raise, and the worker
died holding its claims. A line logging cannot take is written as it is to the process's
stderr descriptor, with what logging raised, and the worker goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

WORKER_LOGGER = "django_leases.worker"


class WorkerLogger(logging.LoggerAdapter[logging.Logger]):
    """``logging.getLogger(name)``'s calls, each one unable to raise."""

    def __init__(self, name: str = WORKER_LOGGER) -> None:
        super().__init__(logging.getLogger(name), {})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return msg, kwargs  # the call's own ``extra``, not the adapter's (empty) one

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        # The record names the caller, not this method.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        try:
            if self.logger.isEnabledFor(level):
                self.logger.log(level, msg, *args, **kwargs)
            return
        except Exception as e:  # noqa: BLE001 -- a log line must not end the worker
            error: Exception = e
        if kwargs.get("exc_info"):
            # A handler's exception whose traceback cannot be formatted: the line without it.
            kwargs["exc_info"] = None
            try:
                self.logger.log(level, msg, *args, **kwargs)
                return
            except Exception as e:  # noqa: BLE001
                error = e
        write_raw(level, msg, args, error)


def write_raw(level: int, msg: Any, args: tuple[Any, ...], error: BaseException) -> None:
    """Write a line logging could not take straight to descriptor 2; never raises."""
    try:
        try:
            text = str(msg) % args if args else str(msg)
        except Exception:  # noqa: BLE001 -- arguments that do not fit the message
            text = f"{msg!r} {args!r}"
        line = (
            f"{logging.getLevelName(level)} {text} "
            f"[not logged: {type(error).__qualname__}: {error}]\n"
        )
        os.write(2, line.encode("utf-8", "backslashreplace"))
    except Exception:  # noqa: BLE001, S110 -- descriptor 2 closed too: nothing left to tell
        pass
