"""The worker processes' registry: each run_lease_worker's row, and who looks gone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.db import IntegrityError, models, router, transaction
from django.db.models import Case, F, Func, Q, Value, When
from django.db.models.functions import Now

from . import conf
from .states import JobState

if TYPE_CHECKING:
    from .models import WorkerProcess  # noqa: F401 -- the queryset's type argument below


class Seconds(Func):
    """A duration of ``expression`` seconds (a float column or expression), on every
    database: lets a comparison on the database clock use a period stored per row."""

    output_field = models.DurationField()
    # SQLite and MariaDB keep durations as microseconds; Django writes them into the date
    # arithmetic (MariaDB: INTERVAL … MICROSECOND).
    template = "CAST((%(expressions)s) * 1000000 AS INTEGER)"

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="CAST((%(expressions)s) * 1000000 AS SIGNED)", **extra
        )

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="make_interval(secs => %(expressions)s)", **extra
        )


def registered_period(fallback: float) -> Any:
    """The heartbeat period a row's worker registered; ``fallback`` for a row of a 0.1.0
    worker (no ``instance``): it wrote no period, and the 10 s the database filled in
    would read a worker beating every 100 s (a 300 s lease) as gone after 20 s."""
    return Case(
        When(instance="", then=Value(float(fallback))),
        default=F("heartbeat_seconds"),
        output_field=models.FloatField(),
    )


def silent_since(period: Any) -> Any:
    """The time on the database clock before which a heartbeat of ``period`` seconds (a
    number, column or expression) has been silent for conf.silent_after() of it."""
    return Now() - Seconds(conf.silent_after(period))


class WorkerQuerySet(models.QuerySet["WorkerProcess"]):
    """The worker processes' own rows (times on the database clock)."""

    def register(
        self,
        worker_id: str,
        *,
        instance: str,
        hostname: str,
        pid: int,
        queues: list[str],
        heartbeat_seconds: float,
        process_key: str = "",
        dead: str | None = None,
    ) -> WorkerProcess | None:
        """Take ``worker_id`` for the process ``instance`` names and return None; or, while
        another process holds the id (it does not look gone: see gone()), return its row,
        annotated with ``db_now`` and ``period`` (with_status()), and take nothing.
        ``dead``: the instance of a holder known to have died (identity.died()), taken
        from at once, if it still holds the id.

        Two live processes under one id would read as one: the first to stop would mark
        the other's healthy claims as a gone worker's. A stopped or silent holder is
        taken over by a conditional UPDATE (its rowcount says who won a race); a new id
        is inserted, and an insert that loses a race reads the winner.
        """
        fields = {
            "instance": instance,
            "hostname": hostname,
            "pid": pid,
            "queues": queues,
            "heartbeat_seconds": heartbeat_seconds,
            "process_key": process_key,
            "started_at": Now(),
            "last_seen_at": Now(),
            "stopped_at": None,
        }
        rows = self.filter(worker_id=worker_id)
        holder: Any = None  # a WorkerProcess with db_now
        lost_race: IntegrityError | None = None
        for _ in range(3):
            holder = rows.with_status().first()
            if holder is None:
                try:
                    with transaction.atomic(using=self.db):
                        self.create(worker_id=worker_id, **fields)
                    return None
                except IntegrityError as e:
                    lost_race = e
                    continue  # another process inserted it first: read its row
            if holder.instance not in (instance, dead) and not holder.looks_gone:
                return cast("WorkerProcess", holder)  # live, by its own period (database clock)
            # Gone (or this very process registering again after an answer that never
            # came back): take it, unless another process did first; then read again.
            takeable = self._gone_q() | Q(instance=instance)
            if dead:
                takeable |= Q(instance=dead)
            if rows.filter(instance=holder.instance).filter(takeable).update(**fields):
                return None
        if holder is not None:
            return cast("WorkerProcess", holder)
        assert lost_race is not None
        raise lost_race  # inserted and never seen: not a race this loop can settle

    def seen(self, worker_id: str, instance: str) -> int:
        """1 while this process still holds its id; 0 once another took it over."""
        return self.filter(worker_id=worker_id, instance=instance).update(last_seen_at=Now())

    def stopped(self, worker_id: str, instance: str) -> int:
        return self.filter(worker_id=worker_id, instance=instance).update(
            last_seen_at=Now(), stopped_at=Now()
        )

    # -- admin views -------------------------------------------------------------------

    def _gone_q(self, legacy: float | None = None) -> Q:
        if legacy is None:
            legacy = conf.get_options().heartbeat_seconds
        return Q(stopped_at__isnull=False) | Q(
            last_seen_at__lt=silent_since(registered_period(legacy))
        )

    def gone(self, legacy_period: float | None = None) -> WorkerQuerySet:
        """Stopped, or silent for conf.silent_after() of the worker's own heartbeat period
        (``heartbeat_seconds``, as it registered: ``--heartbeat`` may differ from the
        settings the admin reads; for a 0.1.0 worker's row, which says none,
        ``legacy_period``, else the first lease backend's HEARTBEAT_SECONDS), on the
        database clock."""
        return self.filter(self._gone_q(legacy_period))

    def prunable(self, older_than_days: float) -> WorkerQuerySet:
        """Rows of workers gone more than ``older_than_days`` ago, and at least a day:
        stopped then, or silent since then (a crash never restarted under its id). Each
        restart under the default id (``hostname-pid``) or a pod's name leaves a row. A
        worker silent for less than a day may still be alive (paused, or cut off from the
        database): one whose row went would stop at its next heartbeat."""
        before = Now() - Seconds(max(older_than_days, 1.0) * 86400)
        return self.filter(Q(stopped_at__lt=before) | Q(stopped_at=None, last_seen_at__lt=before))

    def prune(self, older_than_days: float) -> int:
        """Delete the prunable rows in one statement that states the condition (a row a
        worker took over meanwhile is seen again and kept); return how many went."""
        db = getattr(self, "_db", None) or router.db_for_write(self.model)  # not a replica
        # No row of ours points at a worker's: nothing to collect, no read-then-delete gap.
        deleted: int = self.using(db).prunable(older_than_days)._raw_delete(db) or 0
        return deleted

    def with_status(self) -> WorkerQuerySet:
        """Annotate ``db_now``, ``period`` (the heartbeat period the row is judged by) and
        ``looks_gone``. The claims each worker holds are JobQuerySet.claims_per_worker():
        one grouped count for a page of workers."""
        return self.annotate(
            db_now=Now(),
            period=registered_period(conf.get_options().heartbeat_seconds),
            looks_gone=Case(
                When(self._gone_q(), then=Value(True)),
                default=Value(False),
                output_field=models.BooleanField(),
            ),
        )

    def with_claims(self) -> WorkerQuerySet:
        """with_status(), plus ``claims_held`` and ``claims_expired``: a subquery per worker,
        each reading every claimed job (the admin counts a page of workers at once instead)."""
        from django.db.models.functions import Coalesce

        Job = apps.get_model("django_leases", "Job")

        def count(**lookups: Any) -> Any:
            held = (
                Job.objects.using(self.db)
                .filter(state=JobState.CLAIMED, claimed_by=models.OuterRef("worker_id"), **lookups)
                .order_by()
                .values("claimed_by")
                .annotate(n=models.Count("*"))
                .values("n")
            )
            return Coalesce(models.Subquery(held), 0)

        return self.with_status().annotate(
            claims_held=count(), claims_expired=count(lease_expires_at__lt=Now())
        )
