"""The run_lease_worker process: claim loop, heartbeat, watchdog, executors, shutdown."""

from __future__ import annotations

from .loop import Worker

__all__ = ["Worker"]
