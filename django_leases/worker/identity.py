"""The worker's id, and one live process per id.

The admin tells claims apart by the id of the worker that holds them; a worker that stops
marks its id stopped, and the claims of a stopped worker read as stalled. Two processes
started with the same ``--worker-id`` would share one row, and the first to stop would
make the other's healthy claims look like a gone worker's. So a process takes its id only
from a holder that stopped or has been silent for two heartbeat periods and a second (a crashed
predecessor of a restart), waits while a live one holds it, and stops if another process
takes it over while it was silent itself.

A holder that died (kill -9, an OOM kill) is taken from at once when /proc can say so: its
row's key names its own pid and host, this machine's boot, this process's pid namespace and
user, and no process of its pid that started when it did is alive. Anywhere else (another
host, another container, which may run the same hostname and pid 1) its silence is the
only sign.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

from ..safe_logging import WorkerLogger

logger = WorkerLogger()

# How often a process waiting for its id says so again.
HELD_LOG_EVERY = 60.0


def process_key() -> str:
    """This process as /proc knows it: "<boot id> <pid namespace> <pid> <start time>
    <user id>"; "" where /proc cannot tell (not Linux, or a /proc of another pid
    namespace)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        own = Path("/proc/self/stat").read_text().split(" ", 1)[0]
        pid = os.getpid()
        start = _start_time(pid)
    except (OSError, ValueError, IndexError):
        return ""
    if own != str(pid) or start is None or " " in boot + namespace:
        return ""
    return f"{boot} {namespace} {pid} {start} {os.geteuid()}"


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22);
    None if there is no such process (the kernel says so, whatever /proc may hide), or only
    its zombie. Raises OSError where /proc will not say of a process that exists (another
    user's under hidepid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it exists: another user's
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command (field 2) is in parentheses and may hold spaces and parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    state, start = fields[0], fields[19]
    return None if state in ("Z", "X") else start


def died(holder: Any) -> bool:
    """Whether the process that holds a worker row is gone for certain: its row's key
    (process_key()) was written by it (its pid and host), names this boot, pid namespace
    and user, and the kernel has no process of its pid, or /proc shows one started at
    another time (its pid reused) or a zombie. False whenever that cannot be told: a key a
    worker of an earlier release left under another holder's row, another host, another
    container, another user, a /proc that will not say."""
    parts = str(getattr(holder, "process_key", "")).split(" ")
    mine = process_key().split(" ")
    if len(parts) != 5 or len(mine) != 5 or parts[:2] != mine[:2] or parts[4] != mine[4]:
        return False
    if parts[2] != str(holder.pid) or holder.hostname != socket.gethostname():
        return False
    if not parts[2].isdigit() or int(parts[2]) <= 0:
        return False  # os.kill() would signal a process group
    try:
        return _start_time(int(parts[2])) != parts[3]
    except (OSError, ValueError, IndexError):
        return False


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def new_instance() -> str:
    """This process's token in its worker row (WorkerProcess.instance)."""
    return uuid.uuid4().hex


def silent_for(holder: Any) -> float:
    """Seconds since the holder's last heartbeat, on the database clock."""
    seconds: float = (holder.db_now - holder.last_seen_at).total_seconds()
    return max(seconds, 0.0)


def log_id_held(worker_id: str, holder: Any, gone_after: float) -> None:
    logger.warning(
        "Worker id %r is held by host=%s pid=%s, not stopped and seen %.1f s ago; waiting "
        "until it stops or has been silent for %g s. Give each worker its own --worker-id",
        worker_id,
        holder.hostname,
        holder.pid,
        silent_for(holder),
        gone_after,
        extra={
            "event": "id_held",
            "worker": worker_id,
            "host": holder.hostname,
            "pid": holder.pid,
        },
    )


def log_id_replaced(worker_id: str, holder: Any) -> None:
    """``holder``: the row's (hostname, pid) now, or None if the row is gone."""
    if holder is None:
        logger.error(
            "Worker id %r: its worker row was deleted; stopping",
            worker_id,
            extra={"event": "id_replaced", "worker": worker_id},
        )
        return
    host, pid = holder
    logger.error(
        "Worker id %r was taken over by host=%s pid=%s while this process was silent for "
        "two heartbeat periods and a second (the database unreachable, or this process "
        "paused); stopping",
        worker_id,
        host,
        pid,
        extra={"event": "id_replaced", "worker": worker_id, "host": host, "pid": pid},
    )
