"""Operator verbs and the reads of the admin, the backend and the advisor.

Operator verbs are conditional on state and answer how many jobs changed; none of them
needs a claim token. The reads never write. Every comparison uses the database clock.
JobQuerySet (query.py) is composed from these and the owner's verbs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.models import Case, F, Value, When
from django.db.models.functions import Now

from . import conf
from .deadlocks import retry_deadlock_victims
from .enqueue import after_now, checked_seconds
from .states import ACTIVE_STATES, TERMINAL_STATES, DeadReason, JobState

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
CENSUS_CAP = 1000
CENSUS_SAMPLE_ROWS = 50_000


class OperatorVerbs(_VerbsBase):
    """What people and maintenance commands do to jobs, and what the admin, the backend and
    the advisor read (a mixin of JobQuerySet)."""

    if TYPE_CHECKING:
        _db: str | None

        def stalled_claims(self, heartbeat_seconds: float) -> JobQuerySet: ...

    # -- operator actions: conditional on state, answering how many changed -------------

    @retry_deadlock_victims
    def cancel(self) -> int:
        """Cancel pending and claimed jobs; a running handler learns at its next renewal."""
        return self.filter(state__in=ACTIVE_STATES).update(
            state=JobState.CANCELLED, finished_at=Now(), claim_token=None, lease_expires_at=None
        )

    def requeue(self, *, reset_attempts: bool = True, max_age: float | None = None) -> int:
        """Put dead and cancelled jobs back to pending, due now, with a fresh deadline
        (``max_age`` seconds, default the backend's MAX_AGE_DAYS, from the database's Now()).

        A job whose unique key is held by another active job stays where it is.
        """
        age = (
            conf.get_options(None).max_age_days * 86400
            if max_age is None
            else checked_seconds("max_age", max_age)
        )
        changes: dict[str, Any] = (
            {"attempts": 0}
            if reset_attempts
            else {
                # Keep the count but leave room for one more try.
                "max_attempts": Case(
                    When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                    default=F("max_attempts"),
                    output_field=models.PositiveIntegerField(),
                )
            }
        )
        taken = list(
            self.model._default_manager.using(self.db)
            .filter(active_key__isnull=False)
            .values_list("active_key", flat=True)
        )
        return (
            self.filter(state__in=[JobState.DEAD, JobState.CANCELLED])
            .exclude(unique_key__in=taken)
            .update(
                state=JobState.PENDING,
                available_at=Now(),
                finished_at=None,
                dead_reason="",
                deadline=after_now(timedelta(seconds=age)),
                **changes,
            )
        )

    @retry_deadlock_victims
    def retry_now(self) -> int:
        """Make pending jobs due now, parked ones included."""
        return self.filter(state=JobState.PENDING).update(available_at=Now())

    @retry_deadlock_victims
    def expire_now(self) -> int:
        """End the lease of claimed jobs (a second ago, DB clock) so any worker may take them."""
        return self.filter(state=JobState.CLAIMED).update(
            lease_expires_at=Now() - Value(timedelta(seconds=1))
        )

    def expire_stalled_now(self, heartbeat_seconds: float) -> int:
        """End the lease of stalled claims only; the same UPDATE re-checks that each is stalled,
        so a claim whose worker renewed in the meantime keeps its lease."""
        return self.stalled_claims(heartbeat_seconds).expire_now()

    def prunable(self, older_than_days: float, *, include_dead: bool = False) -> Any:
        """Finished jobs past retention: succeeded, cancelled, and dead ones if asked; not
        a schedule's last job, which the schedule still names (its next tick replaces it)."""
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        named = self._schedules().filter(last_job__isnull=False).values("last_job")
        return self.filter(
            state__in=states, finished_at__lt=Now() - Value(timedelta(days=older_than_days))
        ).exclude(pk__in=named)

    def prune(
        self, older_than_days: float, *, include_dead: bool = False, batch_size: int = 1000
    ) -> int:
        """Delete finished jobs (succeeded and cancelled, and dead ones if asked) that finished
        more than N days ago on the database clock, with their failures and effects; return
        how many jobs were deleted. A deleted job's schedule run record is unlinked (set NULL,
        as its on_delete says; the records go with ScheduleRun.objects.prune()). A schedule's
        last job stays: unlinking it would write to schedule rows the workers' tick decisions
        lock, and prune never waits for a worker.

        Each batch of ``batch_size`` is its own short transaction that locks only finished
        jobs past retention and the history of those it deletes, taken with SKIP LOCKED where
        the database has it, and re-checks the state and the age in the DELETE itself: a job
        requeued by an operator in the meantime is pending again and stays. Batches walk each
        state's (state, finished_at) index in order from where the last one stopped, so no
        batch rescans what its predecessors deleted.
        """
        states = [s for s in TERMINAL_STATES if include_dead or s != JobState.DEAD]
        db = self._db or router.db_for_write(self.model)
        deleted = 0
        for state in states:
            after: Any = None
            while True:
                n, after = (
                    self._prune_batch_pg(db, state, older_than_days, after, batch_size)
                    if connections[db].vendor == "postgresql"
                    else self._prune_batch(db, state, older_than_days, after, batch_size)
                )
                deleted += n
                if n == 0 or after is None:
                    break
        return deleted

    def _prune_batch(
        self, db: str, state: str, days: float, after: Any, batch_size: int
    ) -> tuple[int, Any]:
        """One batch through the ORM: (jobs deleted, the last finished_at seen)."""
        manager = self.model._default_manager.using(db)
        # Plain reads, never a lock on a schedule row a decision holds. Only a new job ever
        # becomes a schedule's last job, so a list read a moment ago keeps every job it must;
        # read again once the rows are locked, for a retention shorter than that moment.
        named = self._named_by_schedules(db)
        old = (
            self.filter(state=state, finished_at__lt=Now() - Value(timedelta(days=days)))
            .exclude(pk__in=named)
            .using(db)
        )
        if after is not None:
            old = old.filter(finished_at__gte=after)
        with transaction.atomic(using=db):
            if connections[db].features.has_select_for_update_skip_locked:
                old = old.select_for_update(skip_locked=True)
            rows = list(
                old.order_by("finished_at", "pk").values_list("pk", "finished_at")[:batch_size]
            )
            if not rows:
                return 0, None
            named = self._named_by_schedules(db)
            # Conditional again, in each DELETE itself: only what is still finished and old
            # (a job requeued since the read is pending again and stays, history and all).
            doomed = manager.filter(
                pk__in=[pk for pk, _ in rows if pk not in named],
                state=state,
                finished_at__lt=Now() - Value(timedelta(days=days)),
            )
            for rel in self._own_references():
                linked = rel.related_model._default_manager.using(db).filter(
                    **{f"{rel.field.name}__in": doomed}
                )
                if rel.on_delete is models.CASCADE:
                    linked.delete()
                else:
                    linked.update(**{rel.field.name: None})
            # One DELETE with the predicate: what pointed at the jobs is gone or unlinked,
            # so there is nothing left to collect.
            deleted: int = doomed._raw_delete(db)
        return deleted, rows[-1][1]

    def _schedules(self) -> Any:
        """The Schedule model's manager: schedules name their last job."""
        meta = (self.model._meta.concrete_model or self.model)._meta
        return apps.get_model(meta.app_label, "Schedule")._default_manager

    def _named_by_schedules(self, db: str) -> set[Any]:
        """The ids of the jobs schedules name as their last job (one per schedule)."""
        last = self._schedules().using(db).filter(last_job__isnull=False)
        return set(last.values_list("last_job", flat=True))

    def _own_references(self) -> list[Any]:
        """This app's relations pointing at a job that a raw DELETE must follow as Django's
        collector would, or the foreign keys refuse it: failures and effects (CASCADE,
        deleted with it) and a schedule's run record (SET_NULL, unlinked). Not a
        schedule's last job: prune keeps that job (prunable())."""
        meta = (self.model._meta.concrete_model or self.model)._meta
        schedule = self._schedules().model
        rels = [
            f
            for f in meta.get_fields(include_hidden=True)
            if isinstance(f, models.ForeignObjectRel)
            and (f.one_to_many or f.one_to_one)
            and f.related_model._meta.app_label == meta.app_label
            and f.related_model is not schedule
        ]
        for rel in rels:
            if rel.on_delete not in (models.CASCADE, models.SET_NULL):
                raise TypeError(f"prune cannot follow on_delete of {rel.field}")
        return rels

    def _prune_batch_pg(
        self, db: str, state: str, days: float, after: Any, batch_size: int
    ) -> tuple[int, Any]:
        """One batch on PostgreSQL, one statement: pick the oldest rows of ``state`` past
        retention and no schedule's last job (an ordered scan of leases_job_finished_idx,
        SKIP LOCKED: a lock on the jobs only, never on the schedules it reads), delete their
        failures and effects, unlink their schedule run records, then delete the jobs.
        Autocommit makes it its own transaction."""
        quote = connections[db].ops.quote_name
        job = self.model._meta
        schedule = self._schedules().model._meta
        last = quote(schedule.get_field("last_job").column)
        references = ""
        for n, rel in enumerate(self._own_references()):
            table = quote(rel.related_model._meta.db_table)
            column = quote(rel.field.column)
            change = (
                f"DELETE FROM {table}"
                if rel.on_delete is models.CASCADE
                else f"UPDATE {table} SET {column} = NULL"
            )
            references += f"""
        , linked_{n} AS (
            {change} WHERE {column} = ANY(ARRAY(SELECT id FROM doomed))
        )"""
        sql = f"""
        WITH doomed AS (
            SELECT j.id, j.finished_at FROM {quote(job.db_table)} j
            WHERE j.state = %(state)s
              AND j.finished_at < statement_timestamp() - make_interval(secs => %(secs)s)
              {"AND j.finished_at >= %(after)s" if after is not None else ""}
              -- One array for the statement (one id per schedule), whatever the plan.
              AND j.id <> ALL(ARRAY(
                SELECT {last} FROM {quote(schedule.db_table)} WHERE {last} IS NOT NULL
              ))
            ORDER BY j.finished_at
            LIMIT %(limit)s
            FOR UPDATE OF j SKIP LOCKED
        ){references}
        , jobs AS (
            -- ids as an array: primary-key lookups, never a join planned as a scan of the
            -- whole table.
            DELETE FROM {quote(job.db_table)}
            WHERE id = ANY(ARRAY(SELECT id FROM doomed)) AND state = %(state)s
            RETURNING finished_at
        )
        SELECT count(*), max(finished_at) FROM jobs
        """
        params = {"state": state, "secs": days * 86400, "after": after, "limit": batch_size}
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            cursor.execute(sql, params)
            n, last = cursor.fetchone()
        return n, last

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
        """Delete succeeded and cancelled jobs (with their failure rows); return jobs deleted."""
        _, per_model = self.filter(state__in=[JobState.SUCCEEDED, JobState.CANCELLED]).delete()
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
            finished = finished.filter(
                finished_at__gte=Now()
                - Value(timedelta(days=checked_seconds("since_days", since_days)))
            )
        return (
            finished.order_by()
            .annotate(
                duration=models.ExpressionWrapper(
                    F("finished_at") - F("last_attempted_at"), output_field=models.DurationField()
                ),
            )
            .values_list("task_path", "lease_seconds", "duration")
        )
