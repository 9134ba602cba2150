"""JobQuerySet: the lease views, the manager's entry to enqueue.py, and the verbs it is
composed from.

The lease views (claimable, expired, stalled) are read by the claim, the admin and the
operators alike; every comparison uses the database clock. The verbs live beside their
statements: the claim in claiming.py, the owner's writes in owner_writes.py, operator verbs
and the admin's reads in operators.py, prune in pruning.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import models, router
from django.db.models import Case, OuterRef, Q, Subquery, Value, When
from django.db.models.functions import Coalesce, Now

from .claiming import ClaimedJob
from .enqueue import insert_job, insert_jobs
from .enqueue_options import EnqueueOptions, check_queue, checked_arguments
from .lease_statements import ClaimRef
from .operators import OperatorVerbs
from .owner_writes import OwnerVerbs, RecordedFailure
from .pruning import PruneVerbs
from .states import JobState
from .worker_registry import registered_period, silent_since

if TYPE_CHECKING:
    from .models import Job

__all__ = ["ClaimRef", "ClaimedJob", "EnqueueOptions", "JobQuerySet", "RecordedFailure"]


class JobQuerySet(OperatorVerbs, PruneVerbs, OwnerVerbs, models.QuerySet["Job"]):
    """Lease views and the manager's enqueue; the verbs of its mixins: the claim
    (ClaimVerbs), the owner's writes (OwnerVerbs), operator verbs (OperatorVerbs), prune
    (PruneVerbs)."""

    # -- lease views -------------------------------------------------------------------
    # "Stalled" is the design's full definition, the one the admin shows: renewals stopped
    # for conf.silent_after() of the holder's own heartbeat period (two periods and a
    # second), or the worker that holds the claim is stopped or unseen for as long. Every
    # comparison uses Now().

    def claimable(self) -> JobQuerySet:
        """Pending and due, or claimed with a lease that has run out."""
        return self.filter(
            Q(state=JobState.PENDING, available_at__lte=Now())
            | Q(state=JobState.CLAIMED, lease_expires_at__lt=Now())
        )

    def claim_order(self, queues: Iterable[str] | None) -> JobQuerySet:
        """Claimable jobs of ``queues`` (None: of every queue) in the order a claim takes
        them (partial indexes on PostgreSQL the claim itself runs an ordered scan of
        leases_job_due_idx)."""
        jobs = self if queues is None else self.filter(queue_name__in=list(queues))
        return jobs.claimable().order_by("-priority", "available_at", "id")

    def expired(self) -> JobQuerySet:
        """Claimed, and the lease has passed: any worker may claim it again."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__lt=Now())

    def lease_valid(self) -> JobQuerySet:
        """Claimed with a lease that has not run out (healthy or stalled)."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__gte=Now())

    def _workers(self) -> Any:
        return apps.get_model("django_leases", "WorkerProcess").objects.using(self.db)

    def _silent_q(self, heartbeat_seconds: float) -> Q:
        """No renewal for conf.silent_after() of its worker's registered period."""
        holders_period = (
            self._workers()
            .filter(worker_id=OuterRef("claimed_by"))
            .annotate(period=registered_period(heartbeat_seconds))
            .values("period")[:1]
        )
        period = Coalesce(Subquery(holders_period), Value(float(heartbeat_seconds)))
        return Q(heartbeat_at__lt=silent_since(period))

    def _stalled_q(self, heartbeat_seconds: float) -> Q:
        gone = self._workers().gone(heartbeat_seconds).values("worker_id")
        return Q(state=JobState.CLAIMED, lease_expires_at__gte=Now()) & (
            self._silent_q(heartbeat_seconds) | Q(claimed_by__in=gone)
        )

    def stalled_claims(self, heartbeat_seconds: float) -> JobQuerySet:
        """Claimed with a valid lease, but its renewals silent for conf.silent_after() of
        its worker's heartbeat period (as the worker registered it; ``heartbeat_seconds``
        for a claim whose worker has no row or a 0.1.0 worker's, which says none), or its
        worker gone."""
        return self.filter(self._stalled_q(heartbeat_seconds))

    def with_lease_status(self, heartbeat_seconds: float) -> JobQuerySet:
        """Annotate ``db_now``, ``lease_status`` (healthy, stalled, expired or None) and
        ``heartbeat_silent`` (why a stalled claim is: its renewals silent, else its worker
        gone).

        ``db_now`` is the database clock of the same statement, so ages and countdowns shown
        from it never depend on the web server's clock.
        """
        return self.annotate(
            db_now=Now(),
            lease_status=Case(
                When(state=JobState.CLAIMED, lease_expires_at__lt=Now(), then=Value("expired")),
                When(self._stalled_q(heartbeat_seconds), then=Value("stalled")),
                When(state=JobState.CLAIMED, then=Value("healthy")),
                default=Value(None),
                output_field=models.CharField(),
            ),
            heartbeat_silent=Case(
                When(self._silent_q(heartbeat_seconds), then=Value(True)),
                default=Value(False),
                output_field=models.BooleanField(),
            ),
        )

    # -- enqueue: the manager's entry to enqueue.py -----------------------------------

    def enqueue(
        self,
        task_path: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Job:
        """Insert a pending job in the caller's transaction and return it.

        ``options`` are those of EnqueueOptions: queue_name, priority, run_after, delay,
        lease_seconds, max_attempts, retry, on_lease_lost, deadline, max_age, unique_key,
        on_duplicate. Raise InvalidJobArgument (naming the argument) or InvalidLeaseOption
        before anything is written. ``delay`` counts from the database clock, and ``max_age``
        from the due time so reached (or the later of ``run_after`` and Now());
        ``run_after`` and ``deadline`` are the caller's own absolute times. With
        ``unique_key``, a second pending or claimed job with the same key is refused
        (DuplicateJob) or, with ``on_duplicate="merge"``, the existing job is returned instead.

        ``task_path`` is not looked up: the manager takes the path of a task this process
        need not declare (one only the workers' code has, a path kept in data), as Celery's
        ``send_task()`` does. A path no worker declares is written and ends dead as
        ``UnknownTask`` when claimed; the backend's ``enqueue()`` refuses such a task.
        """
        args, kwargs = checked_arguments(args, kwargs)
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_job(self.model, db, fields, args, kwargs)

    def enqueue_many(
        self,
        task_path: str,
        calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
        *,
        batch_size: int = 1000,
        **options: Any,
    ) -> list[Job]:
        """Insert one pending job per ``(args, kwargs)`` call in as few INSERTs as possible
        (``batch_size`` rows each), in the caller's transaction; the options are those of
        ``enqueue()`` except ``unique_key``, checked once for every call. Every call is
        checked before anything is written: an argument that does not round-trip through
        JSON raises InvalidJobArgument naming the call (``calls[3].args[0]``) and nothing is
        inserted.
        """
        from .exceptions import InvalidLeaseOption

        if "unique_key" in options:
            raise InvalidLeaseOption(
                "unique_key", "enqueue_many() takes no unique_key; use enqueue()"
            )
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_jobs(self.model, db, fields, calls, batch_size)
