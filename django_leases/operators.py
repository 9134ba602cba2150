"""Operator verbs and the reads of the admin, the backend and the advisor.

Operator verbs are conditional on state and answer how many jobs changed; none of them
needs a claim token. The reads never write. Every comparison uses the database clock.
JobQuerySet (query.py) is composed from these, the claim (claiming.py), the owner's writes
(owner_writes.py) and prune (pruning.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Self, cast

from django.apps import apps
from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import Case, F, Value, When
from django.db.models.deletion import ProtectedError, RestrictedError
from django.db.models.functions import Coalesce, Least, Now

from . import conf
from .deadlocks import retry_deadlock_victims
from .enqueue_options import checked_seconds
from .id_chunks import id_chunks
from .lease_statements import after_now
from .prune_refusals import check_foreign_keys_now
from .states import ACTIVE_STATES, DeadReason, JobState

if TYPE_CHECKING:
    from .models import Job
    from .query import JobQuerySet

    # For the type checker the mixin is the queryset it is mixed into; at run time it is a
    # plain class, and JobQuerySet puts models.QuerySet after it.
    _VerbsBase = models.QuerySet[Job]
else:
    _VerbsBase = object


# The admin's census on PostgreSQL: past this many rows in the table, groups are counted
# exactly up to CENSUS_CAP and larger ones estimated from a sample of about
# CENSUS_SAMPLE_ROWS rows (docs/scale.md measures it on 5,100,000 jobs).
CENSUS_EXACT_ROWS = 1_000_000
# What keeps a job purge_finished() was asked to delete.
_KEPT = (ProtectedError, RestrictedError, IntegrityError)
# Jobs purge_finished() deletes at a time once a delete of them all was refused.
PURGE_CHUNK = 500
# Unique keys requeue() reads and puts back at a time.
REQUEUE_CHUNK = 500
CENSUS_CAP = 1000
CENSUS_SAMPLE_ROWS = 50_000


class OperatorVerbs(_VerbsBase):
    """What people and maintenance commands do to jobs, and what the admin, the backend and
    the advisor read (a mixin of JobQuerySet)."""

    if TYPE_CHECKING:
        _db: str | None

        def stalled_claims(self, heartbeat_seconds: float) -> JobQuerySet: ...

        def _kept_by_projects(self, db: str) -> models.Q: ...

    # -- operator actions: conditional on state, answering how many changed -------------

    # The jobs each verb may change, by state: the verb's own condition, and what the
    # admin locks before it calls the verb.

    def cancel_candidates(self) -> Self:
        return self.filter(state__in=ACTIVE_STATES)

    def requeue_candidates(self) -> Self:
        return self.filter(state__in=[JobState.DEAD, JobState.CANCELLED])

    def retry_now_candidates(self) -> Self:
        return self.filter(state=JobState.PENDING)

    def expire_now_candidates(self) -> Self:
        """Claimed jobs; expire_stalled_now() changes only those of them that are stalled."""
        return self.filter(state=JobState.CLAIMED)

    def purge_finished_candidates(self) -> Self:
        return self.filter(state__in=[JobState.SUCCEEDED, JobState.CANCELLED])

    @retry_deadlock_victims
    def cancel(self) -> int:
        """Cancel pending and claimed jobs; a running handler learns at its next renewal."""
        return self.cancel_candidates().update(
            state=JobState.CANCELLED, finished_at=Now(), claim_token=None, lease_expires_at=None
        )

    def requeue(self, *, reset_attempts: bool = True, max_age: float | None = None) -> int:
        """Put dead and cancelled jobs back to pending, due now, with a fresh deadline
        (``max_age`` seconds, default the backend's MAX_AGE_DAYS, from the database's Now()).

        One active job per unique key, as enqueue keeps it: of the jobs asked for that share
        a key, the newest (highest id) goes back; they all stay where they are while another
        active job holds their key. Keyed jobs go back REQUEUE_CHUNK at a time, and should a
        chunk be refused (a job enqueued with the key meanwhile), one at a time.
        """
        age = (
            conf.get_options(None).max_age_days * 86400
            if max_age is None
            else checked_seconds("max_age", max_age)
        )
        back: dict[str, Any] = {
            "state": JobState.PENDING,
            "available_at": Now(),
            "finished_at": None,
            "dead_reason": "",
            "deadline": after_now(timedelta(seconds=age)),
        }
        if reset_attempts:
            back["attempts"] = 0
            back["releases"] = 0  # a fresh start at stops too (UNCOUNTED_RELEASES)
        else:
            # Keep the count but leave room for one more try.
            back["max_attempts"] = Case(
                When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                default=F("max_attempts"),
                output_field=models.PositiveIntegerField(),
            )
        db = self._db or router.db_for_write(self.model)
        ended = self.using(db).requeue_candidates()
        manager = self.model._default_manager.using(db)
        with transaction.atomic(using=db):
            requeued = ended.filter(unique_key__isnull=True).update(**back)
            # Ordered by id, so the newest job of each key is the one the dict keeps.
            newest = dict(
                ended.filter(unique_key__isnull=False)
                .order_by("pk")
                .values_list("unique_key", "pk")
            )
            keys = list(newest)
            for at in range(0, len(keys), REQUEUE_CHUNK):
                chunk = keys[at : at + REQUEUE_CHUNK]
                held = set(
                    manager.filter(active_key__in=chunk).values_list("active_key", flat=True)
                )
                # A key enqueued meanwhile keeps its job ended, not the rest of the chunk.
                requeued += _apart(
                    db,
                    [newest[key] for key in chunk if key not in held],
                    lambda ids: manager.filter(pk__in=ids).requeue_candidates().update(**back),
                    (IntegrityError,),
                    sizes=(1,),
                )
        return requeued

    @retry_deadlock_victims
    def retry_now(self) -> int:
        """Make pending jobs due now, parked ones included."""
        return self.retry_now_candidates().update(available_at=Now())

    @retry_deadlock_victims
    def expire_now(self) -> int:
        """End the lease of claimed jobs so any worker may take them: a second before the
        last renewal (DB clock), so the lease it leaves reads as one no claim is granted,
        and the takeover says the lease was ended early, not that some lease ran out."""
        return self.expire_now_candidates().update(
            lease_expires_at=Least(Now(), Coalesce(F("heartbeat_at"), Now()))
            - Value(timedelta(seconds=1))
        )

    def expire_stalled_now(self, heartbeat_seconds: float) -> int:
        """End the lease of stalled claims only; the same UPDATE re-checks that each is stalled,
        so a claim whose worker renewed in the meantime keeps its lease."""
        return self.stalled_claims(heartbeat_seconds).expire_now()

    def dead_letter_past_deadline(self, *, batch_size: int = 1000) -> int:
        """Dead-letter pending jobs whose deadline passed (database clock) although no claim
        came to settle them: parked jobs, jobs of a queue no worker serves, jobs scheduled
        past their own deadline. Return how many ended."""
        manager = self.model._default_manager.using(self.db)
        late = self.filter(state=JobState.PENDING, deadline__lt=Now())
        ended = 0
        while True:
            ids = list(late.order_by("pk").values_list("pk", flat=True)[:batch_size])
            if not ids:
                return ended
            # Conditional again: a job claimed since the read keeps running.
            ended += manager.filter(pk__in=ids, state=JobState.PENDING, deadline__lt=Now()).update(
                state=JobState.DEAD, dead_reason=DeadReason.DEADLINE, finished_at=Now()
            )

    def purge_finished(self) -> int:
        """Delete succeeded and cancelled jobs (with their failure rows); return jobs deleted.

        The jobs are locked as they are read, in one transaction with the delete: a job
        requeued meanwhile is pending when read and stays (Django's delete() reads the jobs,
        then deletes by id, with no state in the DELETE). A job a project's row protects
        (PROTECT, RESTRICT, a foreign key the database checks) stays, the others go: those
        prune() knows to be kept are left out, and should the rest be refused all the
        same, they go again in chunks of PURGE_CHUNK, a refused chunk a job at a time.
        """
        db = self._db or router.db_for_write(self.model)
        finished = self.purge_finished_candidates().using(db)
        with transaction.atomic(using=db):
            locked = finished.exclude(self._kept_by_projects(db)).select_for_update()
            ids = list(locked.order_by("pk").values_list("pk", flat=True))
            # As many at once as a statement takes first: each check re-checks what went
            # before it (PostgreSQL's deferred foreign keys), so small chunks only once
            # something refused; what protects one job keeps that job, not the rest.
            return sum(
                _apart(db, most, partial(self._delete_jobs, db), _KEPT, sizes=(PURGE_CHUNK, 1))
                for most in id_chunks(db, ids)
            )

    def _delete_jobs(self, db: str, ids: Sequence[Any]) -> int:
        """Delete the jobs of ``ids`` with what Django's on_delete says, their foreign keys
        checked before the savepoint _apart() puts it in ends."""
        jobs = self.model._default_manager.using(db).filter(pk__in=ids)
        _, per_model = jobs.delete()
        check_foreign_keys_now(db, {apps.get_model(label) for label in per_model})
        return per_model.get(self.model._meta.label, 0)

    # -- reads: the admin's, the backend's, the advisor's --------------------------------

    def census(self) -> list[dict[str, Any]]:
        """Count jobs per (queue, task, state): the admin's header and filters.

        One GROUP BY, unless the table is big on PostgreSQL (over CENSUS_EXACT_ROWS by the
        planner's statistics): a GROUP BY reads every row, seconds on millions of jobs.
        Then every (queue, task, state) present is found by a skip scan of
        leases_job_census_idx, one index descent each, and counted exactly up to
        CENSUS_CAP; a larger group's count is estimated from a sample of the table's pages
        and its row says ``estimated``. No value present is left out of the filters.
        """
        db = self._db or router.db_for_read(self.model)
        if (
            connections[db].vendor == "postgresql"
            and not self.query.where
            and (self._pg_reltuples(db) or 0) > CENSUS_EXACT_ROWS
        ):
            return self._pg_big_census(db)
        rows = (
            self.order_by()
            .values("queue_name", "task_path", "state")
            .annotate(n=models.Count("*"))
            .order_by()
        )
        # The admin reads a row's columns by name from a variable: plain dicts, not TypedDicts.
        return cast("list[dict[str, Any]]", list(rows))

    def _pg_reltuples(self, db: str) -> float | None:
        with connections[db].cursor() as cursor:
            cursor.execute(
                "SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
                [self.model._meta.db_table],
            )
            row = cursor.fetchone()
        return None if row is None else float(row[0])

    def _pg_big_census(self, db: str) -> list[dict[str, Any]]:
        table = connections[db].ops.quote_name(self.model._meta.db_table)
        with connections[db].cursor() as cursor:
            cursor.execute(
                f"""
                WITH RECURSIVE present AS (
                    (SELECT queue_name, task_path, state FROM {table}
                     ORDER BY queue_name, task_path, state LIMIT 1)
                    UNION ALL
                    SELECT next.* FROM present, LATERAL (
                        SELECT queue_name, task_path, state FROM {table} AS j
                        WHERE (j.queue_name, j.task_path, j.state)
                            > (present.queue_name, present.task_path, present.state)
                        ORDER BY queue_name, task_path, state LIMIT 1
                    ) AS next
                )
                SELECT queue_name, task_path, state, (
                    SELECT count(*) FROM (
                        SELECT 1 FROM {table} AS j
                        WHERE j.queue_name = present.queue_name
                          AND j.task_path = present.task_path AND j.state = present.state
                        LIMIT %(cap)s + 1
                    ) AS capped
                ) FROM present
                """,
                {"cap": CENSUS_CAP},
            )
            rows = [
                {"queue_name": q, "task_path": t, "state": s, "n": n, "estimated": n > CENSUS_CAP}
                for q, t, s, n in cursor.fetchall()
            ]
            if any(row["estimated"] for row in rows):
                # About CENSUS_SAMPLE_ROWS rows from whole pages picked at random.
                cursor.execute(
                    f"""
                    SELECT queue_name, task_path, state, count(*) * 100.0 / %(percent)s
                    FROM {table} TABLESAMPLE SYSTEM (%(percent)s) REPEATABLE (0)
                    GROUP BY 1, 2, 3
                    """,
                    {
                        "percent": min(
                            100.0,
                            100.0 * CENSUS_SAMPLE_ROWS / max(self._pg_reltuples(db) or 1, 1),
                        )
                    },
                )
                sampled = {(q, t, s): n for q, t, s, n in cursor.fetchall()}
                for row in rows:
                    if row["estimated"]:
                        key = (row["queue_name"], row["task_path"], row["state"])
                        # Never below what was counted exactly.
                        row["n"] = max(int(sampled.get(key, 0)), CENSUS_CAP + 1)
        return rows

    def estimated_count(self) -> int | None:
        """The planner's row estimate for this queryset on PostgreSQL (None elsewhere).

        COUNT(*) reads every matching row; EXPLAIN reads statistics only, which is what a
        paginator over a million jobs can afford.
        """
        if connections[self.db].vendor != "postgresql":
            return None
        plan = json.loads(self.order_by().values("pk").explain(format="json"))
        if isinstance(plan, list):
            plan = plan[0]
        return int(plan["Plan"]["Plan Rows"])

    def claims_per_worker(self, worker_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(held, expired) claims of each of ``worker_ids`` that holds any: one grouped count
        over the claimed jobs, where a subquery per worker would walk all of them each time."""
        rows = (
            self.filter(state=JobState.CLAIMED, claimed_by__in=list(worker_ids))
            .order_by()
            .values("claimed_by")
            .annotate(
                held=models.Count("*"),
                expired=models.Count("pk", filter=models.Q(lease_expires_at__lt=Now())),
            )
            .values_list("claimed_by", "held", "expired")
        )
        return {worker: (held, expired) for worker, held, expired in rows}

    def with_failures(self, ids: Iterable[Any]) -> list[Job]:
        """The jobs ``ids`` with their failures loaded: what the Django Tasks backend turns
        into TaskResults, for any number of jobs in two statements."""
        return list(self.filter(pk__in=list(ids)).prefetch_related("failures"))

    def handler_durations(
        self, since_days: float | None = None
    ) -> models.QuerySet[Job, tuple[str, float, timedelta]]:
        """(task_path, lease_seconds, duration) of succeeded jobs, finished in the last
        ``since_days`` days if given. ``duration`` is finished_at - last_attempted_at, the
        last attempt from claim to acknowledgement: both stamps come from the database
        clock, so the difference holds whatever the workers' clocks say."""
        finished = self.filter(
            state=JobState.SUCCEEDED, last_attempted_at__isnull=False, finished_at__isnull=False
        )
        if since_days is not None:
            since_days = conf.checked_number(
                "since_days", since_days, low=0, high=conf.MAX_INTERVAL_DAYS
            )
            finished = finished.filter(finished_at__gte=Now() - Value(timedelta(days=since_days)))
        return (
            finished.order_by()
            .annotate(
                duration=models.ExpressionWrapper(
                    F("finished_at") - F("last_attempted_at"), output_field=models.DurationField()
                ),
            )
            .values_list("task_path", "lease_seconds", "duration")
        )


def _apart(
    db: str,
    ids: Sequence[Any],
    write: Callable[[Sequence[Any]], int],
    refused: tuple[type[Exception], ...],
    *,
    sizes: tuple[int, ...],
) -> int:
    """``write(ids)`` in a savepoint, answering its count; should the database refuse it
    (``refused``), the ids again in slices of ``sizes[0]``, each refused one in slices of
    the next size, down to a refused id that is left out: a refusal rolls back its own
    slice alone."""
    if not ids:
        return 0
    try:
        with transaction.atomic(using=db):
            return write(ids)
    except refused:
        if not sizes:
            return 0
    size, smaller = sizes[0], sizes[1:]
    return sum(
        _apart(db, ids[at : at + size], write, refused, sizes=smaller)
        for at in range(0, len(ids), size)
    )
