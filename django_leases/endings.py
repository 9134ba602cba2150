"""Claim candidates that end instead of running again, and the line that says so.

A claim that finds a job past its deadline, or an expired claim with no attempts left or
whose task must not run twice, settles it (dead, or parked for an operator) instead of
taking it. Nobody's handler fails there, so nobody else would say it: the claim logs it,
once its transaction has committed, on the worker's logger (the claim is the worker's
verb), as a warning an operator can alert on.
"""

from __future__ import annotations

from typing import Any

from .safe_logging import WorkerLogger
from .states import DeadReason, JobState, LeaseLostPolicy

# The worker's logger by name: its events are listed in django_leases.worker.logs.EVENTS.
logger = WorkerLogger()

# The ending of a job parked rather than dead-lettered.
PARK = "park"


def ending(job: Any) -> str | None:
    """How a claim candidate ends instead of being claimed: a dead reason, PARK, or None."""
    if job.past_deadline:
        return DeadReason.DEADLINE
    if job.state != JobState.CLAIMED:
        return None
    if job.on_lease_lost == LeaseLostPolicy.DEAD:
        return DeadReason.LEASE_LOST
    if job.on_lease_lost == LeaseLostPolicy.PARK:
        return PARK
    if job.attempts >= job.max_attempts:
        return DeadReason.ATTEMPTS
    return None


def log_ended(worker_id: str, ended: list[tuple[Any, str]]) -> None:
    """One warning per job the claim of ``worker_id`` settled: (job as read, its ending)."""
    for job, how in ended:
        previous = job.claimed_by if job.state == JobState.CLAIMED else None
        # What the claim found: a job past its deadline, a claim whose last lease ran out.
        found = [
            "past its deadline" if how == DeadReason.DEADLINE else "",
            f"the lease of {previous} ran out" if previous else "",
        ]
        said = (job.pk, job.fence, worker_id, how, "; ".join(f for f in found if f))
        facts = {
            "job_id": job.pk,
            "task": job.task_path,
            "queue": job.queue_name,
            "fence": job.fence,
            "worker": worker_id,
            "reason": how,
            "previous_worker": previous,
        }
        if how == PARK:
            logger.warning(
                "Parked job=%s fence=%s by the claim of worker=%s reason=%s: %s; pending "
                "until retried by hand",
                *said,
                extra={"event": "parked", **facts},
            )
        else:
            logger.warning(
                "Dead-lettered job=%s fence=%s by the claim of worker=%s reason=%s: %s",
                *said,
                extra={"event": "dead_lettered", **facts},
            )
