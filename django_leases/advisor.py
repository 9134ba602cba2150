"""The lease advisor: each task's handler durations against its lease and heartbeat.

A lease is a bet on how long a handler may go without a renewal. The advisor reads what
finished jobs actually took (``finished_at - last_attempted_at``, two database-clock
stamps, so no worker clock enters the figure) and says, per task, whether the bet is too
short (a handler outlives its lease whenever renewals stop: duplicates), too long (a
crashed worker's job waits that long) or leaves the heartbeat no slack. Used by
``manage.py lease_report`` and the admin's advisor page.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction

from . import conf, registry
from .durations import duration_text

# The lease should cover the slowest handlers with this much to spare ...
HEADROOM = 1.5
# ... and never drop below this: with heartbeats the lease must also outlast a database
# failover or a long pause, and 30 s (SQS's default visibility timeout) covers most.
MIN_LEASE = 30.0
# A lease this many times the recommendation makes a crash stall for nothing.
TOO_LONG_FACTOR = 4.0
# Fewer finished jobs than this and the tail is a guess: report, but do not judge.
MIN_SAMPLES = 20

OK, SHORT, HEARTBEAT, LONG, FEW = "ok", "lease-short", "heartbeat-slow", "lease-long", "few-samples"


def percentile(values: Any, p: float) -> float:
    """Nearest-rank percentile of sorted ``values`` (p in 0..100): an observed duration, never
    an interpolation, so p99.9 of a thousand jobs is the second slowest."""
    if not len(values):
        raise ValueError("no values")
    # round() first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point.
    rank = max(1, math.ceil(round(p * len(values) / 100, 9)))
    return float(values[min(rank, len(values)) - 1])


def recommend_lease(p999: float, *, headroom: float = HEADROOM, floor: float = MIN_LEASE) -> float:
    """Whole seconds covering p99.9 with ``headroom``, at least ``floor``, within the bounds
    LEASE_SECONDS accepts."""
    wanted = max(p999 * headroom, floor, conf.MIN_LEASE_SECONDS)
    return float(min(math.ceil(wanted), conf.MAX_LEASE_SECONDS))


@dataclass
class Finding:
    code: str
    text: str


@dataclass
class TaskAdvice:
    """One task's durations, its lease and heartbeat, and what to change."""

    task_path: str
    samples: int
    p50: float
    p99: float
    p999: float
    max: float
    lease: float
    heartbeat: float | None
    recommended_lease: float
    recommended_heartbeat: float
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def verdict(self) -> str:
        """One line: "ok", or the findings joined."""
        return "; ".join(f.text for f in self.findings) or "ok: lease covers p99.9 with headroom"


def configured(
    task_path: str, seen_leases: Iterable[float], alias: str | None = None
) -> tuple[float, float | None]:
    """The lease new jobs of ``task_path`` get (the task's, its queue's, else the backend's)
    and the configured HEARTBEAT_SECONDS (None: lease / 3).

    A task no longer declared falls back to the longest lease its finished jobs carried.
    """
    options = conf.get_options(alias)
    backend_alias = alias or conf.first_lease_backend()
    task = registry.lookup(backend_alias, task_path) if backend_alias else None
    if task is None and backend_alias:
        registry.discover()
        task = registry.lookup(backend_alias, task_path)
    if task is not None:
        lease, _ = options.for_queue(task.queue_name)
        lease = float(getattr(task, "lease", None) or lease)
    else:
        seen = list(seen_leases)
        lease = max(seen) if seen else options.lease_seconds
    return lease, _raw_heartbeat(backend_alias)


def _raw_heartbeat(alias: str | None) -> float | None:
    from django.conf import settings

    if alias is None:
        return None
    value = settings.TASKS[alias].get("OPTIONS", {}).get("HEARTBEAT_SECONDS")
    return None if value is None else float(value)


def advise(
    task_path: str,
    durations: Any,
    lease: float,
    heartbeat: float | None,
    *,
    headroom: float = HEADROOM,
    floor: float = MIN_LEASE,
    min_samples: int = MIN_SAMPLES,
) -> TaskAdvice:
    """Judge one task from its sorted handler durations (seconds)."""
    p999 = percentile(durations, 99.9)
    recommended = recommend_lease(p999, headroom=headroom, floor=floor)
    advice = TaskAdvice(
        task_path=task_path,
        samples=len(durations),
        p50=percentile(durations, 50),
        p99=percentile(durations, 99),
        p999=p999,
        max=float(durations[-1]),
        lease=lease,
        heartbeat=heartbeat,
        recommended_lease=recommended,
        recommended_heartbeat=round(min(lease, recommended) / 3, 1),
    )
    if len(durations) < min_samples:
        advice.findings.append(
            Finding(
                FEW,
                f"only {len(durations)} finished job{'' if len(durations) == 1 else 's'}; "
                f"judging needs {min_samples}",
            )
        )
        return advice
    if lease < p999 * headroom:
        advice.findings.append(
            Finding(
                SHORT,
                f"lease {duration_text(lease, precise=True)} is below p99.9 {duration_text(p999, precise=True)} x {headroom:g}: without "
                f"heartbeats (a paused worker, a database failover) handlers outlive "
                f"their lease and duplicates are likely; set the lease to {duration_text(recommended, precise=True)}",
            )
        )
    elif lease > recommended * TOO_LONG_FACTOR:
        advice.findings.append(
            Finding(
                LONG,
                f"lease {duration_text(lease, precise=True)} is far above need (p99.9 {duration_text(p999, precise=True)}): a crashed "
                f"worker's job waits up to {duration_text(lease, precise=True)} before anyone retries it; "
                f"set the lease to {duration_text(recommended, precise=True)}",
            )
        )
    if heartbeat is not None and heartbeat > lease / 3:
        advice.findings.append(
            Finding(
                HEARTBEAT,
                f"HEARTBEAT_SECONDS {duration_text(heartbeat, precise=True)} is above lease/3 ({duration_text(lease / 3, precise=True)}): "
                f"fewer than two beats may fail before the claim is lost (run_lease_worker renews these "
                f"claims every {duration_text(lease / 3, precise=True)} anyway); set it to at most "
                f"{duration_text(advice.recommended_heartbeat, precise=True)}",
            )
        )
    return advice


def report(
    since_days: float | None = None,
    *,
    alias: str | None = None,
    using: str | None = None,
    headroom: float = HEADROOM,
    floor: float = MIN_LEASE,
    min_samples: int = MIN_SAMPLES,
) -> list[TaskAdvice]:
    """Advice for every task with succeeded jobs (finished in the last ``since_days``).
    An argument out of range raises InvalidLeaseOption naming it."""
    from .models import Job

    headroom = conf.checked_number("headroom", headroom, low=1, high=100)
    floor = conf.checked_number(
        "floor", floor, low=conf.MIN_LEASE_SECONDS, high=conf.MAX_LEASE_SECONDS
    )
    min_samples = int(
        conf.checked_number("min_samples", min_samples, low=1, high=10**9, integer=True)
    )

    if using is None or alias is not None:
        alias = conf.lease_backend(alias, "alias")
    database = using or conf.get_options(alias).database
    durations: dict[str, array[float]] = {}
    leases: dict[str, set[float]] = {}
    rows = Job.objects.using(database).handler_durations(since_days)
    # In a transaction: outside one, PostgreSQL's server-side cursor is declared WITH HOLD and
    # read in later transactions, which a transaction pooler may send to another session.
    with transaction.atomic(using=database):
        for task_path, lease_seconds, duration in rows.iterator(chunk_size=5000):
            durations.setdefault(task_path, array("d")).append(_seconds(duration))
            leases.setdefault(task_path, set()).add(float(lease_seconds))
    out = []
    for task_path in sorted(durations):
        values = sorted(durations[task_path])
        lease, heartbeat = configured(task_path, leases[task_path], alias)
        out.append(
            advise(
                task_path,
                values,
                lease,
                heartbeat,
                headroom=headroom,
                floor=floor,
                min_samples=min_samples,
            )
        )
    return out


def _seconds(value: Any) -> float:
    # Some backends hand a DurationField back as microseconds.
    if isinstance(value, timedelta):
        return max(value.total_seconds(), 0.0)
    return max(float(value) / 1e6, 0.0)
