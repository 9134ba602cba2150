"""Run timeouts: a handler may run for its task's ``timeout`` (else its queue's or the
backend's TIMEOUT_SECONDS), counted on the monotonic clock from the moment it started (a
process-isolated one: when its child says so, its start-up not counted) until it returned.

Past it the handler is told to stop, as a lost claim's is (``current_job().lost``, its
checkpoints and fenced writes refused, an async handler cancelled), while the worker still
holds the claim: its attempt is failed under the claim's token (HandlerTimeout) and retried
by the job's ladder. A process-isolated handler that has not stopped within a second is
killed. A thread cannot be killed: one that has not stopped within a second is abandoned,
running on, its slot replaced by a new thread; its job's retry then waits at least one
lease, as a takeover of a lease it let run out would have. A thread-isolated handler whose
claim was lost (cancelled, taken over) and that has not stopped a lease after it was told
is abandoned the same way, so that a hung handler never keeps a slot for good.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..safe_logging import WorkerLogger
from .child import KILL_GRACE_SECONDS
from .claims import ACKED, LOST, RUNNING, Claim, Kind, Outcome
from .logs import claim_fields

logger = WorkerLogger()

# How long a handler told to stop (timed out, or its claim lost) may take to return before
# a thread-isolated one is abandoned: as long as a process-isolated one has before its kill.
ABANDON_AFTER_SECONDS = KILL_GRACE_SECONDS

TIMEOUT_CLASS_PATH = "django_leases.exceptions.HandlerTimeout"


def timeout_of(task: Any, options: Any, queue_name: str) -> float | None:
    """How long a handler of ``task`` (None: not declared) on ``queue_name`` may run: the
    task's own timeout, else the queue's or the backend's TIMEOUT_SECONDS (None: no limit)."""
    own = getattr(task, "timeout", None)
    if own is not None:
        return float(own)
    return options.timeout_for_queue(queue_name) if options is not None else None


def timeout_retryable(task: Any) -> bool:
    """Whether a timed-out attempt of ``task`` is retried: unless its ``non_retryable``
    lists HandlerTimeout (or a base of it), as for an exception its handler raised."""
    from ..exceptions import HandlerTimeout

    return not issubclass(HandlerTimeout, tuple(getattr(task, "non_retryable", ()) or ()))


# How a timed-out handler ended, as its failure's message says; those still running when
# the failure is written make the retry wait the lease.
ENDINGS = {
    "stopped": ("it stopped when told", False),
    "killed": ("its process did not stop when told and was killed", False),
    "unstarted": ("its process had not started the handler yet and was killed", False),
    "abandoned": ("its thread did not stop when told and was abandoned, still running", True),
    "stopping": ("the worker stopped before it did", True),
}


def timed_out_outcome(claim: Claim, ending: str = "stopped") -> Outcome:
    """The failed attempt of a handler that ran past its timeout and ended so (ENDINGS)."""
    how, running = ENDINGS[ending]
    if running:
        how += f" (the retry waits at least the lease, {claim.lease:g} s)"
    return Outcome(
        Kind.ERROR,
        exception_class_path=TIMEOUT_CLASS_PATH,
        message=f"handler ran past its timeout of {claim.timeout:g} s; {how}",
        retryable=claim.timeout_retryable,
        min_retry_in=claim.lease if running else 0.0,
    )


class RunTimeouts:
    """Watched by the watchdog thread: times out handlers past their timeout, and abandons
    thread-isolated handlers that do not stop when told (``abandon`` answers whether the
    executor replaced the slot; None: it cannot, as a process's slot needs no replacing)."""

    def __init__(
        self,
        *,
        worker_id: str,
        abandon: Callable[[Claim], bool] | None,
        deliver: Callable[[Claim, Outcome], None],
        forget: Callable[[Claim], None],
        abandoned: Callable[[], None] = lambda: None,
    ) -> None:
        self.worker_id = worker_id
        self._abandon = abandon
        self._deliver = deliver
        self._forget = forget
        # Told after each abandonment (the worker counts those still running).
        self._abandoned = abandoned

    def watch(self, claims: Iterable[Claim], now: float) -> None:
        for claim in claims:
            if claim.running_since is None or claim.returned_at is not None:
                continue  # not started yet, or its handler came back
            if (
                claim.timeout is not None
                and now - claim.running_since >= claim.timeout
                and claim.time_out(now)
            ):
                logger.warning(
                    "Handler of job=%s fence=%s worker=%s ran past its timeout of %g s; "
                    "telling it to stop, %s",
                    claim.pk,
                    claim.job.fence,
                    self.worker_id,
                    claim.timeout,
                    "its job stays done (it acknowledged it)"
                    if claim.acked
                    else "its attempt fails",
                    extra=claim_fields(
                        claim.job, self.worker_id, "timed_out", timeout=claim.timeout
                    ),
                )
            self._maybe_abandon(claim, now)

    def _maybe_abandon(self, claim: Claim, now: float) -> None:
        told = claim.told_at
        if self._abandon is None or told is None:
            return
        # Timed out and still held, or lost; not one being released at a stop (the stop
        # waits for it and releases it itself) nor one its handler acknowledged. A lost
        # claim's handler gets a lease to notice: in a database outage every claim is lost
        # and handlers blocked on the database return with its errors, not abandoned.
        timed_out = claim.timed_out and claim.state == RUNNING
        done = claim.timed_out and claim.state == ACKED  # acknowledged itself, then hung
        if not (timed_out or done or claim.state == LOST):
            return
        wait = ABANDON_AFTER_SECONDS if claim.timed_out else max(ABANDON_AFTER_SECONDS, claim.lease)
        if now - told < wait or not self._abandon(claim):
            return
        logger.warning(
            "Handler of job=%s fence=%s worker=%s did not stop %.1f s after it was told "
            "(%s); abandoned, its thread running on, its slot replaced",
            claim.pk,
            claim.job.fence,
            self.worker_id,
            now - told,
            "past its timeout"
            if timed_out
            else "past its timeout, its job acknowledged"
            if done
            else claim.lost_reason or "its claim was lost",
            extra=claim_fields(claim.job, self.worker_id, "handler_abandoned"),
        )
        if timed_out:
            self._deliver(claim, timed_out_outcome(claim, "abandoned"))
        else:
            self._forget(claim)  # lost, or done: nothing to write, the slot counts as free
        self._abandoned()
