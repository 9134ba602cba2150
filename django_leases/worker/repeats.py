"""One warning when a trouble starts, one a minute while it lasts, one line when it ends.

In an outage each thread that talks to the database fails at its own pace: renewals
retried every fraction of a period, the wake-up connection, the schedule ticker, the
claim loop. Logged at every try, one worker wrote about 200 warnings a minute. A
Trouble logs the first failure at once, then at most one line per REPEAT_SECONDS
saying how many it held back, and the first success after it says how long it lasted
(``trouble_over``). The pacing is local: time.monotonic() intervals.
"""

from __future__ import annotations

import time
from typing import Any

from ..safe_logging import WorkerLogger

logger = WorkerLogger()

# Longest a trouble that goes on stays unsaid.
REPEAT_SECONDS = 60.0


class Trouble:
    """The repeated failures of one kind (``event``) of one worker, told in few lines;
    ``every=0`` holds none back (what is tried once or twice: each failure is said).
    ``fields`` name what fails (``schedule=...``) on every line, its end's included."""

    def __init__(
        self, event: str, worker_id: str, every: float = REPEAT_SECONDS, **fields: Any
    ) -> None:
        self.event, self.worker_id = event, worker_id
        self.every = every
        self.fields = fields
        # time.monotonic() when the trouble began and when it was last said; None: no trouble.
        self._since: float | None = None
        self._said_at = 0.0
        self._failures = 0
        self._held = 0

    def warn(self, msg: str, *args: Any, error: str) -> None:
        """Count a failure; log ``msg`` (with ``error`` and the number held back since the
        last line, ``repeats``) if it is the first or the last line is old enough."""
        now = time.monotonic()
        self._failures += 1
        if self._since is None:
            self._since = now
        elif now - self._said_at < self.every:
            self._held += 1
            return
        held, self._held, self._said_at = self._held, 0, now
        if held:
            msg = f"{msg} ({held} more since the last line)"
        # The fields of every Trouble's lines (tests/test_worker_logs.py reads them here).
        extra = {
            "event": self.event,
            "worker": self.worker_id,
            **self.fields,
            "repeats": held,
            "error": error,
        }
        logger.warning(msg, *args, extra=extra)

    def over(self) -> None:
        """A success: say how long the trouble lasted, if there was one."""
        if self._since is None:
            return
        lasted, failures = time.monotonic() - self._since, self._failures
        self._since, self._failures, self._held = None, 0, 0
        logger.info(
            "Trouble over trouble=%s worker=%s: %d failure(s) in %.1fs",
            self.event,
            self.worker_id,
            failures,
            lasted,
            extra={
                "event": "trouble_over",
                "worker": self.worker_id,
                **self.fields,
                "trouble": self.event,
                "failures": failures,
            },
        )
