"""Job states. Importable before the app registry is ready (no models here)."""

from __future__ import annotations

from django.db.models import TextChoices
from django.utils.translation import pgettext_lazy


class JobState(TextChoices):
    # Waiting for available_at; moved out by a claim, or by cancel.
    PENDING = "pending", pgettext_lazy("Job state", "Pending")
    # Held under a lease by the worker that owns claim_token; moved out by that worker's
    # ack/fail/release, by another worker's claim once the lease expired, or by cancel.
    CLAIMED = "claimed", pgettext_lazy("Job state", "Claimed")
    # Acknowledged by its owner. Terminal.
    SUCCEEDED = "succeeded", pgettext_lazy("Job state", "Succeeded")
    # Given up on after max_attempts; kept for people and moved out only by requeue.
    DEAD = "dead", pgettext_lazy("Job state", "Dead")
    # Stopped by an operator. Terminal unless requeued.
    CANCELLED = "cancelled", pgettext_lazy("Job state", "Cancelled")


# In a fixed order, so that a statement filtering on them is the same text every time.
TERMINAL_STATES = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)
ACTIVE_STATES = (JobState.PENDING, JobState.CLAIMED)


class FailureKind(TextChoices):
    # The handler raised.
    EXCEPTION = "exception", pgettext_lazy("Failure kind", "Exception")
    # The lease ran out before the owner acknowledged; another claim took the job over.
    LEASE_EXPIRED = "lease_expired", pgettext_lazy("Failure kind", "Lease expired")
    # The job could not be run at all (unknown task, bad arguments).
    UNRUNNABLE = "unrunnable", pgettext_lazy("Failure kind", "Unrunnable")


class LeaseLostPolicy(TextChoices):
    """What an expired claim means for a job, decided when another worker finds it expired."""

    # Run it again (the handler is idempotent, or fenced). Counts as a spent attempt.
    RETRY = "retry", pgettext_lazy("Lease lost policy", "Retry")
    # Dead-letter at once: running twice would do harm, and nobody can tell how far it got.
    DEAD = "dead", pgettext_lazy("Lease lost policy", "Dead-letter")
    # Hold it pending with no due time until a person releases (retry now) or cancels it.
    PARK = "park", pgettext_lazy("Lease lost policy", "Park for a person")


class DeadReason(TextChoices):
    ATTEMPTS = "attempts", pgettext_lazy("Dead reason", "Out of attempts")
    DEADLINE = "deadline", pgettext_lazy("Dead reason", "Past its deadline")
    NON_RETRYABLE = "non_retryable", pgettext_lazy("Dead reason", "Non-retryable error")
    LEASE_LOST = "lease_lost", pgettext_lazy("Dead reason", "Lease lost (not idempotent)")
    UNRUNNABLE = "unrunnable", pgettext_lazy("Dead reason", "Unrunnable")
